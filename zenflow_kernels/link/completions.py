"""Completions: the handles a link hands back for asynchronous work, and the one place the link package starts
its worker threads.

Every asynchronous operation returns or records a handle, and nothing is read before its handle was waited on.
A :class:`Future` is a job on a :class:`~zenflow_kernels.link.worker.HostWorker` (the CPU engine's streams, the
accumulate and update workers), an :class:`Event` a CUDA event on a copy stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..device_model import Delays
from .worker import HostWorker


class Future:
    """A job on a :class:`HostWorker`; ``wait()`` is bounded by the worker's timeout and re-raises the
    job's failure with its traceback. Safe to wait on from any thread, any number of times."""

    __slots__ = ("worker", "job")

    def __init__(self, worker: HostWorker, job):
        self.worker, self.job = worker, job

    def wait(self) -> Any:
        return self.worker.wait(self.job)

    def done(self) -> bool:
        """Finished (or failed), without waiting."""
        return self.job.done.is_set()


class Event:
    """A CUDA event recorded on a copy stream."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()  # created with blocking=True: the waiting thread sleeps, not spins


def new_worker(**kwargs) -> HostWorker:
    """A :class:`HostWorker` (its keyword arguments) for the link package: every module of it starts its threads
    here, so ``HostWorker`` is looked up in this module only (tests record what is made by replacing it here)."""
    return HostWorker(**kwargs)


def _nothing() -> None:
    return None


def _submit(worker: HostWorker, fn: Callable, delays: Delays | None) -> Future:
    """Queue ``fn`` on ``worker`` (with chaos delays around it, if any); its completion."""
    return Future(worker, worker.submit(delays.wrap(fn) if delays is not None else fn))
