"""Device <-> host movement for ZenFlowAdamW (docs/design.md sections 4-5): one protocol, three links.

The optimizer decides *what* moves and *when* (the algorithm); a link moves it and hands back
completions. Every asynchronous operation returns or records a handle, and nothing is read before
its handle was waited on. The training thread keeps all bookkeeping (what was accumulated in which
interval, counts, what is pending); a link never changes anything the optimizer decides with.

One interval on a GPU (``overlap_step=True``), time running right::

    training thread   backward -(hooks)-> stage(g_i) ... step: fast step | accumulate() | boundary: wait U(n-1),
                                                                             write_back(), update U(n)
    D2H stream          g_i -> ring slot s (own dtype) ... marker(s) --+
    accumulate worker   wait marker(s); acc[b] += pieces of s  (then s is free): from the hook once s is full
                        when the step's gradients are final at their hooks, else from step()
    update worker                                        wait last accumulate of b; AdamW(acc[b]); wait guard;
                                                         write out; acc[b] = 0
    H2D stream                                       out -> non-selected columns -> event (= the guard);
                                                     the device's later work waits for it

Buffers and their owners (who writes, who reads, which wait hands them over):

* staging slot ``s`` (a ring of ``STAGING_SLOTS`` bounded byte buffers, each allocated once; staging.py):
  written by the D2H copies of one step, read by the accumulate job it is handed to once its gradients
  are final: from a backward hook when the step's gradients are known final there (docs/design.md
  section 5.1), else at ``step()``; filled again only after that job completed (a hook that hands over
  waits for it, one that does not only checks; ``step()`` waits).
* ``acc[b]``: written by the accumulate jobs of the intervals that use ``b`` (in order, one worker),
  read and zeroed by that interval's host update, which first waits for the last of those jobs; the
  training thread reads it only after draining (checkpoints).
* copy-out buffers ``out``: written by a host update only after the previous write-back's handle
  (the copy-out guard) completed, read by the write-back copies.
* master and moments: owned by the host update in flight; the training thread touches them only
  after waiting for it (drain).

Links:

* :class:`CpuLink` (CPU parameters): plain synchronous copies; the training thread accumulates
  itself (and may fold the interval's last gradient into a synchronous update).
* :class:`RingLink` over a :class:`CudaEngine`: pinned staging (page-locked at its exact size), D2H/H2D
  streams, events.
* :class:`RingLink` over a :class:`ThreadEngine`: the same protocol on CPU, each stream a thread
  running its copies in order, each event a future, with optional seeded random delays before and
  after every asynchronous piece of work (:func:`zenflow_kernels.testing.chaos`). An ordering bug
  that a GPU would expose (a read before a copy finished, a count read before a worker ran, a slot
  reused while a copy still reads it) then gives a wrong number on CPU, where the oracle sees it.
"""

from __future__ import annotations

import collections
import math
import mmap
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._memory import gather_columns
from .cpu_ops.accumulate import SUM_CHUNK, accumulate_unchecked, sum_squares_unchecked
from .device_model import Chaos, Timeline, _Delays, modeled_copy, recorded
from .host import HostShard, HostWorker
from .staging import ALIGN_BYTES, Staged, StagingRing
from .streamed_adam import DeviceSums

__all__ = ["Chaos", "CpuLink", "CudaEngine", "RingLink", "ThreadEngine", "make_link"]


# -- completions -------------------------------------------------------------------------------------


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


# -- engines: where copies run ---------------------------------------------------------------------------


