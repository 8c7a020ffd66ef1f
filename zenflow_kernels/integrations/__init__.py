"""Thin adapters for the trainers people use. Importing this package imports neither framework:

* ``zenflow_kernels.integrations.transformers.ZenFlowCallback``: a Hugging Face ``TrainerCallback``;
* ``zenflow_kernels.integrations.lightning.ZenFlowCallback``: a Lightning ``Callback``.

Both keep what the framework saves or evaluates current (``ZenFlowAdamW.flush()`` before every save,
evaluation and at the end of training: the non-selected columns are otherwise up to one interval
stale), close the optimizer at the end of training, and hand it the epoch length in optimizer steps
(batches per epoch over gradient-accumulation steps, rounded up) when it was built without one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

__all__ = ["find_zenflow", "give_epoch_length"]


def find_zenflow(optimizer):
    """The ``ZenFlowAdamW`` inside ``optimizer`` (itself, or wrapped by accelerate's ``AcceleratedOptimizer``
    or Lightning's ``LightningOptimizer``), or None."""
    from ..optim import ZenFlowAdamW

    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, ZenFlowAdamW):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        seen += 1
    return None


def give_epoch_length(optimizers: Iterable, batches_per_epoch, accumulation_steps: int, where: str) -> None:
    """``set_steps_per_epoch`` on each ZenFlowAdamW whose epoch-based schedule has no epoch length yet."""
    for opt in optimizers:
        sched = opt.schedule
        if sched.select_strategy != "epoch" or sched.steps_per_epoch is not None:
            continue
        if not isinstance(batches_per_epoch, int) or batches_per_epoch <= 0:
            warnings.warn(
                f"{where}: the epoch length is unknown ({batches_per_epoch!r} batches per epoch), so ZenFlowAdamW "
                "keeps its columns and never re-selects them; pass steps_per_epoch to ZenFlowAdamW",
                stacklevel=3,
            )
            continue
        opt.set_steps_per_epoch(math.ceil(batches_per_epoch / max(1, accumulation_steps)))
