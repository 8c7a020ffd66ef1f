"""Device <-> host movement for ZenFlowAdamW (docs/design.md sections 4-5): one protocol, three links.

The optimizer decides *what* moves and *when* (the algorithm); a link moves it and hands back
completions. Every asynchronous operation returns or records a handle, and nothing is read before
its handle was waited on. The training thread keeps all bookkeeping (what was accumulated in which
interval, counts, what is pending); a link never changes anything the optimizer decides with.

One interval on a GPU (``overlap_step=True``), time running right::

    training thread   backward -(hooks)-> stage(g_i) ... end of backward ... step: check | fast step | accumulate() |
                                                                                boundary: wait U(n-1), write_back(),
                                                                                update U(n)
    compute stream      fp_i = fingerprint(g_i) ...  waits for D2H  ...  fingerprints again; compare (one sync)
    D2H stream          g_i -> landing[i] (own dtype) ...                 changed or unstaged g_j -> landing[j]
    accumulate worker                                                     wait copies; acc[b] += landing * scale
                                                                          (fold jobs, in the hooks' order)
    update worker                                        wait last fold of b; AdamW(acc[b]); wait guard;
                                                         write out; acc[b] = 0
    H2D stream                                       out -> non-selected columns -> event (= the guard);
                                                     the device's later work waits for it

Buffers and their owners (who writes, who reads, which wait hands them over):

* ``landing[i]`` (one buffer per parameter dtype, laid out like the copy-out buffers; HostShard): written by the
  D2H copies of one step (from parameter i's backward hook, or at ``step()``), read by the fold job ``step()``
  submits once it checked the gradient; written again (the next step's hook or ``step()``) only after that job
  completed. Nothing of a step reaches ``acc[b]`` before ``step()`` confirmed it, so a step can always be taken
  back: a skipped step, a gradient changed after its hook, a second backward (docs/design.md section 5.1).
* ``acc[b]``: written by the fold jobs of the intervals that use ``b`` (in order, one worker), read and zeroed
  by that interval's host update, which first waits for the last of those jobs; the training thread reads it
  only after draining (checkpoints).
* copy-out buffers ``out``: written by a host update only after the previous write-back's handle
  (the copy-out guard) completed, read by the write-back copies.
* master and moments: owned by the host update in flight; the training thread touches them only
  after waiting for it (drain).

Links:

* :class:`CpuLink` (CPU parameters): plain synchronous copies; the training thread accumulates
  itself (and may fold the interval's last gradient into a synchronous update).
* :class:`AsyncLink` over a :class:`CudaEngine`: pinned host buffers (whole pages of their own, page-locked in
  place), D2H/H2D streams, events.
* :class:`AsyncLink` over a :class:`ThreadEngine`: the same protocol on CPU, each stream a thread
  running its copies in order, each event a future, with optional seeded random delays before and
  after every asynchronous piece of work (:func:`zenflow_kernels.testing.chaos`). An ordering bug
  that a GPU would expose (a read before a copy finished, a count read before a worker ran, a buffer
  reused while a copy still reads it) then gives a wrong number on CPU, where the oracle sees it.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import ops
from ._memory import gather_columns
from .cpu_ops.accumulate import SUM_CHUNK, accumulate_unchecked
from .device_model import Chaos, Timeline, _Delays, modeled_copy, recorded
from .host import HostShard, HostWorker
from .streamed_adam import DeviceSums

__all__ = ["AsyncLink", "Chaos", "CpuLink", "CudaEngine", "ThreadEngine", "make_link"]


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
        self._pinned: list[tuple[torch.Tensor, int]] = []  # (buffer, bytes) page-locked by this engine, until close
        self._fetch = None  # the stream host updates fetch device-side sums on (made at first use)

    def thread_setup(self) -> None:
        """Run first on every worker thread that waits on this engine's events."""
        torch.cuda.set_device(self.device)

    @staticmethod
    def refuse_capture() -> None:
        """A backward hook is about to copy: not inside a CUDA graph capture (its copies to page-locked memory, event
        records and host waits would invalidate it)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ZenFlowAdamW: a backward captured in a CUDA graph is not supported: the optimizer's gradient hooks "
                "copy to the host and wait on host work (page-locked memory, events), which invalidates the capture. "
                "Do not capture backward, or capture it with another optimizer")

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor of pages of its own, page-locked (:meth:`_pin`)."""
        t = page_aligned_zeros(numel, dtype)
        return self._pin(t) if numel else t

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock ``t``'s memory where it is (``cudaHostRegister``): whole pages that nothing else uses (an
        anonymous mapping of its own: :func:`page_aligned_zeros`; a heap tensor may share its first and last page
        with other allocations, which a later registration of theirs would then find locked). torch's caching
        host allocator (``pin_memory()``) rounds every block up to a power of two and keeps freed blocks, up to
        2x a buffer's size again, and its ``pinned_use_cuda_host_register`` option is process-wide. A failed
        registration leaves the CUDA runtime's last error set, which torch's next kernel launch check would
        report as its own: it is cleared here before the error is raised. The engine keeps the buffer alive
        and unregisters it at :meth:`close` (the link's buffers live as long as the link)."""
        nbytes = t.untyped_storage().nbytes()
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):  # registering initialises CUDA on the current device otherwise
            err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 1))  # 1: portable
        if err != 0:
            cleared = clear_cuda_error()
            raise RuntimeError(f"zenflow: page-locking {nbytes} bytes of host memory failed: "
                               f"{cuda_error_text(cudart, err)}" + ("" if cleared else
                               " (the CUDA runtime's last-error state could not be cleared)"))
        self._pinned.append((t, nbytes))
        return t

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked bytes this engine holds: requested, and reserved (the whole pages they lock)."""
        return pinned_sizes([(t.data_ptr(), nbytes) for t, nbytes in self._pinned])

    def _current(self):
        return torch.cuda.current_stream(self.device)

    def d2h(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue ``dst.copy_(src)`` for each pair after the device work issued so far, in one call. Nothing
        keeps the sources: their owner may drop them at once (``zero_grad(set_to_none=True)`` frees a step's
        gradients, as on the synchronous link), and the caching allocator keeps their memory from new work until
        the D2H stream has passed these copies (``record_stream``, once per allocation: a reduce-scatter's
        output or a ZeRO bucket holds many gradients; a gradient made on another stream, FSDP2's post-reduce
        stream, is covered the same way)."""
        if not copies:
            return
        dsts, srcs = [dst for dst, _ in copies], [src for _, src in copies]
        self._d2h.wait_stream(self._current())
        with torch.cuda.stream(self._d2h):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        recorded = set()
        for src in srcs:
            allocation = src.untyped_storage().data_ptr()
            if allocation not in recorded:
                recorded.add(allocation)
                src.record_stream(self._d2h)

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
        """Later device work on the current stream runs after ``done`` (from :meth:`behind_d2h`): a stream wait,
        no host wait."""
        self._current().wait_event(done)

    @staticmethod
    def completed(done: torch.cuda.Event) -> bool:
        """``done`` (from :meth:`behind_d2h`) has run: no later stream need wait for it."""
        return done.query()

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
        """Unregister the engine's buffers once no copy reads or writes them: every stream of the engine done
        (the fetch stream too: a host update that failed or timed out may have left fetches queued into the sums
        blocks). They stay valid, pageable memory: ``state_dict()`` after ``close()`` works. An unregistration
        that fails is reported after the others were tried (and the CUDA runtime's last error cleared)."""
        for stream in (self._d2h, self._h2d, self._fetch):
            if stream is not None:
                stream.synchronize()
        cudart, failed = torch.cuda.cudart(), []
        for t, nbytes in self._pinned:
            err = int(cudart.cudaHostUnregister(t.data_ptr()))
            if err != 0:
                clear_cuda_error()
                failed.append(f"{nbytes} bytes at {t.data_ptr():#x}: {cuda_error_text(cudart, err)}")
        self._pinned = []
        if failed:
            raise RuntimeError("zenflow: unlocking page-locked host memory failed for " + "; ".join(failed))


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

    @staticmethod
    def refuse_capture() -> None:
        """(No CUDA graphs on CPU.)"""

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

    @staticmethod
    def completed(handle: Future) -> bool:
        return handle.done()

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


