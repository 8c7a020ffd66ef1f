"""The CUDA engine: pinned host buffers (whole pages of their own, page-locked in place), a D2H and an H2D stream,
a fetch stream, CUDA events as completions; and the page-locking helpers it uses."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import torch

from .completions import Event


class CudaEngine:
    """Pinned host memory, a D2H and an H2D stream on ``device``, events as completions."""

    moves_state = True
    workers: tuple = ()  # streams, not threads: nothing to check or close
    delays = None  # no chaos delays: the streams' own timing

    def __init__(self, device: torch.device, owner: str = "ZenFlow"):
        self.device = device
        self.owner = owner  # what errors call the optimizer (ZenFlowAdamW, ZenFlow(Lion), ...)
        self._d2h = torch.cuda.Stream(device)
        self._h2d = torch.cuda.Stream(device)
        self.pinned: list[tuple[torch.Tensor, int]] = []  # (buffer, bytes) page-locked by this engine, until close
        self._fetch = None  # the stream host updates fetch device-side sums on (made at first use)

    def thread_setup(self) -> None:
        """Run first on every worker thread that waits on this engine's events."""
        torch.cuda.set_device(self.device)

    def refuse_capture(self) -> None:
        """A backward hook is about to copy: not inside a CUDA graph capture (its copies to page-locked memory, event
        records and host waits would invalidate it)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.owner}: a backward captured in a CUDA graph is not supported: the optimizer's gradient hooks "
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
        self.pinned.append((t, nbytes))
        return t

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked bytes this engine holds: requested, and reserved (the whole pages they lock)."""
        return pinned_sizes([(t.data_ptr(), nbytes) for t, nbytes in self.pinned])

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
        for t, nbytes in self.pinned:
            err = int(cudart.cudaHostUnregister(t.data_ptr()))
            if err != 0:
                clear_cuda_error()
                failed.append(f"{nbytes} bytes at {t.data_ptr():#x}: {cuda_error_text(cudart, err)}")
        self.pinned = []
        if failed:
            raise RuntimeError("zenflow: unlocking page-locked host memory failed for " + "; ".join(failed))


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

