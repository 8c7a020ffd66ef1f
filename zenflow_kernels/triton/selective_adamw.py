# Fused selective AdamW: AdamW (torch.optim.AdamW(foreach=False) math) on param[:, indices], in place,
# with compact fp32 state m, v (and optional fp32 master) of shape [R, k]; with decoupled=False (the
# constexpr L2) Adam as torch.optim.Adam(foreach=False): g + weight_decay * w, no decay multiply.
#
# Design: one pass. A program owns a [BLOCK_R, BLOCK_K] tile of the compact [R, k] space: it loads the
# BLOCK_K column numbers once, gathers param and grad at (row, indices[j]) through their strides, loads
# the compact state with coalesced row-major offsets, does the fp32 math and scatters param back; no
# column copy is ever materialised. `indices=None` (HAS_IDX=False, a constexpr) is the dense update:
# column j is j. Per-column step counts (PER_COL_STEP) give per-column bias corrections, computed in
# the kernel as 1 - beta^s = -expm1(s * ln beta) (a Taylor series for |x| < 1, 1 - exp(x) beyond), which
# stays accurate to ~1e-7 relative where 1 - beta^s is tiny; a Python-int step uses corrections
# computed in double by the launcher, as torch does. Division and sqrt are IEEE round-to-nearest
# (div_rn, sqrt_rn) so GPU results match torch's to rounding. Every hyper-parameter is a runtime
# argument. The tile shape is chosen from (R, k) by `tile_for` (heuristic, not autotuned: the kernel
# updates in place, and autotuning would re-run it on live state).
# Multi-tensor: the same tile body; a per-tensor table (pointers, sizes, strides, per-tensor lr,
# weight decay and bias corrections) and a 1-D grid over (tensor, tile); one launch per group of
# tensors sharing (param dtype, grad dtype, master?, dense?, per-column steps?, tile shape).
# Limits: R, k < 2^31; offsets int64; step counts exact up to 2^24 in the per-column form.
# The tile's walk (_tile.py: its offsets, the gather of gradient and weights, the scatter back) and the plan
# helpers (`plan_groups`, `cached_plan`) are shared with the Lion and SGD kernels (selective_lion.py,
# selective_sgd.py).
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from .. import _validate as V
from ..launch_plan import PlannedFor
from ..torch_ops import multi_adamw_args
from ._tile import gather_tile, pointer_at, program_tile, scatter_tile
from ._util import TL_DTYPE, device_table, launch, search_steps

_TILE_ELEMS = 1024
_WARPS = 4


