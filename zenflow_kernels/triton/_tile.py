"""The column walk every selective update kernel shares (AdamW, Lion, SGD on param[:, indices], compact state):
a program's [BLOCK_R, BLOCK_K] tile of one tensor's compact [R, k] space, its offsets, the gather of the gradient
and the weights (the fp32 master, or the parameter), and the scatter of the stepped weights back. Each kernel's
own arithmetic stays in its module."""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import find_segment


@triton.jit
def round_to(w, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even. bf16 goes through integer ops (the torch/c10 sequence),
    bit-identical to the GPU's cvt.rn.bf16.f32 and also correct under TRITON_INTERPRET, whose own
    fp32 -> bf16 cast truncates."""
    if DTYPE == tl.bfloat16:  # noqa: SIM300 - a constexpr dtype, compared at compile time
        bits = w.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        r = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        nan = tl.full(w.shape, 0x7FC0, tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(w != w, nan, r)
    else:
        return w.to(DTYPE)


@triton.jit
def tile_offsets(idx_ptr, R, K, stride_pr, stride_pc, stride_gr, stride_gc, r0, j0,
                 HAS_IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_R, BLOCK_K] tile at (r0, j0) of the compact [R, K] space: its compact column numbers
    ``js`` and their mask, the tile's mask, and the int64 offsets into param, grad and the compact state."""
    rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    js = j0 + tl.arange(0, BLOCK_K).to(tl.int64)
    kmask = js < K
    mask = (rows < R)[:, None] & kmask[None, :]
    if HAS_IDX:  # noqa: SIM108 - constexpr branch: the dense kernel has no index load
        cols = tl.load(idx_ptr + js, mask=kmask, other=0)
    else:
        cols = js
    p_off = rows[:, None] * stride_pr + cols[None, :] * stride_pc
    g_off = rows[:, None] * stride_gr + cols[None, :] * stride_gc
    s_off = rows[:, None] * K + js[None, :]
    return js, kmask, mask, p_off, g_off, s_off


@triton.jit
def table_tile(itab, WIDTH: tl.constexpr, n_tensors, pid, n_steps, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tensor and tile in a multi-tensor launch whose int table rows (WIDTH columns) end with
    (R, K, stride_pr, stride_pc, stride_gr, stride_gc, first unit): (table row index, row pointer, R, K, the
    four strides, first row, first column)."""
    t = find_segment(itab + WIDTH - 1, WIDTH, n_tensors, pid, n_steps)
    row = itab + t.to(tl.int64) * WIDTH
    R = tl.load(row + WIDTH - 7)
    K = tl.load(row + WIDTH - 6)
    local = pid - tl.load(row + WIDTH - 1)
    n_k = tl.cdiv(K, BLOCK_K)
    r0 = (local // n_k) * BLOCK_R
    j0 = (local % n_k) * BLOCK_K
    return (t, row, R, K, tl.load(row + WIDTH - 5), tl.load(row + WIDTH - 4), tl.load(row + WIDTH - 3),
            tl.load(row + WIDTH - 2), r0, j0)


@triton.jit
def program_tile(itab, WIDTH: tl.constexpr, ftab, F_WIDTH: tl.constexpr, n_tensors, n_steps, P_DTYPE: tl.constexpr,
                 G_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tile of a multi-tensor launch (``table_tile``; int rows of WIDTH, float rows of F_WIDTH
    columns): (int row, float row, the param, grad and indices pointers of columns 0 to 2, R, K, the four
    strides, first row, first column)."""
    t, row, R, K, spr, spc, sgr, sgc, r0, j0 = table_tile(itab, WIDTH, n_tensors, tl.program_id(0), n_steps,
                                                          BLOCK_R, BLOCK_K)
    return (row, ftab + t.to(tl.int64) * F_WIDTH, tl.load(row + 0).to(tl.pointer_type(P_DTYPE)),
            tl.load(row + 1).to(tl.pointer_type(G_DTYPE)), tl.load(row + 2).to(tl.pointer_type(tl.int64)),
            R, K, spr, spc, sgr, sgc, r0, j0)


@triton.jit
def pointer_at(row, column: tl.constexpr, DTYPE: tl.constexpr):
    """Column ``column`` of a table row as a pointer to DTYPE (a state, master or step tensor)."""
    return tl.load(row + column).to(tl.pointer_type(DTYPE))


@triton.jit
def gather_tile(p_ptr, g_ptr, idx_ptr, w_ptr, R, K, stride_pr, stride_pc, stride_gr, stride_gc, r0, j0,
                HAS_IDX: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``tile_offsets`` of the tile at (r0, j0) but grad's (js, kmask, mask, p_off, s_off), then its gradient and
    its weights as fp32 (``w_ptr``'s master with HAS_MASTER, else the parameter's values)."""
    js, kmask, mask, p_off, g_off, s_off = tile_offsets(idx_ptr, R, K, stride_pr, stride_pc, stride_gr, stride_gc,
                                                        r0, j0, HAS_IDX, BLOCK_R, BLOCK_K)
    g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_MASTER:
        w = tl.load(w_ptr + s_off, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + p_off, mask=mask, other=0.0).to(tl.float32)
    return js, kmask, mask, p_off, s_off, g, w


@triton.jit
def scatter_tile(p_ptr, w_ptr, p_off, s_off, w, mask, HAS_MASTER: tl.constexpr):
    """The stepped weights ``w`` into the master (HAS_MASTER) and the parameter, rounded to its dtype."""
    if HAS_MASTER:
        tl.store(w_ptr + s_off, w, mask=mask)
    tl.store(p_ptr + p_off, round_to(w, p_ptr.dtype.element_ty), mask=mask)
