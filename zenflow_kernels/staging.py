"""The staging ring of the asynchronous links: a few bounded host slots that gradients cross on their way
from the device to the accumulation buffers (docs/design.md sections 6 and 9).

A slot is one flat byte buffer (pinned on a GPU) of at most ``slot_bytes``. A gradient is copied into the
slot being filled as one or more *pieces* (a range of its flat elements at a 64-byte aligned offset); a
gradient larger than what a slot has left continues in the next slot. A slot is handed to the accumulate
worker once every gradient it holds is final: as soon as it is full, from a backward hook, where the
step's gradients are known final at their hooks (``place(..., seal=...)``; docs/design.md section 5.1),
else at ``step()`` (a later micro-batch or an in-place write changes a gradient after its hook copied it:
it is copied again over the same pieces). A slot is filled again only once that worker is done with it
(its *reader*).

Memory: at most ``slots * slot_bytes`` (allocated lazily), whatever the model size, instead of a
whole-shard buffer per slot and gradient dtype; the link sizes the slots so that a small shard's ring
holds two steps of its gradients and no more. Where hooks hand slots over, backward waits for a slot
only when the host cannot keep up; where they cannot, hooks copy only while a slot is free (they never
wait) and what did not fit is copied at ``step()``, which waits for slots as the worker frees them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Piece", "StagingRing"]

ALIGN_BYTES = 64


@dataclass(slots=True)
class Piece:
    """Elements ``[lo, lo + numel)`` of parameter ``index``'s flat gradient, at byte ``byte`` of slot ``slot``."""

    index: int
    dtype: torch.dtype
    lo: int
    numel: int
    slot: int
    byte: int
    data: torch.Tensor | None = None  # its bytes in the slot, as its dtype
    live: bool = True  # False once the gradient it holds is dropped (another dtype, a skipped step)


@dataclass(slots=True)
class Staged:
    """A gradient copied this step: the tensor and its version when copied, and where its elements went."""

    grad: torch.Tensor
    version: int
    pieces: list[Piece] = field(default_factory=list)
    placed: int = 0  # elements placed so far (all of them once the ring had room)


