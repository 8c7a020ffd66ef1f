"""Where a host shard keeps its master and its update rule's state: flat buffers in host memory, or a state file
(``offload_device="nvme"``). Chosen once, when the shard is laid out (as ``optim/sums.py`` chooses where the
gradient sums live); the shard and the host update go through the same methods either way.

Both hold the fields ``names`` (``"master"`` and the rule's ``state_names``), flat over the shard's layout: ``read``
a parameter's piece, ``write_many`` pieces, ``set_columns`` of matrices, ``snapshot`` for a checkpoint, and
``step_runs``, the host update of runs of the layout (each a ``streamed_host.RangeStep``: a range of flat elements
and its step arguments) with the rule's host kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .streamed_host import DeviceSums, RangeStep, streamed_host_step_

__all__ = ["FieldsInMemory", "FieldsOnDisk"]


class FieldsInMemory:
    """The fields as flat buffers from ``alloc`` (the link's: pinned on a GPU): ``master`` fp32, the rule's state in
    its ``state_dtype``."""

    on_disk = False
    files = None

    def __init__(self, names: Sequence[str], numel: int, alloc: Callable[[int, torch.dtype], torch.Tensor],
                 state_dtype: torch.dtype):
        self.buffers = {name: alloc(numel, torch.float32 if name == "master" else state_dtype) for name in names}

    def read(self, name: str, lo: int, numel: int) -> torch.Tensor:
        """Elements ``[lo, lo + numel)`` of a field as fp32: a view (a copy where the state is bf16)."""
        return self.buffers[name][lo : lo + numel].float()

    def write_many(self, items, *, fresh: bool = False) -> None:
        """``(name, lo, value)``: elements from ``lo`` <- ``value`` (any float tensor, its elements flat)."""
        for name, lo, value in items:
            self.buffers[name][lo : lo + value.numel()].copy_(value.detach().reshape(-1))

    def set_columns(self, items) -> None:
        """``(name, lo, shape, cols, value)``: columns ``cols`` of the matrix of ``shape`` at ``lo`` <- ``value``."""
        for name, lo, shape, cols, value in items:
            self.buffers[name][lo : lo + shape[0] * shape[1]].view(shape)[:, cols] = value

    def snapshot(self, extra: torch.Tensor | None = None) -> None:
        return None  # the buffers themselves are the state

    def step_runs(self, rule, acc: torch.Tensor, runs: Sequence[RangeStep], sums: DeviceSums | None = None) -> None:
        """The rule's host kernel over each run, with the sums in ``acc`` (zeroed as they are read)."""
        master, state = self.buffers["master"], [self.buffers[name] for name in rule.state_names]
        for run in runs:
            lo, hi = run.lo, run.hi
            rule.host_step_(master[lo:hi], acc[lo:hi], [t[lo:hi] for t in state], out=run.out, zero_grad=True,
                            **run.step_args)

    def close(self) -> None:
        return None


class FieldsOnDisk:
    """The fields in a state file (:class:`~zenflow_kernels.state_files.StateFiles`), never whole in memory: every
    access is a pass over the blocks it touches; the host update streams the file (``streamed_host_step_``)."""

    on_disk = True

    def __init__(self, files, names: Sequence[str]):
        if tuple(files.fields) != tuple(names):
            files.close()
            raise ValueError(f"HostShard: the state file holds the fields {tuple(files.fields)}, the update rule "
                             f"needs {tuple(names)}")
        self.files = files
        self.buffers = dict.fromkeys(names)

    def read(self, name: str, lo: int, numel: int) -> torch.Tensor:
        return self.files.read(name, lo, lo + numel)

    def write_many(self, items, *, fresh: bool = False) -> None:
        self.files.write_many(list(items), fresh=fresh)  # one pass, each block's piece converted at a time

    def set_columns(self, items) -> None:
        self.files.fill_many([(name, lo, shape[0] * shape[1], _column_fill(shape[1], cols, value))
                              for name, lo, shape, cols, value in items])

    def snapshot(self, extra: torch.Tensor | None = None) -> torch.Tensor:
        return self.files.snapshot(extra)

    def step_runs(self, rule, acc: torch.Tensor | None, runs: Sequence[RangeStep],
                  sums: DeviceSums | None = None) -> None:
        if runs:
            streamed_host_step_(self.files, acc, runs, rule=rule, sums=sums)

    def close(self) -> None:
        self.files.close()


def _column_fill(width: int, cols: torch.Tensor, value: torch.Tensor):
    """``StateFiles.fill_many``'s fill for columns ``cols`` of a row-major matrix ``width`` wide <- ``value`` ([R,
    len(cols)]): each block's piece gets the elements of those columns that fall in it."""
    cols, value = cols.reshape(-1).long(), value.detach().to("cpu", torch.float32)

    def fill(dst: torch.Tensor, s: int, e: int, last: bool) -> None:
        first, stop = s // width, -(-e // width)  # the rows this piece touches
        where = (torch.arange(first, stop).unsqueeze(1) * width + cols.unsqueeze(0)).reshape(-1)
        keep = (where >= s) & (where < e)
        dst[where[keep] - s] = value[first:stop].reshape(-1)[keep]

    return fill
