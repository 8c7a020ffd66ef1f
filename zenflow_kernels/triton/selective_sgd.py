# Fused selective SGD: rules.SGD's step (torch.optim.SGD(foreach=False)'s op order, fp32: momentum,
# dampening, Nesterov, L2 weight decay) on param[:, indices] of many tensors, in place, with the compact
# fp32 momentum buffer (when momentum != 0) and optional fp32 master of shape [R, k].
#
# Design: the selective AdamW kernel's layout (selective_adamw.py): a program owns a [BLOCK_R, BLOCK_K]
# tile of one tensor's compact [R, k] space, gathers param and grad through their strides, loads the
# state row-major, scatters param back; `indices=None` (HAS_IDX=False) is the dense update. One launch per
# group of tensors sharing (param dtype, grad dtype, dense?, master?, buffer?, per-column steps?, tile
# shape), over a per-tensor table (pointers, sizes, strides; lr, weight decay and "first step" in a float
# table) kept in a plan (`LaunchItems`).
# Per element, as SGD.step_ through UpdateRule.fast_step_: d = grad * float32(1 / grad_scale);
# d = d + wd * w (only where wd != 0: 0 * inf is NaN); with momentum b = d at the column's first step
# (its count is 1; torch's fresh buffer), else b = b * momentum + (1 - dampening) * d; d = d + momentum * b
# (Nesterov) or b; w = w - lr * d. torch's CPU `add(x, alpha=a)` is a fused multiply-add (CUDA's contracts
# to one), so the kernel writes tl.fma where torch adds with alpha: bit-identical to torch on CPU under
# TRITON_INTERPRET. Limits: R, k < 2^31; offsets int64.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tile import gather_tile, pointer_at, program_tile, scatter_tile
from ._util import TL_DTYPE, device_table, launch, search_steps
from .selective_adamw import cached_plan, plan_groups, planned_for

_WARPS = 4


