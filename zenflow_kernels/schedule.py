"""When ZenFlow selects columns and when the host updates: docs/design.md section 3, as pure functions of t.

``t`` counts optimizer steps from 0 (skipped non-finite steps do not count). ``Wu`` is
``full_warm_up_rounds`` and ``I`` the resolved select interval in steps (0 = never re-selected).

* Warm-up: ``t < Wu``; every step is a synchronous host update (the rule's) on everything.
* Select boundary: ``t >= Wu and (t == Wu or (I != 0 and (t - Wu) % I == 0))``; with
  ``select_anchor="absolute"`` (DeepSpeed's) ``t % I == 0`` in place of ``(t - Wu) % I == 0``.
* Update boundary (integer ``update_interval = U``): ``t >= Wu`` and either ``(t - Wu + 1) % U == 0``
  (every U steps after warm-up) or ``t + 1`` is a select boundary (so no accumulation interval
  straddles a change of ownership).
* Update boundary (``"auto"``): the caller's Zen-auto vote, or the interval reached its bound
  ``min(I, max_update_interval)``, or ``t + 1`` is a select boundary.

The epoch strategy needs an epoch length. It comes from ``steps_per_epoch`` in the config, the
``steps_per_epoch`` argument, or ``len(dataloader)`` when that is > 0 (in this order of preference;
pass ``steps_per_epoch`` yourself when you accumulate gradients over several batches per step). When
none is known the interval resolves to 0: the columns are chosen once and never re-selected, and a
:class:`ZenFlowWarning` says so, naming the three ways out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from .config import ZenFlowConfig, ZenFlowConfigError, ZenFlowWarning, interval_order_error, is_int

__all__ = ["Schedule", "make_schedule", "resolve_schedule"]

NEVER_RESELECTED = (
    "zenflow: select_strategy={strategy!r} measures select_interval in epochs, but the epoch length is "
    "unknown{why}, so select_interval resolves to 0: the important columns are chosen once, at step {wu}, "
    "and never re-selected. To re-select, set zenflow.steps_per_epoch, hand over the dataloader or its "
    "length (steps_per_epoch=len(loader)), or use select_strategy='step' with an integer select_interval."
)
AUTO_IGNORES_INTERVAL = (
    "zenflow: select_strategy='auto' means one epoch, so select_interval={interval!r} is ignored; "
    "use select_strategy='step' or 'epoch' to set the interval yourself."
)


@dataclass(frozen=True)
class Schedule:
    """A resolved ZenFlow schedule. Build it with :func:`resolve_schedule`.

    Attributes:
        warmup: ``full_warm_up_rounds``.
        select_strategy: ``"step"`` or ``"epoch"`` (``"auto"`` resolved).
        select_interval: steps between selections; 0 means chosen once and never re-selected.
        update_interval: an integer >= 1 or ``"auto"``.
        auto_bound: the longest a Zen-auto interval may run (steps); ``None`` for integer intervals.
        steps_per_epoch: the epoch length used, or ``None`` if unknown or unused.
        steps_per_epoch_source: where that length came from (``"config"``, ``"argument"``,
            ``"dataloader"``) or ``None``.
        warnings: the warnings emitted while resolving, as text.
        anchor: ``select_anchor``: re-selections counted from the warm-up's end (``"warm_up"``) or from step 0
            (``"absolute"``).
    """

    warmup: int
    select_strategy: str
    select_interval: int
    update_interval: int | str
    auto_bound: int | None
    steps_per_epoch: int | None
    steps_per_epoch_source: str | None
    warnings: tuple[str, ...] = field(default=())
    anchor: str = "warm_up"

    @property
    def is_auto(self) -> bool:
        return self.update_interval == "auto"

    def is_warmup(self, t: int) -> bool:
        return t < self.warmup

    def is_select_boundary(self, t: int) -> bool:
        s = t - self.warmup
        counted = t if self.anchor == "absolute" else s
        return s >= 0 and (s == 0 or (self.select_interval != 0 and counted % self.select_interval == 0))

    def is_update_boundary(self, t: int, steps_accumulated: int | None = None, auto_trigger: bool = False) -> bool:
        """Whether step ``t`` ends an accumulation interval (the host updates after adding ``g_t``).

        For ``update_interval="auto"`` pass ``steps_accumulated`` (steps in the current interval,
        ``t`` included) and ``auto_trigger`` (the Zen-auto vote at ``t``). Warm-up steps return
        False: they are synchronous full updates, not accumulation boundaries.
        """
        if t < self.warmup:
            return False
        if self.is_select_boundary(t + 1):
            return True
        if self.is_auto:
            if steps_accumulated is None:
                raise ValueError("is_update_boundary with update_interval='auto' needs steps_accumulated")
            return auto_trigger or steps_accumulated >= self.auto_bound
        return (t - self.warmup + 1) % self.update_interval == 0

    def select_steps(self, num_steps: int) -> list[int]:
        """Steps in ``range(num_steps)`` at which columns are (re-)selected."""
        return [t for t in range(num_steps) if self.is_select_boundary(t)]

    def update_steps(self, num_steps: int) -> list[int]:
        """Steps in ``range(num_steps)`` that end an interval. For ``"auto"``, the *forced* ones only
        (bound reached, or the step before a re-selection), assuming the vote never fires."""
        out = []
        since = 0
        for t in range(self.warmup, num_steps):
            since += 1
            if self.is_update_boundary(t, steps_accumulated=since, auto_trigger=False):
                out.append(t)
                since = 0
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "warmup": self.warmup,
            "select_strategy": self.select_strategy,
            "select_interval": self.select_interval,
            "update_interval": self.update_interval,
            "auto_bound": self.auto_bound,
            "steps_per_epoch": self.steps_per_epoch,
            "steps_per_epoch_source": self.steps_per_epoch_source,
            "warnings": list(self.warnings),
            # (only when not the default: a checkpoint's record keeps the keys it had before the field existed)
            **({"anchor": self.anchor} if self.anchor != "warm_up" else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        data = dict(data)
        data["warnings"] = tuple(data.get("warnings", ()))
        return cls(**data)


def _dataloader_length(dataloader: Any) -> tuple[int | None, str]:
    """len(dataloader) when it has one; (None, reason) when it has none or it is empty."""
    try:
        n = len(dataloader)  # Python guarantees an int >= 0 (a __len__ returning anything else raises)
    except TypeError:
        return None, f" (the dataloader of type {type(dataloader).__name__} has no len())"
    if n == 0:
        return None, " (the dataloader handed over is empty)"
    return n, ""


def resolve_schedule(
    config: ZenFlowConfig | dict | None = None,
    steps_per_epoch: int | None = None,
    dataloader: Any = None,
) -> Schedule:
    """Resolve ``config``'s select/update intervals into a :class:`Schedule` (docs/design.md section 3).

    Emits each applicable :class:`ZenFlowWarning` once; raises :class:`ZenFlowConfigError` for an
    invalid ``steps_per_epoch`` (config or argument), conflicting epoch lengths, or a resolved select
    interval below an integer update interval.
    """
    config = ZenFlowConfig.coerce(config)
    notes: list[str] = []

    strategy = config.select_strategy
    interval = config.select_interval
    if strategy == "auto":
        if interval != "auto":
            notes.append(AUTO_IGNORES_INTERVAL.format(interval=interval))
        strategy, interval = "epoch", 1
    elif interval == "auto":  # only "epoch" reaches here: config rejects "step" with "auto"
        interval = 1

    if steps_per_epoch is not None:
        if not is_int(steps_per_epoch) or steps_per_epoch < 1:
            raise ZenFlowConfigError(
                f"steps_per_epoch={steps_per_epoch!r} is invalid: allowed None or an integer >= 1 (not a bool)"
            )
        if config.steps_per_epoch is not None and config.steps_per_epoch != steps_per_epoch:
            raise ZenFlowConfigError(
                f"steps_per_epoch={steps_per_epoch} conflicts with zenflow.steps_per_epoch="
                f"{config.steps_per_epoch}: give one, or the same value in both"
            )

    epoch_length: int | None = None
    source: str | None = None
    why = ""
    if strategy == "epoch":
        if config.steps_per_epoch is not None:
            epoch_length, source = config.steps_per_epoch, "config"
        elif steps_per_epoch is not None:
            epoch_length, source = int(steps_per_epoch), "argument"
        elif dataloader is not None:
            epoch_length, why = _dataloader_length(dataloader)
            source = "dataloader" if epoch_length is not None else None
        else:
            why = " (no steps_per_epoch and no dataloader)"

    if strategy == "step":
        resolved = int(interval)
    elif epoch_length is not None:
        resolved = int(interval) * epoch_length
    else:
        resolved = 0
        notes.append(NEVER_RESELECTED.format(strategy=config.select_strategy, why=why, wu=config.full_warm_up_rounds))

    update = config.update_interval
    if update != "auto" and resolved != 0 and resolved < update:
        raise interval_order_error(resolved, update)
    auto_bound = None
    if update == "auto":
        auto_bound = config.max_update_interval if resolved == 0 else min(resolved, config.max_update_interval)

    for note in notes:
        warnings.warn(note, ZenFlowWarning, stacklevel=2)
    return Schedule(
        warmup=config.full_warm_up_rounds,
        select_strategy=strategy,
        select_interval=resolved,
        update_interval=update,
        auto_bound=auto_bound,
        steps_per_epoch=epoch_length,
        steps_per_epoch_source=source,
        warnings=tuple(notes),
        anchor=config.select_anchor,
    )


def make_schedule(cls: type[Schedule], config: ZenFlowConfig, steps_per_epoch: int | None = None,
                  dataloader: Any = None, saved: dict[str, Any] | None = None) -> Schedule:
    """A schedule as ``cls`` (a subclass of :class:`Schedule`): resolved from ``config`` (:func:`resolve_schedule`),
    or from a checkpoint's record ``saved`` (``Schedule.to_dict``). The optimizer makes its schedule only here."""
    if saved is not None:
        return cls.from_dict(saved)
    resolved = resolve_schedule(config, steps_per_epoch=steps_per_epoch, dataloader=dataloader)
    return resolved if type(resolved) is cls else cls.from_dict(resolved.to_dict())
