"""AdamW over host state that lives in a file (:class:`~zenflow_kernels.state_files.StateFiles`), streamed
through a bounded pipeline: a reader thread reads block ``j + 1`` while the calling thread runs the fused
numba Adam (``cpu_ops.cpu_adam_``, the in-memory host's kernel) on block ``j`` and a writer thread writes
block ``j - 1`` back. Adam is elementwise, so a block-by-block pass gives the bits of one pass over the whole
range. Memory: ``depth`` blocks of buffers (12 B per element each), whatever the shard's size.

Every block a run touches is read, updated and written once (runs sharing a block are updated in the same
visit), so no block is read before an earlier write of it landed. A failed read or write stops the pipeline
and raises :class:`~zenflow_kernels.state_files.StateFileError` (file, operation, offset) in the caller; the
blocks after the failed one are not written.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import cpu_ops
from .state_files import StateFiles

__all__ = ["Run", "streamed_adam_"]


@dataclass(frozen=True)
class Run:
    """Flat elements ``[lo, hi)`` of the shard stepped with one set of ``cpu_adam_`` arguments (``adam``: step,
    grad_scale, lr, beta1, beta2, eps, weight_decay), their weights rounded into ``out`` (``hi - lo`` elements)."""

    lo: int
    hi: int
    out: torch.Tensor | None
    adam: dict


_STOP = object()


def streamed_adam_(files: StateFiles, acc: torch.Tensor, runs: Sequence[Run], *, depth: int = 3) -> dict:
    """One AdamW step of ``runs`` (disjoint, ascending) over the state in ``files``, with the gradient sums
    in ``acc`` (flat fp32, the shard's size; zeroed where used, as the in-memory update does). Returns the
    blocks and bytes moved."""
    if depth < 2:
        raise ValueError(f"streamed_adam_: depth={depth!r} is invalid: allowed >= 2 (one block read ahead)")
    plan: dict[int, list[tuple[Run, int, int]]] = {}
    for run in runs:
        for j, _, s, e in files.pieces(run.lo, run.hi):
            plan.setdefault(j, []).append((run, s, e))
    blocks = sorted(plan)
    if not blocks:
        return {"blocks": 0, "bytes": 0}
    free: queue.Queue = queue.Queue()
    for _ in range(min(depth, len(blocks))):
        free.put(files.new_block())
    ready: queue.Queue = queue.Queue()
    written: queue.Queue = queue.Queue()
    stop = threading.Event()
    errors: list[BaseException] = []

    def read_ahead():
        try:
            for j in blocks:
                bufs = free.get()
                if stop.is_set():  # the writer failed (or the caller stopped): wake the caller up
                    ready.put(_STOP)
                    return
                files.read_block(j, bufs)
                ready.put((j, bufs))
        except BaseException as exc:  # re-raised by the caller
            ready.put(exc)

    def write_behind():
        while (item := written.get()) is not _STOP:
            j, bufs = item
            try:
                if not errors:
                    files.write_block(j, bufs)
            except BaseException as exc:
                errors.append(exc)
                stop.set()
            free.put(bufs)

    reader = threading.Thread(target=read_ahead, name="zenflow-state-read", daemon=True)
    writer = threading.Thread(target=write_behind, name="zenflow-state-write", daemon=True)
    reader.start()
    writer.start()
    try:
        for _ in blocks:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            if errors or item is _STOP:
                raise errors[0]
            j, (master, exp_avg, exp_avg_sq) = item
            a, _ = files.block_range(j)
            for run, s, e in plan[j]:
                cpu_ops.cpu_adam_(master[s - a : e - a], acc[s:e], exp_avg[s - a : e - a], exp_avg_sq[s - a : e - a],
                                  out=None if run.out is None else run.out[s - run.lo : e - run.lo], zero_grad=True,
                                  **run.adam)
            written.put((j, (master, exp_avg, exp_avg_sq)))
    finally:
        stop.set()
        written.put(_STOP)
        writer.join()
        free.put(None)  # a reader waiting for a buffer wakes up and sees the stop
        reader.join()
    if errors:
        raise errors[0]
    return {"blocks": len(blocks), "bytes": 2 * len(blocks) * files.block_numel * 12}
