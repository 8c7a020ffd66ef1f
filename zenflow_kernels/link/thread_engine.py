"""The thread engine: the CUDA engine's protocol on CPU, each stream a thread running its copies in order, each
event a future, with the modeled device's bandwidths and chaos delays (``zenflow_kernels.testing.chaos``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..device_model import Delays, Timeline, modeled_copy
from .completions import Future, _nothing, _submit, new_worker


class ThreadEngine:
    """The CUDA engine's protocol on CPU: each stream is a thread running its jobs in order, an event
    is a future, and "later device work waits for the H2D copy" becomes a wait the training thread
    does before it next touches the parameters (:meth:`join`)."""

    moves_state = True

    def __init__(self, *, timeout: float | None, delays: Delays | None, d2h_bytes_per_s: float | None = None,
                 h2d_bytes_per_s: float | None = None, timeline: Timeline | None = None):
        self.delays = delays  # chaos delays around every job (None: none); the link's workers take them too
        # the modeled device: each copy job takes bytes / bandwidth on its thread (device_model.py)
        self._d2h_rate, self._h2d_rate, self.timeline = d2h_bytes_per_s, h2d_bytes_per_s, timeline
        self._d2h = new_worker(timeout=timeout, name="zenflow-d2h")
        self._h2d = new_worker(timeout=timeout, name="zenflow-h2d")
        self._fetch = new_worker(timeout=timeout, name="zenflow-fetch")  # the CUDA engine's fetch stream
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
        self._last_d2h = _submit(self._d2h, copy, self.delays)

    def d2h_marker(self) -> Future:
        """The last job queued on the copy thread (it runs its jobs in order): no job of its own, unless
        none was queued yet."""
        if self._last_d2h is None:
            self._last_d2h = _submit(self._d2h, _nothing, self.delays)
        return self._last_d2h

    def fetcher(self, flat: torch.Tensor) -> Callable[[torch.Tensor, int, int], Callable[[], None]]:
        """``DeviceSums.fetch`` over ``flat``: the copy queued on the fetch thread (the CUDA engine's fetch stream),
        taking the modeled D2H time, with chaos delays, recorded on the ``fetch`` lane; returns its wait."""

        def fetch(dst: torch.Tensor, lo: int, hi: int) -> Callable[[], None]:
            src = flat[lo:hi]
            copy = modeled_copy(lambda: dst.copy_(src), src.numel() * src.element_size(), self._d2h_rate,
                                self.timeline, "fetch")
            return _submit(self._fetch, copy, self.delays).wait

        return fetch

    def h2d(self, work: Callable[[], None], nbytes: int = 0) -> Future:
        def run():
            with torch.no_grad():  # grad mode is per thread: the work writes into parameters
                work()

        handle = _submit(self._h2d, modeled_copy(run, nbytes, self._h2d_rate, self.timeline, "h2d"), self.delays)
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

        handle = _submit(self._d2h, run, self.delays)
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
