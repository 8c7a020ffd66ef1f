"""What every link shares (:class:`_Link`): the host shard, the update worker (overlap), timed waits, counters,
the write-back's copies."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._memory import gather_columns
from ..cpu_ops.accumulate import SUM_CHUNK
from ..device_model import Timeline
from ..host import HostShard
from ..streamed_host import DeviceSums
from .completions import Future, new_worker
from .worker import HostWorker


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
            self._updater = new_worker(num_threads=host_threads, cores=cores, timeout=timeout, setup=thread_setup)
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
        # gradient bytes hooks copied whose landed bytes step() fingerprinted on the host (written in place during
        # their backward: AsyncLink._landed_differ)
        self.landed_checked_bytes = 0
        # the step just accumulated (step_bytes): bytes of each gradient's last hook copy, of them those that changed
        self._step_bytes = (0, 0)
        self._sums_blocks: list[torch.Tensor] | None = None  # device_sums' host blocks (made at first use)

    SUMS_BLOCKS = 3
    """Host blocks a streamed update fetches device-side sums into: ``streamed_host_step_``'s depth."""

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
        """``(copied, changed)`` of the step just accumulated: the bytes of the gradients backward's hooks handed
        to the host (each one's last copy: not those a later backward's hook copied over), and of them those of
        gradients that changed after their hook (``step()`` copied them again); ``(0, 0)`` after a skipped one.
        Reset when taken."""
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

        out = {name: size(t) for name, t in host.fields.items()}  # master and the update rule's state
        out.update(accumulation=size(*host.acc), copy_out=size(*host.out.values()), landing=self.landing_bytes)
        if self._sums_blocks is not None:  # device_accumulation on disk: the blocks its sums are fetched into
            out["sums_blocks"] = size(*self._sums_blocks)
        if host.disk is not None:  # the master and rule state are on disk: their bytes there, not in memory
            out["disk"] = host.disk.nbytes
        return out

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked host memory (a CUDA link's), requested and reserved; empty where nothing is pinned."""
        return {}

    @property
    def failed(self) -> bool:
        return any(w.failure is not None for w in self.workers)

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
