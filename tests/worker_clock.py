"""The accumulate worker's CPU time against wall time over training steps (shared by
tests/test_cuda_protocol.py on CPU and tests/test_gpu_link.py on a GPU): a worker that blocks while it waits
for the copies uses far less CPU than the wall time passing."""

from __future__ import annotations

import time
from collections.abc import Callable


def accumulate_worker_times(opt, train_step: Callable[[], None], steps: int = 20) -> tuple[float, float]:
    """(CPU seconds of the optimizer's accumulate thread, wall seconds) over ``steps`` calls of
    ``train_step`` (zero_grad, backward, step), then the link synchronised. ``opt`` has stepped once (its
    link and workers exist)."""
    worker = next(w for w in opt.link.workers if w._thread.name == "zenflow-accumulate")
    clock = time.pthread_getcpuclockid(worker._thread.ident)
    cpu0, wall0 = time.clock_gettime(clock), time.perf_counter()
    for _ in range(steps):
        train_step()
    opt.link.synchronize()
    return time.clock_gettime(clock) - cpu0, time.perf_counter() - wall0
