"""The synchronous link (:class:`CpuLink`, parameters on CPU): plain copies on the training thread, which also
accumulates."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..cpu_ops.accumulate import accumulate_unchecked
from .base import _Link


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
        into its host pass (``HostShard.update(last=...)``)."""
        t0 = time.perf_counter()
        last, sums, grads = {}, [], []
        for i, grad in items:
            self.d2h_bytes += grad.numel() * grad.element_size()
            if fuse_min_numel is not None and grad.numel() >= fuse_min_numel:
                last[i] = grad
            else:
                sums.append(self.host.acc_view(buf, i))
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
            self.host.acc_view(buf, i).copy_(total)
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


def add_scaled(sums: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float) -> None:
    """``sum += float32(grad) * scale`` with the product rounded first (``accumulate_unchecked``'s bits), for
    tensors the numba kernel does not take (strided gradients, or a device's)."""
    if not sums:
        return
    if scale == 1.0:
        torch._foreach_add_(list(sums), list(grads))
    else:
        torch._foreach_add_(list(sums), torch._foreach_mul([g.float() for g in grads], scale))
