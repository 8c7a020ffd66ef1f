"""An update rule's host step (its ``host_step_``, the kernel the in-memory host runs: AdamW's fused numba Adam
``cpu_ops.cpu_adam_``, Lion's, SGD's, ...) over host state that lives in a file
(:class:`~zenflow_kernels.state_files.StateFiles`: ``master`` and the rule's ``state_names``), streamed through a
bounded pipeline: a reader thread reads block ``j + 1`` while the calling thread runs the rule's step on block ``j``
and a writer thread writes block ``j - 1`` back. The host step is elementwise, so a block-by-block pass gives the
bits of one pass over the whole range. Memory: ``depth`` blocks of buffers (4 B per element and field each: the
master and one per state tensor, 12 B for AdamW), whatever the shard's size.

With ``device_accumulation`` the gradient sums stay on the device (:class:`DeviceSums`): the reader also
fetches each block's piece of them into one more buffer (``DeviceSums.buffers``, reused across updates), so no
shard-sized host buffer of sums exists. It starts the fetch before reading the block and waits for it after,
so the copy over the link runs beside the disk read (``orderings.fetch_beside_read`` False: read, then fetch,
the former order).

Every block a run touches is read, updated and written once (runs sharing a block are updated in the same
visit), so no block is read before an earlier write of it landed. A failed read or write stops the pipeline
and raises :class:`~zenflow_kernels.state_files.StateFileError` (file, operation, offset) in the caller; the
blocks after the failed one are not written.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .orderings import orderings
from .rules import UpdateRule
from .state_files import StateFiles

__all__ = ["DeviceSums", "RangeStep", "streamed_host_step_"]


@dataclass(frozen=True)
class RangeStep:
    """Flat elements ``[lo, hi)`` of the shard stepped with one set of ``host_step_`` keyword arguments
    (``step_args``: step, grad_scale and the rule's hyper-parameters, e.g. AdamW's lr, beta1, beta2, eps, weight_decay),
    their weights rounded into ``out`` (``hi - lo`` elements)."""

    lo: int
    hi: int
    out: torch.Tensor | None
    step_args: dict


@dataclass(frozen=True)
class DeviceSums:
    """An interval's gradient sums that stay on the device (``device_accumulation``), flat and laid out like the
    shard: ``fetch(dst, lo, hi)`` starts copying elements ``[lo, hi)`` into the host fp32 tensor ``dst`` (from any
    thread) and returns None once they are there, or a wait that blocks until they are (and raises if the copy
    failed); ``buffers`` are host blocks to fetch into (fp32, each at least the largest state block, pinned on a
    GPU), owned by the link and reused by every update."""

    fetch: Callable[[torch.Tensor, int, int], Callable[[], None] | None]
    buffers: Sequence[torch.Tensor]

    def start(self, dst: torch.Tensor, lo: int, hi: int) -> Callable[[], None]:
        """``fetch``, returning its wait (one that returns at once where the copy is already done)."""
        return self.fetch(dst, lo, hi) or _done

    def get(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """``fetch`` and wait for it."""
        self.start(dst, lo, hi)()


def _done() -> None:
    return None


def _settle(waits: list[Callable[[], None]]) -> None:
    """Wait for copies already started, their errors dropped (another error is on its way): nothing may still be
    writing into a block once the pipeline has stopped."""
    for wait in waits:
        with contextlib.suppress(BaseException):
            wait()


_STOP = object()

def streamed_host_step_(files: StateFiles, acc: torch.Tensor | None, runs: Sequence[RangeStep], *,
                        rule: UpdateRule, depth: int = 3, sums: DeviceSums | None = None) -> dict:
    """One host step of ``rule`` (the file holds ``master`` and its ``state_names``) over ``runs`` (disjoint,
    ascending) of the state in ``files``, with the gradient sums in ``acc`` (flat fp32, the shard's size; zeroed where
    used, as the in-memory update does) or, with ``acc`` None, fetched block by block from ``sums`` (left as they are:
    their owner zeroes them). Returns the blocks and bytes moved."""
    if tuple(files.fields) != ("master", *rule.state_names):
        raise ValueError(f"streamed_host_step_: the file holds {tuple(files.fields)}, the rule {rule.name} steps "
                         f"{('master', *rule.state_names)}")
    if depth < 2:
        raise ValueError(f"streamed_host_step_: depth={depth!r} is invalid: allowed >= 2 (one block read ahead)")
    if (acc is None) == (sums is None):
        raise ValueError("streamed_host_step_: pass the gradient sums either as acc (host memory) or as sums (fetched "
                         "from the device), exactly one of them")
    need = min(files.block_numel, files.numel)  # the largest block
    if sums is not None and (len(sums.buffers) < depth or any(
            b.numel() < need or b.dtype != torch.float32 for b in sums.buffers)):
        raise ValueError(f"streamed_host_step_: sums.buffers must hold at least depth={depth} fp32 buffers of "
                         f"min(block_numel, numel)={need} elements, got {[(b.numel(), b.dtype) for b in sums.buffers]}")
    plan: dict[int, list[tuple[RangeStep, int, int]]] = {}
    for run in runs:
        for j, _, s, e in files.pieces(run.lo, run.hi):
            plan.setdefault(j, []).append((run, s, e))
    blocks = sorted(plan)
    if not blocks:
        return {"blocks": 0, "bytes": 0}
    free: queue.Queue = queue.Queue()
    for k in range(min(depth, len(blocks))):
        free.put((files.new_block(), None if sums is None else sums.buffers[k]))
    ready: queue.Queue = queue.Queue()
    written: queue.Queue = queue.Queue()
    stop = threading.Event()
    errors: list[BaseException] = []

    def read_ahead():
        try:
            for j in blocks:
                item = free.get()
                if stop.is_set():  # the writer failed (or the caller stopped): wake the caller up
                    ready.put(_STOP)
                    return
                bufs, fetched = item
                waits: list[Callable[[], None]] = []
                beside = orderings.fetch_beside_read  # (read at each block; False: the former order)
                try:
                    if not beside:
                        files.read_block(j, bufs)
                    if fetched is not None:  # this block's piece of the sums starts crossing from the device ...
                        a, _ = files.block_range(j)
                        for _, s, e in plan[j]:
                            waits.append(sums.start(fetched[s - a : e - a], s, e))
                    if beside:
                        files.read_block(j, bufs)  # ... while its state is read from the file
                    for wait in waits:
                        wait()
                except BaseException:
                    _settle(waits)  # (waiting twice for a copy is harmless)
                    raise
                ready.put((j, item))
        except BaseException as exc:  # re-raised by the caller
            ready.put(exc)

    def write_behind():
        while (item := written.get()) is not _STOP:
            j, item = item
            try:
                if not errors:
                    files.write_block(j, item[0])
            except BaseException as exc:
                errors.append(exc)
                stop.set()
            free.put(item)

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
            j, pair = item
            (master, *state), fetched = pair
            a, _ = files.block_range(j)
            for run, s, e in plan[j]:
                grads = acc[s:e] if fetched is None else fetched[s - a : e - a]
                rule.host_step_(master[s - a : e - a], grads, [t[s - a : e - a] for t in state],
                                out=None if run.out is None else run.out[s - run.lo : e - run.lo],
                                zero_grad=fetched is None, **run.step_args)
            written.put((j, pair))
    finally:
        stop.set()
        written.put(_STOP)
        writer.join()
        free.put(None)  # a reader waiting for a buffer wakes up and sees the stop
        reader.join()
    if errors:
        raise errors[0]
    return {"blocks": len(blocks), "bytes": 2 * len(blocks) * files.block_numel * 4 * len(files.fields)}
