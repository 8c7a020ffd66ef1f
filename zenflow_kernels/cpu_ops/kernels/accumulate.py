"""Gradient accumulation, sums of squares and dtype conversion (launchers: cpu_ops/accumulate.py)."""

from __future__ import annotations

import numpy as np
from numba import carray, prange

from ._dtype import load_f32, store_f32
from ._ir import pointer_at
from ._jit import REDUCE_FASTMATH, host_kernel


@host_kernel()
def accumulate_kernel(acc, grad):
    """acc[i] += float32(grad[i]) over n elements."""
    for i in prange(acc.size):
        acc[i] = acc[i] + load_f32(grad, i)


@host_kernel()
def multi_accumulate_kernel(acc_addrs, grad_addrs, numels, chunk_starts, chunk, grad_proto, scale):
    """``acc_t[i] += float32(grad_t[i]) * scale`` for every tensor pair t (``numels[t]`` elements at
    ``acc_addrs[t]``, float32, and at ``grad_addrs[t]``, of ``grad_proto``'s type; ``scale`` float32, the product
    rounded before the addition, so ``scale == 1`` gives the bits of ``acc + grad``); work item ``c`` is chunk
    ``j`` of tensor t (items ``chunk_starts[t]`` to ``chunk_starts[t + 1] - 1``), indexed from 0 in slices (see
    ``multi_sum_squares_kernel``)."""
    state_proto = np.empty(0, dtype=np.float32)
    for c in prange(chunk_starts[chunk_starts.size - 1]):
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        lo = (c - chunk_starts[t]) * chunk
        hi = min(numels[t], lo + chunk)
        acc = carray(pointer_at(acc_addrs[t], state_proto), numels[t])[lo:hi]
        grad = carray(pointer_at(grad_addrs[t], grad_proto), numels[t])[lo:hi]
        for i in range(acc.size):
            acc[i] = acc[i] + load_f32(grad, i) * scale


@host_kernel(fastmath=REDUCE_FASTMATH)
def sum_squares_kernel(x):
    """sum(float64(x[i])**2) with float64 accumulation; inf/NaN in x give a non-finite sum
    (no finite float32 squared in float64 can overflow it: 2^40 * 1.2e77 << 1.8e308)."""
    s = 0.0
    for i in prange(x.size):
        v = np.float64(load_f32(x, i))
        s += v * v
    return s


@host_kernel(fastmath=REDUCE_FASTMATH)
def multi_sum_squares_kernel(addrs, numels, chunk_starts, chunk, proto, out):
    """``out[c]`` = the float64 sum of squares of work item ``c``: elements ``chunk * j`` to
    ``chunk * (j + 1) - 1`` of tensor t (its ``j``-th chunk; tensor t owns items ``chunk_starts[t]`` to
    ``chunk_starts[t + 1] - 1``), each tensor ``numels[t]`` elements of ``proto``'s type at ``addrs[t]``.
    An item's sum has the compiled loop's order (the reassociation ``REDUCE_FASTMATH`` allows), the same
    whatever the thread count. The loop runs over a slice from 0: ``range(lo, hi)`` indexing would keep
    numba's negative-index wraparound check in the loop, which stops it vectorising (5x slower)."""
    for c in prange(chunk_starts[chunk_starts.size - 1]):
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        lo = (c - chunk_starts[t]) * chunk
        x = carray(pointer_at(addrs[t], proto), numels[t])[lo : min(numels[t], lo + chunk)]
        s = 0.0
        for i in range(x.size):
            v = np.float64(load_f32(x, i))
            s += v * v
        out[c] = s


@host_kernel()
def convert_kernel(src, out):
    """out[i] = src[i] converted (src float32, bf16-as-int16 or fp16-as-uint16; out likewise)."""
    for i in prange(src.size):
        store_f32(out, i, load_f32(src, i))