class StagingRing:
    """The slots, what each holds this step, and each slot's reader.

    Args:
        slots: number of slots.
        slot_bytes: the most bytes one slot holds.
        alloc: ``alloc(numel, dtype)`` -> a zeroed flat host tensor (the engine's: pinned on a GPU).
    """

    def __init__(self, slots: int, slot_bytes: int, alloc: Callable[[int, torch.dtype], torch.Tensor]):
        if slots < 1 or slot_bytes < ALIGN_BYTES:
            raise ValueError(f"StagingRing: slots={slots}, slot_bytes={slot_bytes}: allowed >= 1 and >= {ALIGN_BYTES}")
        self.slot_bytes = slot_bytes - slot_bytes % ALIGN_BYTES
        self._alloc = alloc
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self._typed: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(slots)]  # a slot as each dtype
        self.readers: list = [None] * slots  # the accumulate job that last read each slot (None: none yet)
        self.pieces: list[list[Piece]] = [[] for _ in range(slots)]
        self.used = [0] * slots  # bytes filled this step
        self.open: list[int] = []  # slots holding this step's pieces, not yet handed over (fill order)
        self.current: int | None = None  # the slot being filled
        self._next = 0  # the slot to try after the current one is full
        self.allocated_bytes = 0

    def _view(self, slot: int, dtype: torch.dtype, byte: int, numel: int) -> torch.Tensor:
        typed = self._typed[slot].get(dtype)
        if typed is None:  # the whole slot as this dtype, once (slots are a multiple of 64 bytes)
            typed = self._typed[slot][dtype] = self.buffers[slot].view(dtype)
        start = byte // dtype.itemsize
        return typed[start : start + numel]

    def place(self, index: int, dtype: torch.dtype, lo: int, numel: int, claim: Callable[[int], bool],
              seal: Callable[[int], None] | None = None,
              on_piece: Callable[[Piece], None] | None = None) -> list[Piece]:
        """Pieces for elements ``[lo, lo + numel)`` of a gradient, in the current slot and the next ones.
        ``claim(slot)`` says whether the ring may move on to that slot (it waits for the slot's reader, or
        only checks it); when it refuses, fewer elements than asked are placed. ``seal(slot)``, if given,
        hands a full slot over before the ring moves on (at ``step()``, or from a hook whose gradient is
        final; other hooks leave full slots open), so
        ``on_piece(piece)`` is called as each piece is placed: its copy must be issued before its slot is
        sealed."""
        placed: list[Piece] = []
        itemsize = dtype.itemsize
        while numel > 0:
            slot, room = self.current, 0
            if slot is not None:  # elements of dtype the current slot still takes, from an aligned start
                start = -(-self.used[slot] // ALIGN_BYTES) * ALIGN_BYTES
                room = max(0, self.slot_bytes - start) // itemsize
            if room == 0:
                if slot is not None and seal is not None:
                    seal(slot)
                slot = self._next
                if slot in self.open or not claim(slot):
                    break
                self._take(slot)
                start, room = 0, self.slot_bytes // itemsize
            n = min(numel, room)
            piece = Piece(index, dtype, lo, n, slot, start, self._view(slot, dtype, start, n))
            self.pieces[slot].append(piece)
            self.used[slot] = start + n * itemsize
            placed.append(piece)
            if on_piece is not None:
                on_piece(piece)
            lo, numel = lo + n, numel - n
        return placed

    def place_whole(self, index: int, dtype: torch.dtype, numel: int) -> Piece | None:
        """What :meth:`place` does for a gradient that fits whole in the slot being filled (no claim, no seal):
        its one piece; None when it does not fit (or has no elements): :meth:`place` places it."""
        got = self.place_run([(index, dtype, numel)])
        return got[0] if got else None

    def place_run(self, entries: list[tuple[int, torch.dtype, int]]) -> list[Piece]:
        """:meth:`place_whole` for consecutive gradients ``(index, dtype, numel)``: one piece each for the
        longest prefix of ``entries`` that fits whole in the slot being filled (the rest go through
        :meth:`place`). The pieces' views are made in one ``split_with_sizes`` per run of one dtype (a
        slice per piece costs twice as much, and step() places every gradient no hook staged here)."""
        slot = self.current
        if slot is None:
            return []
        used, limit, spans = self.used[slot], self.slot_bytes, []
        for index, dtype, numel in entries:
            start = -(-used // ALIGN_BYTES) * ALIGN_BYTES
            end = start + numel * dtype.itemsize
            if numel == 0 or end > limit:
                break
            spans.append((index, dtype, numel, start))
            used = end
        placed: list[Piece] = []
        k = 0
        while k < len(spans):
            dtype = spans[k][1]
            itemsize, sizes, real = dtype.itemsize, [], []
            first = pos = spans[k][3] // itemsize
            while k < len(spans) and spans[k][1] is dtype:
                index, _, numel, start = spans[k]
                if start // itemsize > pos:  # the alignment gap before it
                    sizes.append(start // itemsize - pos)
                real.append(len(sizes))
                sizes.append(numel)
                pos = start // itemsize + numel
                placed.append(Piece(index, dtype, 0, numel, slot, start))
                k += 1
            views = self._view(slot, dtype, first * itemsize, pos - first).split_with_sizes(sizes)
            for piece, at in zip(placed[len(placed) - len(real):], real, strict=True):
                piece.data = views[at]
        self.pieces[slot] += placed
        self.used[slot] = used
        return placed

    def _take(self, slot: int) -> None:
        """Start filling ``slot`` (its reader is done): allocated on first use."""
        if self.buffers[slot] is None:
            self.buffers[slot] = self._alloc(self.slot_bytes, torch.uint8)
            self.allocated_bytes += self.slot_bytes
        self.pieces[slot], self.used[slot] = [], 0
        self.open.append(slot)
        self.current = slot
        self._next = (slot + 1) % len(self.buffers)

    def hand_over(self, slot: int) -> list[Piece]:
        """Slot ``slot``'s live pieces, for an accumulate job (the caller records it in ``readers``: the
        slot is the job's until it is done)."""
        self.open.remove(slot)
        if self.current == slot:
            self.current = None
        return [p for p in self.pieces[slot] if p.live]

    def drop_open(self) -> None:
        """Forget this step's pieces (a skipped step): the open slots are free again (their copies, still in
        flight, land before any later copy into them: the copy stream runs in order)."""
        for slot in self.open:
            for p in self.pieces[slot]:
                p.live = False
            self.pieces[slot], self.used[slot] = [], 0
        self.open = []
        self.current = None

    def capacity(self) -> int:
        return len(self.buffers) * self.slot_bytes
