"""Where an interval's gradient sums live, chosen once per optimizer (docs/design.md section 4; docs/nvme.md):

* :class:`SumsInHost`: in host memory; the link adds each step's gradients into them (one buffer, or two with
  ``overlap_step``: the next interval's while an update reads the last one's).
* :class:`SumsOnDevice` (``device_accumulation``, state in memory): summed on the device, crossing to the host's
  one buffer once per update.
* :class:`SumsStreamed` (``device_accumulation``, state on disk): summed on the device and never whole in host
  memory; the streamed update fetches each block's piece (two device buffers with ``overlap_step``).

The training thread's ledger (which parameter was added how often into which buffer) is the interval's
(``interval.py``); these objects hold the data and move it.
"""

from __future__ import annotations

import torch

from ..cpu_ops.accumulate import accumulate_unchecked
from ..streamed_host import DeviceSums
from .run import BuiltOptimizer

__all__ = ["SumsInHost", "SumsOnDevice", "SumsStreamed", "make_sums"]


class SumsInHost:
    """The sums in the host shard's accumulation buffers, added into by the link."""

    fuses = True  # a synchronous CPU update may fold the interval's last gradient into its host pass

    def __init__(self, run: BuiltOptimizer):
        self.run = run
        self.buffers = len(run.host.acc)

    def add(self, indices: list[int], buf: int, *, scale: float, fuse_min_numel: int | None = None) -> dict:
        """Add these parameters' gradients (this rank's share of them) into buffer ``buf``; with ``fuse_min_numel``
        a CPU link may hand large gradients back un-added, ``{index: grad}``, for the update to fold in."""
        shard = self.run.shard
        items = [(i, shard.grad(i)) for i in shard.mine(indices)]
        return self.run.link.accumulate(items, buf, scale=scale, fuse_min_numel=fuse_min_numel)

    def cross(self, indices: list[int], buf: int) -> None:
        """Nothing crosses: the sums are already in host memory."""

    def for_update(self, mine, buf: int, clipped: bool) -> DeviceSums | None:
        return None

    def updated(self) -> None:
        """An update finished reading the sums (it zeroes the host buffer itself)."""

    def flat(self, buf: int) -> torch.Tensor:
        """Buffer ``buf``: the flat fp32 sums, laid out like the host shard."""
        return self.run.host.acc[buf]

    def device_tensors(self) -> list[torch.Tensor]:
        return []


class SumsOnDevice(SumsInHost):
    """``device_accumulation`` in memory: the sums on the device, crossing once per update into the host's buffer."""

    fuses = False

    def __init__(self, run: BuiltOptimizer, count: int = 1):
        self.run = run
        self.tensors = [torch.zeros(run.host.numel, dtype=torch.float32, device=run.device) for _ in range(count)]
        self.buffers = count

    def flat(self, buf: int) -> torch.Tensor:
        """The device buffer, once the last boundary's crossing has read and zeroed it (the link orders the caller
        after that: every access waits)."""
        self.run.link.sums_ready()
        return self.tensors[buf]

    def add(self, indices: list[int], buf: int, *, scale: float, fuse_min_numel: int | None = None) -> dict:
        run = self.run
        acc = self.flat(buf)
        mine = run.shard.mine(indices)
        sums, grads = [run.host.view(acc, i) for i in mine], [run.shard.grad(i) for i in mine]
        if acc.device.type == "cpu" and all(g.is_contiguous() for g in grads):
            # the numba pass widens each gradient as it reads it (the bits of torch's add); torch's mixed-dtype
            # add makes an fp32 copy of every bf16/fp16 gradient first: per-step temporaries (see _memory)
            accumulate_unchecked(sums, grads, scale=scale)
        elif scale == 1.0:
            torch._foreach_add_(sums, grads)
        else:  # (a power-of-two scale: exact whether or not the device fuses the multiply into the add)
            torch._foreach_add_(sums, grads, alpha=scale)
        return {}

    def cross(self, indices: list[int], buf: int) -> None:
        """These parameters' sums cross to the host's buffer now (the link zeroes them behind the copies)."""
        acc = self.flat(buf)
        self.run.link.upload([(i, self.run.host.view(acc, i)) for i in indices], buf)

    def device_tensors(self) -> list[torch.Tensor]:
        return self.tensors


class SumsStreamed(SumsOnDevice):
    """``device_accumulation`` with the state on disk: the sums stay on the device; a host update fetches each
    block's piece of them (:meth:`for_update`) and they are zeroed once it is done (:meth:`updated`)."""

    def __init__(self, run: BuiltOptimizer, count: int):
        super().__init__(run, count)
        self._read: list[torch.Tensor] = []  # sums an update reads: zeroed once it is done

    def cross(self, indices: list[int], buf: int) -> None:
        """Nothing crosses ahead: the update fetches block by block."""

    def for_update(self, mine, buf: int, clipped: bool) -> DeviceSums:
        """Buffer ``buf`` for the update of ``mine`` to fetch from (clipping reads it twice)."""
        run = self.run
        acc = self.flat(buf)
        self._read = [run.host.view(acc, i) for i in mine]
        run.link.d2h_bytes += sum(t.numel() for t in self._read) * 4 * (2 if clipped else 1)
        return run.link.device_sums(acc)

    def updated(self) -> None:
        """The sums the finished update fetched start the buffer's next interval from zero (on the device, behind
        the fetches, which that update waited for)."""
        if self._read:
            torch._foreach_zero_(self._read)
            self._read = []


def make_sums(run: BuiltOptimizer):
    """The sums' home for this run's config."""
    cfg = run.config
    if not cfg.device_accumulation:
        return SumsInHost(run)
    if cfg.offload_device == "nvme":
        return SumsStreamed(run, 2 if cfg.overlap_step else 1)
    return SumsOnDevice(run)


def host_buffers(config) -> int:
    """Accumulation buffers the host shard holds: two where the host accumulates while an update reads
    (``overlap_step``), none where the sums stay on the device until a streamed update fetches them block by
    block, else one."""
    if config.device_accumulation and config.offload_device == "nvme":
        return 0
    return 2 if config.overlap_step and not config.device_accumulation else 1
