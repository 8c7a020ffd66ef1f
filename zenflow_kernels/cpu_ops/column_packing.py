"""Packing selected columns into flat fp32 buffers and back, as numba kernels over a table of addresses (the
compiled rules' fast path on the CPU: ``rules.packing``). One launch packs every item of a multi-tensor launch,
whatever their number: per-tensor Python work is a table row (the multi-tensor kernels' way, ``_rule_plan.py``).

The kernels: ``kernels/column_packing.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _common as C
from .kernels.column_packing import (
    T_COLS,
    T_GRAD,
    T_IDX,
    T_K,
    T_MASTER,
    T_PARAM,
    T_ROWS,
    T_STATE,
    pack_kernel,
    unpack_kernel,
)
from .selective_adamw import _PROTO

__all__ = ["MAX_STATE", "ROW_BLOCK_ELEMENTS", "ColumnTable", "numba_dtype", "row_blocks"]

MAX_STATE = 4  # state tensors a rule may keep for the numba packing (more: the torch packing)


ROW_BLOCK_ELEMENTS = 2048
"""Packed elements per work item (whole rows of one block): one row of a few selected columns is too little work
for a work item's setup (the item's addresses as arrays), a whole tall block too much for one thread."""


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
