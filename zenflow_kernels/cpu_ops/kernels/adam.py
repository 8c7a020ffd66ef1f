"""Adam/AdamW kernels: the host pass (launcher: cpu_ops/adam.py) and the CPU fast path on selected columns
(launcher: cpu_ops/selective_adamw.py)."""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from ._columns import column_of, item_block, load_master, part_of, part_tensors, row_of, tensor_items
from ._dtype import array_at, coupled_grad, load_f32, state_hash, store_f32, store_state_high, store_state_low
from ._ir import fma, pointer_at
from ._jit import host_kernel


@njit(inline="always")
def adam_constants(one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64):
    """The loop constants every Adam kernel shares, rounded to float32 once: torch's lerp form for the
    first moment (``lerp_coeff``, ``lerp_small``), then beta2, 1 - beta2 and eps."""
    w = np.float32(one_minus_beta1_64)
    lerp_small = abs(w) < np.float32(0.5)
    lerp_coeff = w if lerp_small else w - np.float32(1.0)
    return lerp_coeff, lerp_small, np.float32(beta2_64), np.float32(one_minus_beta2_64), np.float32(eps64)


@host_kernel()
def adam_kernel(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    acc,
    out,
    zero_acc,
    inv_scale64,
    l2_64,
    decay64,
    one_minus_beta1_64,
    beta2_64,
    one_minus_beta2_64,
    inv_bc2_sqrt64,
    eps64,
    neg_step_size64,
    key,
    salt,
):
    """One fused pass of Adam/AdamW over n elements (all arrays 1-D, length n, contiguous).

    The float64 hyper-parameters are rounded to float32 once, here; the loop is all float32. The
    operations and their rounding follow torch's single-tensor Adam on CPU (fma where ATen's
    vectorised kernels use one), so m and v come out bit-identical to torch whenever g does:

    g = take_grad(acc, grad, i, zero_acc) * inv_scale    (grad[i], acc[i] + grad[i], or acc[i] when grad is None)
    g = fma(p, l2, g)                              if l2 != 0 (Adam's L2 decay; AdamW passes l2 = 0)
    m = lerp(m, g, w): fma(w, g - m, m) if |w| < 0.5 else fma(w - 1, g - m, g)    (w = 1 - beta1, torch's)
    v = fma(one_minus_beta2 * g, g, v * beta2)             (v.mul_(beta2).addcmul_(g, g, 1 - beta2))
    p = p * decay + (neg_step_size * m) / (sqrt(v) * inv_bc2_sqrt + eps)   (decay = 1 - lr*wd for AdamW)
    out[i] = p (converted), when out is not None; acc[i] = the sum (or 0 with zero_acc).

    ``salt`` None: bf16 moments stored rounded to nearest even; else (uint32) rounded stochastically, m with the
    low and v with the high 16 bits of ``rounding_hash(key + i, salt)`` (``key``: int64, element 0's key).
    """
    inv_scale = np.float32(inv_scale64)
    l2 = np.float32(l2_64)
    decay = np.float32(decay64)
    lerp_coeff, lerp_small, beta2, one_minus_beta2, eps = adam_constants(
        one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64
    )
    inv_bc2_sqrt = np.float32(inv_bc2_sqrt64)
    neg_step_size = np.float32(neg_step_size64)
    for i in prange(param.size):
        p = param[i]
        g = coupled_grad(acc, grad, i, zero_acc, inv_scale, p, l2)  # (AdamW: l2 = 0)
        m = load_f32(exp_avg, i)
        m = fma(lerp_coeff, g - m, m if lerp_small else g)
        v = fma(one_minus_beta2 * g, g, load_f32(exp_avg_sq, i) * beta2)
        h = state_hash(key, i, salt)
        store_state_low(exp_avg, i, m, h, salt)  # (bf16 moments: stored rounded; p below uses m and v)
        store_state_high(exp_avg_sq, i, v, h, salt)
        p = p * decay + (neg_step_size * m) / (np.sqrt(v) * inv_bc2_sqrt + eps)
        param[i] = p
        store_f32(out, i, p)


