"""Who holds the flushed weights (docs/design.md section 5.2): the ``flushed()`` contexts open and an
integration's ``hold_flushed``. The weights themselves, and what is kept to restore, are the interval's
(:meth:`HostInterval.enter_flushed` and :meth:`HostInterval.restore`); this part decides when to enter and when the
last holder has left."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from ..config import ZenFlowWarning
from .interval import HostInterval

__all__ = ["FlushedWeights"]


class FlushedWeights:
    """``depth``: ``flushed()`` contexts open (nested: the outermost restores); ``held``: an integration holds the
    flushed weights between two callbacks. Each call is given the optimizer's interval (None before the first step:
    nothing to flush)."""

    def __init__(self, name: str = "ZenFlow"):
        self.name = name  # what the messages call the optimizer (build.display_name)
        self.depth = 0
        self.held = False
        self._warned = False

    @contextlib.contextmanager
    def context(self, interval: HostInterval | None, *, closed: bool) -> Iterator[None]:
        self._enter(interval, closed)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self._leave(interval)

    def hold(self, held: bool, interval: HostInterval | None, *, closed: bool) -> None:
        if held:
            self._enter(interval, closed)
            self.held = interval is not None and interval.unflushed is not None  # (not built, or closed)
        else:
            self.held = False
            self._leave(interval)

    def before_step(self, interval: HostInterval | None) -> None:
        """``step()`` inside a context is an error; weights still held (an integration missed the callback that
        restores them before the next forward) are restored, with a warning the first time."""
        if self.depth:
            raise RuntimeError(
                f"{self.name}.step() inside opt.flushed(): the parameters hold the flushed weights, which training "
                "does not continue from; step after the with-block")
        if self.held:
            if not self._warned:
                self._warned = True
                warnings.warn(f"{self.name}.step(): the weights flushed for a save or an evaluation were still in "
                              "place when this step's forward ran (no callback restored them); restored now. The run "
                              "differs from one without the save/evaluation from here on", ZenFlowWarning,
                              stacklevel=4)
            self.hold(False, interval, closed=False)

    @staticmethod
    def _enter(interval: HostInterval | None, closed: bool) -> None:
        if interval is not None and not closed:
            interval.enter_flushed()

    def _leave(self, interval: HostInterval | None) -> None:
        if not self.depth and not self.held and interval is not None:
            interval.restore()
