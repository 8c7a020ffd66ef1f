"""Host gradient accumulation and sum of squares: one multithreaded numba pass each (GIL released).

``accumulate_`` is the per-step half of docs/design.md section 2 item 5 (each step's gradient is added
into the host accumulation buffer); ``sum_squares`` gives the squared norm for clipping (item 6) and,
because its result is non-finite exactly when the input holds inf/NaN, the skip decision too, in
the same single read of the data.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _common as C
from .kernels.accumulate import accumulate_kernel, multi_accumulate_kernel, multi_sum_squares_kernel, sum_squares_kernel


def accumulate_(acc: torch.Tensor, grad: torch.Tensor, *, num_threads: int | None = None) -> None:
    """``acc += grad`` in one pass, in place.

    Args:
        acc: fp32, contiguous, n elements; updated in place (fp32 addition, like ``acc.add_(grad.float())``).
        grad: fp32, bf16 or fp16, contiguous, n elements (any shape); read only, must not overlap acc.
        num_threads: as ``cpu_adam_``.

    Everything is checked before anything is written. n = 0 is a no-op.
    """
    C.check_tensor("acc", acc, C.STATE_DTYPES)
    C.check_tensor("grad", grad, C.GRAD_DTYPES, acc.numel())
    C.check_disjoint({"acc": acc, "grad": grad})
    nthreads = C.check_num_threads(num_threads)
    n = acc.numel()
    if n == 0:
        return
    C.launch(accumulate_kernel, n, nthreads, C.as_numpy(acc), C.as_numpy(grad))
    C.bump_versions(acc)


def multi_accumulate_(accs, grads, *, scale: float = 1.0, num_threads: int | None = None) -> None:
    """``acc += grad * scale`` for every pair, in place: one launch per gradient dtype present (usually one)
    instead of a call per tensor. Each element is ``float32(grad) * float32(scale)`` rounded, then one fp32
    addition: with ``scale=1`` the bits of ``accumulate_`` and of ``acc.add_(grad.float())``; with a power of two
    (a loss scaler's ``1 / scale``) the bits of adding the gradient unscaled in place.

    Args:
        accs: a list of fp32 contiguous CPU tensors; updated in place.
        grads: a list as long, of fp32, bf16 or fp16 contiguous CPU tensors, each with its acc's number of
            elements (any shapes); read only. No two tensors of either list may share memory.
        scale: a finite float, rounded to float32 (default 1).
        num_threads: as ``cpu_adam_``.

    Everything is checked before anything is written.
    """
    for name, value in (("accs", accs), ("grads", grads)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(value).__name__}")
    if len(accs) != len(grads):
        raise ValueError(f"accs and grads must have the same length, got {len(accs)} and {len(grads)}")
    for i, (acc, grad) in enumerate(zip(accs, grads, strict=True)):
        C.check_tensor(f"accs[{i}]", acc, C.STATE_DTYPES)
        C.check_tensor(f"grads[{i}]", grad, C.GRAD_DTYPES, acc.numel())
    C.check_disjoint({f"{name}[{i}]": t for name, ts in (("accs", accs), ("grads", grads)) for i, t in enumerate(ts)})
    scale = C.check_real("scale", scale)
    accumulate_unchecked(accs, grads, C.check_num_threads(num_threads), scale)
    C.bump_versions(*accs)


def accumulate_unchecked(accs, grads, nthreads: int = 0, scale: float = 1.0) -> None:
    """``multi_accumulate_`` for a caller that made the tensors itself (the host shard's accumulation
    buffers and staged or checked gradients): contiguous, disjoint, fp32 accs and fp32/bf16/fp16 grads of
    the same sizes; anything else is undefined behaviour. Versions are not bumped (the buffers are the
    optimizer's own, never in an autograd graph)."""
    for dtype, chosen, numels, chunk_starts in _work_items(grads):
        if chunk_starts[-1]:
            C.launch(multi_accumulate_kernel, int(numels.sum()), nthreads,
                     np.array([accs[t].data_ptr() for t in chosen], dtype=np.int64),
                     np.array([grads[t].data_ptr() for t in chosen], dtype=np.int64), numels, chunk_starts,
                     SUM_CHUNK, _BITS[dtype], np.float32(scale))


def sum_squares(x: torch.Tensor, *, num_threads: int | None = None) -> float:
    """``sum(x**2)`` over all elements, accumulated in float64, in one pass; returns a Python float.

    Args:
        x: fp32, bf16 or fp16, contiguous CPU tensor, any shape; read only.
        num_threads: as ``cpu_adam_``.

    The result is non-finite (inf or NaN) if and only if ``x`` holds an inf or NaN: a finite float32
    squared is at most ~1.2e77, so no float64 sum of them overflows. It therefore doubles as the
    finiteness check for gradient clipping and skipped steps. The summation order depends on the
    thread count (deterministic for a fixed count). n = 0 gives 0.0.
    """
    C.check_tensor("x", x, C.GRAD_DTYPES)
    nthreads = C.check_num_threads(num_threads)
    n = x.numel()
    if n == 0:
        return 0.0
    return float(C.launch(sum_squares_kernel, n, nthreads, C.as_numpy(x)))


SUM_CHUNK = 1 << 14
"""Elements per work item of ``multi_sum_squares`` and ``multi_accumulate_``: a fixed split, so the sum's
order (and its bits) does not depend on the thread count."""

_BITS = {torch.float32: np.empty(0, np.float32), torch.bfloat16: np.empty(0, np.int16),
         torch.float16: np.empty(0, np.uint16)}  # element types of the bit views (see _common.as_numpy)


def multi_sum_squares(tensors, *, num_threads: int | None = None) -> float:
    """``sum(x**2)`` over every element of every tensor, accumulated in float64: one launch per dtype
    present (usually one) instead of a norm per tensor; returns a Python float.

    Args:
        tensors: a list of fp32, bf16 or fp16 contiguous CPU tensors (any shapes, dtypes may differ); read
            only.
        num_threads: as ``cpu_adam_``.

    Non-finite exactly when some tensor holds an inf or NaN (see ``sum_squares``). Unlike ``sum_squares``,
    the summation order does not depend on the thread count (chunks of ``SUM_CHUNK`` elements, each summed
    by the compiled loop, then added in order). An empty list gives 0.0.
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        C.check_tensor(f"tensors[{i}]", t, C.GRAD_DTYPES)
    return sum_squares_unchecked(tensors, C.check_num_threads(num_threads))


def sum_squares_unchecked(tensors, nthreads: int = 0) -> float:
    """``multi_sum_squares`` for a caller that checked the tensors itself (the optimizer checks every
    gradient once per step): contiguous fp32/bf16/fp16 CPU tensors; anything else is undefined behaviour."""
    total = 0.0
    for dtype, chosen, numels, chunk_starts in _work_items(tensors):
        out = np.empty(int(chunk_starts[-1]), dtype=np.float64)
        if out.size:
            C.launch(multi_sum_squares_kernel, int(numels.sum()), nthreads,
                     np.array([tensors[t].data_ptr() for t in chosen], dtype=np.int64), numels, chunk_starts,
                     SUM_CHUNK, _BITS[dtype], out)
        total += float(out.sum())
    return total


def sum_squares_chunks_unchecked(x: torch.Tensor, out: np.ndarray, nthreads: int = 0) -> None:
    """``out[k]`` = the float64 sum of squares of elements ``k * SUM_CHUNK`` to ``(k + 1) * SUM_CHUNK - 1`` of ``x``
    (contiguous fp32/bf16/fp16 CPU tensor; ``out`` float64, ``ceil(x.numel() / SUM_CHUNK)`` long): the work
    items of ``sum_squares_unchecked([x])``, which returns ``float(out.sum())``. A tensor fetched and summed in
    pieces that start at multiples of ``SUM_CHUNK`` fills the same array, so ``float(out.sum())`` has the same
    bits as the whole tensor's (the host update's clipping norm over sums it reads in blocks)."""
    n = x.numel()
    if n:
        C.launch(multi_sum_squares_kernel, n, nthreads, np.array([x.data_ptr()], dtype=np.int64),
                 np.array([n], dtype=np.int64), np.array([0, len(out)], dtype=np.int64), SUM_CHUNK, _BITS[x.dtype],
                 out)


def _work_items(tensors):
    """The work items of the multi-tensor kernels here, one launch per dtype present: ``(dtype, positions
    of its tensors, their numels, chunk_starts)`` with tensor t owning items ``chunk_starts[t]`` to
    ``chunk_starts[t + 1] - 1`` (``SUM_CHUNK`` elements each). Dtypes come in order of first appearance, so
    a mixed list's per-dtype sums are added in one order on every run and rank."""
    dtypes = [t.dtype for t in tensors]
    kinds = dict.fromkeys(dtypes)
    for dtype in kinds:
        chosen = range(len(tensors)) if len(kinds) == 1 else [t for t, d in enumerate(dtypes) if d is dtype]
        numels = np.array([tensors[t].numel() for t in chosen], dtype=np.int64)
        chunk_starts = np.zeros(len(numels) + 1, dtype=np.int64)
        np.cumsum((numels + SUM_CHUNK - 1) // SUM_CHUNK, out=chunk_starts[1:])
        yield dtype, chosen, numels, chunk_starts