def tile_for(R: int, K: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K): 1024-element tiles, [1, 1024] for row vectors ([1, n] views of vector params).

    Register-bound sizing (ptxas, sm_90, bf16 + master + per-column steps): 8x128 tiles at 4 warps take
    124 registers (4 blocks per SM), 16x128 take 224 (2 blocks); the bytes in flight per SM are the
    same, and smaller tiles balance better across SMs.
    """
    if R == 1:
        return 1, 1024
    bk = 128 if K >= 128 else max(16, triton.next_power_of_2(K))
    return _TILE_ELEMS // bk, bk


@triton.jit
def _one_minus_pow(log_beta, s):
    """1 - beta**s for s >= 1, given ln(beta) (-inf for beta == 0), accurate where the result is tiny."""
    x = s * log_beta
    # expm1(x) for |x| < 1: Taylor series to x^12 (truncation < 1e-9 relative), Horner form; the series
    # is evaluated on max(x, -1) so the branch not taken never overflows.
    xs = tl.maximum(x, -1.0)
    p = 1.0 / 479001600.0
    p = p * xs + 1.0 / 39916800.0
    p = p * xs + 1.0 / 3628800.0
    p = p * xs + 1.0 / 362880.0
    p = p * xs + 1.0 / 40320.0
    p = p * xs + 1.0 / 5040.0
    p = p * xs + 1.0 / 720.0
    p = p * xs + 1.0 / 120.0
    p = p * xs + 1.0 / 24.0
    p = p * xs + 1.0 / 6.0
    p = p * xs + 0.5
    p = p * xs + 1.0
    small = -(p * xs)
    return tl.where(x > -1.0, small, 1.0 - tl.exp(x))


@triton.jit
def _adamw_tile(p_ptr, g_ptr, idx_ptr, m_ptr, v_ptr, w_ptr, step_ptr,
                R, K, stride_pr, stride_pc, stride_gr, stride_gc, r0, j0,
                lr, decay, step_size, bc2_sqrt, one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2,
                eps, grad_scale,
                HAS_IDX: tl.constexpr, HAS_MASTER: tl.constexpr, PER_COL_STEP: tl.constexpr, L2: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``decay``: 1 - lr * weight_decay (AdamW), or the weight decay itself with ``L2`` (Adam)."""
    js, kmask, mask, p_off, s_off, g, w = gather_tile(p_ptr, g_ptr, idx_ptr, w_ptr, R, K, stride_pr, stride_pc,
                                                      stride_gr, stride_gc, r0, j0, HAS_IDX, HAS_MASTER, BLOCK_R,
                                                      BLOCK_K)
    g = tl.math.div_rn(g, grad_scale)
    m = tl.load(m_ptr + s_off, mask=mask, other=0.0)
    v = tl.load(v_ptr + s_off, mask=mask, other=0.0)

    if PER_COL_STEP:
        st = tl.load(step_ptr + js, mask=kmask, other=1).to(tl.float32)
        ss = tl.math.div_rn(tl.zeros_like(st) + lr, _one_minus_pow(log_beta1, st))[None, :]
        b2s = tl.sqrt_rn(_one_minus_pow(log_beta2, st))[None, :]
    else:
        ss = step_size
        b2s = bc2_sqrt

    if L2:
        # grad.add(param, alpha=weight_decay): a fused multiply-add in torch; skipped at 0 (0 * inf is NaN)
        g = tl.where(decay != 0.0, tl.fma(w, decay, g), g)
    else:
        w = w * decay
    # exp_avg.lerp_(g, 1 - beta1), with torch's two-sided lerp formula
    m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * (g - m), g - (g - m) * (1.0 - one_minus_beta1))
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), b2s) + eps
    w = w + tl.math.div_rn(-ss * m, denom)

    tl.store(m_ptr + s_off, m, mask=mask)
    tl.store(v_ptr + s_off, v, mask=mask)
    scatter_tile(p_ptr, w_ptr, p_off, s_off, w, mask, HAS_MASTER)


@triton.jit
def _selective_adamw_kernel(p_ptr, g_ptr, idx_ptr, m_ptr, v_ptr, w_ptr, step_ptr,
                            R, K, stride_pr, stride_pc, stride_gr, stride_gc,
                            lr, decay, step_size, bc2_sqrt, one_minus_beta1, beta2, one_minus_beta2,
                            log_beta1, log_beta2, eps, grad_scale,
                            HAS_IDX: tl.constexpr, HAS_MASTER: tl.constexpr, PER_COL_STEP: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(R, BLOCK_R) * cdiv(K, BLOCK_K),), column tiles fastest."""
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BLOCK_K)
    r0 = (pid // n_k).to(tl.int64) * BLOCK_R
    j0 = (pid % n_k).to(tl.int64) * BLOCK_K
    _adamw_tile(p_ptr, g_ptr, idx_ptr, m_ptr, v_ptr, w_ptr, step_ptr, R, K, stride_pr, stride_pc, stride_gr,
                stride_gc, r0, j0, lr, decay, step_size, bc2_sqrt, one_minus_beta1, beta2, one_minus_beta2,
                log_beta1, log_beta2, eps, grad_scale, HAS_IDX, HAS_MASTER, PER_COL_STEP, False, BLOCK_R, BLOCK_K)


# Multi-tensor table, int64, one row per tensor:
#   0 param ptr, 1 grad ptr, 2 indices ptr, 3 exp_avg ptr, 4 exp_avg_sq ptr, 5 master ptr, 6 step ptr,
#   7 R, 8 K, 9 stride_pr, 10 stride_pc, 11 stride_gr, 12 stride_gc, 13 first unit
# and float32, one row per tensor: 0 lr, 1 decay (Adam: the weight decay), 2 step_size, 3 bc2_sqrt (the last
# two for int steps).
@triton.jit
def _multi_selective_adamw_kernel(itab, ftab, n_tensors, n_steps,
                                  one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps, grad_scale,
                                  P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
                                  HAS_IDX: tl.constexpr, HAS_MASTER: tl.constexpr, PER_COL_STEP: tl.constexpr,
                                  L2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (total tiles,): unit = (tensor, row tile, column tile)."""
    row, frow, p_ptr, g_ptr, idx_ptr, R, K, spr, spc, sgr, sgc, r0, j0 = program_tile(
        itab, 14, ftab, 4, n_tensors, n_steps, P_DTYPE, G_DTYPE, BLOCK_R, BLOCK_K)
    _adamw_tile(p_ptr, g_ptr, idx_ptr, pointer_at(row, 3, tl.float32), pointer_at(row, 4, tl.float32),
                pointer_at(row, 5, tl.float32), pointer_at(row, 6, tl.int64), R, K, spr, spc, sgr, sgc, r0, j0,
                tl.load(frow + 0), tl.load(frow + 1), tl.load(frow + 2), tl.load(frow + 3),
                one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps, grad_scale,
                HAS_IDX, HAS_MASTER, PER_COL_STEP, L2, BLOCK_R, BLOCK_K)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else float("-inf")


