"""Gradient fingerprints (launcher: cpu_ops/fingerprint.py; docs/design.md section 5.1)."""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange

from ._ir import pointer_at
from ._jit import host_kernel

# Gradient fingerprints (docs/design.md section 5.1): a linear hash of a tensor's bits over the integers modulo
# 2**64. Word k of a tensor is its element k's bits (4-byte dtypes), or elements 2k and 2k + 1 in the low and high
# half (2-byte dtypes; a missing last element is 0); its weight is murmur3's 64-bit finalizer of (k + key), made
# odd. Every backend (this one, Triton, torch) computes the same value: wrapping sums are order-free.
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)
_HALF = np.uint64(16)
_ONE = np.uint64(1)


@njit(inline="always")
def fingerprint_weight(k, key):
    """The odd weight of word ``k`` (uint64 arithmetic throughout: an int64 operand would make numba compute
    in float64)."""
    z = np.uint64(k) + key
    z ^= z >> _SHIFT
    z *= _FMIX_1
    z ^= z >> _SHIFT
    z *= _FMIX_2
    z ^= z >> _SHIFT
    return z | _ONE


@host_kernel()
def multi_fingerprint_kernel(addrs, numels, chunk_starts, chunk, proto, key, out):
    """``out[c]`` = the wrapping uint64 sum of ``word_k * weight(k)`` over work item ``c``: words ``chunk * j`` to
    ``chunk * (j + 1) - 1`` of tensor t (its ``j``-th chunk; tensor t owns items ``chunk_starts[t]`` to
    ``chunk_starts[t + 1] - 1``), each tensor ``numels[t]`` elements of ``proto``'s type (uint32, or uint16: two
    elements a word) at ``addrs[t]``."""
    wide = proto.itemsize == 4
    for c in prange(chunk_starts[chunk_starts.size - 1]):
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        lo = (c - chunk_starts[t]) * chunk
        n = numels[t]
        s = np.uint64(0)
        if wide:
            x = carray(pointer_at(addrs[t], proto), n)[lo : min(n, lo + chunk)]
            for k in range(x.size):
                s += np.uint64(x[k]) * fingerprint_weight(lo + k, key)
        else:
            x = carray(pointer_at(addrs[t], proto), n)[2 * lo : min(n, 2 * (lo + chunk))]
            full = x.size // 2
            for k in range(full):
                word = np.uint64(x[2 * k]) | (np.uint64(x[2 * k + 1]) << _HALF)
                s += word * fingerprint_weight(lo + k, key)
            if x.size % 2:
                s += np.uint64(x[x.size - 1]) * fingerprint_weight(lo + full, key)
        out[c] = s
