"""Packing selected columns into flat fp32 buffers and back (launcher: cpu_ops/column_packing.py). Work item w is
one row of one block (an item's run of state columns); values are loaded as fp32 from the parameter's dtype (bf16,
fp16 bits) and stored back rounded to nearest even."""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from ._dtype import load_f32, store_f32
from ._ir import pointer_at
from ._jit import host_kernel

# columns of the item table
T_PARAM, T_GRAD, T_IDX, T_MASTER, T_ROWS, T_COLS, T_K = range(7)
T_STATE = 7  # ... then one column per state tensor


@njit(inline="always")
def _work_item(table, w_block, w_row, w_nrows, b_item, b_start, b_len, w, param_proto):
    """Work item w's block, its item t, its rows ``[r0, r1)``, the block's columns (``start``, ``nj``), the item's
    shape, its parameter and column indices (``dense``: every column, no indices)."""
    b, r0 = w_block[w], w_row[w]
    t, start, nj = b_item[b], b_start[b], b_len[b]
    rows, cols, k = table[t, T_ROWS], table[t, T_COLS], table[t, T_K]
    dense = table[t, T_IDX] == 0
    param = carray(pointer_at(table[t, T_PARAM], param_proto), rows * cols)
    idx = carray(pointer_at(table[t, T_IDX], np.empty(0, dtype=np.int64)), 0 if dense else k)
    return b, t, r0, r0 + w_nrows[w], start, nj, rows, cols, k, dense, param, idx


@host_kernel()
def pack_kernel(table, w_block, w_row, w_nrows, b_item, b_start, b_len, b_off, block_cols, n_state, P, G, S,
                param_proto, grad_proto, has_master):
    """Work item w: rows ``w_row[w]`` on (``w_nrows[w]`` of them) of block ``w_block[w]`` (item ``b_item``'s state
    columns ``block_cols[b_start : b_start + b_len]``), packed row-major at ``b_off``: ``P`` the fp32 master's or the
    parameter's values, ``G`` the gradient as fp32, each row of ``S`` a state tensor."""
    f32 = np.empty(0, dtype=np.float32)
    for w in prange(w_block.size):
        b, t, r0, r1, start, nj, rows, cols, k, dense, param, idx = _work_item(
            table, w_block, w_row, w_nrows, b_item, b_start, b_len, w, param_proto)
        grad = carray(pointer_at(table[t, T_GRAD], grad_proto), rows * cols)
        for r in range(r0, r1):
            off = b_off[b] + r * nj
            for jj in range(nj):
                j = block_cols[start + jj]
                src = r * cols + (j if dense else idx[j])
                G[off + jj] = load_f32(grad, src)
                if not has_master:
                    P[off + jj] = load_f32(param, src)
        if has_master:
            master = carray(pointer_at(table[t, T_MASTER], f32), rows * k)
            for r in range(r0, r1):
                off = b_off[b] + r * nj
                for jj in range(nj):
                    P[off + jj] = master[r * k + block_cols[start + jj]]
        for i in range(n_state):
            state = carray(pointer_at(table[t, T_STATE + i], f32), rows * k)
            for r in range(r0, r1):
                off = b_off[b] + r * nj
                for jj in range(nj):
                    S[i, off + jj] = state[r * k + block_cols[start + jj]]


@host_kernel()
def unpack_kernel(table, w_block, w_row, w_nrows, b_item, b_start, b_len, b_off, block_cols, n_state, P, S,
                  param_proto, has_master):
    """The inverse of :func:`pack_kernel`: the stepped values into the parameter (rounded to its dtype) and its master,
    the state back into its tensors."""
    f32 = np.empty(0, dtype=np.float32)
    for w in prange(w_block.size):
        b, t, r0, r1, start, nj, rows, cols, k, dense, param, idx = _work_item(
            table, w_block, w_row, w_nrows, b_item, b_start, b_len, w, param_proto)
        for r in range(r0, r1):
            off = b_off[b] + r * nj
            for jj in range(nj):
                j = block_cols[start + jj]
                store_f32(param, r * cols + (j if dense else idx[j]), P[off + jj])
        if has_master:
            master = carray(pointer_at(table[t, T_MASTER], f32), rows * k)
            for r in range(r0, r1):
                off = b_off[b] + r * nj
                for jj in range(nj):
                    master[r * k + block_cols[start + jj]] = P[off + jj]
        for i in range(n_state):
            state = carray(pointer_at(table[t, T_STATE + i], f32), rows * k)
            for r in range(r0, r1):
                off = b_off[b] + r * nj
                for jj in range(nj):
                    state[r * k + block_cols[start + jj]] = S[i, off + jj]