@njit(inline="always")
def _adam_columns(param, grad, idx, exp_avg, exp_avg_sq, master, base, sbase, j0, j1, neg_step_size, bc2_sqrt,
                  coef_base, grad_scale, decay, l2, lerp_coeff, lerp_small, beta2, one_minus_beta2, eps):
    """AdamW on selected columns j0..j1-1 of one row: ``base`` is the row's offset in param/grad,
    ``sbase`` in the compact state, ``coef_base`` the tensor's offset in the per-column coefficients.
    ``l2`` != 0: Adam's coupled decay, ``g = fma(w, l2, g)`` (``grad.add(param, alpha=wd)``; decay is then 1).
    Everything is indexed from 0 in slices (a loop index numba knows to be non-negative needs no
    wraparound check, and a dense row then vectorises)."""
    p = row_of(param, base, j0, idx)
    g_row = row_of(grad, base, j0, idx)
    cols = part_of(idx, j0, j1)
    m_row = exp_avg[sbase + j0 : sbase + j1]
    v_row = exp_avg_sq[sbase + j0 : sbase + j1]
    w_row = part_of(master, sbase + j0, sbase + j1)
    step_size = neg_step_size[coef_base + j0 : coef_base + j1]
    bc2 = bc2_sqrt[coef_base + j0 : coef_base + j1]
    for j in range(j1 - j0):
        c = column_of(cols, j)
        g = load_f32(g_row, c) / grad_scale
        w = load_master(w_row, j, p, c) * decay
        # (l2 == 0 must leave g untouched even when w is inf/NaN)
        g = g if l2 == np.float32(0.0) else fma(w, l2, g)
        m = m_row[j]
        m = fma(lerp_coeff, g - m, m if lerp_small else g)
        v = fma(one_minus_beta2 * g, g, v_row[j] * beta2)
        m_row[j] = m
        v_row[j] = v
        w = w + (step_size[j] * m) / (np.sqrt(v) / bc2[j] + eps)
        store_f32(w_row, j, w)
        store_f32(p, c, w)


@host_kernel()
def selective_adam_kernel(
    param,
    grad,
    idx,
    exp_avg,
    exp_avg_sq,
    master,
    rows,
    cols,
    grad_scale64,
    decay64,
    one_minus_beta1_64,
    beta2_64,
    one_minus_beta2_64,
    eps64,
    neg_step_size,
    bc2_sqrt,
):
    """AdamW on the columns ``idx`` (or all columns when ``idx`` is None) of a row-major
    ``[rows, cols]`` parameter, with compact ``[rows, k]`` state; the CPU fast path of docs/design.md
    section 2 item 4. ``neg_step_size`` and ``bc2_sqrt`` are float32 ``[k]`` arrays (per-column bias
    correction; all equal for a single step count).

    The operation order is ``torch_ops._adamw``'s (torch.optim.AdamW's): ``g = grad / grad_scale``,
    ``w *= decay``, ``m = lerp(m, g, 1 - beta1)``, ``v = v * beta2 + (1 - beta2) * g * g``,
    ``w += neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)``; ``w`` is the fp32 master when given (the
    parameter then receives it rounded), else the parameter's value in float32.
    """
    k = exp_avg.size // rows if rows > 0 else 0
    grad_scale = np.float32(grad_scale64)
    decay = np.float32(decay64)
    lerp_coeff, lerp_small, beta2, one_minus_beta2, eps = adam_constants(
        one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64
    )
    for r in prange(rows):
        _adam_columns(param, grad, idx, exp_avg, exp_avg_sq, master, r * cols, r * k, 0, k, neg_step_size, bc2_sqrt,
                      0, grad_scale, decay, np.float32(0.0), lerp_coeff, lerp_small, beta2, one_minus_beta2, eps)