def page_aligned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed flat host tensor in an anonymous mapping of its own: page-aligned, whole pages (the mapping is
    freed with the tensor's storage)."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(0, dtype=dtype)
    region = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)  # zero-filled; the tensor keeps it
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes].view(dtype)


def cuda_error_text(cudart, err: int) -> str:
    """``cudaGetErrorString`` of ``err`` where torch's binding takes it, else its number."""
    try:
        return f"{cudart.cudaGetErrorString(cudart.cudaError(err))} (cudaError {err})"
    except Exception:  # noqa: BLE001 - the binding's enum declares few values
        return f"cudaError {err}"


def clear_cuda_error() -> bool:
    """Reset the CUDA runtime's last error (``cudaGetLastError``: torch's bindings do not expose it, so through the
    libcudart this process loaded). True when done."""
    import ctypes

    get_last_error = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return True
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
            return True
    except OSError:
        pass
    return False


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
    asynchronous = False  # copies complete later: gradients are worth copying from backward hooks

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
        self.fold_s = 0.0  # the accumulate worker folded the landing area into the sums (an asynchronous link)
        self.d2h_bytes = 0  # bytes moved device -> host (gradients) and host -> device (weights)
        self.h2d_bytes = 0
        self.early_bytes = 0  # gradient bytes backward's hooks copied that step() found unchanged and used
        # gradient bytes backward's hooks copied that were not used: copied again (the gradient changed after its
        # hook, or a later backward's hook copied it again), or dropped (a skipped step or batch)
        self.unused_bytes = 0
        # the step just accumulated (step_bytes): bytes its hooks copied, of them not used
        self._step_bytes = (0, 0)
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
            self._sums_blocks = [self.alloc(numel, torch.float32) for _ in range(self.SUMS_BLOCKS)]
        return DeviceSums(self._fetcher(flat), self._sums_blocks)

    @staticmethod
    def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer that device copies read or write (the engine's: page-locked on a GPU)."""
        return torch.zeros(numel, dtype=dtype)

    @staticmethod
    def _fetcher(flat: torch.Tensor) -> Callable[[torch.Tensor, int, int], None]:
        def fetch(dst: torch.Tensor, lo: int, hi: int) -> None:
            dst.copy_(flat[lo:hi])  # done when it returns: no wait to hand back

        return fetch

    def sums_ready(self) -> None:
        """The device sums (``device_accumulation``) are about to be read or written: whatever the link still
        does with them comes first (here nothing: a synchronous upload copied and zeroed them)."""

    def step_bytes(self) -> tuple[int, int]:
        """``(copied, unused)`` of the step just accumulated: gradient bytes backward's hooks copied to the host,
        and of them those not used (copied again by a later hook or by ``step()``, or not part of the step);
        ``(0, 0)`` after a skipped one. Reset when taken."""
        taken, self._step_bytes = self._step_bytes, (0, 0)
        return taken

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

    landing_bytes = 0  # the landing area (an asynchronous link's)

    def host_bytes(self) -> dict[str, int]:
        """The host buffers of this link, by kind: the bytes of each buffer's storage as allocated."""
        host = self.host

        def size(*ts):
            return sum(t.untyped_storage().nbytes() for t in ts if t is not None)

        out = {"master": size(host.master), "exp_avg": size(host.exp_avg), "exp_avg_sq": size(host.exp_avg_sq),
               "accumulation": size(*host.acc), "copy_out": size(*host.out.values()), "landing": self.landing_bytes}
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

    def stage(self, i: int, grad: torch.Tensor) -> None:
        """Nothing to start early: accumulation reads the gradient where it is."""

    def accumulate(
        self, items: Sequence[tuple[int, torch.Tensor]], buf: int, *, scale: float = 1.0,
        fuse_min_numel: int | None = None
    ) -> dict[int, torch.Tensor]:
        """acc[buf] += grad * ``scale`` for each ``(index, grad)``, now. With ``fuse_min_numel`` (and ``scale``
        1) the gradients of at least that many elements are returned instead, for a synchronous update to fold
        into its AdamW pass (``HostShard.update(last=...)``)."""
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
                add_scaled([t for t, f in zip(sums, flat, strict=True) if not f],
                           [g for g, f in zip(grads, flat, strict=True) if not f], scale)
                sums = [t for t, f in zip(sums, flat, strict=True) if f]
                grads = [g for g, f in zip(grads, flat, strict=True) if f]
            accumulate_unchecked(sums, grads, scale=scale)
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


class AsyncLink(_Link):
    """Asynchronous movement: gradients land in a host landing area, fold into the sums once ``step()`` checked
    them; write-backs and fetches on an engine's streams (docs/design.md section 5.1)."""

    asynchronous = True
    FOLD_CHUNK_BYTES = 1 << 26
    """Landing bytes one fold job adds into the sums: the next backward's hooks each wait only for the job that
    reads their gradient's place, in the order they fired (a class attribute; tests shrink it)."""
    # device_accumulation in memory: wait for the sums' crossing at the boundary, before the next forward, as the
    # link did before the wait moved to the next write into the sums (bench.nvme_timeline's "eager" variant)
    SUMS_WAIT_AT_BOUNDARY = False

    def __init__(self, host: HostShard, engine, *, kind: str, delays: _Delays | None = None, **kwargs):
        super().__init__(host, thread_setup=engine.thread_setup, **kwargs)
        self.kind = kind
        self.moves_state = engine.moves_state
        self._engine = engine
        self._delays = delays
        self.alloc, self._fetcher = engine.alloc, engine.fetcher
        self._accumulator = HostWorker(
            num_threads=kwargs["host_threads"], cores=kwargs["cores"], timeout=kwargs["timeout"],
            name="zenflow-accumulate", setup=engine.thread_setup,
        )
        self.workers += [self._accumulator, *engine.workers]
        self.key = int.from_bytes(os.urandom(8), "little")  # the fingerprints' weights (ops.multi_fingerprint)
        self._fingerprints: torch.Tensor | None = None  # int64 [params] on the device: each taken at its hook
        # this step's gradients that backward's hooks copied into the landing area (index -> bytes), in the order
        # the hooks fired; step() checks each against its fingerprint before folding it into the sums
        self._staged: dict[int, int] = {}
        self._overwritten = 0  # bytes of this step's hook copies a later hook copied over (a second backward)
        self._readers: dict[int, Future] = {}  # index -> the fold job that last read its place in the landing area
        self._ordered = False  # this backward's end orders the device's later work after its copies (queued)
        self._last_accumulate = None  # completion of every fold (and upload) issued so far (jobs run in order)
        self._guard = None  # completion of the last write-back: the copy-out buffers are free after it
        self._sums_zeroed = None  # device_accumulation in memory: the last upload's zeroing of the device sums
        self.timeline = getattr(engine, "timeline", None)

    def submit_update(self, fn: Callable) -> Future:
        return _submit(self._updater, recorded(fn, self.timeline, "update"), self._delays)

    @property
    def landing_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.host.landing.values())

    def _free(self, i: int) -> None:
        """Parameter ``i``'s place in the landing area may be written: the fold that read it is done (the wait,
        from a hook or step(), counts as stall)."""
        reader = self._readers.get(i)
        if reader is not None:
            if not reader.done():
                t0 = time.perf_counter()
                try:
                    reader.wait()
                finally:
                    self._waited(t0, "fold")
            del self._readers[i]

    def stage(self, i: int, grad: torch.Tensor) -> None:
        """From parameter ``i``'s backward hook, as backward produced its gradient: take its fingerprint (on the
        device, in stream order) and start its copy into the landing area. Nothing reaches the sums before
        ``step()`` checked the gradient is still what was copied (:meth:`accumulate`); a second backward copies
        over the first (the copy stream runs in order)."""
        dst = self.host.landing_view(i)
        if grad.shape != dst.shape or grad.dtype != dst.dtype:
            return  # not this parameter's gradient as the host lays it out: step() copies (or refuses) it
        self._engine.refuse_capture()
        self._free(i)
        if self._fingerprints is None:
            self._fingerprints = torch.zeros(len(self.host.host_step), dtype=torch.int64, device=grad.device)
        src = grad.detach()
        ops.multi_fingerprint([src], self.key, out=self._fingerprints[i : i + 1])
        self._engine.d2h([(dst, src)])
        nbytes = src.numel() * src.element_size()
        self.d2h_bytes += nbytes
        self._overwritten += self._staged.pop(i, 0)  # (re-inserted: the order is the last firing's)
        self._staged[i] = nbytes
        if not self._ordered:
            self._ordered = _at_backward_end(self._after_backward)

    def _after_backward(self) -> None:
        """End of a backward whose hooks copied gradients: the device's later work (a user's in-place write to a
        gradient, GradScaler's unscale, the optimizer step) comes after those copies, so a copy reads the
        gradient its fingerprint was taken of. A stream wait on a GPU; the stand-in's training thread waits."""
        self._ordered = False
        t0 = time.perf_counter()
        self._engine.device_waits_for_d2h()
        self._waited(t0, "backward")

    def accumulate(self, items, buf: int, *, scale: float = 1.0, fuse_min_numel: int | None = None) -> dict:
        """acc[buf] += grad * ``scale`` for each ``(index, grad)``, in the background: a gradient a hook copied
        whose fingerprint is unchanged is not copied again; every other one (changed since its hook, or never
        staged) is copied now, into its place in the landing area; then fold jobs add the landing area into
        acc[buf] (on the accumulate worker, behind the copies). Hooks' copies of gradients not in ``items``
        are dropped. Returns ``{}`` (nothing is left to fuse)."""
        staged, wanted = self._staged, dict(items)
        checked = [(i, wanted[i]) for i in staged if i in wanted]
        changed: set[int] = set()
        if checked:
            now = ops.multi_fingerprint([g.detach() for _, g in checked], self.key)
            where = torch.tensor([i for i, _ in checked], device=now.device)
            differ = (now != self._fingerprints.index_select(0, where)).tolist()  # (one device sync)
            changed = {i for (i, _), d in zip(checked, differ, strict=True) if d}
        kept = [i for i, _ in checked if i not in changed]
        hooks_copied = self._engine.d2h_marker() if kept else None
        copies = []
        for i, grad in items:
            if i in staged and i not in changed:
                continue
            self._free(i)
            copies.append((self.host.landing_view(i), grad.detach()))
        if copies:
            self._engine.d2h(copies)
            self.d2h_bytes += sum(src.numel() * src.element_size() for _, src in copies)
        hook_bytes = sum(staged.values()) + self._overwritten
        used = sum(staged[i] for i in kept)
        self.early_bytes += used
        self.unused_bytes += hook_bytes - used
        self._step_bytes = (hook_bytes, hook_bytes - used)
        self._overwritten, self._ordered = 0, False  # (a backward that failed never ran its end: start again)
        # fold in the order the next backward's hooks will want their places back (this one's), then the rest
        later = [i for i, _ in items if i not in kept]
        all_copied = self._engine.d2h_marker() if later else hooks_copied
        for order, copied in ((kept, hooks_copied), (later, all_copied)):
            for chunk in self._chunks(order):
                self._fold(chunk, buf, scale, copied)
        self._staged = {}
        # the copies read the gradients as they are now; whatever the user does to them after step()
        # (zero_grad(set_to_none=False), p.grad.zero_(), the next backward adding in place) comes after
        self._engine.device_orders_after_d2h()
        return {}

    def _chunks(self, order: list[int]) -> list[list[int]]:
        """``order`` cut into runs of at most ``FOLD_CHUNK_BYTES`` of landing area (a larger gradient alone)."""
        chunks, size = [], 0
        for i in order:
            s = self.host.slots[i]
            nbytes = s.numel * s.dtype.itemsize
            if not chunks or size + nbytes > self.FOLD_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += nbytes
        return chunks

    def _fold(self, indices: list[int], buf: int, scale: float, copied) -> None:
        """One job on the accumulate worker: wait for the copies, then acc[buf] += landing * scale for these
        parameters; their places in the landing area are the job's until it is done."""
        host, timeline = self.host, self.timeline

        def fold():
            copied.wait()
            t0 = time.perf_counter()
            host.fold(buf, indices, scale)
            t1 = time.perf_counter()
            self.fold_s += t1 - t0  # (one worker thread adds; the training thread reads it for telemetry)
            if timeline is not None:
                timeline.add("accumulate", "fold", t0, t1,
                             sum(host.slots[i].numel * host.slots[i].dtype.itemsize for i in indices))

        self._last_accumulate = job = _submit(self._accumulator, fold, self._delays)
        for i in indices:
            self._readers[i] = job

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
        """The device sums are about to be read or written: the last upload's copies and zeroing come first, for
        the stream current now; every access waits until the zeroing is known to have run (a first access under a
        side stream, ``state_dict()`` inside ``torch.cuda.stream(s)``, must not leave the default stream's next
        add racing it)."""
        if self._sums_zeroed is not None:
            done = self._sums_zeroed
            t0 = time.perf_counter()
            self._engine.device_waits_for(done)
            self._waited(t0, "sums")
            if self._engine.completed(done):
                self._sums_zeroed = None

    def discard(self) -> None:
        """Forget what backward's hooks copied this step (a skipped step or batch): none of it reached the sums;
        the next copies into the same places land after these (the copy stream runs in order)."""
        self.unused_bytes += sum(self._staged.values()) + self._overwritten
        self._staged, self._overwritten, self._ordered = {}, 0, False

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