def _coeffs(lr, wd, step, beta1, beta2, decoupled=True):
    decay = 1 - lr * wd if decoupled else wd
    if isinstance(step, torch.Tensor):
        return decay, 0.0, 1.0
    return decay, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5


def selective_adamw_(param, grad, indices, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                     master=None, grad_scale=1.0, check_data: bool = True) -> None:
    op = "selective_adamw_"
    lr, beta1, beta2, eps, weight_decay, grad_scale = V.hyper(
        op, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    K, step = V.adamw_input(op, None, param, grad, indices, exp_avg, exp_avg_sq, master, step)
    per_col = isinstance(step, torch.Tensor)
    if check_data:
        V.data(op, indices=[] if indices is None else [("indices", indices, param.shape[1])],
               steps=[("step", step)] if per_col else [])
    R = param.shape[0]
    if R == 0 or K == 0:
        return
    decay, step_size, bc2_sqrt = _coeffs(lr, weight_decay, step, beta1, beta2)
    br, bk = tile_for(R, K)
    grid = (triton.cdiv(R, br) * triton.cdiv(K, bk),)
    launch(_selective_adamw_kernel, grid,
           param, grad, param if indices is None else indices, exp_avg, exp_avg_sq,
           exp_avg if master is None else master, step if per_col else exp_avg,
           R, K, param.stride(0), param.stride(1), grad.stride(0), grad.stride(1),
           lr, decay, step_size, bc2_sqrt, 1 - beta1, beta2, 1 - beta2, _log(beta1), _log(beta2), eps, grad_scale,
           HAS_IDX=indices is not None, HAS_MASTER=master is not None, PER_COL_STEP=per_col,
           BLOCK_R=br, BLOCK_K=bk, num_warps=_WARPS)


def multi_selective_adamw_(params, grads, indices_list, exp_avgs, exp_avg_sqs, *, steps, lrs, beta1, beta2, eps,
                           weight_decays, masters=None, grad_scale=1.0, check_data: bool = True) -> None:
    items, (beta1, beta2, eps, grad_scale) = multi_adamw_args(
        "multi_selective_adamw_", params, grads, indices_list, exp_avgs, exp_avg_sqs, steps, lrs, beta1, beta2, eps,
        weight_decays, masters, grad_scale, check_data)
    multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale)


def multi_selective_adamw_items_(items, beta1: float, beta2: float, eps: float, grad_scale: float,
                                 decoupled: bool = True) -> None:
    """The launches of ``multi_selective_adamw_`` for items as ``multi_adamw_args`` returns them (or as
    ``LaunchItems``: the tables laid out once, see :class:`_Plan`). ``decoupled=False``: Adam, the L2 decay of
    ``torch.optim.Adam(foreach=False)`` (``g + weight_decay * w``) instead of AdamW's decoupled one."""
    if items:
        cached_plan(items, _Plan).run(items, beta1, beta2, eps, grad_scale, decoupled)


def _triton_grad_layout(g: torch.Tensor) -> tuple:
    return g.dtype, g.stride()


