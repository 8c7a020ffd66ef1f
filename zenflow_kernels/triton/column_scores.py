# Column scores: s[c] = sum_r g[r, c]^2 ("l2") or sum_r |g[r, c]| ("l1"), fp32 accumulation.
#
# Fixed summation order. The fp32 result depends on the order of the additions, and the order must not
# depend on the autotune config or on the row split (both vary between processes: two ZeRO ranks that
# score the same averaged gradient, or a resumed run, must select the same columns even when two columns
# nearly tie). So every launch adds in one canonical order, whatever the tile width, warps, stages or
# split: rows fall into fixed groups of GROUP_ROWS = 512 (absolute row numbers); within a group, lane
# i = r % LANES (LANES = 64) sums its rows sequentially in row order; the 64 lane sums are combined by a
# fixed pairwise tree (lanes 2i and 2i + 1, level by level: reshape/split, never tl.sum, whose order
# follows the register layout); the group sums are added sequentially in group order, by the program
# itself when it owns every row, else by the partial-sum kernel. Masked elements add an exact 0. FP
# contraction is off for these kernels (enable_fp_fusion=False): each square is rounded before it is
# added, as written and as the interpreter does, rather than fused where the compiler sees fit.
#
# Design. A program reduces one column strip of BLOCK_C columns over a range of whole groups, walking it
# in [LANES, BLOCK_C] tiles into a [LANES, BLOCK_C] fp32 accumulator that the tree folds once per group.
# Strides are kernel arguments: for a row-major gradient the columns are the contiguous axis (coalesced
# along BLOCK_C); for a transposed view (stride_r == 1, which Triton specialises) the configs with
# narrow strips are kept, so the loads coalesce along the 64 rows instead. No input is ever copied.
# Tall matrices: when the column strips alone cannot fill the GPU (about 4 programs per SM), the rows
# are split into S ranges of whole groups; each (strip, range) program writes one fp32 partial row per
# group ([cdiv(R, GROUP_ROWS), C] in all: 1/512 of the input's elements) and a second, small kernel adds
# them in group order. No atomics.
# Multi-tensor: the same strip reduction, driven by a per-tensor table (see _util); one launch per
# gradient dtype, plus one partial-sum launch when some tensor is split; outputs are views into one
# flat fp32 buffer. Same order, so a tensor's scores are the same bits as column_scores gives.
# Limits: fp32/bf16/fp16 input; R, C < 2^31 each; offsets are int64, so numel may exceed 2^31.
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _validate as V
from ._util import (
    TL_DTYPE,
    config_pruner,
    device_table,
    find_segment,
    launch,
    num_sms,
    search_steps,
)

LANES = 64  # rows per tile: lane i of a group sums rows i, i + 64, ... of it in order
GROUP_ROWS = 512  # rows per fixed-order partial; a split holds whole groups
_LANES = tl.constexpr(LANES)
_LOG2_LANES = tl.constexpr(LANES.bit_length() - 1)
_GROUP_ROWS = tl.constexpr(GROUP_ROWS)
_SUM_BLOCK = 512  # columns per program in the partial-sum kernel
_SUM_UNROLL = tl.constexpr(8)  # partial rows loaded together (added one after another) in that kernel
MULTI_BLOCK_C = 128  # strip width of the multi-tensor kernel (fixed: it defines the work-unit table)
_NO_FP_FUSION = dict(enable_fp_fusion=False)  # launch option of every score kernel (see the header)


def _c(block_c, warps, stages=3):
    return triton.Config({"BLOCK_C": block_c}, num_warps=warps, num_stages=stages)


# Row-major configs first (columns contiguous), then column-major ones (rows contiguous). They differ in
# strip width, warps and stages only: the tile height is LANES, part of the summation order. 16 to 32
# accumulator elements a thread (80 to 170 registers on sm_90; 64 spill).
_ROW_MAJOR = [_c(64, 8), _c(64, 4), _c(128, 8), _c(256, 16), _c(64, 8, 4), _c(64, 4, 4)]
_COL_MAJOR = [_c(32, 8), _c(16, 4), _c(32, 4), _c(16, 4, 4)]
_CONFIGS = _ROW_MAJOR + _COL_MAJOR


