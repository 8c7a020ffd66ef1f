"""Choosing the engine and the link for a device: :func:`make_engine`, :func:`host_alloc`, :func:`make_link`.

The optimizer builds the host shard between the two calls, the engine's allocator for its buffers::

    engine = make_engine(device, chaos=chaos, timeout=timeout)
    host = HostShard(params, groups, num_acc=num_acc, rule=rule, **host_alloc(engine), indices=indices, disk=disk,
                     landing=landing and engine is not None)
    link = make_link(host, engine, overlap=overlap, host_threads=host_threads, cores=cores, timeout=timeout)

(``zenflow_kernels.optim.build.make_host_and_link`` does exactly that.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..device_model import Chaos, Delays
from ..host import HostShard
from .asynchronous import AsyncLink
from .cpu import CpuLink
from .cuda_engine import CudaEngine
from .thread_engine import ThreadEngine


def make_engine(device: torch.device, *, chaos: Chaos | None,
                timeout: float | None) -> CudaEngine | ThreadEngine | None:
    """Where the copies of parameters on ``device`` run: CUDA -> a :class:`CudaEngine` on it; CPU with ``chaos``
    (``zenflow_kernels.testing.chaos``) -> a :class:`ThreadEngine` with its delays (none where ``chaos.max_delay``
    is 0), modeled bandwidths and timeline, its threads bounded by ``timeout``; CPU without -> None (the
    synchronous :class:`CpuLink`: no engine)."""
    if device.type == "cuda":
        return CudaEngine(device)
    if chaos is None:
        return None
    delays = Delays(chaos) if chaos.max_delay > 0 else None
    return ThreadEngine(timeout=timeout, delays=delays, d2h_bytes_per_s=chaos.d2h_bytes_per_s,
                        h2d_bytes_per_s=chaos.h2d_bytes_per_s, timeline=chaos.timeline)


def host_alloc(engine: CudaEngine | ThreadEngine | None) -> dict[str, Callable[[int, torch.dtype], torch.Tensor]]:
    """The allocator keyword of ``HostShard(...)`` for a link over ``engine``: ``{"alloc": engine.alloc}`` (page-locked
    buffers on a GPU), or ``{}`` without an engine (HostShard's default, plain zeroed tensors)."""
    return {"alloc": engine.alloc} if engine is not None else {}


def make_link(host: HostShard, engine, *, overlap: bool, host_threads: int, cores, timeout: float | None):
    """The link over ``host`` (a :class:`~zenflow_kernels.host.HostShard`) and ``engine`` (:func:`make_engine`'s):
    None -> :class:`CpuLink`; a :class:`CudaEngine` -> ``AsyncLink(kind="cuda")``; a :class:`ThreadEngine` ->
    ``AsyncLink(kind="cpu-async")`` with the engine's delays on its workers too. ``overlap``: a host update runs on
    a worker of ``host_threads`` numba threads pinned to ``cores`` (the accumulate worker too); ``timeout``: the
    longest wait for one job."""
    common = dict(overlap=overlap, host_threads=host_threads, cores=cores, timeout=timeout)
    if engine is None:
        return CpuLink(host, **common)
    if isinstance(engine, CudaEngine):
        return AsyncLink(host, engine, kind="cuda", **common)
    if isinstance(engine, ThreadEngine):
        return AsyncLink(host, engine, kind="cpu-async", delays=engine.delays, **common)
    raise TypeError(f"make_link: engine={engine!r} is invalid: allowed None, a CudaEngine or a ThreadEngine")
