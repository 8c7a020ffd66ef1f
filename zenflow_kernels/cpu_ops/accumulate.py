"""Host gradient accumulation and sum of squares: one multithreaded numba pass each (GIL released).

``accumulate_`` is the per-step half of docs/design.md section 2 item 5 (each step's gradient is added
into the host accumulation buffer); ``sum_squares`` gives the squared norm for clipping (item 6) and,
because its result is non-finite exactly when the input holds inf/NaN, the skip decision too, in
the same single read of the data.
"""

from __future__ import annotations

import torch

from . import _common as C
from ._kernels import accumulate_kernel, sum_squares_kernel


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
