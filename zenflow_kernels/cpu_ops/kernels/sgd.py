"""SGD kernels: the host pass (launcher: cpu_ops/sgd.py) and the CPU fast path on selected columns (launcher:
cpu_ops/selective_sgd.py). Every ``add`` with ``alpha`` is an ``fma``, as torch's vectorised kernels compute it
(measured: the docstring of ``lion``)."""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange, types
from numba.extending import overload

from ._columns import (
    R_FIRST,
    R_STEPS,
    column_of,
    item_block,
    load_master,
    part_of,
    part_tensors,
    row_of,
    rule_tensor,
    tensor_items,
)
from ._dtype import coupled_grad, is_none, load_f32, state_hash, store_f32, store_state_low
from ._ir import fma, pointer_at
from ._jit import host_kernel


def momentum_step(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
    """SGD's momentum for element i (numba only): the direction to step along; ``buf[i]`` updated (a bf16 buffer:
    rounded to nearest, or stochastically with the low bits of ``h`` where ``salt`` is not None).

    * ``buf`` None (momentum == 0): ``d`` unchanged;
    * else ``b = d`` on the buffer's first step, ``fma(d, 1 - dampening, buf[i] * momentum)`` after it;
      ``buf[i] = b``; returns ``fma(b, momentum, d)`` with Nesterov, ``b`` without.
    """
    raise NotImplementedError("numba-only helper")


@overload(momentum_step, inline="always")
def _ov_momentum_step(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
    if is_none(buf):
        return lambda buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None: d
    if not (isinstance(buf, types.Array) and buf.dtype in (types.float32, types.int16)):
        return None

    def impl(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
        # torch.optim.SGD's first step clones d (its buffer is None): no dampening, the old buffer unread
        b = d if first else fma(d, one_minus_dampening, load_f32(buf, i) * momentum)
        store_state_low(buf, i, b, h, salt)  # (a bf16 buffer keeps b rounded; the step below uses b itself)
        return fma(b, momentum, d) if nesterov else b

    return impl


def column_momentum(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
    """``momentum_step`` for the fast path's kernel (numba only), inlined by LLVM rather than numba's IR inliner,
    whose SSA pass warns (NumbaIRAssumptionWarning) on the helper inlined into that kernel's branches."""
    raise NotImplementedError("numba-only helper")


overload(column_momentum)(_ov_momentum_step)


@host_kernel()
def sgd_kernel(param, grad, momentum_buffer, acc, out, zero_acc, inv_scale64, weight_decay64, momentum64,
               one_minus_dampening64, neg_lr64, first, nesterov, key, salt):
    """One fused pass of SGD over n elements, ``torch.optim.SGD``'s single-tensor step:

    d = take_grad(acc, grad, i, zero_acc) * inv_scale
    d = fma(p, weight_decay, d)                          if weight_decay != 0   (d.add(p, alpha=wd))
    b = d if first else fma(d, 1 - dampening, b * momentum)   momentum_buffer[i] = b   (buffer not None)
    d = fma(b, momentum, d) if nesterov else b           (buffer not None)
    p = fma(d, -lr, p)                                   (p.add_(d, alpha=-lr))
    out[i] = p (converted), when out is not None.
    """
    inv_scale = np.float32(inv_scale64)
    weight_decay = np.float32(weight_decay64)
    momentum = np.float32(momentum64)
    one_minus_dampening = np.float32(one_minus_dampening64)
    neg_lr = np.float32(neg_lr64)
    for i in prange(param.size):
        p = param[i]
        d = coupled_grad(acc, grad, i, zero_acc, inv_scale, p, weight_decay)
        d = momentum_step(momentum_buffer, i, d, first, momentum, one_minus_dampening, nesterov,
                          state_hash(key, i, salt), salt)
        p = fma(d, neg_lr, p)
        param[i] = p
        store_f32(out, i, p)


@njit(inline="always")
def _sgd_columns(param, grad, idx, buf, master, steps, per_column, first, base, sbase, j0, j1, inv_scale,
                 weight_decay, neg_lr, momentum, one_minus_dampening, nesterov):
    """SGD (``sgd_kernel``'s element step) on selected columns j0..j1-1 of one row; ``steps`` the tensor's
    per-column step counts when ``per_column`` (else ``first`` for every column)."""
    p = row_of(param, base, j0, idx)
    g_row = row_of(grad, base, j0, idx)
    cols = part_of(idx, j0, j1)
    b_row = part_of(buf, sbase + j0, sbase + j1)
    w_row = part_of(master, sbase + j0, sbase + j1)
    s_row = steps[j0:j1] if per_column else steps
    for j in range(j1 - j0):
        c = column_of(cols, j)
        w = load_master(w_row, j, p, c)
        d = load_f32(g_row, c) * inv_scale
        d = d if weight_decay == np.float32(0.0) else fma(w, weight_decay, d)
        starts = s_row[j] == 1 if per_column else first
        d = column_momentum(b_row, j, d, starts, momentum, one_minus_dampening, nesterov)
        w = fma(d, neg_lr, w)
        store_f32(w_row, j, w)
        store_f32(p, c, w)


@host_kernel()
def multi_selective_sgd_kernel(table, chunk_starts, parts, lr64, wd64, param_proto, grad_proto, master_proto,
                               buf_proto, block, inv_scale64, momentum64, one_minus_dampening64, nesterov):
    """SGD on the selected columns of many tensors in one launch (``multi_selective_lion_kernel``'s table and walk);
    ``buf_proto`` None: no momentum buffer (momentum 0). A column's first step (its count 1, or ``R_FIRST``) starts
    its buffer as torch's does."""
    idx_proto = np.empty(0, dtype=np.int64)  # (the element types the walk views memory as)
    step_proto = np.empty(0, dtype=np.int64)
    inv_scale = np.float32(inv_scale64)
    momentum = np.float32(momentum64)
    one_minus_dampening = np.float32(one_minus_dampening64)
    for q in prange(parts):
        c0, c1, t0, t1 = part_tensors(q, parts, chunk_starts)
        for t in range(t0, t1):
            rows, cols, k, blocks, param, grad, buf, master, idx, dense = rule_tensor(
                table, t, block, param_proto, grad_proto, buf_proto, master_proto, idx_proto)
            weight_decay = np.float32(wd64[t])
            neg_lr = np.float32(-lr64[t])
            per_column = table[t, R_STEPS] != 0
            steps = carray(pointer_at(table[t, R_STEPS], step_proto), k if per_column else 0)
            first = table[t, R_FIRST] != 0
            lo, hi = tensor_items(c0, c1, t, chunk_starts)
            for local in range(lo, hi):
                r, j0, j1 = item_block(local, blocks, block, k)
                if dense:
                    _sgd_columns(param, grad, None, buf, master, steps, per_column, first, r * cols, r * k, j0, j1,
                                 inv_scale, weight_decay, neg_lr, momentum, one_minus_dampening, nesterov)
                else:
                    _sgd_columns(param, grad, idx, buf, master, steps, per_column, first, r * cols, r * k, j0, j1,
                                 inv_scale, weight_decay, neg_lr, momentum, one_minus_dampening, nesterov)