def cached_plan(items, plan_type):
    """The ``plan_type`` plan of ``items``: the one kept in ``items.launch_cache["triton"]`` (``LaunchItems``) if
    it is of that type and was made for these items, else a new one, kept there."""
    cache = getattr(items, "launch_cache", None)
    plan = None if cache is None else cache.get("triton")
    if not isinstance(plan, plan_type) or not plan.made_for.fits(items):
        plan = plan_type(items)
        if cache is not None:
            cache["triton"] = plan
    return plan


def planned_for(items, n_state: int) -> PlannedFor:
    """What a Triton plan of items with ``n_state`` state tensors each was made for (gradients: dtype, strides)."""
    return PlannedFor(items, _triton_grad_layout, n_state=n_state)


def plan_groups(items, key_of, row_of) -> list[tuple]:
    """The launch groups of ``items`` (``(param, grad, columns, ...)`` tuples): items with the same
    ``(*key_of(item), tile shape)`` share a launch; items with no work (R * k == 0) are left out. Per group:
    (key, positions in ``items``, int64 table (rows ``row_of(item, R, K)`` with the group's first unit of
    the item appended), units). Column 1 of each row is left for the gradient's address (written by a run)."""
    by_key: dict[tuple, list[int]] = {}
    shapes = []
    for t, it in enumerate(items):
        R, K = it[0].shape[0], it[0].shape[1] if it[2] is None else it[2].shape[0]
        shapes.append((R, K))
        if R and K:
            by_key.setdefault((*key_of(it), tile_for(R, K)), []).append(t)
    groups = []
    for key, positions in by_key.items():
        br, bk = key[-1]
        irows, unit = [], 0
        for t in positions:
            R, K = shapes[t]
            irows.append([*row_of(items[t], R, K), unit])
            unit += triton.cdiv(R, br) * triton.cdiv(K, bk)
        groups.append((key, positions, np.array(irows, dtype=np.int64), unit))
    return groups


class _Plan:
    """The launches of one list of items: per group of tensors sharing (param dtype, grad dtype, dense?,
    master?, per-column steps?, tile shape), the int table (every column but the gradients' addresses,
    with each tensor's first unit) and the grid. A call writes the gradients' addresses, builds the float
    rows (lr, decay and the bias corrections of integer steps, one computation per distinct (step, lr,
    weight decay)) and copies both tables to the device: no per-tensor attribute reads or tile arithmetic
    once the plan exists."""

    def __init__(self, items):
        self.made_for = planned_for(items, 2)

        def key_of(it):
            p, g, idx, _, _, w, step, *_ = it
            return p.dtype, g.dtype, idx is not None, w is not None, isinstance(step, torch.Tensor)

        def row_of(it, R, K):
            p, g, idx, m, v, w, step, *_ = it
            return [p.data_ptr(), 0, 0 if idx is None else idx.data_ptr(), m.data_ptr(), v.data_ptr(),
                    0 if w is None else w.data_ptr(), step.data_ptr() if isinstance(step, torch.Tensor) else 0,
                    R, K, p.stride(0), p.stride(1), g.stride(0), g.stride(1)]

        self.groups = plan_groups(items, key_of, row_of)

    def run(self, items, beta1, beta2, eps, grad_scale, decoupled=True) -> None:
        dev = items[0][0].device
        coefficients: dict[tuple, list[float]] = {}
        for (p_dtype, g_dtype, has_idx, has_master, per_col, (br, bk)), positions, irows, unit in self.groups:
            irows[:, 1] = [items[t][1].data_ptr() for t in positions]  # (device_table copies the table)
            frows = []
            for t in positions:
                *_, step, lr, wd = items[t]
                key = (None if per_col else step, lr, wd)
                row = coefficients.get(key)
                if row is None:
                    row = coefficients[key] = [lr, *_coeffs(lr, wd, step, beta1, beta2, decoupled)]
                frows.append(row)
            launch(_multi_selective_adamw_kernel, (unit,), device_table(irows, dev),
                   device_table(frows, dev, torch.float32), len(irows), search_steps(len(irows)),
                   1 - beta1, beta2, 1 - beta2, _log(beta1), _log(beta2), eps, grad_scale,
                   P_DTYPE=TL_DTYPE[p_dtype], G_DTYPE=TL_DTYPE[g_dtype], HAS_IDX=has_idx, HAS_MASTER=has_master,
                   PER_COL_STEP=per_col, L2=not decoupled, BLOCK_R=br, BLOCK_K=bk, num_warps=_WARPS)
