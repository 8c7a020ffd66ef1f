"""numba kernels for the host (CPU) side, one op a module: Adam, Lion, SGD (each with its fast path on selected
columns), gradient accumulation and sums of squares, fingerprints, column packing; the shared helpers in the
``_``-modules (``_ir``: LLVM IR intrinsics, ``_dtype``: dtype dispatch, ``_columns``: the column walk, ``_jit``: how
kernels compile and cache). This package imports numba, numpy and llvmlite only; the launchers are cpu_ops' modules.

Design. Every kernel is one ``prange`` pass over flat, contiguous 1-D numpy views of torch CPU
tensors (no copies). Parameters are fp32, optimizer state fp32 or bf16; gradients may be fp32, bf16 or fp16
and the optional copy-out may be fp32, bf16 or fp16. numba has no 16-bit float type, so 16-bit
tensors arrive as their bit patterns: **bf16 as ``int16``, fp16 as ``uint16``** (the launchers make
those views), and the conversions (``_ir``) work on bits. The element type picks the conversion at
compile time (``@overload`` on the array's dtype), ``None`` arguments compile the feature out, so
one Python kernel covers every dtype combination without a runtime branch in the loop.

All hyper-parameters arrive as precomputed ``float32`` scalars (never Python floats: a float64
anywhere in the loop halves the vector width). The loops vectorise to 8-wide AVX2 on x86 (checked
with ``inspect_asm``: ``vsqrtps``/``vdivps`` on ``ymm`` registers, see tests/test_cpu_ops_convert.py).

fastmath. The element-wise kernels need none to vectorise and use none: strict IEEE arithmetic, with
explicit ``fma`` where ATen's vectorised Adam uses one, so results follow torch's rounding step by
step (the moments come out bit-identical to ``torch.optim.AdamW(foreach=False)``; the parameter
differs by at most an ulp or so, because ATen's CPU ``sqrt`` is not correctly rounded and ours is).
Only the reduction in ``sum_squares`` uses ``REDUCE_FASTMATH`` = {'reassoc', 'contract', 'nsz'}:
reassociation lets the float64 sum vectorise, a change of summation order, i.e. rounding only.
'nnan'/'ninf' are never used: with them LLVM may assume no inf/NaN exists and fold the
finiteness signal of ``sum_squares`` (and the inf/NaN propagation of Adam) away; 'afn'/'arcp'
(approximate or reciprocal division and sqrt) are not used either.

Caching. ``cache=True`` writes compiled code to ``__pycache__`` beside these files (or numba's user cache directory
when that is not writable). numba invalidates a cached kernel only when *the file that defines it* changes, not
when a helper it calls changes in another file; ``_jit.host_kernel`` therefore stamps every kernel's cache with
all of this package's files: keep numba code, and only numba code, in this package.

Threads. The kernels run on numba's threading layer with the calling thread's thread count; the
launchers (``_common.launch``) set it per call. (Calling ``numba.set_num_threads`` inside a kernel
would be cheaper still, but makes it uncacheable: numba embeds a ctypes pointer for it.)
``nogil=True``: the GIL is released for the whole kernel, so a background thread running one
overlaps with Python and torch work in the main thread.
"""

from __future__ import annotations

import importlib
import pkgutil


def all_kernels() -> dict:
    """Every host kernel (a numba dispatcher) by name, its module imported."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    from ._jit import KERNELS

    return dict(KERNELS)
