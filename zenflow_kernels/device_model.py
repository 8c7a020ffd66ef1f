"""The modeled device of the asynchronous CPU link (``testing.chaos``): seeded delays, copy bandwidths and a
timeline (docs/testing.md, "A GPU's timeline without a GPU").

On CPU a "device to host copy" is a memcpy, so nothing shows what a PCIe link costs. Here each copy job of
the asynchronous CPU link takes ``bytes / bandwidth`` seconds on its copy thread (it sleeps what the memcpy
did not take, without the GIL, as a copy engine runs beside the host), so a test can measure how much of a
step's transfer backward hides, and :class:`Timeline` records when each lane (the copy threads, the
accumulate and update workers, the training thread's waits, and spans the caller marks, such as backward)
was busy, for a picture of one step.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Chaos", "Timeline", "current_chaos"]


class Timeline:
    """Busy spans per lane, in ``time.perf_counter()`` seconds: ``(lane, label, start, end, nbytes)``.

    The asynchronous CPU link records its lanes: ``"d2h"`` and ``"h2d"`` (each copy job, with its bytes),
    ``"accumulate"`` and ``"update"`` (the host workers' jobs), ``"wait"`` (the training thread, or a backward
    hook, blocked on one of them: the stall). Mark your own with :meth:`span` (``"backward"``, ``"step"``).
    Appends come from several threads (a list append is atomic under the GIL)."""

    def __init__(self):
        self.spans: list[tuple[str, str, float, float, int]] = []
        self._lock = threading.Lock()

    def add(self, lane: str, label: str, start: float, end: float, nbytes: int = 0) -> None:
        with self._lock:
            self.spans.append((lane, label, start, end, nbytes))

    @contextlib.contextmanager
    def span(self, lane: str, label: str = "") -> Iterator[None]:
        """Record the block's wall time on ``lane``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, label, start, time.perf_counter())

    def between(self, start: float, end: float) -> list[tuple[str, str, float, float, int]]:
        """The spans that overlap ``[start, end)``, in start order."""
        with self._lock:
            return sorted((s for s in self.spans if s[3] > start and s[2] < end), key=lambda s: s[2])

    def busy(self, lane: str, start: float, end: float) -> float:
        """Seconds ``lane`` was busy within ``[start, end)`` (overlapping spans counted once)."""
        total, reach = 0.0, start
        for _, _, s, e, _ in (x for x in self.between(start, end) if x[0] == lane):
            s, e = max(s, reach), min(e, end)
            if e > s:
                total += e - s
                reach = e
        return total

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()


@dataclass(frozen=True)
class Chaos:
    """The asynchronous CPU link's settings (see :func:`zenflow_kernels.testing.chaos`): seeded random delays,
    modeled copy bandwidths (bytes per second, None: a plain memcpy) and an optional timeline."""

    seed: int = 0
    max_delay: float = 0.005
    d2h_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    timeline: Timeline | None = None


_CHAOS: contextvars.ContextVar[Chaos | None] = contextvars.ContextVar("zenflow_kernels_chaos", default=None)


def current_chaos() -> Chaos | None:
    """The chaos settings in force here (``testing.chaos``), or None."""
    return _CHAOS.get()


@contextlib.contextmanager
def chaos_in_force(settings: Chaos) -> Iterator[Chaos]:
    """``settings`` in force for the block (this thread's context): what ``testing.chaos`` sets."""
    token = _CHAOS.set(settings)
    try:
        yield settings
    finally:
        _CHAOS.reset(token)


class Delays:
    """Draws (before, after) sleeps for each asynchronous job, on the submitting thread, so one seed
    gives one sequence of delays whatever the threads then do."""

    def __init__(self, chaos: Chaos):
        self._rng = random.Random(chaos.seed)
        self._max = chaos.max_delay

    def draw(self) -> tuple[float, float]:
        """Seconds to sleep before a job's work and after it, together at most ``max_delay``. Half the
        jobs run at once: a reader that lags while its writer races ahead is what uncovers a missing
        wait, and uniform delays on every thread would mostly cancel out."""
        if self._rng.random() < 0.5:
            return 0.0, 0.0
        total = self._rng.uniform(0.0, self._max)
        before = total * self._rng.random()
        return before, total - before

    def wrap(self, fn: Callable) -> Callable:
        before, after = self.draw()

        def delayed(*args):
            time.sleep(before)  # the work starts late: a writer that did not wait for its reader loses
            result = fn(*args)
            time.sleep(after)  # and completes late: a reader that did not wait reads stale data
            return result

        return delayed


def modeled_copy(copy: Callable[[], None], nbytes: int, bytes_per_s: float | None, timeline: Timeline | None,
                 lane: str) -> Callable[[], None]:
    """``copy`` as a copy engine at ``bytes_per_s`` would run it: it takes at least ``nbytes / bytes_per_s``
    seconds (the memcpy, then a sleep for the rest: the GIL is free meanwhile), recorded on ``lane``."""
    if bytes_per_s is None and timeline is None:
        return copy

    def run():
        start = time.perf_counter()
        copy()
        if bytes_per_s is not None:
            rest = start + nbytes / bytes_per_s - time.perf_counter()
            if rest > 0:
                time.sleep(rest)
        if timeline is not None:
            timeline.add(lane, "copy", start, time.perf_counter(), nbytes)

    return run


def recorded(fn: Callable, timeline: Timeline | None, lane: str, label: str = "") -> Callable:
    """``fn`` with its run recorded on ``lane`` (as is when there is no timeline)."""
    if timeline is None:
        return fn

    def run(*args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            timeline.add(lane, label, start, time.perf_counter())

    return run
