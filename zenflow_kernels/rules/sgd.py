"""SGD as ``torch.optim.SGD``: momentum, dampening, Nesterov, L2 weight decay. The step in plain torch (torch's
single-tensor op sequence); the host pass the fused numba kernel (``cpu_ops.cpu_sgd_``, bit-identical to torch's step
on x86 with AVX2); the device's update of the selected columns one fused multi-tensor launch (``ops.fused_kernels``:
numba on CPU, Triton on GPU)."""

from __future__ import annotations

import torch

from .base import UpdateRule, check_real

__all__ = ["SGD"]


class SGD(UpdateRule):
    """SGD as ``torch.optim.SGD``. With ``momentum`` one buffer (``momentum_buffer``, 4 bytes of host state per
    parameter beside the master); without, none, and param groups may not turn momentum on. The buffer's first
    step takes the gradient as it is (torch's), so a column entering the fast path starts its buffer afresh."""

    name = "SGD"
    launch_hyperparams = ("momentum", "dampening", "nesterov")

    def __init__(self, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, *, state_dtype: torch.dtype = torch.float32,
                 state_rounding: str = "nearest", rounding_seed: int = 0):
        self.set_state_storage("rules.SGD", state_dtype, state_rounding, rounding_seed)
        self._check("rules.SGD", dict(momentum=momentum, dampening=dampening, nesterov=nesterov,
                                      weight_decay=weight_decay))
        self.momentum, self.dampening, self.nesterov = float(momentum), float(dampening), bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.state_names = ("momentum_buffer",) if self.momentum != 0 else ()

    @staticmethod
    def _check(where: str, group: dict) -> None:
        check_real(where, "momentum", group.get("momentum"))
        check_real(where, "dampening", group.get("dampening"))
        check_real(where, "weight_decay", group.get("weight_decay"))
        nesterov = group.get("nesterov")
        if not isinstance(nesterov, bool):
            raise ValueError(f"{where}: nesterov={nesterov!r} is invalid: allowed True or False")
        if nesterov and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{where}: nesterov=True needs momentum > 0 and dampening == 0 (torch.optim.SGD's "
                             f"rule), got momentum={group['momentum']!r}, dampening={group['dampening']!r}")

    def group_defaults(self) -> dict:
        return dict(momentum=self.momentum, dampening=self.dampening, nesterov=self.nesterov,
                    weight_decay=self.weight_decay)

    def check_group(self, group: dict, where: str) -> None:
        super().check_group(group, where)
        self._check(where, group)
        if group["momentum"] != 0 and not self.state_names:
            raise ValueError(f"{where}: momentum={group['momentum']!r} is invalid for rules.SGD(momentum=0), which "
                             "keeps no momentum buffer: allowed 0 (give the rule a momentum to use it in any group)")

    def hyperparams(self, group: dict) -> dict:
        return dict(lr=float(group["lr"]), momentum=group["momentum"], dampening=group["dampening"],
                    nesterov=group["nesterov"], weight_decay=group["weight_decay"])

    def step_(self, param, grad, state, *, step, lr, momentum, dampening, nesterov, weight_decay) -> None:
        d = grad
        if weight_decay != 0:
            d = d.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:  # torch: a buffer that is None starts as the gradient itself
                buf.copy_(d)
            else:
                buf.mul_(momentum).add_(d, alpha=1 - dampening)
            d = d.add(buf, alpha=momentum) if nesterov else buf
        param.add_(d, alpha=-lr)

    def host_step_(self, param, grad, state, *, step, grad_scale, out=None, zero_grad=False, rounding=None,
                   **hyperparams) -> None:
        from .. import cpu_ops

        cpu_ops.cpu_sgd_(param, grad, state[0] if state else None, step=step, grad_scale=grad_scale, out=out,
                         zero_grad=zero_grad, rounding=rounding, **hyperparams)

    def fast_step_(self, items, *, grad_scale, momentum, dampening, nesterov) -> None:
        from .. import ops

        kernels = ops.fused_kernels(items[0][0]) if items else None
        if kernels is None:  # the "torch" backend
            self.reference_fast_step_(items, grad_scale=grad_scale, momentum=momentum, dampening=dampening,
                                      nesterov=nesterov)
        else:
            kernels.multi_selective_sgd_items_(items, momentum, dampening, nesterov, grad_scale)
