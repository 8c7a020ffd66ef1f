"""``HostWorker``: host jobs run in order on one background thread (the numba kernels release the GIL, so the host
update overlaps the training thread's work). A job's exception is re-raised in the caller with the worker's
traceback; a worker that dies or hangs is detected within a bounded wait. The links start their threads through
:func:`zenflow_kernels.link.completions.new_worker`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..rules.compiled import compiling

__all__ = ["HostWorker", "HostWorkerError"]


class HostWorkerError(RuntimeError):
    """A host job failed (the message carries the worker's traceback) or the worker died or hung."""


class _Job:
    __slots__ = ("fn", "args", "done", "result", "error", "tb")

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result = self.error = self.tb = None


_STOP = object()


def _worker_loop(jobs: queue.Queue, num_threads: int | None, cores: Sequence[int] | None, failures: list,
                 setup: Callable[[], None] | None, ready: threading.Event) -> None:
    # Module-level on purpose: the thread must hold no reference to the optimizer.
    setup_failed = None
    if setup is not None:
        try:
            setup()
        except Exception as exc:  # every later submit and wait re-raises it: the worker is failed from the start
            setup_failed = _Job(setup, ())
            setup_failed.error, setup_failed.tb = exc, traceback.format_exc()
            failures.append(setup_failed)
    ready.set()  # after the failure is recorded: submit() waits for this, so it cannot miss it
    if cores and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread
    if num_threads:
        import numba

        numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        if setup_failed is not None:  # never run a job on a thread whose setup failed (e.g. on the wrong GPU)
            job.error, job.tb = setup_failed.error, setup_failed.tb
            job.fn = job.args = None
            job.done.set()
            continue
        try:
            job.result = job.fn(*job.args)
        except Exception as exc:  # kept and re-raised in the caller
            job.error, job.tb = exc, traceback.format_exc()
            failures.append(job)  # the worker is failed from now on, even if nobody waits for this job
        except BaseException:  # SystemExit and the like end the thread: the job is never done
            job.tb = traceback.format_exc()
            return
        # a done job keeps its result, not its work: a completion waited on later (a copy job standing for
        # every copy before it) must not hold a step's gradients alive
        job.fn = job.args = None
        job.done.set()


class HostWorker:
    """One background thread that runs host jobs in submission order.

    Args:
        num_threads: numba threads for the jobs (thread-local in numba, set inside the worker).
        cores: CPU affinity of the worker thread (Linux), or None.
        timeout: longest wait for one job, in seconds, before :class:`HostWorkerError` (None: no limit,
            but a dead worker is still detected).
        poll: how often a waiting caller checks that the worker is alive.
        setup: run first on the thread (a CUDA link sets the parameters' device there: a new thread's
            current device is 0, and its first CUDA call would create a context on GPU 0).
    """

    def __init__(
        self,
        *,
        num_threads: int | None = None,
        cores: Sequence[int] | None = None,
        timeout: float | None = 600.0,
        poll: float = 0.05,
        name: str = "zenflow-host",
        setup: Callable[[], None] | None = None,
    ):
        self.timeout, self.poll = timeout, poll
        self._jobs: queue.Queue = queue.Queue()
        self._failures: list[_Job] = []  # appended by the thread: every job that raised
        self._dead: _Job | None = None  # the job a caller saw the thread die under
        self._ready = threading.Event()  # set once the thread's setup has run (and any failure is recorded)
        self._thread = threading.Thread(
            target=_worker_loop,
            args=(self._jobs, num_threads, list(cores) if cores else None, self._failures, setup, self._ready),
            name=name, daemon=True,
        )
        self._thread.start()

    @property
    def failure(self) -> _Job | None:
        """The first failure: a job that raised, or the worker's death; None while healthy."""
        return self._failures[0] if self._failures else self._dead

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable, *args) -> _Job:
        # A setup failure must fail the first job's caller, not a later one: a caller that does not wait for its
        # job (an overlapped update) would otherwise learn of it one step late, or never if it is the last step.
        self._wait_ready()
        self.check()
        if not self.alive:
            raise HostWorkerError("zenflow host worker is not running (it was closed or it died)")
        job = _Job(fn, args)
        self._jobs.put(job)
        return job

    def wait(self, job: _Job) -> Any:
        """Block until ``job`` is done; return its result or raise :class:`HostWorkerError`."""
        stuck = "zenflow host update did not finish within host_timeout={} s; the worker is stuck"
        if not self._until(job.done, stuck):
            self._dead = job
            raise HostWorkerError(
                "zenflow host worker thread died before finishing a host update; the optimizer cannot continue"
                + (f":\n{job.tb}" if job.tb else "")
            )
        if job.error is not None:
            raise HostWorkerError(f"zenflow host update failed in the background worker:\n{job.tb}") from job.error
        self.check()  # an earlier job failed: what followed it cannot be trusted
        return job.result

    def _until(self, event: threading.Event, late: str) -> bool:
        """Wait for ``event``, checking every ``poll`` seconds that the thread is alive: False if it died first;
        past ``timeout``, :class:`HostWorkerError` with ``late`` (its ``{}`` the timeout). Time while a rule's step
        compiles (``rules.compiled.compiling``: a first compile takes seconds) does not count."""
        last = time.perf_counter()
        waited = 0.0
        while not event.wait(self.poll):
            if not self.alive:
                return False
            now = time.perf_counter()
            waited += 0.0 if compiling() else now - last
            last = now
            if self.timeout is not None and waited > self.timeout:
                raise HostWorkerError(late.format(self.timeout))
        return True

    def _wait_ready(self) -> None:
        # (a thread that died in setup: submit() reports that)
        self._until(self._ready, "zenflow host worker's thread setup did not finish within host_timeout={} s")

    def check(self) -> None:
        """Re-raise an earlier failure of any job of this worker, waited for or not (a failed worker stays
        failed)."""
        if self.failure is not None:
            job = self.failure
            raise HostWorkerError(f"zenflow host update failed earlier in the background worker:\n{job.tb}") from (
                job.error
            )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the queued jobs; idempotent. Called on the worker's own thread (an optimizer whose
        last reference a job dropped is finalized there) it only asks the thread to stop after this job."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
