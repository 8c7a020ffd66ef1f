# Gradient fingerprints: fp = sum_k word_k * (fmix64(k + key) | 1) modulo 2**64, per tensor.
#
# Words. A tensor's bits in row-major order as 32-bit words: a 4-byte element is one word; 2-byte elements
# 2k and 2k + 1 form word k (low and high half; a missing last element is 0). fmix64 is murmur3's 64-bit
# finalizer. The spec (and why it detects changes: docs/design.md section 5.1) is the same on every backend:
# torch_ops.multi_fingerprint is the reference, cpu_ops.fingerprint the host's.
#
# Design. Order-free: integer addition modulo 2**64 is associative and commutative, so each program sums its
# block of words (uint64 arithmetic wraps), and adds the block's sum into the tensor's int64 output with one
# atomic add (two's complement: the same bits as the uint64 sum); any block size, grid or launch split gives the
# same value. 2-byte tensors are read as two interleaved uint16 streams (elements 2k and 2k + 1), which touch the
# same cache lines as one coalesced read; nothing assumes a 4-byte aligned address. Weights cost two 64-bit
# multiplies a word, the hash one more: memory-bound on an H100/H200 for fp32 words, close to it for bf16.
# Multi-tensor: one launch per element width over a per-tensor table (see _util), grid = total blocks.
# Limits: contiguous input (the launcher copies a strided tensor first); numel < 2^62.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _validate as V
from ._util import device_table, find_segment, launch, search_steps

BLOCK_WORDS = 1024
FMIX_1 = 0xFF51AFD7ED558CCD
FMIX_2 = 0xC4CEB9FE1A85EC53
_BITS = {4: tl.uint32, 2: tl.uint16}
_CONSTS: dict = {}  # (key, device) -> int64 [3] on the device: key, FMIX_1, FMIX_2 (their bits)


def _signed(x: int) -> int:
    """The int64 with the bits of the uint64 ``x``."""
    return x - (1 << 64) if x >= 1 << 63 else x


@triton.jit
def _weights(k, key, m1, m2):
    """fmix64(k + key) | 1 for uint64 word indices ``k``."""
    z = k + key
    z ^= z >> 33
    z *= m1
    z ^= z >> 33
    z *= m2
    z ^= z >> 33
    return z | 1


@triton.jit
def _multi_fingerprint_kernel(table_ptr, consts_ptr, out_ptr, n_tensors, n_steps, BITS: tl.constexpr,
                              HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (blocks of every tensor,): block = (tensor, BLOCK words). Table rows: ptr, numel, first block,
    output index."""
    pid = tl.program_id(0)
    t = find_segment(table_ptr + 2, 4, n_tensors, pid, n_steps)
    row = table_ptr + t.to(tl.int64) * 4
    x_ptr = tl.load(row + 0).to(tl.pointer_type(BITS))
    n = tl.load(row + 1)
    k = (pid - tl.load(row + 2)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HALF:
        lo = tl.load(x_ptr + 2 * k, mask=2 * k < n, other=0).to(tl.uint64)
        hi = tl.load(x_ptr + 2 * k + 1, mask=2 * k + 1 < n, other=0).to(tl.uint64)
        word = lo | (hi << 16)
    else:
        word = tl.load(x_ptr + k, mask=k < n, other=0).to(tl.uint64)
    key = tl.load(consts_ptr + 0).to(tl.uint64, bitcast=True)
    m1 = tl.load(consts_ptr + 1).to(tl.uint64, bitcast=True)
    m2 = tl.load(consts_ptr + 2).to(tl.uint64, bitcast=True)
    block_sum = tl.sum(word * _weights(k.to(tl.uint64), key, m1, m2), axis=0)  # masked words are 0
    tl.atomic_add(out_ptr + tl.load(row + 3), block_sum.to(tl.int64, bitcast=True))


def _consts(key: int, device: torch.device) -> torch.Tensor:
    got = _CONSTS.get((key, device))
    if got is None:
        got = _CONSTS[(key, device)] = device_table([_signed(key), _signed(FMIX_1), _signed(FMIX_2)], device)
    return got


def multi_fingerprint(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: the fingerprint of each tensor as int64 ``[n]`` on their device (``out``, zeroed first, when
    given); one launch per element width present."""
    tensors, key, out = V.fingerprint_args("multi_fingerprint", tensors, key, out)
    return multi_fingerprint_unchecked(tensors, key, out=out)


def multi_fingerprint_unchecked(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`multi_fingerprint` for a caller that checked its arguments (a non-empty list when ``out`` is None)."""
    if out is None:
        out = torch.zeros(len(tensors), dtype=torch.int64, device=tensors[0].device)
    if not tensors:
        return out
    device = out.device
    out.zero_()
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    for width in (4, 2):
        rows, blocks = [], 0
        for n, t in enumerate(flat):
            if t.element_size() != width or t.numel() == 0:
                continue
            words = t.numel() if width == 4 else (t.numel() + 1) // 2
            rows.append([t.data_ptr(), t.numel(), blocks, n])
            blocks += triton.cdiv(words, BLOCK_WORDS)
        if blocks:
            launch(_multi_fingerprint_kernel, (blocks,), device_table(rows, device), _consts(key, device), out,
                   len(rows), search_steps(len(rows)), BITS=_BITS[width], HALF=width == 2, BLOCK=BLOCK_WORDS)
    return out
