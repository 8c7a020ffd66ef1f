"""ReferenceZenFlow: a plain, slow, readable torch implementation of docs/design.md sections 2-3.

This is the oracle every fast path is tested against, so it favours being obviously right over
being fast: no threads, no kernels, no flat buffers, per-parameter Python loops, float32 or float64
parameters only. Staleness is explicit: with ``overlap_step=True`` the host update of an interval is
computed at once but only *written back* at the next update boundary (or drained at a re-selection).
It shares nothing with the fast implementation except ``config`` and ``schedule``.

Per matrix parameter ``W [R, C]`` (state in ``self.state[W]``):

* host side: ``master`` (fp32/fp64 copy of W), the update rule's state ``[R, C]`` by its names (AdamW:
  ``exp_avg``/``exp_avg_sq``), ``host_step`` (one count: the host updates every column of the master), ``acc``
  (sum of the interval's gradients), ``acc_count`` and ``pending`` (a computed update not yet written back);
* fast side: ``selected`` (sorted column indices), compact ``fast_<name>`` of each state name (AdamW:
  ``fast_exp_avg``/``fast_exp_avg_sq``) ``[R, k]`` and ``fast_step`` ``[k]`` (a step count per column);
* Zen-auto trackers: ``auto_selected``/``auto_unselected`` sums and ``auto_count``.

Vector parameters (anything not 2-D) keep one plain state of the rule (its names and ``step``): host-updated
during warm-up, on the fast path after, without a break.

The update rule (``rule=``, default AdamW) is applied through its plain-torch ``step_`` only, at an int step count
(columns at different counts are stepped in groups); the rules' steps are checked against torch's own optimizers
(tests/test_rules.py).

Decisions this implementation pins down where docs/design.md leaves room (the fast path must agree):

* a skipped (non-finite) step does not advance ``t``; ``skipped_steps`` counts it;
* a parameter whose ``.grad`` is None at a step takes no part in it (no fast update, nothing
  accumulated, no re-selection); a matrix first seen with a gradient after warm-up is selected then;
* at a select boundary every pending write-back is applied first (the in-flight host update is
  drained), then columns change hands: columns that leave refresh the master from the live weights,
  columns that enter start with zero moments and a step count of 0;
* Selection per param group (its own ``topk_ratio``/``importance``, else the config's): top-k of the
  column scores (``"l2"``/``"l1"``, or a callable ``scores(grad, param)``), or for ``"random"`` k columns
  drawn by ``numpy.random.default_rng([selection_seed, t, parameter index]).choice(C, k, replace=False)``,
  sorted.
* Zen-auto magnitude of a column is its L2 norm (``importance`` other than ``"l1"``) or L1 norm (``"l1"``) of the
  step's raw gradient; a matrix needs an update when the sum over the interval's steps of the mean
  non-selected magnitude reaches the interval's mean selected magnitude. Matrices with ``k == 0``
  always need one, matrices with ``k == C`` do not vote; with no voter only the bound triggers.
* clipping multiplies by ``min(1, max_grad_norm / (norm + 1e-6))`` like ``clip_grad_norm_``: the
  fast path by the norm of the step's whole gradient, the host by the norm of the interval's mean
  gradients (of the parameters it updates). The norm in force at a step is the smaller of ``max_grad_norm``
  and the requests made with ``clip_grad_norm_()`` since the last ``step()`` (``zero_grad()`` drops them:
  a dropped batch's request does not apply; a loop that zeroes with ``model.zero_grad()`` instead keeps it
  for the next step); each tensor a request returned is filled at ``step()`` with the step's gradient norm
  (NaN until then);
* under a ``torch.amp.GradScaler`` (the fused-optimizer protocol: the scaler sets ``grad_scale`` and
  ``found_inf`` for the length of ``step()`` instead of unscaling in place) the step reads every gradient
  times the float32 reciprocal of the scale, as the scaler's own unscale would compute it (exact for its
  powers of two); a step with ``found_inf`` set is skipped like a non-finite one.

DeepSpeed's choices (config fields, docs/deepspeed.md), each where it acts:

* ``gradient_scale="interval"``: the step reads every gradient times the float32 reciprocal of
  ``update_interval`` (times GradScaler's scale, one reciprocal of their product), and the host steps on the
  interval's sum of those instead of their mean;
* ``host_step_count="steps"``: a host update's step number is ``t + 1`` (warm-up included);
* ``reselect_state="reset"``: at a selection every selected column's rule state starts from zero and every column
  takes the matrix's step count (its fast steps so far; all its columns share it: 0 at its first selection);
* ``vector_state="reset"``: a vector's fast-path state starts from zero with step 0 at its first step after warm-up,
  and its rule state (not its step count) is zeroed again at every selection;
* ``select_anchor="absolute"``: the schedule's (``Schedule.anchor``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .config import ZenFlowConfig, check_adamw_hyperparameters, check_group_settings, check_max_grad_norm, num_selected
from .rules import AdamW, UpdateRule, adamw_step_, check_rule
from .schedule import Schedule, resolve_schedule

__all__ = ["ReferenceZenFlow", "adamw_step_"]

_REFERENCE_DTYPES = (torch.float32, torch.float64)


def _columns_step_(rule: UpdateRule, block, grad, state: dict, steps, hyperparams: dict) -> None:
    """The rule's step on the columns of ``block [R, k]`` where column i is at its own step ``steps[i]``:
    columns sharing a step count are stepped together by ``rule.step_``."""
    for s in torch.unique(steps).tolist():
        cols = (steps == s).nonzero().flatten()
        p = block[:, cols]
        held = {name: t[:, cols] for name, t in state.items()}
        rule.step_(p, grad[:, cols], held, step=int(s), **hyperparams)
        block[:, cols] = p
        for name, t in held.items():
            state[name][:, cols] = t


def _clip_coefficient(tensors: Iterable[torch.Tensor], max_norm: float | None) -> float | None:
    """``clip_grad_norm_``'s factor for these tensors, or None when clipping is off."""
    if max_norm is None:
        return None
    squares = [t.double().pow(2).sum() for t in tensors]
    total = math.sqrt(float(sum(squares))) if squares else 0.0
    return min(1.0, max_norm / (total + 1e-6))


