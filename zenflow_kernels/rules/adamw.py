"""AdamW (``torch.optim.AdamW``, decoupled weight decay) and Adam (``torch.optim.Adam``, L2 decay in the gradient):
the step in plain torch, torch's own op sequence, and the fused kernels (numba on the host, the Triton / numba
selective AdamW on the device, for both)."""

from __future__ import annotations

import torch

from .base import UpdateRule, check_betas, check_real

__all__ = ["AdamW", "Adam", "adamw_step_"]


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                decoupled: bool = True) -> None:
    """One Adam/AdamW step in place, the op sequence of ``torch.optim.AdamW(foreach=False)`` (``decoupled``) or
    ``torch.optim.Adam(foreach=False)`` (L2: ``grad + weight_decay * param``)."""
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(UpdateRule):
    """AdamW as ``torch.optim.AdamW``: ``betas``, ``eps``, ``weight_decay`` (decoupled). Two moments: 8 bytes of
    host state per parameter beside the master, 4 with ``state_dtype=torch.bfloat16`` (``UpdateRule.state_dtype``),
    rounded to nearest or, with ``state_rounding="stochastic"``, stochastically (``UpdateRule.state_rounding``)."""

    name = "AdamW"
    state_names = ("exp_avg", "exp_avg_sq")
    launch_hyperparams = ("beta1", "beta2", "eps")
    decoupled = True

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, *,
                 state_dtype: torch.dtype = torch.float32, state_rounding: str = "nearest", rounding_seed: int = 0):
        where = f"rules.{type(self).__name__}"
        self.set_state_storage(where, state_dtype, state_rounding, rounding_seed)
        check_betas(where, betas)
        check_real(where, "eps", eps)
        check_real(where, "weight_decay", weight_decay)
        self.betas, self.eps, self.weight_decay = (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)

    def group_defaults(self) -> dict:
        return dict(betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def check_group(self, group: dict, where: str) -> None:
        super().check_group(group, where)
        check_betas(where, group.get("betas"))
        check_real(where, "eps", group.get("eps"))
        check_real(where, "weight_decay", group.get("weight_decay"))

    def hyperparams(self, group: dict) -> dict:
        return dict(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                    weight_decay=group["weight_decay"])

    def step_(self, param, grad, state, *, step, lr, beta1, beta2, eps, weight_decay) -> None:
        adamw_step_(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, decoupled=self.decoupled)

    # the numba host kernel (cpu_ops.adam): both forms
    fuses_last = True

    def host_step_(self, param, grad, state, *, step, grad_scale, out=None, zero_grad=False, rounding=None,
                   **hyperparams) -> None:
        from .. import cpu_ops

        cpu_ops.cpu_adam_(param, grad, state[0], state[1], step=step, grad_scale=grad_scale, out=out,
                          zero_grad=zero_grad, adamw=self.decoupled, rounding=rounding, **hyperparams)

    def host_accumulate_step_(self, param, acc, grad, state, *, step, grad_scale, out=None, zero_acc=False,
                              rounding=None, **hyperparams) -> None:
        from .. import cpu_ops

        cpu_ops.accumulate_adam_(param, acc, grad, state[0], state[1], step=step, grad_scale=grad_scale, out=out,
                                 zero_acc=zero_acc, adamw=self.decoupled, rounding=rounding, **hyperparams)

    def fast_step_(self, items, *, grad_scale, **launch_hyperparams) -> None:
        from .. import ops

        if self.decoupled:
            ops.multi_selective_adamw_items_(items, grad_scale=grad_scale, **launch_hyperparams)
            return
        kernels = ops.fused_kernels(items[0][0]) if items else None
        if kernels is None:  # the "torch" backend
            self.reference_fast_step_(items, grad_scale=grad_scale, **launch_hyperparams)
        else:
            h = launch_hyperparams
            kernels.multi_selective_adamw_items_(items, h["beta1"], h["beta2"], h["eps"], grad_scale,
                                                 False)


class Adam(AdamW):
    """Adam as ``torch.optim.Adam``: ``weight_decay`` adds ``weight_decay * param`` to the gradient (L2, coupled).
    Both kernels are AdamW's with the coupled decay: the numba host pass (``cpu_adam_(adamw=False)``) and the fused
    selective update of the device (``ops.multi_selective_adamw_items_(decoupled=False)``)."""

    name = "Adam"
    decoupled = False

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *,
                 state_dtype: torch.dtype = torch.float32, state_rounding: str = "nearest", rounding_seed: int = 0):
        super().__init__(betas, eps, weight_decay, state_dtype=state_dtype, state_rounding=state_rounding,
                         rounding_seed=rounding_seed)
