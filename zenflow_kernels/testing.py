"""Test helpers for code built on zenflow_kernels.

:func:`chaos` runs the GPU's asynchronous protocol on CPU with seeded random delays, so ordering bugs
(a read before a copy finished, a count taken before a worker ran, a buffer reused too early) show up
as wrong numbers in a CPU test instead of only on a GPU. With copy bandwidths it is also a modeled
device: copies take the time a PCIe link would, and a :class:`Timeline` shows when each lane was busy.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Iterator

from .device_model import Chaos, Timeline, chaos_in_force

__all__ = ["Timeline", "chaos", "free_port"]


@contextlib.contextmanager
def chaos(seed: int = 0, max_delay: float = 0.005, *, d2h_bytes_per_s: float | None = None,
          h2d_bytes_per_s: float | None = None, timeline: Timeline | None = None) -> Iterator[Chaos]:
    """Every ``ZenFlowAdamW`` created inside this block whose parameters are on CPU uses the asynchronous
    CPU link instead of the synchronous one: the protocol of the CUDA link (a landing area, a D2H and an
    H2D copy thread standing in for the streams, an accumulation worker, completions as futures, and
    the same waits), with a random delay of up to ``max_delay`` seconds, drawn from ``seed``, split
    before and after every asynchronous job: gradient copies, folds, host update, write-back.
    Under ZeRO (several ranks) each rank also sleeps before every collective, with a sequence of its
    own, so the ranks arrive out of step and asynchronous reductions complete late.

    The modeled device (docs/testing.md): with ``d2h_bytes_per_s`` / ``h2d_bytes_per_s`` (bytes per second,
    e.g. ``25e9`` for PCIe 4 x16) each gradient copy job / write-back job takes at least ``bytes /
    bandwidth`` seconds on its copy thread, sleeping without the GIL as a copy engine runs beside the host,
    so a CPU run shows how much of a step's transfer backward hides. ``timeline``: a :class:`Timeline`
    the link records its lanes into (copies, accumulation, host updates, waits).

    Results stay bit-identical to the synchronous CPU link for the same inputs; a difference is an
    ordering bug. ``max_delay=0`` keeps the threads and drops the sleeps. Optimizers on CUDA are not
    affected (they use the CUDA link). The setting is read when an optimizer is created and is per
    thread (a ``contextvars.ContextVar``), like ``ops.use_backend``::

        with chaos(seed=3):
            opt = ZenFlowAdamW(model.parameters(), zenflow=dict(overlap_step=True, ...))
        train(model, opt)   # the optimizer keeps the asynchronous link after the block
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"chaos: seed={seed!r} is invalid: allowed an integer")
    if isinstance(max_delay, bool) or not isinstance(max_delay, (int, float)) or not (
        math.isfinite(max_delay) and max_delay >= 0
    ):
        raise ValueError(f"chaos: max_delay={max_delay!r} is invalid: allowed a finite number of seconds >= 0")
    for name, rate in (("d2h_bytes_per_s", d2h_bytes_per_s), ("h2d_bytes_per_s", h2d_bytes_per_s)):
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
                math.isfinite(rate) and rate > 0)):
            raise ValueError(f"chaos: {name}={rate!r} is invalid: allowed None or a finite number of bytes per "
                             "second > 0")
    if timeline is not None and not isinstance(timeline, Timeline):
        raise TypeError(f"chaos: timeline={timeline!r} is invalid: allowed None or a zenflow_kernels.testing.Timeline")
    settings = Chaos(seed=seed, max_delay=float(max_delay),
                     d2h_bytes_per_s=None if d2h_bytes_per_s is None else float(d2h_bytes_per_s),
                     h2d_bytes_per_s=None if h2d_bytes_per_s is None else float(h2d_bytes_per_s), timeline=timeline)
    with chaos_in_force(settings):
        yield settings


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now: ``MASTER_PORT`` for rank processes a test starts (torchrun's
    ``--master_port=0`` does not pick a free port for the workers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
