"""ZenFlowAdamW: :class:`~zenflow_kernels.optim.optimizer.ZenFlow` with ``rules.AdamW``, with ``torch.optim.AdamW``'s
signature."""

from __future__ import annotations

import inspect
from typing import Any

from ..config import check_adamw_hyperparameters
from ..rules import AdamW
from .optimizer import ZenFlow

__all__ = ["ZenFlowAdamW"]


class ZenFlowAdamW(ZenFlow):
    """AdamW with ZenFlow's split: ``ZenFlow(params, rules.AdamW(betas, eps, weight_decay), lr, ...)`` with
    ``torch.optim.AdamW``'s signature (decoupled weight decay). The other arguments are :class:`ZenFlow`'s. ``lr``
    may be a 1-element floating-point tensor, as for ``torch.optim.AdamW`` (a scheduler writes into it in place)."""

    facade_name = "ZenFlowAdamW"

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        **options: Any,
    ):
        # ``options``: ZenFlow's keyword-only arguments (zenflow, max_grad_norm, ...), written once there; the
        # signature below lists them
        unknown = sorted(options.keys() - _ZENFLOW_OPTIONS)
        if unknown:
            raise TypeError(f"{self.facade_name}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        check_adamw_hyperparameters(lr, betas, eps, weight_decay, options.get("max_grad_norm"),
                                    where=self.facade_name)
        super().__init__(params, AdamW(betas, eps, weight_decay), lr, **options)


def _signature(own, base) -> inspect.Signature:
    """``own``'s signature with its ``**options`` replaced by ``base``'s keyword-only arguments (what ``help()`` and
    an editor show)."""
    mine = inspect.signature(own)
    kept = [p for p in mine.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    theirs = [p for p in inspect.signature(base).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return mine.replace(parameters=kept + theirs)


ZenFlowAdamW.__init__.__signature__ = _signature(ZenFlowAdamW.__init__, ZenFlow.__init__)
_ZENFLOW_OPTIONS = frozenset(p.name for p in inspect.signature(ZenFlow.__init__).parameters.values()
                             if p.kind is inspect.Parameter.KEYWORD_ONLY)
