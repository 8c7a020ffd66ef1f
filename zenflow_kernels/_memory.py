"""Model-sized temporaries that the process gives back (docs/design.md section 9: RSS agrees with ``host_bytes``).

glibc's malloc serves a request below its mmap threshold from its heap and keeps what is freed there (up to
twice the threshold at the heap's top, and anything below a live block, until ``malloc_trim``). The threshold
starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB: after one such temporary
(the optimizer's or the training loop's), every temporary of a few MB is heap memory and the process's RSS
keeps the most it ever held at once. A request of at least ``TRANSIENT_BYTES`` never grows the heap: glibc
maps it (unmapped at free) or carves it from free heap memory the process already holds; only the pages
written become resident.
"""

from __future__ import annotations

import torch

__all__ = ["TRANSIENT_BYTES", "gather_columns", "host_copy", "transient_empty"]

TRANSIENT_BYTES = 32 << 20
"""The ceiling of glibc's dynamic mmap threshold on 64-bit Linux (``DEFAULT_MMAP_THRESHOLD_MAX``)."""
SMALL_BYTES = 128 << 10
"""glibc's initial mmap threshold: smaller temporaries are heap memory anyway, reused, and a mapping
would cost more than they do."""


def transient_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat uninitialised CPU tensor of ``numel`` elements for a temporary, in an allocation of at least
    ``TRANSIENT_BYTES`` (virtual: only what is written becomes resident); a plain one below ``SMALL_BYTES``."""
    if numel * dtype.itemsize < SMALL_BYTES:
        return torch.empty(numel, dtype=dtype)
    capacity = max(numel, -(-TRANSIENT_BYTES // dtype.itemsize))
    return torch.empty(capacity, dtype=dtype)[:numel]


def gather_columns(src: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``src[:, cols]`` (``cols``: int64 indices) as a new tensor, in transient memory on CPU."""
    numel = src.shape[0] * cols.numel()
    if src.device.type != "cpu" or numel * src.element_size() < SMALL_BYTES:
        return src[:, cols]
    out = transient_empty(numel, src.dtype).view(src.shape[0], cols.numel())
    return torch.index_select(src, 1, cols, out=out)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (any device; a DTensor's caller passes its local tensor) in transient memory."""
    out = transient_empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t.detach())
    return out
