"""Gradient fingerprints on the host: one multithreaded numba pass (GIL released) over any number of tensors.

A fingerprint tells, cheaply and soundly up to a stated bound, whether a tensor's bits changed: the
asynchronous link takes one of each gradient as a backward hook copies it to the host and compares it with
the gradient ``step()`` sees (docs/design.md section 5.1). The value is a linear hash over the integers
modulo 2**64 (``kernels.fingerprint.multi_fingerprint_kernel``; the same on every backend: ``ops.multi_fingerprint``).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _common as C
from .kernels.fingerprint import multi_fingerprint_kernel

FINGERPRINT_CHUNK = 1 << 14
"""Words per work item (a fixed split: the per-item partial sums are added modulo 2**64, in any order)."""

_WORDS = {4: np.empty(0, np.uint32), 2: np.empty(0, np.uint16)}  # element bits by width


def multi_fingerprint(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.multi_fingerprint`` on CPU tensors (the contract and checks of every backend: ``_validate``); a
    strided tensor is read through a contiguous copy."""
    from .. import _validate as V

    tensors, key, out = V.fingerprint_args("multi_fingerprint", tensors, key, out)
    if tensors and out.device.type != "cpu":
        raise ValueError(f"multi_fingerprint: the numba backend runs on CPU tensors, got {out.device}")
    return multi_fingerprint_unchecked(tensors, key, out=out)


def multi_fingerprint_unchecked(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`multi_fingerprint` for a caller that checked its arguments (CPU tensors of the allowed dtypes)."""
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    got = fingerprint_unchecked(flat, key)
    if out is None:
        return got
    out.copy_(got)
    return out


def fingerprint_unchecked(tensors, key: int, nthreads: int = 0) -> torch.Tensor:
    """:func:`multi_fingerprint` for a caller that checked the tensors (contiguous fp32/bf16/fp16 CPU tensors)."""
    out = np.zeros(len(tensors), dtype=np.uint64)
    widths = [t.element_size() for t in tensors]
    for width in dict.fromkeys(widths):
        chosen = [n for n, w in enumerate(widths) if w == width]
        numels = np.array([tensors[n].numel() for n in chosen], dtype=np.int64)
        words = (numels + (4 // width - 1)) // (4 // width)
        chunk_starts = np.zeros(len(chosen) + 1, dtype=np.int64)
        np.cumsum((words + FINGERPRINT_CHUNK - 1) // FINGERPRINT_CHUNK, out=chunk_starts[1:])
        if not chunk_starts[-1]:
            continue
        partials = np.empty(int(chunk_starts[-1]), dtype=np.uint64)
        C.launch(multi_fingerprint_kernel, int(numels.sum()), nthreads,
                 np.array([tensors[n].data_ptr() for n in chosen], dtype=np.int64), numels, chunk_starts,
                 FINGERPRINT_CHUNK, _WORDS[width], np.uint64(key), partials)
        # each tensor's items summed in one pass, modulo 2**64 (the order does not matter); a tensor without items
        # (empty) is 0, which reduceat (that would take the next item) does not give
        sums = np.add.reduceat(partials, np.minimum(chunk_starts[:-1], partials.size - 1), dtype=np.uint64)
        sums[chunk_starts[1:] == chunk_starts[:-1]] = 0
        out[np.array(chosen)] = sums
    return torch.from_numpy(out.view(np.int64))