# Columns of the address table of ``multi_selective_adam_kernel``.
T_PARAM, T_GRAD, T_IDX, T_EXP_AVG, T_EXP_AVG_SQ, T_MASTER, T_ROWS, T_COLS, T_K, T_COEF = range(10)


@host_kernel()
def multi_selective_adam_kernel(
    table,
    chunk_starts,
    parts,
    decay64,
    l2_64,
    neg_step_size,
    bc2_sqrt,
    param_proto,
    grad_proto,
    master_proto,
    block,
    grad_scale64,
    one_minus_beta1_64,
    beta2_64,
    one_minus_beta2_64,
    eps64,
):
    """``selective_adam_kernel`` over many tensors in one launch (the CPU multi-tensor form).

    ``table`` is int64 ``[n, 10]``, one row per tensor (columns ``T_*``): the addresses of param,
    grad, indices (0: dense, every column), exp_avg, exp_avg_sq and master (ignored when
    ``master_proto`` is None), then rows, cols, k and the tensor's offset into the float32 per-column
    coefficients ``neg_step_size`` / ``bc2_sqrt``; ``decay64[t]`` is 1 - lr*wd of tensor t (AdamW; 1 for Adam),
    ``l2_64[t]`` its coupled decay (Adam's weight_decay; 0 for AdamW). Every tensor
    of a launch has param_proto's, grad_proto's and master_proto's element types (the launcher groups
    them), and all memory is contiguous. The work items are (tensor, row, block of ``block`` selected
    columns); tensor t owns items ``chunk_starts[t]`` to ``chunk_starts[t + 1] - 1``, so one long
    vector is split as finely as a tall matrix. The items are dealt out in ``parts`` contiguous ranges,
    one ``prange`` iteration each, walked in order: a tensor's row is found once per range, not per item
    (a tiny item, a row of a few selected columns, costs little more than its arithmetic).
    """
    state_proto = np.empty(0, dtype=np.float32)  # (the element types the walk views memory as)
    idx_proto = np.empty(0, dtype=np.int64)
    grad_scale = np.float32(grad_scale64)
    lerp_coeff, lerp_small, beta2, one_minus_beta2, eps = adam_constants(
        one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64
    )
    for q in prange(parts):
        c0, c1, t0, t1 = part_tensors(q, parts, chunk_starts)
        for t in range(t0, t1):
            rows, cols, k = table[t, T_ROWS], table[t, T_COLS], table[t, T_K]
            blocks = (k + block - 1) // block
            param = carray(pointer_at(table[t, T_PARAM], param_proto), rows * cols)
            grad = carray(pointer_at(table[t, T_GRAD], grad_proto), rows * cols)
            exp_avg = carray(pointer_at(table[t, T_EXP_AVG], state_proto), rows * k)
            exp_avg_sq = carray(pointer_at(table[t, T_EXP_AVG_SQ], state_proto), rows * k)
            master = array_at(table[t, T_MASTER], rows * k, master_proto)
            decay = np.float32(decay64[t])
            l2 = np.float32(l2_64[t])
            coef = table[t, T_COEF]
            dense = table[t, T_IDX] == 0
            idx = carray(pointer_at(table[t, T_IDX], idx_proto), 0 if dense else k)
            lo, hi = tensor_items(c0, c1, t, chunk_starts)
            for local in range(lo, hi):
                r, j0, j1 = item_block(local, blocks, block, k)
                if dense:
                    _adam_columns(param, grad, None, exp_avg, exp_avg_sq, master, r * cols, r * k, j0, j1,
                                  neg_step_size, bc2_sqrt, coef, grad_scale, decay, l2, lerp_coeff, lerp_small, beta2,
                                  one_minus_beta2, eps)
                else:
                    _adam_columns(param, grad, idx, exp_avg, exp_avg_sq, master, r * cols, r * k, j0, j1,
                                  neg_step_size, bc2_sqrt, coef, grad_scale, decay, l2, lerp_coeff, lerp_small, beta2,
                                  one_minus_beta2, eps)