class CudaEngine:
    """Pinned host memory, a D2H and an H2D stream on ``device``, events as completions."""

    moves_state = True
    workers: tuple = ()  # streams, not threads: nothing to check or close

    def __init__(self, device: torch.device):
        self.device = device
        self._d2h = torch.cuda.Stream(device)
        self._h2d = torch.cuda.Stream(device)
        self._pinned: list[torch.Tensor] = []  # page-locked by this engine (kept alive until close)
        self._reading: collections.deque = collections.deque()  # (event, sources) of D2H copies in flight
        self._fetch = None  # the stream host updates fetch device-side sums on (made at first use)

    def thread_setup(self) -> None:
        """Run first on every worker thread that waits on this engine's events."""
        torch.cuda.set_device(self.device)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor, page-locked at its exact size."""
        return self._pin(torch.zeros(numel, dtype=dtype))

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock ``t``'s memory where it is (``cudaHostRegister``), at its exact size: torch's caching
        host allocator (``pin_memory()``) rounds every block up to a power of two and keeps freed blocks,
        up to 2x a buffer's size again, and its ``pinned_use_cuda_host_register`` option is process-wide.
        The engine keeps it alive and unregisters it at :meth:`close` (the link's buffers live as long as
        the link)."""
        nbytes = t.untyped_storage().nbytes()
        if nbytes == 0:
            return t
        with torch.cuda.device(self.device):  # registering initialises CUDA on the current device otherwise
            err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1))  # 1: portable
        if err != 0:
            raise RuntimeError(f"zenflow: page-locking {nbytes} bytes of host memory failed (cudaError {err})")
        self._pinned.append(t)
        return t

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked bytes this engine holds: requested, and reserved (the whole pages they lock)."""
        return pinned_sizes([(t.data_ptr(), t.untyped_storage().nbytes()) for t in self._pinned])

    def _current(self):
        return torch.cuda.current_stream(self.device)

    def d2h(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue ``dst.copy_(src)`` for each pair after the device work issued so far, in one call. The
        sources stay referenced here until their copies' event has completed (a later call or close()
        finds it so): the caching allocator cannot hand their memory to new work while a copy reads it,
        without a ``record_stream`` per source."""
        if not copies:
            return
        dsts, srcs = [dst for dst, _ in copies], [src for _, src in copies]
        self._d2h.wait_stream(self._current())
        with torch.cuda.stream(self._d2h):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            done = torch.cuda.Event()  # only queried, never waited on
            done.record(self._d2h)
        while self._reading and self._reading[0][0].query():
            self._reading.popleft()
        self._reading.append((done, srcs))

    def d2h_marker(self) -> Event:
        """A completion for every D2H copy enqueued so far."""
        event = torch.cuda.Event(blocking=True)
        event.record(self._d2h)
        return Event(event)

    def fetcher(self, flat: torch.Tensor) -> Callable[[torch.Tensor, int, int], Callable[[], None]]:
        """``DeviceSums.fetch`` over the device tensor ``flat``, final after the device work issued so far (an
        event recorded now): each fetch enqueues a copy on a stream of its own that waits for that event, and
        returns a wait on which the calling thread (a host update's reader, any thread) sleeps until the copy is
        done, so the reader can read the state file meanwhile."""
        if self._fetch is None:
            self._fetch = torch.cuda.Stream(self.device)
        stream, ready = self._fetch, torch.cuda.Event()
        ready.record(self._current())

        def fetch(dst: torch.Tensor, lo: int, hi: int) -> Callable[[], None]:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                dst.copy_(flat[lo:hi], non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
            return done.synchronize

        return fetch

    def h2d(self, work: Callable[[], None], nbytes: int = 0) -> Event:
        """Run ``work`` (copies into device tensors, ``nbytes`` in all) on the H2D stream after the device work
        issued so far; later device work waits for it (stream order, no host wait)."""
        self._h2d.wait_stream(self._current())
        with torch.cuda.stream(self._h2d):
            work()
            event = torch.cuda.Event(blocking=True)
            event.record(self._h2d)
        self._current().wait_stream(self._h2d)
        return Event(event)

    def device_waits_for_d2h(self) -> None:
        self._current().wait_stream(self._d2h)

    def device_orders_after_d2h(self) -> None:
        """Later device work (the user's ``p.grad.zero_()``, the next backward) runs after every D2H copy
        issued so far: a stream wait, no host wait."""
        self.device_waits_for_d2h()

    def behind_d2h(self, work: Callable[[], None]) -> torch.cuda.Event:
        """Device work (``work`` enqueues it) on the D2H stream, behind every copy issued so far; returns its
        completion for :meth:`device_waits_for`. The compute stream does not wait for it now: the next forward
        runs while the copies do."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._d2h):
            work()
            done = torch.cuda.Event()
            done.record(self._d2h)
        return done

    def device_waits_for(self, done: torch.cuda.Event) -> None:
        """Later device work runs after ``done`` (from :meth:`behind_d2h`): a stream wait, no host wait."""
        self._current().wait_event(done)

    def join(self) -> None:
        """The training thread may touch device tensors (nothing to do: the device waits in order)."""

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def to_host_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on the current stream: ordered before the next fetch

    def new_host_state(self, t: torch.Tensor) -> torch.Tensor:
        # offloaded fast-path state is replaced at every selection while copies may still read it: torch's
        # caching host allocator keeps a freed block until the streams that used it are past it
        return t.to("cpu").pin_memory()

    def close(self) -> None:
        """Unregister the engine's buffers once no copy reads them (they stay valid, pageable memory:
        ``state_dict()`` after ``close()`` works)."""
        self._d2h.synchronize()
        self._h2d.synchronize()
        self._reading.clear()
        cudart = torch.cuda.cudart()
        for t in self._pinned:
            cudart.cudaHostUnregister(t.data_ptr())
        self._pinned = []


class ThreadEngine:
    """The CUDA engine's protocol on CPU: each stream is a thread running its jobs in order, an event
    is a future, and "later device work waits for the H2D copy" becomes a wait the training thread
    does before it next touches the parameters (:meth:`join`)."""

    moves_state = True

    def __init__(self, *, timeout: float | None, delays: _Delays | None, d2h_bytes_per_s: float | None = None,
                 h2d_bytes_per_s: float | None = None, timeline: Timeline | None = None):
        self._delays = delays
        # the modeled device: each copy job takes bytes / bandwidth on its thread (device_model.py)
        self._d2h_rate, self._h2d_rate, self.timeline = d2h_bytes_per_s, h2d_bytes_per_s, timeline
        self._d2h = HostWorker(timeout=timeout, name="zenflow-d2h")
        self._h2d = HostWorker(timeout=timeout, name="zenflow-h2d")
        self._fetch = HostWorker(timeout=timeout, name="zenflow-fetch")  # the CUDA engine's fetch stream
        self.workers = [self._d2h, self._h2d, self._fetch]
        self._device_waits: list[Future] = []  # H2D copies the parameters' next reader must wait for
        self._last_d2h: Future | None = None

    def thread_setup(self) -> None:
        """What the CUDA engine's ``set_device`` stands for: every worker thread runs it first (tests
        record it)."""

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def d2h(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # holds src alive until the copy ran (the allocator's record_stream); one foreach call: the worker
        # takes the GIL once, not once per copy, while the training thread runs
        dsts, srcs = [dst for dst, _ in copies], [src for _, src in copies]

        def copy():
            if dsts:
                torch._foreach_copy_(dsts, srcs)

        nbytes = sum(src.numel() * src.element_size() for src in srcs)
        copy = modeled_copy(copy, nbytes, self._d2h_rate, self.timeline, "d2h")
        self._last_d2h = _submit(self._d2h, copy, self._delays)

    def d2h_marker(self) -> Future:
        """The last job queued on the copy thread (it runs its jobs in order): no job of its own, unless
        none was queued yet."""
        if self._last_d2h is None:
            self._last_d2h = _submit(self._d2h, _nothing, self._delays)
        return self._last_d2h

    def fetcher(self, flat: torch.Tensor) -> Callable[[torch.Tensor, int, int], Callable[[], None]]:
        """``DeviceSums.fetch`` over ``flat``: the copy queued on the fetch thread (the CUDA engine's fetch stream),
        taking the modeled D2H time, with chaos delays, recorded on the ``fetch`` lane; returns its wait."""

        def fetch(dst: torch.Tensor, lo: int, hi: int) -> Callable[[], None]:
            src = flat[lo:hi]
            copy = modeled_copy(lambda: dst.copy_(src), src.numel() * src.element_size(), self._d2h_rate,
                                self.timeline, "fetch")
            return _submit(self._fetch, copy, self._delays).wait

        return fetch

    def h2d(self, work: Callable[[], None], nbytes: int = 0) -> Future:
        def run():
            with torch.no_grad():  # grad mode is per thread: the work writes into parameters
                work()

        handle = _submit(self._h2d, modeled_copy(run, nbytes, self._h2d_rate, self.timeline, "h2d"), self._delays)
        self._device_waits.append(handle)
        return handle

    def device_waits_for_d2h(self) -> None:
        if self._last_d2h is not None:
            self._last_d2h.wait()

    def device_orders_after_d2h(self) -> None:
        """Later "device" work (here: whatever the training thread does to the gradients after
        :meth:`join`) runs after every D2H copy issued so far, as the CUDA stream wait orders it."""
        if self._last_d2h is not None:
            self._device_waits.append(self._last_d2h)

    def behind_d2h(self, work: Callable[[], None]) -> Future:
        """Device work queued behind every D2H copy issued so far on the D2H thread; returns its completion,
        which the training thread waits for only at :meth:`device_waits_for` (not at :meth:`join`), as the
        CUDA engine's compute stream waits for its event only there."""

        def run():
            with torch.no_grad():
                work()

        handle = _submit(self._d2h, run, self._delays)
        self._last_d2h = handle
        return handle

    def device_waits_for(self, handle: Future) -> None:
        handle.wait()

    def join(self) -> None:
        waits, self._device_waits = self._device_waits, []
        for handle in waits:
            handle.wait()

    def synchronize(self) -> None:
        self.join()
        self.device_waits_for_d2h()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()  # a real copy: state not copied back would be lost, as on a GPU

    def to_host_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def new_host_state(self, t: torch.Tensor) -> torch.Tensor:
        return t  # already a CPU tensor of the caller's own: host memory here

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _nothing() -> None:
    return None


class _EarlyHandOver:
    """One step's hand-over from backward hooks: the accumulation buffer, the parameters with pieces handed
    over (training thread), and, from the accumulate worker, those it added and whether it met an inf/NaN
    (read by the training thread only after waiting for the jobs)."""

    __slots__ = ("buf", "handed", "added", "poisoned")

    def __init__(self):
        self.buf = 0
        self.handed: set[int] = set()
        self.added: set[int] = set()
        self.poisoned = False


def _unchanged(rec: Staged, grad: torch.Tensor) -> bool:
    """``grad`` is the tensor a staged record copied, not written since: the same object, or (FSDP2's
    ``to_local()`` makes a new view each call) a view of the same memory, and the same version. Holding
    ``rec.grad`` keeps that memory alive, so no other tensor can have been allocated there."""
    if rec.version != grad._version:
        return False
    old = rec.grad
    return old is grad or (old.data_ptr() == grad.data_ptr() and old.dtype == grad.dtype
                           and old.shape == grad.shape and old.stride() == grad.stride())


def pinned_sizes(spans: Sequence[tuple[int, int]]) -> dict[str, int]:
    """``(address, bytes)`` of page-locked buffers -> bytes requested and reserved (whole pages)."""
    page = mmap.PAGESIZE
    reserved = sum(-(-(ptr + n) // page) * page - ptr // page * page for ptr, n in spans)
    return {"pinned_requested": sum(n for _, n in spans), "pinned_reserved": reserved}


def _submit(worker: HostWorker, fn: Callable, delays: _Delays | None) -> Future:
    """Queue ``fn`` on ``worker`` (with chaos delays around it, if any); its completion."""
    return Future(worker, worker.submit(delays.wrap(fn) if delays is not None else fn))


# -- links -----------------------------------------------------------------------------------------------


class _Link:
    """What both links share: the host shard, the update worker (overlap), timed waits, counters."""

    kind = ""
    moves_state = False  # the fast-path state has a home apart from the device (offload can move it)
    asynchronous = False  # copies complete later: gradients are worth staging from backward hooks

    def __init__(self, host: HostShard, *, overlap: bool, host_threads: int, cores, timeout: float | None,
                 thread_setup: Callable[[], None] | None = None):
        self.host = host
        self.workers: list[HostWorker] = []
        self._updater = None
        if overlap:
            self._updater = HostWorker(num_threads=host_threads, cores=cores, timeout=timeout, setup=thread_setup)
            self.workers.append(self._updater)
        self.waited_s = 0.0  # the training thread blocked on asynchronous work
        self.accumulate_s = 0.0  # the training thread accumulated gradients itself
        self.d2h_bytes = 0  # bytes moved device -> host (gradients) and host -> device (weights)
        self.h2d_bytes = 0
        self.early_bytes = 0  # gradient bytes handed to the accumulate worker from backward hooks
        # this step, for the optimizer (take_step_report): every gradient a hook copied was unchanged at
        # step(); the parameters whose interval restarted (their counts start again)
        self.hooks_clean = True
        self.restarted: set[int] = set()
        self._sums_blocks: list[torch.Tensor] | None = None  # device_sums' host blocks (made at first use)

    SUMS_BLOCKS = 3
    """Host blocks a streamed update fetches device-side sums into: ``streamed_adam_``'s depth."""

    def device_sums(self, flat: torch.Tensor) -> DeviceSums:
        """``device_accumulation`` with the state on disk: the interval's sums in the device tensor ``flat``
        (final once the device work issued so far has run), for a host update to fetch block by block into
        ``SUMS_BLOCKS`` host blocks of the state file's block size, at least ``SUM_CHUNK`` (the clipping norm's
        piece) elements, at most the shard's (this link's, reused by every update)."""
        if self._sums_blocks is None:
            numel = min(max(self.host.disk.block_numel, SUM_CHUNK), self.host.numel)
            self._sums_blocks = [self._alloc(numel, torch.float32) for _ in range(self.SUMS_BLOCKS)]
        return DeviceSums(self._fetcher(flat), self._sums_blocks)

    @staticmethod
    def _alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    @staticmethod
    def _fetcher(flat: torch.Tensor) -> Callable[[torch.Tensor, int, int], None]:
        def fetch(dst: torch.Tensor, lo: int, hi: int) -> None:
            dst.copy_(flat[lo:hi])  # done when it returns: no wait to hand back

        return fetch

    def sums_ready(self) -> None:
        """The device sums (``device_accumulation``) are about to be read or written: whatever the link still
        does with them comes first (here nothing: a synchronous upload copied and zeroed them)."""

    @property
    def handed_this_step(self) -> bool:
        """Backward's hooks have added part of the coming step's gradients to the host sums already."""
        early = getattr(self, "_early", None)
        return early is not None and bool(early.handed)

    def take_step_report(self) -> tuple[bool, set[int]]:
        """``(hooks_clean, restarted)`` for the step just accumulated or discarded, reset for the next."""
        report = self.hooks_clean, self.restarted
        self.hooks_clean, self.restarted = True, set()
        return report

    timeline: Timeline | None = None  # the modeled device's (testing.chaos), where one is recorded

    def wait(self, handle) -> Any:
        """Wait for a completion on the training thread (or in a backward hook); the time counts as stall."""
        t0 = time.perf_counter()
        try:
            return handle.wait()
        finally:
            self._waited(t0)

    def _waited(self, t0: float, label: str = "") -> None:
        """The training thread (or a hook) waited since ``t0``: counted as stall, and on the timeline where
        it blocked (not a check of a finished job)."""
        t1 = time.perf_counter()
        self.waited_s += t1 - t0
        if self.timeline is not None and t1 - t0 > 5e-5:
            self.timeline.add("wait", label, t0, t1)

    def submit_update(self, fn: Callable) -> Future:
        """Run a host update in the background (``overlap_step``); returns its completion."""
        return Future(self._updater, self._updater.submit(fn))

    staging_bytes = 0  # host staging allocated (the ring link's)

    def host_bytes(self) -> dict[str, int]:
        """The host buffers of this link, by kind: the bytes of each buffer's storage as allocated."""
        host = self.host

        def size(*ts):
            return sum(t.untyped_storage().nbytes() for t in ts if t is not None)

        out = {"master": size(host.master), "exp_avg": size(host.exp_avg), "exp_avg_sq": size(host.exp_avg_sq),
               "accumulation": size(*host.acc), "copy_out": size(*host.out.values()), "staging": self.staging_bytes}
        if self._sums_blocks is not None:  # device_accumulation on disk: the blocks its sums are fetched into
            out["sums_blocks"] = size(*self._sums_blocks)
        if host.disk is not None:  # the master and moments are on disk: their bytes there, not in memory
            out["disk"] = host.disk.nbytes
        return out

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked host memory (a CUDA link's), requested and reserved; empty where nothing is pinned."""
        return {}

    @property
    def failed(self) -> bool:
        return any(w._failed is not None for w in self.workers)

    def check(self) -> None:
        """Re-raise a background failure seen earlier (a failed link stays failed)."""
        for w in self.workers:
            w.check()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.host.close()  # an NVMe host's state file is removed (after the workers that read it stopped)

    @staticmethod
    def _write_back_work(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> Callable:
        def work():
            for p, src, keep_columns in items:
                if keep_columns is None or keep_columns.numel() == 0:
                    p.copy_(src, non_blocking=True)
                    continue
                # the fast path owns these columns: preserve what it wrote (a transient copy: see _memory)
                keep = gather_columns(p, keep_columns)
                p.copy_(src, non_blocking=True)
                p[:, keep_columns] = keep

        return work

    def _count_write_back(self, items) -> int:
        nbytes = sum(src.numel() * src.element_size() for _, src, _ in items)
        self.h2d_bytes += nbytes
        return nbytes


class CpuLink(_Link):
    """Parameters on CPU: plain copies on the training thread, which also accumulates."""

    kind = "cpu"

    def stage(self, i: int, grad: torch.Tensor, buf: int | None = None) -> None:
        """Nothing to start early: accumulation reads the gradient where it is."""

    def accumulate(
        self, items: Sequence[tuple[int, torch.Tensor]], buf: int, *, fuse_min_numel: int | None = None
    ) -> dict[int, torch.Tensor]:
        """acc[buf] += grad for each ``(index, grad)``, now. With ``fuse_min_numel`` the gradients of
        at least that many elements are returned instead, for a synchronous update to fold into its
        AdamW pass (``HostShard.update(last=...)``)."""
        t0 = time.perf_counter()
        last, sums, grads = {}, [], []
        for i, grad in items:
            self.d2h_bytes += grad.numel() * grad.element_size()
            if fuse_min_numel is not None and grad.numel() >= fuse_min_numel:
                last[i] = grad
            else:
                sums.append(self.host.view(self.host.acc[buf], i))
                grads.append(grad)
        if sums:
            # one numba launch per gradient dtype (fp32 additions, bf16/fp16 read and widened in the same
            # pass; torch's mixed-dtype _foreach_add_ takes a slow path per tensor); a strided gradient (the
            # kernel reads flat memory) through torch
            flat = [g.is_contiguous() for g in grads]
            if not all(flat):
                torch._foreach_add_([t for t, f in zip(sums, flat, strict=True) if not f],
                                    [g for g, f in zip(grads, flat, strict=True) if not f])
                sums = [t for t, f in zip(sums, flat, strict=True) if f]
                grads = [g for g, f in zip(grads, flat, strict=True) if f]
            accumulate_unchecked(sums, grads)
        self.accumulate_s += time.perf_counter() - t0
        return last

    def upload(self, items: Sequence[tuple[int, torch.Tensor]], buf: int) -> None:
        """acc[buf] <- a device-side sum for each ``(index, sum)`` (acc[buf] holds nothing of this
        interval), then the sums are zeroed for the next interval (``device_accumulation``)."""
        t0 = time.perf_counter()
        for i, total in items:
            self.host.view(self.host.acc[buf], i).copy_(total)
            total.zero_()
            self.d2h_bytes += total.numel() * total.element_size()
        self.accumulate_s += time.perf_counter() - t0

    def discard(self) -> None:
        pass

    def accumulation(self) -> None:
        """The completion of the accumulation issued so far (None: it is done)."""
        return None

    def copy_out_guard(self) -> None:
        return None

    def write_back(self, items) -> None:
        self._write_back_work(items)()
        self._count_write_back(items)

    def before_grad_write(self) -> None:
        pass

    def join(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    # no to_device / to_host_ / new_host_state: offload moves state only on a link that moves_state


class RingLink(_Link):
    """Asynchronous movement through a staging ring, an accumulate worker and an engine's streams."""

    STAGING_SLOTS = 4
    """Slots of the staging ring (docs/design.md section 9)."""
    STAGING_SLOT_BYTES = 1 << 24
    """The most bytes one staging slot holds: the ring's host memory is at most ``STAGING_SLOTS`` times
    this (64 MiB pinned), whatever the model. Where a step's gradients are final at their hooks, full slots
    go to the accumulate worker during backward and the ring cycles; elsewhere what the hooks could not
    stage for lack of a free slot is copied at ``step()``, which waits for slots as the worker frees them
    (a class attribute, read when the link is built; the tests and bench.overlap shrink it)."""
    asynchronous = True
    # device_accumulation in memory: wait for the sums' crossing at the boundary, before the next forward, as the
    # link did before the wait moved to the next write into the sums (bench.nvme_timeline's "eager" variant)
    SUMS_WAIT_AT_BOUNDARY = False

    def __init__(self, host: HostShard, engine, *, kind: str, delays: _Delays | None = None, **kwargs):
        super().__init__(host, thread_setup=engine.thread_setup, **kwargs)
        self.kind = kind
        self.moves_state = engine.moves_state
        self._engine = engine
        self._delays = delays
        self._alloc, self._fetcher = engine.alloc, engine.fetcher
        self._accumulator = HostWorker(
            num_threads=kwargs["host_threads"], cores=kwargs["cores"], timeout=kwargs["timeout"],
            name="zenflow-accumulate", setup=engine.thread_setup,
        )
        self.workers += [self._accumulator, *engine.workers]
        # written by the D2H copies of one step, read by that step's accumulate jobs; a slot is filled again
        # only after its reader completed (staging.py)
        # a small shard's ring holds two steps of its gradients (in the parameters' dtypes, each aligned),
        # as a whole-shard ring of two did; a large one STAGING_SLOTS * STAGING_SLOT_BYTES
        step_bytes = sum(s.numel * s.dtype.itemsize + ALIGN_BYTES for s in host.slots.values())
        per_slot = -(-2 * step_bytes // self.STAGING_SLOTS)
        self._ring = StagingRing(self.STAGING_SLOTS, max(ALIGN_BYTES, min(self.STAGING_SLOT_BYTES, per_slot)),
                                 engine.alloc)
        self._staged: dict[int, Staged] = {}  # index -> the gradient copied this step, its version and pieces
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # queued (slot view, source) copies
        self._queued_bytes = 0  # their bytes
        self._last_accumulate = None  # completion of every accumulation issued so far
        self._guard = None  # completion of the last write-back: the copy-out buffers are free after it
        self._sums_zeroed = None  # device_accumulation in memory: the last upload's zeroing of the device sums
        self.timeline = getattr(engine, "timeline", None)
        # this step's hand-over from backward hooks (stage(..., buf)): what went to the worker before step()
        self._early = _EarlyHandOver()

    def submit_update(self, fn: Callable) -> Future:
        return _submit(self._updater, recorded(fn, self.timeline, "update"), self._delays)

    @property
    def staging_bytes(self) -> int:
        """Host staging allocated (each slot once, on first use)."""
        return self._ring.allocated_bytes

    def _free_now(self, slot: int) -> bool:
        """A hook's claim: the slot's reader is already done (a hook never waits)."""
        reader = self._ring.readers[slot]
        return reader is None or reader.done()

    def _free_after_wait(self, slot: int) -> bool:
        """step()'s claim, and a hook's that hands over: wait for the slot's reader (the wait counts as
        stall)."""
        reader = self._ring.readers[slot]
        if reader is not None:
            self.wait(reader)
        return True

    def stage(self, i: int, grad: torch.Tensor, buf: int | None = None) -> None:
        """Start copying parameter ``i``'s gradient into the staging ring, from a backward hook, as soon as
        backward produced it.

        ``buf`` None: the gradient may still change before ``step()`` (the optimizer has not seen that it is
        final): it is copied as far as free slots allow, and step() hands the slots over (re-copying what
        changed). ``buf`` given: the gradient is this step's, final (docs/design.md section 5.1): a slot that
        is full goes to the accumulate worker at once, into acc[buf], and a hook that finds no free slot
        waits for one, so the ring keeps cycling during backward whatever the model's size. What such a
        hand-over commits is checked at ``step()`` (:meth:`accumulate`, :meth:`discard`)."""
        if i in self._early.handed:  # a second backward: step() restarts it (it cannot be copied over)
            return
        if buf is None:
            self._copy(i, grad, self._free_now)
        else:
            self._early.buf = buf
            self._copy(i, grad, self._free_after_wait, lambda slot: self._hand_over([slot], buf, early=True))
        self._issue()

    def _copy(self, i: int, grad: torch.Tensor, claim, seal=None) -> bool:
        """Queue the copies of gradient ``i`` (again, over the pieces it has, if it changed) and place what is
        not placed yet; True once all of it is placed. The copies are issued together (:meth:`_issue`),
        always before the slot they fill is handed over."""
        rec = self._staged.get(i)
        if rec is not None:
            if rec.grad.dtype != grad.dtype:  # another dtype: its pieces no longer fit
                for piece in rec.pieces:
                    piece.live = False
                rec = None
                self.hooks_clean = False
            elif _unchanged(rec, grad) and rec.placed == grad.numel():
                return True  # copied whole (by its hook) and unchanged since
        src = grad.detach() if grad.requires_grad else grad
        flat = src.view(-1) if grad.is_contiguous() else src.reshape(-1)
        numel, itemsize = flat.numel(), grad.dtype.itemsize
        if rec is None:
            rec = self._staged[i] = Staged(grad, grad._version)
        elif not _unchanged(rec, grad):
            rec.grad, rec.version = grad, grad._version  # changed since: copy it again over the same pieces
            self.hooks_clean = False
            self._copies += [(p.data, flat if p.numel == numel else flat[p.lo : p.lo + p.numel]) for p in rec.pieces]
            self._queued_bytes += rec.placed * itemsize
        if rec.placed < numel:
            def queue(p):  # (a seal issues the queued copies: self._copies is a new list after it)
                self._copies.append((p.data, flat if p.numel == numel else flat[p.lo : p.lo + p.numel]))
                self._queued_bytes += p.numel * itemsize

            pieces = self._ring.place(i, grad.dtype, rec.placed, numel - rec.placed, claim, seal=seal, on_piece=queue)
            rec.pieces += pieces
            rec.placed += sum(p.numel for p in pieces)
        return rec.placed == numel

    def _issue(self) -> None:
        """Start the queued copies, one job for all of them."""
        if self._copies:
            self._engine.d2h(self._copies)
            self.d2h_bytes += self._queued_bytes
            self._copies, self._queued_bytes = [], 0

    def _hand_over(self, slots: list[int], buf: int, early: bool = False) -> None:
        """These slots' pieces are final: one accumulate job adds them into acc[buf] (slot by slot) once the
        copies issued so far (the queued ones are issued first) have completed; the slots are the job's
        until it is done. ``early``: handed over from a backward hook, before step() knew the step's
        gradient is finite: the job adds nothing once a piece of this step holds an inf or NaN, and says
        which parameters it added (:class:`_EarlyHandOver`)."""
        self._issue()
        copied = self._engine.d2h_marker()
        ring, host, timeline = self._ring, self.host, self.timeline
        pieces = [(p, p.data) for slot in slots for p in ring.hand_over(slot)]
        record = self._early if early else None
        if early:
            record.handed.update(p.index for p, _ in pieces)
            self.early_bytes += sum(data.numel() * data.element_size() for _, data in pieces)

        def add():
            copied.wait()
            t0 = time.perf_counter()
            if record is None:
                host.accumulate_pieces(buf, pieces)
            elif not record.poisoned:
                if math.isfinite(sum_squares_unchecked([data for _, data in pieces])):
                    host.accumulate_pieces(buf, pieces)
                    record.added.update(p.index for p, _ in pieces)
                else:  # the step will be skipped: nothing of it may reach acc[buf] from now on
                    record.poisoned = True
            if timeline is not None:
                timeline.add("accumulate", "early" if early else "step", t0, time.perf_counter(),
                             sum(data.numel() * data.element_size() for _, data in pieces))

        self._last_accumulate = job = _submit(self._accumulator, add, self._delays)
        for slot in slots:
            ring.readers[slot] = job

    def accumulate(self, items, buf: int, *, fuse_min_numel: int | None = None) -> dict:
        """acc[buf] += grad for each ``(index, grad)``, in the background: gradients that changed since their
        hook copied them are copied again, the slots the hooks filled go to the accumulate worker, and what
        is not staged yet goes through the ring slot by slot (a full slot goes to the worker at once; a
        slot is filled again once the worker is done with it). Returns ``{}`` (nothing is left to fuse)."""
        ring = self._ring
        wanted = {i: grad for i, grad in items}
        self._restart_changed(wanted)
        for i, rec in list(self._staged.items()):
            if i not in wanted:  # staged by a hook, not accumulated at this step
                self.hooks_clean = False
                for piece in rec.pieces:
                    piece.live = False
                del self._staged[i]
        # first every copy into the slots the hooks filled (a gradient that changed since its hook is copied
        # again over its pieces), placing what fits in free slots without waiting; then those slots are final
        rest, staged, k, n = [], self._staged, 0, len(items)
        while k < n:
            # a run of gradients no hook staged that fit whole in the slot being filled: one piece each, no
            # record (the slot is handed over below, at this step)
            end = k
            while end < n and items[end][0] not in staged and not items[end][1].requires_grad and (
                    items[end][1].is_contiguous()):
                end += 1
            if end > k:
                run = items[k:end]
                pieces = ring.place_run([(i, grad.dtype, grad.numel()) for i, grad in run])
                placed = zip(pieces, run, strict=False)  # the pieces are for a prefix of the run
                self._copies += [(piece.data, grad.view(-1)) for piece, (_, grad) in placed]
                self._queued_bytes += sum(piece.numel * piece.dtype.itemsize for piece in pieces)
                k += len(pieces)
            if k < n:  # staged by a hook, or it does not fit whole: placed piece by piece
                i, grad = items[k]
                if not self._copy(i, grad, self._free_now):
                    rest.append((i, grad))
                k += 1
        final = [s for s in ring.open if s != ring.current]
        if rest:
            if final:  # the worker starts on them while the rest waits for slots
                self._hand_over(final, buf)
                final = []
            seal = lambda slot: self._hand_over([slot], buf)  # noqa: E731
            for i, grad in rest:  # through the ring: a full slot goes to the worker, the next is waited for
                self._copy(i, grad, self._free_after_wait, seal)
        if ring.current is not None:
            final.append(ring.current)
        if final:  # one job for the slots filled last (usually all of this step's)
            self._hand_over(final, buf)
        self._staged = {}
        self._early = _EarlyHandOver()
        # the copies read the gradients as they are now; whatever the user does to them after step()
        # (zero_grad(set_to_none=False), p.grad.zero_(), the next backward adding in place) comes after
        self._engine.device_orders_after_d2h()
        return {}

    def upload(self, items: Sequence[tuple[int, torch.Tensor]], buf: int) -> None:
        """acc[buf] <- a device-side sum for each ``(index, sum)``, copied straight into the (pinned)
        accumulation buffer, which holds nothing of this interval; the copies' completion is the
        accumulation's. The device zeroes the sums once the copies have read them."""
        self._engine.d2h([(self.host.view(self.host.acc[buf], i), total) for i, total in items])
        self._last_accumulate = self._engine.d2h_marker()
        sums = [total for _, total in items]
        # the next interval starts from zero, zeroed behind the copies: the device's next work (the next
        # forward and backward) overlaps the crossing; only the next write into the sums waits (sums_ready)
        self._sums_zeroed = self._engine.behind_d2h(lambda: torch._foreach_zero_(sums))
        self.d2h_bytes += sum(total.numel() * total.element_size() for total in sums)
        if self.SUMS_WAIT_AT_BOUNDARY:
            self.sums_ready()

    def sums_ready(self) -> None:
        """The device sums are about to be read or written: the last upload's copies and zeroing come first."""
        if self._sums_zeroed is not None:
            done, self._sums_zeroed = self._sums_zeroed, None
            t0 = time.perf_counter()
            self._engine.device_waits_for(done)
            self._waited(t0, "sums")

    def _restart_changed(self, wanted: dict[int, torch.Tensor]) -> None:
        """step() of a step whose hooks handed slots over: a gradient that changed after its pieces went to
        the worker (a second backward, an in-place change), or that this step does not accumulate, cannot
        be taken back out of acc[buf] (a sum in fp32; the ring keeps no copy). Its interval restarts: its
        sum is zeroed behind the jobs that added into it and it is staged again whole; the optimizer
        resets its count (:attr:`restarted`)."""
        early, restart = self._early, set()
        for i in early.handed:
            rec, grad = self._staged.get(i), wanted.get(i)
            if grad is None or rec is None or not _unchanged(rec, grad):
                restart.add(i)
        if restart:
            self._restart(restart, early.buf)
            for i in restart:
                rec = self._staged.pop(i, None)
                for piece in rec.pieces if rec is not None else ():
                    piece.live = False  # pieces still in open slots: not added
            self.hooks_clean = False

    def _restart(self, indices: set[int], buf: int) -> None:
        """acc[buf] of these parameters <- 0, after every accumulate job issued so far (jobs run in order)."""
        views = [self.host.view(self.host.acc[buf], i) for i in sorted(indices)]

        def zero():
            for v in views:
                v.zero_()

        self._last_accumulate = _submit(self._accumulator, zero, self._delays)
        self.restarted |= indices

    def discard(self) -> None:
        """Forget what was staged this step (a skipped step): its slots are filled again next step. What
        hooks handed over early: a job that met the inf/NaN first added nothing after it; the parameters
        added before it restart their interval (waiting for those jobs: a skipped step is rare)."""
        early = self._early
        if early.handed:
            if self._last_accumulate is not None:
                self.wait(self._last_accumulate)
            if early.added:
                self._restart(set(early.added), early.buf)
        self._staged = {}
        self._early = _EarlyHandOver()
        self._ring.drop_open()

    def accumulation(self) -> Future | None:
        """The completion of every accumulation issued so far (jobs run in order)."""
        return self._last_accumulate

    def copy_out_guard(self):
        return self._guard

    def write_back(self, items) -> None:
        nbytes = self._count_write_back(items)
        self._guard = self._engine.h2d(self._write_back_work(items), nbytes)

    def before_grad_write(self) -> None:
        """Gradients are about to be written in place: the copies reading them must finish first."""
        self._engine.device_waits_for_d2h()

    def join(self) -> None:
        t0 = time.perf_counter()
        self._engine.join()
        self._waited(t0, "join")

    def synchronize(self) -> None:
        if self._last_accumulate is not None:
            self.wait(self._last_accumulate)
        self._engine.synchronize()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return self._engine.to_device(t)

    def to_host_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._engine.to_host_(dst, src)

    def new_host_state(self, t: torch.Tensor) -> torch.Tensor:
        return self._engine.new_host_state(t)

    def pinned_bytes(self) -> dict[str, int]:
        pinned = getattr(self._engine, "pinned_bytes", None)
        return pinned() if pinned is not None else {}

    def close(self) -> None:
        super().close()
        self._engine.close()


def make_link(
    params: Sequence[torch.Tensor],
    groups: Sequence[int],
    device: torch.device,
    *,
    overlap: bool,
    host_threads: int,
    cores,
    timeout: float | None,
    chaos: Chaos | None,
    indices: Sequence[int] | None = None,
    num_acc: int | None = None,
    disk=None,
):
    """The link for parameters on ``device``: CUDA -> RingLink(CudaEngine); CPU -> CpuLink, or, when
    ``chaos`` is given, RingLink(ThreadEngine) with its delays. ``indices``: the parameters whose host
    state this rank holds (ZeRO; default all). ``num_acc``: accumulation buffers (default 2 with
    ``overlap``, else 1). ``disk``: ``disk(numel)`` makes the state file of an NVMe host (HostShard)."""
    common = dict(overlap=overlap, host_threads=host_threads, cores=cores, timeout=timeout)
    if num_acc is None:
        num_acc = 2 if overlap else 1
    if device.type == "cuda":
        engine = CudaEngine(device)
        host = HostShard(params, groups, num_acc=num_acc, alloc=engine.alloc, indices=indices, disk=disk)
        return RingLink(host, engine, kind="cuda", **common)
    if chaos is not None:
        delays = _Delays(chaos) if chaos.max_delay > 0 else None
        engine = ThreadEngine(timeout=timeout, delays=delays, d2h_bytes_per_s=chaos.d2h_bytes_per_s,
                              h2d_bytes_per_s=chaos.h2d_bytes_per_s, timeline=chaos.timeline)
        host = HostShard(params, groups, num_acc=num_acc, alloc=engine.alloc, indices=indices, disk=disk)
        return RingLink(host, engine, kind="cpu-async", delays=delays, **common)
    host = HostShard(params, groups, num_acc=num_acc, indices=indices, disk=disk)
    return CpuLink(host, **common)
