# Fused selective Lion: rules.Lion's step (its plain-torch op order, fp32) on param[:, indices] of many
# tensors, in place, with the compact fp32 momentum m (and optional fp32 master) of shape [R, k].
#
# Design: the selective AdamW kernel's layout (selective_adamw.py): a program owns a [BLOCK_R, BLOCK_K]
# tile of one tensor's compact [R, k] space, gathers param and grad through their strides, loads the
# state row-major, scatters param back; `indices=None` (HAS_IDX=False) is the dense update. One launch per
# group of tensors sharing (param dtype, grad dtype, dense?, master?, tile shape), over a per-tensor table
# (pointers, sizes, strides; lr and decay in a float table) kept in a plan (`LaunchItems`).
# Per element, as Lion.step_ through UpdateRule.fast_step_: g = grad * float32(1 / grad_scale);
# c = lerp(m, g, 1 - beta1); w = w * (1 - lr * wd) (1 exactly when wd == 0); w = w - lr * sign(c);
# m = lerp(m, g, 1 - beta2). torch's CPU lerp is a fused multiply-add (and CUDA's contracts to one), so
# the kernel writes tl.fma: bit-identical to torch on CPU under TRITON_INTERPRET. sign is torch's: 0 for
# ±0 and NaN. The step count is not read. Limits: R, k < 2^31; offsets int64.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tile import gather_tile, pointer_at, program_tile, scatter_tile
from ._util import TL_DTYPE, device_table, launch, search_steps
from .selective_adamw import cached_plan, plan_groups, planned_for

_WARPS = 4


@triton.jit
def _lerp(a, b, weight):
    """torch.lerp(a, b, weight) for a scalar weight in [0, 1], torch's two-sided formula as one fma."""
    d = b - a
    return tl.where(weight < 0.5, tl.fma(weight, d, a), tl.fma(weight - 1.0, d, b))


@triton.jit
def _lion_tile(p_ptr, g_ptr, idx_ptr, m_ptr, w_ptr, R, K, stride_pr, stride_pc, stride_gr, stride_gc, r0, j0,
               lr, decay, one_minus_beta1, one_minus_beta2, inv_scale,
               HAS_IDX: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    js, kmask, mask, p_off, s_off, g, w = gather_tile(p_ptr, g_ptr, idx_ptr, w_ptr, R, K, stride_pr, stride_pc,
                                                      stride_gr, stride_gc, r0, j0, HAS_IDX, HAS_MASTER, BLOCK_R,
                                                      BLOCK_K)
    g = g * inv_scale
    m = tl.load(m_ptr + s_off, mask=mask, other=0.0)

    c = _lerp(m, g, one_minus_beta1)
    u = (c > 0.0).to(tl.float32) - (c < 0.0).to(tl.float32)
    w = w * decay
    w = w - lr * u  # lr * u is exact: no rounding for a contraction to change
    m = _lerp(m, g, one_minus_beta2)

    tl.store(m_ptr + s_off, m, mask=mask)
    scatter_tile(p_ptr, w_ptr, p_off, s_off, w, mask, HAS_MASTER)


# Table, int64, one row per tensor: 0 param ptr, 1 grad ptr, 2 indices ptr, 3 exp_avg ptr, 4 master ptr,
#   5 R, 6 K, 7 stride_pr, 8 stride_pc, 9 stride_gr, 10 stride_gc, 11 first unit;
# float32, one row per tensor: 0 lr, 1 decay (1 - lr * weight_decay, rounded once from double as torch does).
@triton.jit
def _multi_selective_lion_kernel(itab, ftab, n_tensors, n_steps, one_minus_beta1, one_minus_beta2, inv_scale,
                                 P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_IDX: tl.constexpr,
                                 HAS_MASTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (total tiles,): unit = (tensor, row tile, column tile)."""
    row, frow, p_ptr, g_ptr, idx_ptr, R, K, spr, spc, sgr, sgc, r0, j0 = program_tile(
        itab, 12, ftab, 2, n_tensors, n_steps, P_DTYPE, G_DTYPE, BLOCK_R, BLOCK_K)
    _lion_tile(p_ptr, g_ptr, idx_ptr, pointer_at(row, 3, tl.float32), pointer_at(row, 4, tl.float32),
               R, K, spr, spc, sgr, sgc, r0, j0,
               tl.load(frow + 0), tl.load(frow + 1), one_minus_beta1, one_minus_beta2, inv_scale,
               HAS_IDX, HAS_MASTER, BLOCK_R, BLOCK_K)


def multi_selective_lion_items_(items, beta1: float, beta2: float, grad_scale: float) -> None:
    """rules.Lion's fast path: one Lion step, in place, on the selected columns of every item ``(param [R, C],
    grad [R, C], columns [k] int64 or None (dense), exp_avg [R, k] fp32, master [R, k] fp32 or None, step
    (not read), lr, weight_decay)``; ``LaunchItems`` keep their plan. Unchecked (the optimizer built the items)."""
    if items:
        cached_plan(items, _Plan).run(items, beta1, beta2, grad_scale)


class _Plan:
    """The launches of one list of items (see selective_adamw._Plan): per group, the int table with every column
    but the gradients' addresses, and the grid; a run writes those addresses and the float rows."""

    def __init__(self, items):
        self.made_for = planned_for(items, 1)

        def key_of(it):
            p, g, idx, _, w, *_ = it
            return p.dtype, g.dtype, idx is not None, w is not None

        def row_of(it, R, K):
            p, g, idx, m, w, *_ = it
            return [p.data_ptr(), 0, 0 if idx is None else idx.data_ptr(), m.data_ptr(),
                    0 if w is None else w.data_ptr(), R, K, p.stride(0), p.stride(1), g.stride(0), g.stride(1)]

        self.groups = plan_groups(items, key_of, row_of)

    def run(self, items, beta1, beta2, grad_scale) -> None:
        dev = items[0][0].device
        for (p_dtype, g_dtype, has_idx, has_master, (br, bk)), positions, irows, unit in self.groups:
            irows[:, 1] = [items[t][1].data_ptr() for t in positions]  # (device_table copies the table)
            frows = [[lr, 1 - lr * wd] for *_, lr, wd in (items[t] for t in positions)]
            launch(_multi_selective_lion_kernel, (unit,), device_table(irows, dev),
                   device_table(frows, dev, torch.float32), len(irows), search_steps(len(irows)),
                   float(1 - beta1), float(1 - beta2), 1.0 / grad_scale,
                   P_DTYPE=TL_DTYPE[p_dtype], G_DTYPE=TL_DTYPE[g_dtype], HAS_IDX=has_idx, HAS_MASTER=has_master,
                   BLOCK_R=br, BLOCK_K=bk, num_warps=_WARPS)
