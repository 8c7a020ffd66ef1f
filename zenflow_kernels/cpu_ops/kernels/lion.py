"""Lion kernels: the host pass (launcher: cpu_ops/lion.py) and the CPU fast path on selected columns (launcher:
cpu_ops/selective_lion.py).

Lion and SGD (sgd.py) follow torch's op sequences as its vectorised CPU kernels round them. Measured on torch 2.13
with its AVX512 and AVX2 kernels (random fp32 data, sizes 1 to 10^6 + 3, so the scalar tail loops too): ``x.add(y,
alpha=a)`` and ``x.add_(y, alpha=a)`` equal ``fma(y, float32(a), x)`` bit for bit and differ from ``x + float32(a) *
y`` in up to 28% of elements; ``x.mul(s)`` is one rounded multiply; ``lerp`` with a scalar weight is the two-form
fma of ``adam.adam_constants``. So every ``add`` with ``alpha`` here and in sgd.py is an ``fma``, which makes the
results bit-identical to the torch op sequences cpu_ops/lion.py and cpu_ops/sgd.py state, wherever torch runs those
kernels (x86 with AVX2); torch's scalar DEFAULT kernels (``ATEN_CPU_CAPABILITY=default``) round product and sum
separately (the last bit or two; tests/test_cpu_rules.py measures it). ``torch.sign`` on CPU is ``(0 < x) - (x <
0)``: +0.0 for +-0.0 *and NaN* (pytorch/pytorch#41245); ``torch_sign`` does the same, so a NaN momentum moves
nothing through the sign, as torch's Lion does (the NaN still shows in ``exp_avg``). State may be fp32 or bf16
(``load_f32``/``store_f32``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._columns import column_of, item_block, load_master, part_of, part_tensors, row_of, rule_tensor, tensor_items
from ._dtype import load_f32, state_hash, store_f32, store_state_low, take_grad
from ._ir import fma
from ._jit import host_kernel


@njit(inline="always")
def lerp_constants(weight64):
    """torch's scalar-weight lerp as ``fma(coeff, end - start, start if small else end)``: (coeff, small),
    with the weight rounded to float32 once (as ``adam.adam_constants`` does for Adam's first moment)."""
    w = np.float32(weight64)
    small = abs(w) < np.float32(0.5)
    return (w if small else w - np.float32(1.0)), small


@njit(inline="always")
def lerp(start, end, coeff, small):
    """``torch.lerp(start, end, w)`` for the constants of ``lerp_constants(w)``: ATen's vectorised form."""
    return fma(coeff, end - start, start if small else end)


@njit(inline="always")
def torch_sign(x):
    """``torch.sign`` of a float32: 1, -1, or +0.0 for +-0.0 and NaN (ATen's ``(0 < x) - (x < 0)``)."""
    return np.float32(1.0) if x > np.float32(0.0) else (np.float32(-1.0) if x < np.float32(0.0) else np.float32(0.0))


@host_kernel()
def lion_kernel(param, grad, exp_avg, acc, out, zero_acc, inv_scale64, decay64, neg_lr64, one_minus_beta1_64,
                one_minus_beta2_64, key, salt):
    """One fused pass of Lion over n elements (all arrays 1-D, length n, contiguous):

    g = take_grad(acc, grad, i, zero_acc) * inv_scale   (grad[i], acc[i] + grad[i], or acc[i] when grad is None)
    u = torch_sign(lerp(m, g, 1 - beta1))
    p = p * decay                                        (decay = 1 - lr*wd; skipped when it is 1)
    p = fma(u, -lr, p)                                   (u is +-1 or 0: the product is exact)
    m = lerp(m, g, 1 - beta2)                            (stored in exp_avg's dtype: fp32, or bf16 rounded:
                                                          as adam_kernel's m, with key and salt)
    out[i] = p (converted), when out is not None.
    """
    inv_scale = np.float32(inv_scale64)
    decay = np.float32(decay64)
    neg_lr = np.float32(neg_lr64)
    coeff1, small1 = lerp_constants(one_minus_beta1_64)
    coeff2, small2 = lerp_constants(one_minus_beta2_64)
    for i in prange(param.size):
        g = take_grad(acc, grad, i, zero_acc) * inv_scale
        m = load_f32(exp_avg, i)
        u = torch_sign(lerp(m, g, coeff1, small1))
        p = param[i]
        # weight_decay == 0 skips torch's mul_ (a multiply by exactly 1 would only quiet a signalling NaN)
        p = p if decay == np.float32(1.0) else p * decay
        p = fma(u, neg_lr, p)
        param[i] = p
        store_state_low(exp_avg, i, lerp(m, g, coeff2, small2), state_hash(key, i, salt), salt)
        store_f32(out, i, p)


@njit(inline="always")
def _lion_columns(param, grad, idx, exp_avg, master, base, sbase, j0, j1, inv_scale, decay, neg_lr, coeff1, small1,
                  coeff2, small2):
    """Lion (``lion_kernel``'s element step) on selected columns j0..j1-1 of one row (``_adam_columns``' layout)."""
    p = row_of(param, base, j0, idx)
    g_row = row_of(grad, base, j0, idx)
    cols = part_of(idx, j0, j1)
    m_row = exp_avg[sbase + j0 : sbase + j1]
    w_row = part_of(master, sbase + j0, sbase + j1)
    for j in range(j1 - j0):
        c = column_of(cols, j)
        g = load_f32(g_row, c) * inv_scale
        m = m_row[j]
        u = torch_sign(lerp(m, g, coeff1, small1))
        w = load_master(w_row, j, p, c)
        w = w if decay == np.float32(1.0) else w * decay
        w = fma(u, neg_lr, w)
        m_row[j] = lerp(m, g, coeff2, small2)
        store_f32(w_row, j, w)
        store_f32(p, c, w)


@host_kernel()
def multi_selective_lion_kernel(table, chunk_starts, parts, lr64, wd64, param_proto, grad_proto, master_proto, block,
                                inv_scale64, one_minus_beta1_64, one_minus_beta2_64):
    """Lion on the selected columns of many tensors in one launch: ``table`` int64 ``[n, 10]`` (columns ``R_*``),
    ``lr64[t]``, ``wd64[t]`` tensor t's numbers (decay ``1 - lr * wd`` in float64, rounded once, as torch's
    ``mul_`` of a Python float); the walk of ``multi_selective_adam_kernel``."""
    state_proto = np.empty(0, dtype=np.float32)  # (the element types the walk views memory as)
    idx_proto = np.empty(0, dtype=np.int64)
    inv_scale = np.float32(inv_scale64)
    coeff1, small1 = lerp_constants(one_minus_beta1_64)
    coeff2, small2 = lerp_constants(one_minus_beta2_64)
    for q in prange(parts):
        c0, c1, t0, t1 = part_tensors(q, parts, chunk_starts)
        for t in range(t0, t1):
            rows, cols, k, blocks, param, grad, exp_avg, master, idx, dense = rule_tensor(
                table, t, block, param_proto, grad_proto, state_proto, master_proto, idx_proto)
            decay = np.float32(1.0 - lr64[t] * wd64[t])
            neg_lr = np.float32(-lr64[t])
            lo, hi = tensor_items(c0, c1, t, chunk_starts)
            for local in range(lo, hi):
                r, j0, j1 = item_block(local, blocks, block, k)
                if dense:
                    _lion_columns(param, grad, None, exp_avg, master, r * cols, r * k, j0, j1, inv_scale, decay,
                                  neg_lr, coeff1, small1, coeff2, small2)
                else:
                    _lion_columns(param, grad, idx, exp_avg, master, r * cols, r * k, j0, j1, inv_scale, decay,
                                  neg_lr, coeff1, small1, coeff2, small2)
