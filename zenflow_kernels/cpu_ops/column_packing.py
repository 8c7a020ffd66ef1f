"""Packing selected columns into flat fp32 buffers and back, as numba kernels over a table of addresses (the
compiled rules' fast path on the CPU: ``rules.packing``). One launch packs every item of a multi-tensor launch,
whatever their number: per-tensor Python work is a table row (the multi-tensor kernels' way, ``_rule_plan.py``).

Work item w is one row of one block (an item's run of state columns); values are loaded as fp32 from the
parameter's dtype (bf16, fp16 bits) and stored back rounded to nearest even.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange

from . import _common as C
from ._kernels import load_f32, pointer_at, store_f32
from .selective_adamw import _PROTO

__all__ = ["MAX_STATE", "ROW_BLOCK_ELEMENTS", "ColumnTable", "numba_dtype", "row_blocks"]

_JIT = {"parallel": True, "nogil": True, "cache": True}
MAX_STATE = 4  # state tensors a rule may keep for the numba packing (more: the torch packing)
# columns of the item table
T_PARAM, T_GRAD, T_IDX, T_MASTER, T_ROWS, T_COLS, T_K = range(7)
T_STATE = 7  # ... then one column per state tensor


ROW_BLOCK_ELEMENTS = 2048
"""Packed elements per work item (whole rows of one block): one row of a few selected columns is too little work
for a work item's setup (the item's addresses as arrays), a whole tall block too much for one thread."""


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


@njit(**_JIT)
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


@njit(**_JIT)
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


def row_blocks(b_rows: np.ndarray, b_len: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The work items of blocks of ``b_rows`` rows of ``b_len`` columns: ``(w_block, w_row, w_nrows)``, each block's
    rows in pieces of about ``ROW_BLOCK_ELEMENTS`` elements."""
    per = np.maximum(1, ROW_BLOCK_ELEMENTS // np.maximum(b_len, 1)).astype(np.int64)  # rows per work item
    pieces = -(-b_rows // per)
    w_block = np.repeat(np.arange(b_rows.size, dtype=np.int64), pieces)
    firsts = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
    w_row = (np.arange(w_block.size, dtype=np.int64) - np.repeat(firsts, pieces)) * per[w_block]
    w_nrows = np.minimum(per[w_block], b_rows[w_block] - w_row)
    return w_block, w_row, w_nrows


def numba_dtype(dtype: torch.dtype) -> bool:
    """The kernels read and write parameters and gradients of this dtype (fp32, bf16, fp16)."""
    return dtype in _PROTO


class ColumnTable:
    """The addresses of one list of items ``(param, grad, columns, *state, master, ...)`` (``UpdateRule.fast_step_``'s
    layout) for :meth:`pack` and :meth:`unpack`; ``work``: the blocks' layout (``rules.packing.Packed._layout``)."""

    def __init__(self, items, n_state: int, rows, ks):
        if n_state > MAX_STATE:
            raise ValueError(f"ColumnTable: n_state={n_state} is invalid: allowed at most {MAX_STATE}")
        first = items[0]
        table = np.zeros((len(items), T_STATE + MAX_STATE), dtype=np.int64)
        for t, it in enumerate(items):
            table[t, T_PARAM] = it[0].data_ptr()
            table[t, T_IDX] = 0 if it[2] is None else it[2].data_ptr()
            table[t, T_MASTER] = 0 if it[3 + n_state] is None else it[3 + n_state].data_ptr()
        table[:, T_ROWS] = rows
        table[:, T_COLS] = [it[0].shape[1] for it in items]
        table[:, T_K] = ks
        self.table, self.n_state = table, n_state
        self.master = first[3 + n_state] is not None
        self.protos = (_PROTO[first[0].dtype], _PROTO[first[1].dtype])
        self.live = [t for it in items for t in (it[0], *it[3 : 4 + n_state]) if t is not None]

    def point_state(self, states) -> None:
        """The state tensors' addresses (``states[t]``: item t's, in ``state_names`` order)."""
        for t, state in enumerate(states):
            for j, tensor in enumerate(state):
                self.table[t, T_STATE + j] = tensor.data_ptr()

    def pack(self, items, work, numel: int, P, G, S, with_state: bool) -> None:
        """The items' selected values into ``P`` (fp32 master or parameter), ``G`` (gradient) and, ``with_state``,
        the rows of ``S``: one launch."""
        for t, it in enumerate(items):
            self.table[t, T_GRAD] = it[1].data_ptr()
        C.launch(pack_kernel, numel, 0, self.table, *work, self.n_state if with_state else 0, C.as_numpy(P),
                 C.as_numpy(G), S.numpy(), *self.protos, self.master)

    def unpack(self, work, numel: int, P, S, with_state: bool) -> None:
        """``P`` into the parameters (rounded to their dtype) and masters, ``S`` (``with_state``) into the state."""
        C.launch(unpack_kernel, numel, 0, self.table, *work, self.n_state if with_state else 0, C.as_numpy(P),
                 S.numpy(), self.protos[0], self.master)
        C.bump_versions(*self.live)