def _at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass running now ends (autograd's final callbacks, as FSDP2 uses);
    False outside a backward pass (nothing queued)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


def add_scaled(sums: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float) -> None:
    """``sum += float32(grad) * scale`` with the product rounded first (``accumulate_unchecked``'s bits), for
    tensors the numba kernel does not take (strided gradients, or a device's)."""
    if not sums:
        return
    if scale == 1.0:
        torch._foreach_add_(list(sums), list(grads))
    else:
        torch._foreach_add_(list(sums), torch._foreach_mul([g.float() for g in grads], scale))


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
    landing: bool = True,
):
    """The link for parameters on ``device``: CUDA -> AsyncLink(CudaEngine); CPU -> CpuLink, or, when
    ``chaos`` is given, AsyncLink(ThreadEngine) with its delays. ``indices``: the parameters whose host
    state this rank holds (ZeRO; default all). ``num_acc``: accumulation buffers (default 2 with
    ``overlap``, else 1). ``disk``: ``disk(numel)`` makes the state file of an NVMe host (HostShard). ``landing``:
    an asynchronous link's gradients cross through a landing area (False: they never cross per step, the sums
    being on the device)."""
    common = dict(overlap=overlap, host_threads=host_threads, cores=cores, timeout=timeout)
    if num_acc is None:
        num_acc = 2 if overlap else 1
    if device.type == "cuda":
        engine = CudaEngine(device)
        host = HostShard(params, groups, num_acc=num_acc, alloc=engine.alloc, indices=indices, disk=disk,
                         landing=landing)
        return AsyncLink(host, engine, kind="cuda", **common)
    if chaos is not None:
        delays = _Delays(chaos) if chaos.max_delay > 0 else None
        engine = ThreadEngine(timeout=timeout, delays=delays, d2h_bytes_per_s=chaos.d2h_bytes_per_s,
                              h2d_bytes_per_s=chaos.h2d_bytes_per_s, timeline=chaos.timeline)
        host = HostShard(params, groups, num_acc=num_acc, alloc=engine.alloc, indices=indices, disk=disk,
                         landing=landing)
        return AsyncLink(host, engine, kind="cpu-async", delays=delays, **common)
    host = HostShard(params, groups, num_acc=num_acc, indices=indices, disk=disk)
    return CpuLink(host, **common)