def _suited(config, args) -> bool:
    """Keep row-major tiles for stride_c == 1 (or a single column), column-major ones for stride_r == 1."""
    bc = config.kwargs["BLOCK_C"]
    row_major = args["stride_c"] == 1 or args["C"] == 1
    col_major = args["stride_r"] == 1 and not row_major
    if row_major:
        return bc >= 64
    if col_major:
        return bc <= 32
    return True


@triton.jit
def _sum_lanes(acc):
    """[LANES, BLOCK_C] -> [BLOCK_C]: the fixed pairwise tree over the lanes (2i + 2i+1, then again)."""
    x = tl.trans(acc)
    for _ in tl.static_range(_LOG2_LANES):
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        x = even + odd
    return tl.reshape(x, [x.shape[0]])


@triton.jit
def _strip(g_ptr, dst_ptr, C, stride_r, stride_c, col0, row_start, row_end, split,
           L1: tl.constexpr, BLOCK_C: tl.constexpr):
    """Columns [col0, col0 + BLOCK_C) summed over rows [row_start, row_end) in the canonical order
    (row_start a multiple of GROUP_ROWS). ``split``: the j-th group's sum goes to dst[j * C + c];
    else the sum of all groups, in group order, to dst[c]."""
    cols = col0 + tl.arange(0, BLOCK_C)
    cmask = cols < C
    col_off = cols.to(tl.int64) * stride_c
    lanes = tl.arange(0, _LANES)
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    for g0 in range(row_start, row_end, _GROUP_ROWS):
        acc = tl.zeros([_LANES, BLOCK_C], dtype=tl.float32)
        for r0 in range(g0, tl.minimum(g0 + _GROUP_ROWS, row_end), _LANES):
            rows = r0 + lanes
            mask = (rows < row_end)[:, None] & cmask[None, :]
            ptrs = g_ptr + (rows.to(tl.int64) * stride_r)[:, None] + col_off[None, :]
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            if L1:
                acc += tl.abs(x)
            else:
                acc += x * x
        part = _sum_lanes(acc)
        total += part
        if split:
            j = (g0 - row_start) // _GROUP_ROWS
            tl.store(dst_ptr + j.to(tl.int64) * C + cols, part, mask=cmask)
    if not split:
        tl.store(dst_ptr + cols, total, mask=cmask)


