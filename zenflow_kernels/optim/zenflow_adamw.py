"""ZenFlowAdamW: :class:`~zenflow_kernels.optim.optimizer.ZenFlow` with ``rules.AdamW``, with ``torch.optim.AdamW``'s
signature."""

from __future__ import annotations

from typing import Any

from ..config import ZenFlowConfig, check_adamw_hyperparameters
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
        *,
        zenflow: ZenFlowConfig | dict | str | None = None,
        max_grad_norm: float | None = None,
        steps_per_epoch: int | None = None,
        dataloader: Any = None,
        host_timeout: float | None = 600.0,
        zero_stage: int = 0,
        process_group: Any = None,
        collective_timeout: float = 300.0,
        release_gradients: bool | None = None,
    ):
        check_adamw_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, where=self.facade_name)
        super().__init__(params, AdamW(betas, eps, weight_decay), lr, zenflow=zenflow, max_grad_norm=max_grad_norm,
                         steps_per_epoch=steps_per_epoch, dataloader=dataloader, host_timeout=host_timeout,
                         zero_stage=zero_stage, process_group=process_group, collective_timeout=collective_timeout,
                         release_gradients=release_gradients)
