"""Thin adapters for the trainers people use. Importing this package imports neither framework:

* ``zenflow_kernels.integrations.transformers.ZenFlowCallback``: a Hugging Face ``TrainerCallback``;
* ``zenflow_kernels.integrations.lightning.ZenFlowCallback``: a Lightning ``Callback``.

Both let the framework save and evaluate the flushed weights (``ZenFlowAdamW.flushed()``: every host update
computed so far applied; the non-selected columns are otherwise up to one interval stale) and give back the
weights training continues from afterwards, bit for bit; both run an evaluation on its own random-number
state (``isolated_rng``: the evaluation's data loader draws a seed from torch's global generator, and a
collator may draw more, so without it a model with dropout trains differently depending on how often it
is evaluated, whatever the optimizer). So how often a run saves or evaluates does not change it. Both
flush and close the optimizer at the end of training, and hand it the epoch length in optimizer steps
(batches per epoch over gradient-accumulation steps, rounded up) when it was built without one.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Iterable

import torch

__all__ = ["RandomState", "find_zenflow", "give_epoch_length"]


class RandomState:
    """Every global random-number state an evaluation may draw from (torch's CPU and CUDA generators,
    Python's ``random``, numpy's), taken at construction and put back by :meth:`restore`."""

    def __init__(self):
        import numpy as np

        self._np = np
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        self._np.random.set_state(self.numpy)


def find_zenflow(optimizer):
    """The ``ZenFlowAdamW`` inside ``optimizer`` (itself, or wrapped by accelerate's ``AcceleratedOptimizer``
    or Lightning's ``LightningOptimizer``), or None."""
    from ..optim import ZenFlow

    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, ZenFlow):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        seen += 1
    return None


def give_epoch_length(optimizers: Iterable, batches_per_epoch, accumulation_steps: int, where: str) -> None:
    """``set_steps_per_epoch`` on each ZenFlow optimizer whose epoch-based schedule has no epoch length yet."""
    for opt in optimizers:
        sched = opt.schedule
        if sched.select_strategy != "epoch" or sched.steps_per_epoch is not None:
            continue
        if not isinstance(batches_per_epoch, int) or batches_per_epoch <= 0:
            name = getattr(opt, "display_name", "ZenFlow")
            warnings.warn(
                f"{where}: the epoch length is unknown ({batches_per_epoch!r} batches per epoch), so {name} "
                f"keeps its columns and never re-selects them; pass steps_per_epoch to {name}",
                stacklevel=3,
            )
            continue
        opt.set_steps_per_epoch(math.ceil(batches_per_epoch / max(1, accumulation_steps)))