def _scaled(grad: torch.Tensor, coef: float | None) -> torch.Tensor:
    return grad if coef is None else grad * coef


def column_magnitudes(grad: torch.Tensor, importance: str) -> torch.Tensor:
    """Per-column L2 norm (``"l2"``) or L1 norm (``"l1"``) of a 2-D gradient."""
    return grad.pow(2).sum(0).sqrt() if importance == "l2" else grad.abs().sum(0)


def column_scores(grad: torch.Tensor, importance: str) -> torch.Tensor:
    """Column importance: sum of squares (``"l2"``) or of absolute values (``"l1"``)."""
    return grad.pow(2).sum(0) if importance == "l2" else grad.abs().sum(0)


class _Default(float):
    """A default argument's value (AdamW's ``eps``, ``weight_decay``), told apart from the same value passed."""


class _DefaultPair(tuple):
    """A default argument's value (AdamW's ``betas``), told apart from the same value passed."""


def _check_explicit(rule: UpdateRule, given: dict) -> None:
    """With ``rule=``, AdamW's ``betas``, ``eps`` and ``weight_decay`` passed explicitly: refused where the rule takes
    no such hyper-parameter (it would be ignored) or has another value for it (set it on the rule)."""
    takes = rule.group_defaults()
    for key, value in given.items():
        if isinstance(value, (_Default, _DefaultPair)):
            continue
        if key not in takes:
            raise ValueError(f"ReferenceZenFlow: {key}={value!r} is invalid with rule={rule!r}: the rule takes no "
                             f"{key} (its hyper-parameters: {', '.join(takes) or 'none but lr'}); leave it out")
        mine = takes[key]
        if (tuple(value) if isinstance(value, (tuple, list)) else value) != (
                tuple(mine) if isinstance(mine, (tuple, list)) else mine):
            raise ValueError(f"ReferenceZenFlow: {key}={value!r} conflicts with rule={rule!r}, whose {key} is "
                             f"{mine!r}: set it on the rule")


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest scores' indices, ties to the lower index, sorted ascending (int64)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return torch.sort(order[:k]).values


