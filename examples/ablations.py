"""Three ablations of ZenFlow, each changing one part of ``ZenFlowAdamW`` (docs/hacking.md).

* :class:`StickyColumns` (the selection part, ``zenflow_kernels/optim/selection.py``): at a re-selection a column
  already on the fast path keeps its place unless an outside column scores more than ``margin`` times higher, so
  fewer columns change hands (each change moves Adam state and writes a column back to the host master). With
  ``margin=1`` it is top-k.
* :class:`LrTimesInterval` (the host interval part, ``zenflow_kernels/optim/interval.py``): the host update, one
  AdamW step on the interval's mean gradient, stands for the interval's S steps; this rule takes it with the
  learning rate times S, as if the S steps had all been taken with that gradient.
* :class:`Signum` (the update rule, ``zenflow_kernels/rules``): sign descent with momentum (Bernstein et al. 2018)
  instead of AdamW, on both of ZenFlow's paths: ``ZenFlow(params, Signum(), lr=...)``.

Use any as the optimizer (``LrTimesInterval(params, lr=..., zenflow=...)``); ``python examples/ablations.py``
trains a small model with the stock optimizer and the ablations and prints the loss and the selection churn.
"""

from __future__ import annotations

import functools

import torch

from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules
from zenflow_kernels.optim.interval import HostInterval
from zenflow_kernels.optim.selection import Selection


class StickySelection(Selection):
    """Top-k with a stay bonus: the columns now selected compete with their score times ``margin``."""

    margin = 2.0

    def choose(self, t, indices, importances, scores, ks):
        chosen = []
        for i, s, k in zip(indices, scores, ks, strict=True):
            old = self.run.fast_state(i).get("selected")
            boosted = s.clone()
            if old is not None and old.numel():
                boosted[old] *= self.margin
            chosen.append(torch.sort(torch.topk(boosted, k).indices).values)  # (sorted, as the fast path reads them)
        return chosen


class StickyColumns(ZenFlowAdamW):
    """ZenFlowAdamW whose re-selections keep the current columns unless an outsider scores ``margin`` times more."""

    selection_class = StickySelection


class LrTimesIntervalHost(HostInterval):
    """Each host update runs with every param group's learning rate times the number of steps in its interval."""

    def boundary(self, max_norm, last=None):
        steps = max(self.counts[self.buf])  # (every parameter with a gradient counted once per step)
        plain = self.hyperparams
        self.hyperparams = lambda: [dict(h, lr=h["lr"] * steps) for h in plain()]
        try:
            super().boundary(max_norm, last)
        finally:
            self.hyperparams = plain


class LrTimesInterval(ZenFlowAdamW):
    """ZenFlowAdamW whose host updates take the learning rate times the interval's length."""

    interval_class = LrTimesIntervalHost


class Signum(rules.UpdateRule):
    """Sign descent with momentum: ``m = lerp(m, g, 1 - beta); p = p * (1 - lr * wd) - lr * sign(m)``."""

    name = "Signum"
    state_names = ("momentum",)  # one fp32 tensor per parameter, on the host and for the selected columns
    launch_hyperparams = ("beta",)  # one value per launch (lr and weight_decay: one per tensor of it)
    uses_step = False  # the step count is not read: columns at different counts are stepped together

    def __init__(self, beta: float = 0.9, weight_decay: float = 0.0):
        self.beta, self.weight_decay = beta, weight_decay

    def group_defaults(self):  # the param groups' keys and defaults
        return dict(beta=self.beta, weight_decay=self.weight_decay)

    def hyperparams(self, group):  # what step_ reads of a param group
        return dict(lr=float(group["lr"]), beta=group["beta"], weight_decay=group["weight_decay"])

    def step_(self, param, grad, state, *, step, lr, beta, weight_decay):
        m = state["momentum"].lerp_(grad, 1 - beta)
        param.mul_(1 - lr * weight_decay).add_(m.sign(), alpha=-lr)


def main() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(512, 64), torch.randn(64, 16)
    y = x @ w + 0.1 * torch.randn(512, 16)
    zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=4, overlap_step=False)
    signum = functools.partial(ZenFlow, rule=Signum())
    for name, cls in (("ZenFlowAdamW", ZenFlowAdamW), ("StickyColumns", StickyColumns),
                      ("LrTimesInterval", LrTimesInterval), ("Signum", signum)):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Tanh(), torch.nn.Linear(64, 16))
        with cls(model.parameters(), lr=3e-3, zenflow=zen) as opt:
            for step in range(80):
                batch = slice((step * 64) % 512, (step * 64) % 512 + 64)
                loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
                loss.backward()
                opt.step()
                opt.zero_grad()
            opt.flush()
            churn = [1 - j for j in opt.stats()["selection_jaccard"] if j == j]
            print(f"{name:>16}: loss {torch.nn.functional.mse_loss(model(x), y).item():.4f}, "
                  f"columns changing hands per re-selection {sum(churn) / max(1, len(churn)):.2f}")


if __name__ == "__main__":
    main()