@triton.jit
def _sgd_tile(p_ptr, g_ptr, idx_ptr, b_ptr, w_ptr, step_ptr, R, K, stride_pr, stride_pc, stride_gr, stride_gc,
              r0, j0, lr, wd, first, momentum, one_minus_dampening, inv_scale,
              HAS_IDX: tl.constexpr, HAS_MASTER: tl.constexpr, HAS_BUF: tl.constexpr, PER_COL_STEP: tl.constexpr,
              NESTEROV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``first``: 1.0 when an int step count is 1 (read when not PER_COL_STEP)."""
    js, kmask, mask, p_off, s_off, d, w = gather_tile(p_ptr, g_ptr, idx_ptr, w_ptr, R, K, stride_pr, stride_pc,
                                                      stride_gr, stride_gc, r0, j0, HAS_IDX, HAS_MASTER, BLOCK_R,
                                                      BLOCK_K)
    d = d * inv_scale

    d = tl.where(wd != 0.0, tl.fma(w, wd, d), d)
    if HAS_BUF:
        b = tl.load(b_ptr + s_off, mask=mask, other=0.0)
        if PER_COL_STEP:  # noqa: SIM108 - constexpr branches: only one is compiled
            fresh = (tl.load(step_ptr + js, mask=kmask, other=1) == 1)[None, :]
        else:
            fresh = first != 0.0
        b = tl.where(fresh, d, tl.fma(d, one_minus_dampening, b * momentum))
        tl.store(b_ptr + s_off, b, mask=mask)
        if NESTEROV:  # noqa: SIM108 - constexpr branches: only one is compiled
            d = tl.fma(b, momentum, d)
        else:
            d = b
    w = tl.fma(d, -lr, w)

    scatter_tile(p_ptr, w_ptr, p_off, s_off, w, mask, HAS_MASTER)


# Table, int64, one row per tensor: 0 param ptr, 1 grad ptr, 2 indices ptr, 3 momentum buffer ptr,
#   4 master ptr, 5 step ptr, 6 R, 7 K, 8 stride_pr, 9 stride_pc, 10 stride_gr, 11 stride_gc, 12 first unit;
# float32, one row per tensor: 0 lr, 1 weight decay, 2 first (1.0 when an int step count is 1).
@triton.jit
def _multi_selective_sgd_kernel(itab, ftab, n_tensors, n_steps, momentum, one_minus_dampening, inv_scale,
                                P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_IDX: tl.constexpr,
                                HAS_MASTER: tl.constexpr, HAS_BUF: tl.constexpr, PER_COL_STEP: tl.constexpr,
                                NESTEROV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (total tiles,): unit = (tensor, row tile, column tile)."""
    row, frow, p_ptr, g_ptr, idx_ptr, R, K, spr, spc, sgr, sgc, r0, j0 = program_tile(
        itab, 13, ftab, 3, n_tensors, n_steps, P_DTYPE, G_DTYPE, BLOCK_R, BLOCK_K)
    _sgd_tile(p_ptr, g_ptr, idx_ptr, pointer_at(row, 3, tl.float32), pointer_at(row, 4, tl.float32),
              pointer_at(row, 5, tl.int64), R, K, spr, spc, sgr, sgc, r0, j0, tl.load(frow + 0), tl.load(frow + 1),
              tl.load(frow + 2), momentum, one_minus_dampening, inv_scale,
              HAS_IDX, HAS_MASTER, HAS_BUF, PER_COL_STEP, NESTEROV, BLOCK_R, BLOCK_K)


def multi_selective_sgd_items_(items, momentum: float, dampening: float, nesterov: bool, grad_scale: float) -> None:
    """rules.SGD's fast path: one SGD step, in place, on the selected columns of every item ``(param [R, C],
    grad [R, C], columns [k] int64 or None (dense), momentum_buffer [R, k] fp32, master [R, k] fp32 or None,
    step (int or int64 [k]), lr, weight_decay)``, without ``momentum_buffer`` for a rule without momentum (a
    buffer with ``momentum == 0`` is left as it is, as torch does); ``LaunchItems`` keep their plan. Unchecked
    (the optimizer built the items) but for a missing buffer."""
    if not items:
        return
    n_state = len(items[0]) - 7
    if momentum != 0 and n_state != 1:
        raise ValueError(f"multi_selective_sgd_items_: momentum={momentum!r} needs items with a momentum buffer "
                         "(param, grad, columns, momentum_buffer, master, step, lr, weight_decay)")
    cached_plan(items, _Plan).run(items, momentum, dampening, nesterov, grad_scale)


class _Plan:
    """The launches of one list of items (see selective_adamw._Plan): per group, the int table with every column
    but the gradients' addresses, and the grid; a run writes those addresses and the float rows."""

    def __init__(self, items):
        n = len(items[0]) - 7  # state tensors: the momentum buffer or none
        self.made_for = planned_for(items, n)

        def key_of(it):
            p, g, idx, w, step = it[0], it[1], it[2], it[3 + n], it[4 + n]
            return p.dtype, g.dtype, idx is not None, w is not None, n == 1, n == 1 and isinstance(step, torch.Tensor)

        def row_of(it, R, K):
            p, g, idx, w, step = it[0], it[1], it[2], it[3 + n], it[4 + n]
            return [p.data_ptr(), 0, 0 if idx is None else idx.data_ptr(), it[3].data_ptr() if n else 0,
                    0 if w is None else w.data_ptr(), step.data_ptr() if isinstance(step, torch.Tensor) else 0,
                    R, K, p.stride(0), p.stride(1), g.stride(0), g.stride(1)]

        self.groups = plan_groups(items, key_of, row_of)

    def run(self, items, momentum, dampening, nesterov, grad_scale) -> None:
        dev = items[0][0].device
        for (p_dtype, g_dtype, has_idx, has_master, has_buf, per_col, (br, bk)), positions, irows, unit in self.groups:
            irows[:, 1] = [items[t][1].data_ptr() for t in positions]  # (device_table copies the table)
            frows = [[lr, wd, float(not isinstance(step, torch.Tensor) and step == 1)]
                     for *_, step, lr, wd in (items[t] for t in positions)]
            launch(_multi_selective_sgd_kernel, (unit,), device_table(irows, dev),
                   device_table(frows, dev, torch.float32), len(irows), search_steps(len(irows)),
                   float(momentum), float(1 - dampening), 1.0 / grad_scale,
                   P_DTYPE=TL_DTYPE[p_dtype], G_DTYPE=TL_DTYPE[g_dtype], HAS_IDX=has_idx, HAS_MASTER=has_master,
                   HAS_BUF=has_buf and momentum != 0, PER_COL_STEP=per_col, NESTEROV=bool(nesterov),
                   BLOCK_R=br, BLOCK_K=bk, num_warps=_WARPS)
