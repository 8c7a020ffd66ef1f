"""The compiled fast path's layout (``rules.compiled``): the selected columns of every item of a launch packed into flat
fp32 buffers, stepped there by the rule's compiled flat step (a call per run of columns that share their
hyper-parameters and, for a rule that reads it, their step count), and unpacked back.

On the CPU, packing and unpacking are one numba launch each over every item (``cpu_ops/column_packing.py``:
addresses in an int64 table, the multi-tensor launches' way), so a launch of many small tensors costs three calls
whatever their number; elsewhere (a CUDA device, a strided tensor) they are torch ops, a few per item. The layout of
one list of tensors is kept in its ``LaunchItems.launch_cache`` (the optimizer launches the same tensors at every
step of a selection) and rebuilt when the items' hyper-parameters split them differently or (``uses_step``) their
columns' step counts do.

Columns are packed column by column (``rows`` values each) in the order of their run: the step is elementwise, as
the host pass over flat runs of many parameters already requires of a rule.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cpu_ops.column_packing import MAX_STATE, ColumnTable, numba_dtype, row_blocks
from ..launch_plan import LaunchItems, PlannedFor

__all__ = ["Packed", "dtype_parts", "packed_for"]

def _grad_layout(g: torch.Tensor) -> tuple:
    return g.dtype, g.is_contiguous()  # (on the parameters' device, as step() checks)


class Packed:
    """The packing of one list of items ``(param, grad, columns, *state, master, step, *tensor_hyperparams)`` (the
    layout of ``UpdateRule.fast_step_``): ``runs(items, ...)`` packs them and gives the flat runs to step, ``unpack()``
    writes them back. A block is one item's columns at one step count (all of them, but for a rule that reads its step
    count and a matrix whose columns are at several), packed row-major ``[rows, columns]``; blocks are ordered by
    their hyper-parameters and step count, so that each run is contiguous."""

    def __init__(self, items, n_state: int, *, home: bool = False):
        self.n_state = n_state
        # home: the state tensors live in the packed buffer (re-pointed into it, ``set_``) while the layout keeps every
        # item whole, so packing and unpacking skip them; only for items the optimizer launches again and again (its
        # ``LaunchItems``: nothing else holds their addresses) whose state is plain contiguous fp32
        self.can_home = home and n_state > 0 and all(
            t.dtype == torch.float32 and t.is_contiguous() and t.device == items[0][0].device and not t.requires_grad
            for it in items for t in it[3 : 3 + n_state])
        self.home = False
        self._state = [tuple(it[3 : 3 + n_state]) for it in items]
        self.made_for = PlannedFor(items, _grad_layout, n_state=n_state)
        first = items[0]
        self.device = first[0].device
        self.master = first[3 + n_state] is not None
        self.numba = (self.device.type == "cpu" and n_state <= MAX_STATE
                      and all(_numba_ok(it, n_state, first) for it in items))
        self.rows = np.array([it[0].shape[0] for it in items], dtype=np.int64)
        self.ks = np.array([it[0].shape[1] if it[2] is None else it[2].numel() for it in items], dtype=np.int64)
        self.numel = int((self.rows * self.ks).sum())
        f32 = dict(dtype=torch.float32, device=self.device)
        self.P, self.G = torch.empty(self.numel, **f32), torch.empty(self.numel, **f32)
        self.S = None  # (made by _layout, for its order)
        if self.numba:
            self.table = ColumnTable(items, n_state, self.rows, self.ks)
        self.key = None  # what the blocks' order was made for: the items' groups and their step counts' pattern
        self._items = None

    def fits(self, items) -> bool:
        return self.made_for.fits(items)

    def runs(self, items, groups: list[int], steps: list | None) -> list[tuple[int, int, int, float]]:
        """Pack ``items`` (``groups[t]``: item t's group of hyper-parameters; ``steps``: None, or each item's step
        count: a float, or its columns' counts as a numpy array) and return the flat runs ``(lo, hi, group, step)``."""
        # the blocks depend on which columns share their hyper-parameters and step counts, not on the counts' values
        # (they all advance by one at a step): kept while that partition stays
        pattern = None if steps is None else tuple(
            None if isinstance(a, float) else np.unique(a, return_inverse=True)[1].tobytes() for a in steps)
        key = (tuple(groups), pattern)
        if key != self.key:
            self._layout(groups, steps)
            self.key = key
        runs = [(lo, hi, g, 0.0 if steps is None else
                 (steps[t] if isinstance(steps[t], float) else float(steps[t][j])))
                for lo, hi, g, t, j in self.segments]
        self._items = items
        if self.numba:
            self.table.pack(items, self.work, self.numel, self.P, self.G, self.S, not self.home)
        else:
            self._torch_pack(items)
        return runs

    def unpack(self) -> None:
        """The stepped runs back into the items' parameters, masters and state."""
        items, self._items = self._items, None
        if self.numba:
            self.table.unpack(self.work, self.numel, self.P, self.S, not self.home)
        else:
            self._torch_unpack(items)

    def _layout(self, groups: list[int], steps: list | None) -> None:
        blocks = []  # (group, step, item, its state columns or None: all)
        for t, g in enumerate(groups):
            a = 0.0 if steps is None else steps[t]
            if isinstance(a, float):
                blocks.append((g, a, t, None))
            else:
                blocks.extend((g, float(v), t, np.flatnonzero(a == v)) for v in np.unique(a))
        blocks.sort(key=lambda b: (b[0], b[1]))  # (stable: items in their order within a run)
        cols = [np.arange(self.ks[t], dtype=np.int64) if js is None else js.astype(np.int64) for _, _, t, js in blocks]
        b_item = np.array([b[2] for b in blocks], dtype=np.int64)
        b_len = np.array([c.size for c in cols], dtype=np.int64)
        b_rows = self.rows[b_item]
        sizes = b_rows * b_len
        b_off = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        b_start = np.concatenate(([0], np.cumsum(b_len)[:-1])).astype(np.int64)
        block_cols = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        self.work = (*row_blocks(b_rows, b_len), b_item, b_start, b_len, b_off, block_cols)
        self.segments = []  # (lo, hi, group, an item and column of the run: where its step count is read)
        for (g, st, t, js), lo, size in zip(blocks, b_off, sizes, strict=True):
            last = self.segments[-1] if self.segments else None
            if last is not None and last[5] == (g, st):
                last[1] = int(lo + size)
            else:
                self.segments.append([int(lo), int(lo + size), g, t, 0 if js is None else int(js[0]), (g, st)])
        self.segments = [tuple(seg[:5]) for seg in self.segments]
        self.blocks = [(t, None if js is None else torch.from_numpy(c).to(self.device), int(lo), int(r), int(c.size))
                       for (_, _, t, js), c, lo, r in zip(blocks, cols, b_off, b_rows, strict=True)]
        # a new buffer for the state in this order: the state tensors may be views of the old one
        S = torch.empty(max(self.n_state, 1), self.numel, dtype=torch.float32, device=self.device)
        whole = all(js is None for _, _, _, js in blocks)
        if self.can_home and whole:
            storage, base = S.untyped_storage(), S.storage_offset()
            with torch.no_grad():
                for t, _, lo, rows, k in self.blocks:
                    for j, tensor in enumerate(self._state[t]):
                        S[j, lo : lo + rows * k].view(rows, k).copy_(tensor)
                        tensor.set_(storage, base + j * self.numel + lo, (rows, k), (k, 1))
            self.home = True
        else:
            self.home = False
        self.S = S
        if self.numba:  # (the state's addresses, for the kernels when not at home)
            self.table.point_state(self._state)

    # -- the torch packing (a device, strided tensors, many state tensors) ----------------------------------------

    def _torch_pack(self, items) -> None:
        n = self.n_state
        for t, js, lo, rows, nj in self.blocks:
            it = items[t]
            p, g, idx = it[:3]
            master = it[3 + n]
            cols = js if idx is None else (idx if js is None else idx.index_select(0, js))
            hi = lo + rows * nj
            self.G[lo:hi].view(rows, nj).copy_(g if cols is None else g.index_select(1, cols))
            if master is not None:
                src = master if js is None else master.index_select(1, js)
            else:
                src = p if cols is None else p.index_select(1, cols)
            self.P[lo:hi].view(rows, nj).copy_(src)
            for j in range(0 if self.home else n):
                self.S[j, lo:hi].view(rows, nj).copy_(it[3 + j] if js is None else it[3 + j].index_select(1, js))

    def _torch_unpack(self, items) -> None:
        n = self.n_state
        with torch.no_grad():
            for t, js, lo, rows, nj in self.blocks:
                it = items[t]
                p, _, idx = it[:3]
                master = it[3 + n]
                cols = js if idx is None else (idx if js is None else idx.index_select(0, js))
                values = self.P[lo : lo + rows * nj].view(rows, nj)
                if cols is None:
                    p.copy_(values)
                else:
                    p.index_copy_(1, cols, values.to(p.dtype))
                for dst, src in ([(master, values)] if master is not None else []) + [
                        (it[3 + j], self.S[j, lo : lo + rows * nj].view(rows, nj))
                        for j in range(0 if self.home else n)]:
                    if js is None:
                        dst.copy_(src)
                    else:
                        dst.index_copy_(1, js, src)


def _numba_ok(item, n_state: int, first) -> bool:
    p, g, idx = item[:3]
    state, master = item[3 : 3 + n_state], item[3 + n_state]
    return (p.device.type == "cpu" and (idx is None or idx.dtype == torch.int64)
            and numba_dtype(p.dtype) and numba_dtype(g.dtype) and p.dtype == first[0].dtype
            and g.dtype == first[1].dtype and (master is None) == (first[3 + n_state] is None)
            and p.is_contiguous() and g.is_contiguous() and (idx is None or idx.is_contiguous())
            and all(s.dtype == torch.float32 and s.is_contiguous() for s in state)
            and (master is None or master.is_contiguous()))


def dtype_parts(items, n_state: int) -> list:
    """``items`` split by (parameter dtype, gradient dtype, master or not): one list, or several (``LaunchItems``
    sharing their ``launch_cache``'s parts, laid out once with it)."""
    cache = getattr(items, "launch_cache", None)
    split = None if cache is None else cache.get("compiled_parts")
    if split is None or split[0] != len(items):
        keys: dict[tuple, list[int]] = {}
        for t, it in enumerate(items):
            keys.setdefault((it[0].dtype, it[1].dtype, it[3 + n_state] is None), []).append(t)
        split = (len(items), list(keys.values()), [{} for _ in keys])
        if cache is not None:
            cache["compiled_parts"] = split
    _, positions, caches = split
    if len(positions) == 1:
        return [items]
    if cache is None:
        return [[items[t] for t in pos] for pos in positions]
    same = getattr(items, "same_tensors", False)
    return [LaunchItems([items[t] for t in pos], part_cache, same_tensors=same)
            for pos, part_cache in zip(positions, caches, strict=True)]


def packed_for(items, n_state: int) -> Packed:
    """The packing of ``items``, kept in their ``launch_cache`` when they have one (``LaunchItems``)."""
    cache = getattr(items, "launch_cache", None)
    packed = None if cache is None else cache.get("compiled")
    if packed is None or not packed.fits(items):
        packed = Packed(items, n_state, home=cache is not None and getattr(items, "same_tensors", False))
        if cache is not None:
            cache["compiled"] = packed
    return packed
