"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2): the sign of an
interpolated momentum, one moment. The step in plain torch; the host pass the fused numba kernel
(``cpu_ops.cpu_lion_``, bit-identical to the torch step on x86 with AVX2); the device's update of the selected
columns one fused multi-tensor launch (``ops.fused_kernels``: numba on CPU, Triton on GPU)."""

from __future__ import annotations

import torch

from .base import UpdateRule, check_betas, check_real

__all__ = ["Lion"]


class Lion(UpdateRule):
    """Lion: ``c = lerp(m, g, 1 - beta1); p = p * (1 - lr * wd) - lr * sign(c); m = lerp(m, g, 1 - beta2)``. One
    moment: 4 bytes of host state per parameter beside the master."""

    name = "Lion"
    state_names = ("exp_avg",)
    launch_hyperparams = ("beta1", "beta2")
    uses_step = False

    def __init__(self, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 state_dtype: torch.dtype = torch.float32, state_rounding: str = "nearest", rounding_seed: int = 0):
        self.set_state_storage("rules.Lion", state_dtype, state_rounding, rounding_seed)
        check_betas("rules.Lion", betas)
        check_real("rules.Lion", "weight_decay", weight_decay)
        self.betas, self.weight_decay = (float(betas[0]), float(betas[1])), float(weight_decay)

    def group_defaults(self) -> dict:
        return dict(betas=self.betas, weight_decay=self.weight_decay)

    def check_group(self, group: dict, where: str) -> None:
        super().check_group(group, where)
        check_betas(where, group.get("betas"))
        check_real(where, "weight_decay", group.get("weight_decay"))

    def hyperparams(self, group: dict) -> dict:
        return dict(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                    weight_decay=group["weight_decay"])

    def step_(self, param, grad, state, *, step, lr, beta1, beta2, weight_decay) -> None:
        exp_avg = state["exp_avg"]
        update = exp_avg.lerp(grad, 1 - beta1).sign_()
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        param.add_(update, alpha=-lr)
        exp_avg.lerp_(grad, 1 - beta2)

    def host_step_(self, param, grad, state, *, step, grad_scale, out=None, zero_grad=False, rounding=None,
                   **hyperparams) -> None:
        from .. import cpu_ops

        cpu_ops.cpu_lion_(param, grad, state[0], grad_scale=grad_scale, out=out, zero_grad=zero_grad,
                          rounding=rounding, **hyperparams)

    def fast_step_(self, items, *, grad_scale, beta1, beta2) -> None:
        from .. import ops

        kernels = ops.fused_kernels(items[0][0]) if items else None
        if kernels is None:  # the "torch" backend
            self.reference_fast_step_(items, grad_scale=grad_scale, beta1=beta1, beta2=beta2)
        else:
            kernels.multi_selective_lion_items_(items, beta1, beta2, grad_scale)
