"""Update rules written as a researcher writes them (a plain-torch ``step_``, no kernel), shared by the benchmarks.

``bench.cpu_rules`` and ``bench.step_overhead --rules`` measure the same rules, so they
are defined once, here; ``zenflow_kernels.rules.compiled`` runs their ``step_`` through torch.compile (Inductor)
with ``compile=True``, eager with ``compile=False``. Compiled kernels are kept per rule class, so every benchmark in
one process shares one compile of each.

* :class:`RMSprop`: one state tensor (``square_avg``), no step count;
* :class:`AdEMAMix`: three state tensors (``exp_avg``, ``exp_avg_slow``, ``exp_avg_sq``), bias corrections from the
  step count: AdEMAMix (Pagliardini et al. 2024) without its alpha and beta3 warm-up schedulers, the largest state a
  rule of one's own is likely to carry;
* :func:`from_torch_rmsprop`: ``rules.from_torch(torch.optim.RMSprop)``, compiled: torch's own functional step.

:func:`make_rule` builds the host benchmarks' candidates by name; :func:`host_bytes_per_element` gives the bytes one
element of the optimizer's host pass moves with each rule, for the benchmarks' memory rooflines.
"""

from __future__ import annotations

import torch

from zenflow_kernels import rules


class RMSprop(rules.UpdateRule):
    """RMSprop as a researcher writes it: no kernel."""

    name = "RMSpropPlain"
    state_names = ("square_avg",)
    launch_hyperparams = ("alpha", "eps")
    uses_step = False

    def __init__(self, alpha=0.99, eps=1e-8, weight_decay=0.0, compile=True):
        self.alpha, self.eps, self.weight_decay, self.compile = alpha, eps, weight_decay, compile

    def group_defaults(self):
        return dict(alpha=self.alpha, eps=self.eps, weight_decay=self.weight_decay)

    def hyperparams(self, group):
        return dict(lr=float(group["lr"]), alpha=group["alpha"], eps=group["eps"],
                    weight_decay=group["weight_decay"])

    def step_(self, param, grad, state, *, step, lr, alpha, eps, weight_decay):
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        square_avg = state["square_avg"]
        square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        param.addcdiv_(grad, square_avg.sqrt().add_(eps), value=-lr)


class AdEMAMix(rules.UpdateRule):
    """AdEMAMix without schedulers, as a researcher writes it: a fast and a slow EMA of the gradient, Adam's
    second moment, decoupled weight decay; three state tensors and the step count (bias corrections)."""

    name = "AdEMAMixPlain"
    state_names = ("exp_avg", "exp_avg_slow", "exp_avg_sq")
    launch_hyperparams = ("beta1", "beta2", "beta3", "alpha", "eps")

    def __init__(self, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0, eps=1e-8, weight_decay=0.0, compile=True):
        self.beta1, self.beta2, self.beta3, self.alpha, self.eps = beta1, beta2, beta3, alpha, eps
        self.weight_decay, self.compile = weight_decay, compile

    def group_defaults(self):
        return dict(beta1=self.beta1, beta2=self.beta2, beta3=self.beta3, alpha=self.alpha, eps=self.eps,
                    weight_decay=self.weight_decay)

    def hyperparams(self, group):
        return dict(lr=float(group["lr"]), **{k: float(group[k]) for k in self.group_defaults()})

    def step_(self, param, grad, state, *, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay):
        exp_avg, slow, exp_avg_sq = state["exp_avg"], state["exp_avg_slow"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        slow.lerp_(grad, 1 - beta3)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = exp_avg_sq.div(bias2).sqrt_().add_(eps)
        update = exp_avg.div(bias1).add_(slow, alpha=alpha).div_(denom)
        param.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)


def from_torch_rmsprop(**hyper) -> rules.UpdateRule:
    """``rules.from_torch(torch.optim.RMSprop, **hyper)``, compiled (``compile=True``, not ``"auto"``: the
    benchmarks' small calls run compiled too)."""
    rule = rules.from_torch(torch.optim.RMSprop, **hyper)
    rule.compile = True
    return rule


def make_rule(name: str) -> rules.UpdateRule:
    """A candidate of bench.cpu_rules by name: ``rmsprop_compiled``, ``rmsprop_eager``, ``ademamix_compiled``,
    ``from_torch_rmsprop`` (weight decay 0.01)."""
    return {"rmsprop_compiled": lambda: RMSprop(weight_decay=0.01, compile=True),
            "rmsprop_eager": lambda: RMSprop(weight_decay=0.01, compile=False),
            "ademamix_compiled": lambda: AdEMAMix(weight_decay=0.01, compile=True),
            "from_torch_rmsprop": lambda: from_torch_rmsprop(weight_decay=0.01)}[name]()


def host_bytes_per_element(rule: rules.UpdateRule, out_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the host pass moves per element (``host_step_(..., out=, zero_grad=True)``): the fp32 master and the
    fp32 sums read and written back (the sums zeroed), each state tensor read and written at ``state_dtype``, the
    copy-out written: ``16 + 2 * state_bytes * len(state_names) + out_bytes`` (RMSprop 26, AdEMAMix 42 with fp32
    state and a bf16 out)."""
    state = torch.empty((), dtype=rule.state_dtype).element_size()
    out = torch.empty((), dtype=out_dtype).element_size()
    return 2 * (4 + 4) + 2 * state * len(rule.state_names) + out