@triton.autotune(
    configs=_CONFIGS,
    key=["R", "C", "stride_r", "stride_c"],
    prune_configs_by={"early_config_prune": config_pruner("_column_scores_kernel", _suited)},
)
@triton.jit
def _column_scores_kernel(g_ptr, out_ptr, R, C, stride_r, stride_c, rows_per_split,
                          L1: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (cdiv(C, BLOCK_C), S). S == 1: writes out[:] itself; else out is [cdiv(R, GROUP_ROWS), C] and
    gets one partial row per group."""
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1).to(tl.int64)
    row_start = pid_s * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, R)
    split = rows_per_split < R
    _strip(g_ptr, out_ptr + (row_start // _GROUP_ROWS) * C, C, stride_r, stride_c, pid_c * BLOCK_C, row_start,
           row_end, split, L1, BLOCK_C)


@triton.jit
def _sum_partials(part_ptr, out_ptr, S, C, col0, BLOCK_C: tl.constexpr):
    """out[c] = sum_{s < S} part[s, c], added in order s = 0, 1, ... (the canonical group order)."""
    cols = col0 + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s0 in range(0, S, _SUM_UNROLL):
        for j in tl.static_range(_SUM_UNROLL):
            s = s0 + j
            valid = cols < tl.where(s < S, C, 0)  # rows past S add an exact 0
            acc += tl.load(part_ptr + s.to(tl.int64) * C + cols, mask=valid, other=0.0)
    tl.store(out_ptr + cols, acc, mask=cmask)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, S, C, BLOCK_C: tl.constexpr):
    _sum_partials(part_ptr, out_ptr, S, C, tl.program_id(0) * BLOCK_C, BLOCK_C)


def _whole_groups(rows: int) -> int:
    return triton.cdiv(rows, GROUP_ROWS) * GROUP_ROWS


def _split(R: int, strips: int, device: torch.device) -> tuple[int, int]:
    """(S, rows_per_split): split rows only when the strips alone leave the GPU under-filled. The split
    changes which program adds what, never the order of the additions."""
    want = triton.cdiv(4 * num_sms(device), max(strips, 1))
    s = max(1, min(want, R // GROUP_ROWS))
    rows = _whole_groups(triton.cdiv(R, s))
    return triton.cdiv(R, rows), rows


def column_scores(grad: torch.Tensor, importance: str = "l2", *, rows_per_split: int | None = None) -> torch.Tensor:
    """Launcher; ``rows_per_split`` forces the row split (tests; rounded up to whole groups of
    GROUP_ROWS rows), otherwise chosen from the shape. The result does not depend on it."""
    l1 = V.scores_input("column_scores", "grad", grad, importance)
    R, C = grad.shape
    out = torch.zeros(C, dtype=torch.float32, device=grad.device)
    if R == 0 or C == 0:
        return out
    if rows_per_split is None:
        S, rows_per_split = _split(R, triton.cdiv(C, MULTI_BLOCK_C), grad.device)
    else:
        rows_per_split = V.integer("column_scores", "rows_per_split", rows_per_split, lo=1)
        rows_per_split = _whole_groups(max(rows_per_split, triton.cdiv(R, 65535)))  # grid axis 1: <= 65535
        S = triton.cdiv(R, rows_per_split)
    groups = triton.cdiv(R, GROUP_ROWS)
    dst = out if S == 1 else torch.empty((groups, C), dtype=torch.float32, device=grad.device)

    def grid(meta):
        return (triton.cdiv(C, meta["BLOCK_C"]), S)

    launch(_column_scores_kernel, grid, grad, dst, R, C, grad.stride(0), grad.stride(1), rows_per_split, L1=l1,
           **_NO_FP_FUSION)
    if S > 1:
        launch(_sum_partials_kernel, (triton.cdiv(C, _SUM_BLOCK),), dst, out, groups, C, BLOCK_C=_SUM_BLOCK,
               **_NO_FP_FUSION)
    return out


# ----------------------------------------------------------------------------------------------------
# Multi-tensor form. Table columns (int64), one row per tensor:
_T_PTR, _T_R, _T_C, _T_SR, _T_SC, _T_STRIPS, _T_RPS, _T_UNIT, _T_DST, _T_OUT, _T_UNIT2, _T_S = range(12)
_NCOL = 12
# _T_DST: offset of the tensor's first write (its output, or its partial rows) in the flat buffer;
# _T_OUT: offset of its output; _T_UNIT / _T_UNIT2: first work unit in pass 1 / pass 2; _T_S: partial
# rows (groups) of a split tensor.

# Warps and stages only: the strip width defines the work units, the tile height the summation order.
_MULTI_CONFIGS = [
    triton.Config({}, num_warps=16),
    triton.Config({}, num_warps=8),
    triton.Config({}, num_warps=16, num_stages=4),
]


@triton.autotune(
    configs=_MULTI_CONFIGS,
    key=["n_tensors", "n_units"],
    prune_configs_by={"early_config_prune": config_pruner("_multi_column_scores_kernel", lambda c, a: True)},
)
@triton.jit
def _multi_column_scores_kernel(table_ptr, buf_ptr, n_tensors, n_units, n_steps, G_DTYPE: tl.constexpr,
                                L1: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (n_units,): unit = (tensor, row range, column strip)."""
    pid = tl.program_id(0)
    t = find_segment(table_ptr + 7, 12, n_tensors, pid, n_steps)  # 7 = _T_UNIT, 12 = _NCOL
    row = table_ptr + t.to(tl.int64) * 12
    g_ptr = tl.load(row + 0).to(tl.pointer_type(G_DTYPE))
    R = tl.load(row + 1)
    C = tl.load(row + 2)
    strips = tl.load(row + 5)
    rows_per_split = tl.load(row + 6)
    local = pid - tl.load(row + 7)
    s = local // strips
    col0 = (local % strips) * BLOCK_C
    row_start = s * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, R)
    split = rows_per_split < R
    dst = buf_ptr + tl.load(row + 8) + (row_start // _GROUP_ROWS) * C
    _strip(g_ptr, dst, C, tl.load(row + 3), tl.load(row + 4), col0, row_start, row_end, split, L1, BLOCK_C)


@triton.jit
def _multi_sum_partials_kernel(table_ptr, buf_ptr, n_tensors, n_steps, BLOCK_C: tl.constexpr):
    """Grid (units of pass 2,): unit = (split tensor, column block)."""
    pid = tl.program_id(0)
    t = find_segment(table_ptr + 10, 12, n_tensors, pid, n_steps)  # 10 = _T_UNIT2
    row = table_ptr + t.to(tl.int64) * 12
    local = pid - tl.load(row + 10)
    _sum_partials(buf_ptr + tl.load(row + 8), buf_ptr + tl.load(row + 9), tl.load(row + 11), tl.load(row + 2),
                  local * BLOCK_C, BLOCK_C)


def multi_column_scores(grads, importance: str = "l2") -> list[torch.Tensor]:
    """Launcher: per gradient dtype, one launch (+1 partial-sum launch when a tensor is split).

    The results are views into one flat fp32 buffer (one per call).
    """
    op = "multi_column_scores"
    V.same_length(op, grads=grads)
    dev = V.common_device(op, "grads", grads)
    l1 = V.importance(op, importance)
    for i, g in enumerate(grads):
        V.scores_input(op, f"grads[{i}]", g, importance)
    if not grads:
        return []
    Cs = [g.shape[1] for g in grads]
    out_offs = [0]
    for c in Cs:
        out_offs.append(out_offs[-1] + c)
    total_strips = sum(triton.cdiv(c, MULTI_BLOCK_C) for g, c in zip(grads, Cs, strict=True) if g.shape[0] > 0)
    plans = []  # (i, S, rows_per_split, strips, offset of its partial rows)
    part_size = 0
    for i, g in enumerate(grads):
        R, C = g.shape
        if R == 0 or C == 0:
            continue
        strips = triton.cdiv(C, MULTI_BLOCK_C)
        S, rps = _split(R, total_strips, dev)
        plans.append((i, S, rps, strips, part_size))
        if S > 1:
            part_size += triton.cdiv(R, GROUP_ROWS) * C
    buf = torch.zeros(out_offs[-1] + part_size, dtype=torch.float32, device=dev)
    for dtype in [d for d in V.FLOAT_DTYPES if any(grads[p[0]].dtype == d for p in plans)]:
        rows, unit, unit2 = [], 0, 0
        for i, S, rps, strips, part_off in plans:
            g = grads[i]
            if g.dtype != dtype:
                continue
            dst = out_offs[-1] + part_off if S > 1 else out_offs[i]
            rows.append([g.data_ptr(), g.shape[0], g.shape[1], g.stride(0), g.stride(1), strips, rps, unit, dst,
                         out_offs[i], unit2, triton.cdiv(g.shape[0], GROUP_ROWS)])
            unit += S * strips
            unit2 += triton.cdiv(g.shape[1], _SUM_BLOCK) if S > 1 else 0
        table = device_table(rows, dev)
        steps = search_steps(len(rows))
        launch(_multi_column_scores_kernel, (unit,), table, buf, len(rows), unit, steps, G_DTYPE=TL_DTYPE[dtype],
               L1=l1, BLOCK_C=MULTI_BLOCK_C, **_NO_FP_FUSION)
        if unit2:
            launch(_multi_sum_partials_kernel, (unit2,), table, buf, len(rows), steps, BLOCK_C=_SUM_BLOCK,
                   **_NO_FP_FUSION)
    return [buf[out_offs[i]:out_offs[i + 1]] for i in range(len(grads))]
