"""The column walk of the CPU fast path's kernels (AdamW, Lion, SGD on selected columns): a row's columns with or
without an index array, the master or the parameter as the weight, the work items of a multi-tensor launch dealt
out in ranges, and the rules' address table."""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types

from ._dtype import array_at, is_none, load_f32, numba_only
from ._ir import pointer_at


@numba_only
def column_of(idx, j):
    """``idx[j]`` as an unsigned index, or ``j`` when idx is None (a dense update) (numba only). Unsigned:
    numba then indexes without its negative-index wraparound check."""
    if is_none(idx):
        return lambda idx, j: j
    if isinstance(idx, types.Array):
        return lambda idx, j: np.uint64(idx[j])
    return None


@numba_only
def row_of(a, base, j0, idx):
    """The part of a flat parameter or gradient that ``column_of(idx, j)`` indexes for columns from ``j0``
    of the row at ``base``: from the row's start with indices, from column ``j0`` without (numba only)."""
    if is_none(idx):
        return lambda a, base, j0, idx: a[base + j0 :]
    return lambda a, base, j0, idx: a[base:]


@numba_only
def part_of(a, lo, hi):
    """``a[lo:hi]``, or None for None (numba only)."""
    if is_none(a):
        return lambda a, lo, hi: None
    return lambda a, lo, hi: a[lo:hi]


@numba_only
def load_master(master, s, param, i):
    """``master[s]`` when a master is given, else ``float32(param[i])`` (numba only)."""
    if is_none(master):
        return lambda master, s, param, i: load_f32(param, i)
    if isinstance(master, types.Array) and master.dtype == types.float32:
        return lambda master, s, param, i: master[s]
    return None


# Columns of the address table of the rules' multi-tensor kernels: the addresses of param, grad, indices (0: dense,
# every column), the state tensor (0: none), master (0: none), then rows, cols, k, the address of the tensor's
# per-column int64 step counts (0: an int step for the whole tensor) and whether that int step is its first (1/0).
R_PARAM, R_GRAD, R_IDX, R_STATE, R_MASTER, R_ROWS, R_COLS, R_K, R_STEPS, R_FIRST = range(10)


@njit(inline="always")
def part_tensors(q, parts, chunk_starts):
    """Range ``q`` of ``parts`` over the work items: its first item ``c0``, its end ``c1``, and the tensors ``t0`` to
    ``t1 - 1`` owning its items (a tensor between them may own none)."""
    total = chunk_starts[chunk_starts.size - 1]
    c0 = q * total // parts
    c1 = (q + 1) * total // parts
    t0 = np.searchsorted(chunk_starts, c0, side="right") - 1
    return c0, c1, t0, np.searchsorted(chunk_starts, c1 - 1, side="right") if c1 > c0 else t0


@njit(inline="always")
def tensor_items(c0, c1, t, chunk_starts):
    """Tensor ``t``'s items among items ``c0`` to ``c1 - 1``, counted within the tensor: the first and the end."""
    return max(c0, chunk_starts[t]) - chunk_starts[t], min(c1, chunk_starts[t + 1]) - chunk_starts[t]


@njit(inline="always")
def item_block(local, blocks, block, k):
    """Work item ``local`` of a tensor whose rows are cut in ``blocks`` blocks of ``block`` of its ``k`` selected
    columns (a row's blocks in order): its row ``r`` and columns ``j0`` to ``j1 - 1``."""
    r = local // blocks
    j0 = (local - r * blocks) * block
    return r, j0, min(k, j0 + block)


@njit(inline="always")
def rule_tensor(table, t, block, param_proto, grad_proto, state_proto, master_proto, idx_proto):
    """Tensor ``t`` of a rules' table (columns ``R_*``): rows, cols, k, its blocks of ``block`` columns a row, and its
    param, grad, state and master (None for a None proto) and indices (empty when ``dense``) as flat arrays, and
    ``dense``."""
    rows, cols, k = table[t, R_ROWS], table[t, R_COLS], table[t, R_K]
    dense = table[t, R_IDX] == 0
    return (rows, cols, k, (k + block - 1) // block, carray(pointer_at(table[t, R_PARAM], param_proto), rows * cols),
            carray(pointer_at(table[t, R_GRAD], grad_proto), rows * cols),
            array_at(table[t, R_STATE], rows * k, state_proto), array_at(table[t, R_MASTER], rows * k, master_proto),
            carray(pointer_at(table[t, R_IDX], idx_proto), 0 if dense else k), dense)