class ReferenceZenFlow(torch.optim.Optimizer):
    """The ZenFlow algorithm, step by step, for float32/float64 parameters (the test oracle).

    Same constructor as :class:`zenflow_kernels.ZenFlowAdamW`; ``rule=`` (an update rule, ``zenflow_kernels.rules``)
    runs ZenFlow with that rule instead (its hyper-parameters replace ``betas``, ``eps``, ``weight_decay``), as
    :class:`zenflow_kernels.ZenFlow` does (``betas``, ``eps`` or ``weight_decay`` passed beside it are refused where
    the rule takes no such hyper-parameter or another value of it). The rule's step is its eager ``step_``, never a
    kernel or its compiled form. ``step()`` reads ``p.grad``.
    Counters: ``t`` (steps taken), ``skipped_steps``, ``host_updates``, ``selections``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = _DefaultPair((0.9, 0.999)),
        eps: float = _Default(1e-8),
        weight_decay: float = _Default(0.01),
        *,
        zenflow: ZenFlowConfig | dict | str | None = None,
        max_grad_norm: float | None = None,
        steps_per_epoch: int | None = None,
        dataloader: Any = None,
        rule: UpdateRule | None = None,
    ):
        if rule is None:
            check_adamw_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, where="ReferenceZenFlow")
            rule = AdamW(betas, eps, weight_decay)
        elif not isinstance(rule, UpdateRule):
            raise TypeError(f"ReferenceZenFlow: rule={rule!r} is invalid: allowed an update rule "
                            "(zenflow_kernels.rules)")
        else:
            _check_explicit(rule, dict(betas=betas, eps=eps, weight_decay=weight_decay))
            rule.check_group(dict(rule.group_defaults(), lr=lr), "ReferenceZenFlow")
            check_max_grad_norm(max_grad_norm, "ReferenceZenFlow")
        check_rule(rule, dict(rule.group_defaults(), lr=lr), "ReferenceZenFlow")
        self.rule = rule
        super().__init__(params, dict(lr=lr, **rule.group_defaults()))
        for group in self.param_groups:
            rule.check_group(group, "ReferenceZenFlow group")
            check_group_settings(group, "ReferenceZenFlow param group")
            for p in group["params"]:
                if p.dtype not in _REFERENCE_DTYPES:
                    raise TypeError(f"ReferenceZenFlow: parameter dtype {p.dtype} is invalid: allowed float32, float64")
        # each parameter's position in the optimizer's order (the random selection's seed)
        self._index = {id(p): n for n, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self.config = ZenFlowConfig.coerce(zenflow)
        self.schedule: Schedule = resolve_schedule(self.config, steps_per_epoch=steps_per_epoch, dataloader=dataloader)
        self.max_grad_norm = max_grad_norm
        self._clip_request: float | None = None  # clip_grad_norm_() since the last step: the smallest norm asked
        self._clip_norms: list[torch.Tensor] = []  # ... and the tensors it returned
        self._grad: dict = {}  # this step's gradients (unscaled under a GradScaler), by parameter
        self.t = 0
        self.skipped_steps = 0
        self.host_updates = 0
        self.selections = 0
        self.steps_accumulated = 0

    # -- helpers ---------------------------------------------------------------------------------

    def _hyper(self, group: dict) -> dict:
        return self.rule.hyperparams(group)

    def _step(self, p: torch.Tensor, grad: torch.Tensor, state: dict, step: int, group: dict,
              prefix: str = "") -> None:
        """The rule's step of ``p`` with its state held in ``state`` under ``prefix + name``."""
        held = {name: state[prefix + name] for name in self.rule.state_names}
        self.rule.step_(p, grad, held, step=step, **self._hyper(group))

    def _params_with_grad(self) -> list[tuple[torch.Tensor, dict]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or p.grad.shape != p.shape:
                    raise ValueError(
                        f"ReferenceZenFlow: gradient of shape {tuple(p.grad.shape)} for a parameter of "
                        f"shape {tuple(p.shape)} is invalid: allowed a dense gradient of the same shape"
                    )
                out.append((p, group))
        return out

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        names = self.rule.state_names
        if p.dim() == 2:
            R, _ = p.shape
            state.update(
                kind="matrix",
                master=p.detach().clone(),
                **{name: torch.zeros_like(p) for name in names},
                host_step=0,
                acc=torch.zeros_like(p),
                acc_count=0,
                pending=False,
                selected=None,
                **{f"fast_{name}": p.new_zeros(R, 0) for name in names},
                fast_step=torch.zeros(0, dtype=torch.int64, device=p.device),
                auto_selected=0.0,
                auto_unselected=0.0,
                auto_count=0,
            )
        else:
            state.update(kind="vector", **{name: torch.zeros_like(p) for name in names}, step=0)
        return state

    def _unselected(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        mask = torch.ones(p.shape[1], dtype=torch.bool, device=p.device)
        if state["selected"] is not None:
            mask[state["selected"]] = False
        return mask

    def _write_back(self, p: torch.Tensor, state: dict) -> None:
        """Non-selected columns of the live weight <- the host master."""
        cols = self._unselected(p, state)
        p[:, cols] = state["master"][:, cols]
        state["pending"] = False

    def _write_back_pending(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and state["kind"] == "matrix" and state["pending"]:
                    self._write_back(p, state)

    # -- GradScaler and clipping requests ----------------------------------------------------------

    _step_supports_amp_scaling = True  # torch.amp.GradScaler sets grad_scale and found_inf for step()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Ask the coming ``step()`` to clip by the global L2 norm at most ``max_norm`` (inf: no clipping, the norm
        only); returns a 0-dim float32 tensor that ``step()`` fills with that norm."""
        if norm_type != 2 or not max_norm > 0:
            raise ValueError(f"ReferenceZenFlow.clip_grad_norm_: max_norm={max_norm!r}, norm_type={norm_type!r} "
                             "is invalid: allowed max_norm > 0 and norm_type 2")
        if math.isfinite(max_norm):
            self._clip_request = min(float(max_norm), self._clip_request or math.inf)
        norm = torch.full((), math.nan, dtype=torch.float32)
        self._clip_norms.append(norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip_request, self._clip_norms = None, []  # a batch dropped before step(): no request applies
        super().zero_grad(set_to_none=set_to_none)

    # -- the algorithm -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        request, norms = self._clip_request, self._clip_norms
        self._clip_request, self._clip_norms = None, []
        limits = [x for x in (self.max_grad_norm, request) if x is not None]
        max_norm = min(limits) if limits else None
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        divide = self.config.update_interval if self.config.gradient_scale == "interval" else 1
        amp = (1.0 if scale is None else float(scale)) * divide
        inv = None if scale is None and divide == 1 else float(torch.tensor(1.0 / amp, dtype=torch.float32))
        active = self._params_with_grad()
        self._grad = {p: p.grad if inv is None else p.grad * inv for p, _ in active}
        total = math.sqrt(float(sum(g.double().pow(2).sum() for g in self._grad.values()))) if active else 0.0
        for out in norms:
            out.fill_(total)
        overflow = found_inf is not None and float(found_inf) != 0.0
        if overflow or not all(bool(torch.isfinite(g).all()) for g in self._grad.values()):
            self.skipped_steps += 1  # nothing else changes, t included
            return loss
        for p, _ in active:
            self._init_state(p)

        t = self.t
        coef = _clip_coefficient(self._grad.values(), max_norm)
        if self.schedule.is_warmup(t):
            self._warmup_step(active, coef)
        else:
            self._zenflow_step(t, active, coef, max_norm)
        self.t += 1
        return loss

    def _warmup_step(self, active, coef) -> None:
        """The plain synchronous rule (AdamW) on the host master of every parameter (ZeRO-Offload)."""
        for p, group in active:
            state = self.state[p]
            grad = _scaled(self._grad[p], coef)
            if state["kind"] == "matrix":
                state["host_step"] = self._host_step(state["host_step"])
                self._step(state["master"], grad, state, state["host_step"], group)
                p.copy_(state["master"])
            else:
                state["step"] = self._host_step(state["step"])
                self._step(p, grad, state, state["step"], group)
        self.host_updates += 1

    def _host_step(self, count: int) -> int:
        """A host update's step number: the parameter's count of them plus one, or (``host_step_count="steps"``) the
        optimizer's step number ``t + 1``."""
        return self.t + 1 if self.config.host_step_count == "steps" else count + 1

    def _zenflow_step(self, t: int, active, coef, max_norm) -> None:
        matrices = [(p, g) for p, g in active if self.state[p]["kind"] == "matrix"]
        boundary = self.schedule.is_select_boundary(t)
        if boundary:
            self._write_back_pending()  # drain: ownership must not change under an in-flight update
            self.selections += 1
        reset_vectors = self.config.vector_state == "reset"
        if boundary and reset_vectors:  # the rule state of every vector on the fast path restarts (not its count)
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if state and state["kind"] == "vector" and state.get("fast"):
                        for name in self.rule.state_names:
                            state[name].zero_()
        for p, group in matrices:
            if boundary or self.state[p]["selected"] is None:
                self._reselect(p, self.state[p], group, t)

        for p, group in active:  # fast path
            state = self.state[p]
            grad = _scaled(self._grad[p], coef)
            if state["kind"] == "vector":
                if reset_vectors and not state.get("fast"):  # its first fast step: from zero, step 0
                    for name in self.rule.state_names:
                        state[name].zero_()
                    state["step"] = 0
                state["fast"] = True
                state["step"] += 1
                self._step(p, grad, state, state["step"], group)
            elif state["selected"].numel():
                cols = state["selected"]
                state["fast_step"] += 1
                block = p[:, cols]
                fast = {name: state[f"fast_{name}"] for name in self.rule.state_names}
                _columns_step_(self.rule, block, grad[:, cols], fast, state["fast_step"], self._hyper(group))
                p[:, cols] = block

        for p, _ in matrices:  # slow path: accumulate the raw gradient
            state = self.state[p]
            state["acc"].add_(self._grad[p])
            state["acc_count"] += 1
        self.steps_accumulated += 1

        trigger = self._auto_vote(matrices) if self.schedule.is_auto else False
        if self.schedule.is_update_boundary(t, steps_accumulated=self.steps_accumulated, auto_trigger=trigger):
            self._host_update(max_norm)

    def _setting(self, group: dict, name: str):
        """A param group's own ``topk_ratio``/``importance``, else the config's."""
        return group.get(name, getattr(self.config, name))

    def _reselect(self, p: torch.Tensor, state: dict, group: dict, t: int) -> None:
        C = p.shape[1]
        k = num_selected(self._setting(group, "topk_ratio"), C)
        importance = self._setting(group, "importance")
        if importance == "random":  # k columns drawn uniformly, seeded with (selection_seed, step, index)
            rng = np.random.default_rng([self.config.selection_seed, t, self._index[id(p)]])
            new = torch.from_numpy(np.sort(rng.choice(C, size=k, replace=False)).astype(np.int64)).to(p.device)
        elif callable(importance):  # a researcher's scorer: top-k of what it returns
            new = top_columns(importance(self._grad[p], p).detach().to(p.device, torch.float64), k)
        else:
            new = top_columns(column_scores(self._grad[p], importance), k)
        old = state["selected"] if state["selected"] is not None else new.new_zeros(0)

        leaving = old[~torch.isin(old, new)]
        state["master"][:, leaving] = p[:, leaving]  # ownership returns to the host, value included

        R = p.shape[0]
        fast = {f"fast_{name}": p.new_zeros(R, k) for name in self.rule.state_names}
        steps = torch.zeros(k, dtype=torch.int64, device=p.device)
        if self.config.reselect_state == "reset":  # zero state, the matrix's one step count
            count = int(state["fast_step"].max()) if state["fast_step"].numel() else 0
            state.update(selected=new, fast_step=steps.fill_(count), **fast)
            return
        for i, j in enumerate(new.tolist()):  # columns that stay keep their state; new ones start at 0
            hit = (old == j).nonzero()
            if hit.numel():
                o = int(hit[0, 0])
                for key, t in fast.items():
                    t[:, i] = state[key][:, o]
                steps[i] = state["fast_step"][o]
        state.update(selected=new, fast_step=steps, **fast)

    def _auto_vote(self, matrices) -> bool:
        """Zen-auto: do at least ``auto_ratio`` of the matrices need a host update now?"""
        voters = needing = 0
        for p, group in matrices:
            state = self.state[p]
            C, k = p.shape[1], state["selected"].numel()
            if k == C:
                continue
            voters += 1
            if k == 0:
                needing += 1
                continue
            mags = column_magnitudes(self._grad[p], "l1" if self._setting(group, "importance") == "l1" else "l2")
            unselected = self._unselected(p, state)
            state["auto_selected"] += float(mags[~unselected].mean())
            state["auto_unselected"] += float(mags[unselected].mean())
            state["auto_count"] += 1
            if state["auto_unselected"] >= state["auto_selected"] / state["auto_count"]:
                needing += 1
        return voters > 0 and needing >= self.config.auto_ratio * voters

    def _host_update(self, max_norm: float | None) -> None:
        """The rule on every host master with the interval's mean gradient (clipped by ``max_norm``, the norm in force
        at this step); write back (now or later)."""
        if self.config.overlap_step:
            self._write_back_pending()  # the previous interval's result lands now: one interval stale
        todo = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and state["kind"] == "matrix":
                    state.update(auto_selected=0.0, auto_unselected=0.0, auto_count=0)
                    if state["acc_count"] > 0:
                        # the mean over the interval; "interval": the sum (each gradient already divided by it)
                        count = 1 if self.config.gradient_scale == "interval" else state["acc_count"]
                        todo.append((p, group, state, state["acc"] / count))
        coef = _clip_coefficient([mean for *_, mean in todo], max_norm)
        for p, group, state, mean in todo:
            state["host_step"] = self._host_step(state["host_step"])
            self._step(state["master"], _scaled(mean, coef), state, state["host_step"], group)
            state["acc"].zero_()
            state["acc_count"] = 0
            state["pending"] = True
            if not self.config.overlap_step:
                self._write_back(p, state)
        self.host_updates += 1
        self.steps_accumulated = 0

    @torch.no_grad()
    def flush(self) -> None:
        """Write back any computed-but-pending host update (e.g. before evaluating or saving weights)."""
        self._write_back_pending()

    # -- checkpoints -------------------------------------------------------------------------------

    _COUNTERS = ("t", "skipped_steps", "host_updates", "selections", "steps_accumulated")

    def state_dict(self) -> dict:
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                packed["params"].append(index[id(p)])
            groups.append(packed)
        state = {}
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    state[index[id(p)]] = {
                        k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state[p].items()
                    }
        zenflow = {name: getattr(self, name) for name in self._COUNTERS}
        zenflow.update(config=self.config.to_dict(), schedule=self.schedule.to_dict(), max_grad_norm=self.max_grad_norm)
        return {"state": state, "param_groups": groups, "zenflow": zenflow}

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError("ReferenceZenFlow.load_state_dict: param_groups do not match this optimizer's")
        for saved, group in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("ReferenceZenFlow.load_state_dict: a param group's size does not match")
        loaded = {}
        for idx, saved in state_dict["state"].items():
            p = params[int(idx)]
            for key in ("master", *self.rule.state_names, "acc"):
                if key in saved and tuple(saved[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"ReferenceZenFlow.load_state_dict: state {key!r} of parameter {idx} has shape "
                        f"{tuple(saved[key].shape)}, the parameter {tuple(p.shape)}"
                    )
            loaded[p] = {k: (v.detach().clone().to(p.device) if torch.is_tensor(v) else v) for k, v in saved.items()}
        zenflow = state_dict["zenflow"]
        config = ZenFlowConfig.from_dict(zenflow["config"])
        schedule = Schedule.from_dict(zenflow["schedule"])
        # validated: apply
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state.clear()
        for p, s in loaded.items():
            self.state[p] = s
        self.config, self.schedule, self.max_grad_norm = config, schedule, zenflow["max_grad_norm"]
        for name in self._COUNTERS:
            setattr(self, name, int(zenflow[name]))
