# Top-k column selection: int64 indices of the k highest scores, sorted ascending, ties to the lower index.
#
# Design: one program per score vector runs an exact radix select, then a stable compaction; no sort.
# 1. Key: the fp32 score (bf16/fp16 are widened exactly) as its order-preserving uint32 bit pattern
#    (flip all bits of negatives, set the sign bit of positives); -0.0 is first mapped to +0.0.
# 2. Radix select, most significant byte first: 4 passes over the vector in CHUNK-sized blocks, each
#    a 256-bin histogram (tl.histogram) of the current byte among keys matching the prefix found so
#    far; a reverse cumulative sum of the histogram picks the byte holding the k-th largest key. After
#    4 passes the threshold T (the k-th largest key) and `need`, the number of keys equal to T to take,
#    are exact.
# 3. Compaction in index order: take key > T, and key == T while fewer than `need` equal keys were
#    seen; output positions come from an exclusive cumulative sum, so the result is sorted ascending.
# Cost: 5 reads of the vector (L2-resident for vocabulary-sized C), histograms in shared memory; the
# register footprint is one CHUNK, whatever C is (tested beyond one chunk; sizes to C < 2^31).
# Multi-tensor: the same program body, one program per tensor, in one launch per score dtype; the
# outputs are views into one flat int64 buffer. k = 0 launches nothing; NaN scores are rejected by the
# launcher (shared data check) before any launch.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _validate as V
from ._util import TL_DTYPE, device_table, launch

_CHUNK = 2048
_WARPS = 8


@triton.jit
def _keys(s_ptr, offs, valid, stride):
    """Order-preserving uint32 keys of the scores at ``offs`` (garbage where not ``valid``)."""
    x = tl.load(s_ptr + offs.to(tl.int64) * stride, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0: equal scores must have equal keys
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _select(s_ptr, stride, C, k, out_ptr, CHUNK: tl.constexpr):
    """Write the ascending indices of the k largest of C scores (1 <= k <= C) to out[0:k]."""
    lanes = tl.arange(0, CHUNK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    known = tl.zeros([], dtype=tl.uint32)  # bits of the threshold fixed so far
    need = k  # keys still to take among those matching `prefix`
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # constexpr: p is a static_range index
        hist = tl.zeros([256], dtype=tl.int32)
        for c0 in range(0, C, CHUNK):
            offs = c0 + lanes
            valid = offs < C
            key = _keys(s_ptr, offs, valid, stride)
            match = valid & ((key & known) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        at_least = tl.cumsum(hist, 0, reverse=True)  # keys with this byte or a larger one
        above = at_least - hist
        hit = (above < need) & (at_least >= need)  # exactly one byte value
        digit = tl.sum(tl.where(hit, bins, 0))
        need -= tl.sum(tl.where(hit, above, 0))
        prefix = prefix | (digit.to(tl.uint32) << shift)
        known = known | (tl.full([], 0xFF, tl.uint32) << shift)
    written = need * 0
    ties_seen = need * 0
    for c0 in range(0, C, CHUNK):
        offs = c0 + lanes
        valid = offs < C
        key = _keys(s_ptr, offs, valid, stride)
        eq = (valid & (key == prefix)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(eq, 0) - eq
        take = (valid & (key > prefix)) | ((eq != 0) & (tie_rank < need))
        take_i = take.to(tl.int32)
        pos = written + tl.cumsum(take_i, 0) - take_i
        tl.store(out_ptr + pos, offs.to(tl.int64), mask=take)
        written += tl.sum(take_i)
        ties_seen += tl.sum(eq)


@triton.jit
def _topk_kernel(s_ptr, stride, C, k, out_ptr, CHUNK: tl.constexpr):
    _select(s_ptr, stride, C, k, out_ptr, CHUNK)


@triton.jit
def _multi_topk_kernel(table_ptr, out_ptr, S_DTYPE: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (n_tensors,). Table row: [scores ptr, stride, C, k, output offset]."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * 5
    s_ptr = tl.load(row).to(tl.pointer_type(S_DTYPE))
    _select(s_ptr, tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), out_ptr + tl.load(row + 4), CHUNK)


def topk_columns(scores: torch.Tensor, k: int, *, check_data: bool = True) -> torch.Tensor:
    k = V.topk_input("topk_columns", "scores", scores, k)
    if check_data:
        V.data("topk_columns", scores=[("scores", scores)])
    out = torch.empty(k, dtype=torch.int64, device=scores.device)
    if k > 0:
        launch(_topk_kernel, (1,), scores, scores.stride(0), scores.shape[0], k, out, CHUNK=_CHUNK,
               num_warps=_WARPS)
    return out


def multi_topk_columns(scores_list, ks, *, check_data: bool = True) -> list[torch.Tensor]:
    op = "multi_topk_columns"
    V.same_length(op, scores_list=scores_list, ks=ks)
    dev = V.common_device(op, "scores_list", scores_list)
    ks = [V.topk_input(op, f"scores_list[{i}]", s, k) for i, (s, k) in enumerate(zip(scores_list, ks, strict=True))]
    if check_data:
        V.data(op, scores=[(f"scores_list[{i}]", s) for i, s in enumerate(scores_list)])
    if not scores_list:
        return []
    offs = [0]
    for k in ks:
        offs.append(offs[-1] + k)
    out = torch.empty(offs[-1], dtype=torch.int64, device=dev)
    for dtype in V.FLOAT_DTYPES:
        rows = [[s.data_ptr(), s.stride(0), s.shape[0], k, offs[i]]
                for i, (s, k) in enumerate(zip(scores_list, ks, strict=True)) if k > 0 and s.dtype == dtype]
        if rows:
            launch(_multi_topk_kernel, (len(rows),), device_table(rows, dev), out, S_DTYPE=TL_DTYPE[dtype],
                   CHUNK=_CHUNK, num_warps=_WARPS)
    return [out[offs[i]:offs[i + 1]] for i in range(len(scores_list))]
