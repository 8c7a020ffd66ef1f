"""Every update rule against an independent oracle (issue 54 item 6): torch's own optimizers (Lion: the paper's loop,
written below as a plain-torch optimizer, since torch has none) for the update math, ``ReferenceZenFlow`` for the
algorithm; never one of our paths against another of ours.

* Defaults and per-group hyper-parameters: ``rules.AdamW()``, ``Adam()``, ``Lion()``, ``SGD()`` against the torch
  optimizer's defaults, and each rule with three param groups of their own numbers (SGD: momentum, Nesterov,
  dampening and weight decay per group) against the torch optimizer with the same groups, where a split rule is its
  plain rule (docs/design.md section 13): every column on the device (``topk_ratio=1``, on the torch, numba and
  Triton-interpreter fast paths) and every column on the host at every step (``topk_ratio=0, update_interval=1``,
  the numba host kernels and the rule's torch ``host_step_``).
* bf16 state (``state_dtype=torch.bfloat16``) for every rule on every path: on the host (numba kernels, and the torch
  ``host_step_`` of a rule without a host kernel) the rule whose stored matrix state is rounded to bf16 after each
  step (the step itself reads the stored values and updates the parameter with the unrounded new ones); on the fast
  path (torch, numba, Triton) the plain rule (the device's state stays fp32).
* An LR scheduler (LambdaLR, StepLR) with the selection's layout kept across steps (the fused launches are laid out
  once per selection): every rule on the torch and numba fast paths against the reference under the same schedule;
  on the Triton interpreter (slow) AdamW against the reference and every rule, with groups and bf16 state, against
  its torch optimizer under the same LambdaLR.
"""

from __future__ import annotations

import pytest
import torch
from support import SHAPES, grad_sequence, make_params, snapshot
from tolerance import assert_within_stated_bound

from zenflow_kernels import ZenFlow, ops, rules
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.rules.base import UpdateRule

LR = 2e-2
STEPS = 8
FAST_BACKENDS = ["torch", "numba", "triton"]


# -- the oracles ----------------------------------------------------------------------------------------------


class PaperLion(torch.optim.Optimizer):
    """Lion as Algorithm 2 of Chen et al. 2023 writes it, plain multiply-adds (torch has no Lion), with param groups
    and the paper's (and lion-pytorch's) defaults: betas (0.9, 0.99), weight decay 0."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.sub_(lr * (torch.sign(c) + wd * p))
                m.copy_(b2 * m + (1 - b2) * p.grad)


TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "lion": PaperLion}
RULE = {"adamw": rules.AdamW, "adam": rules.Adam, "sgd": rules.SGD, "lion": rules.Lion}
STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",),
         "sgd": ("momentum_buffer",)}


def split(params):
    """Three param groups over the model's parameters: the first layer, the middle (a matrix and three vectors), the
    last matrix."""
    return [params[:2], params[2:5], params[5:]]


# each rule's param groups: (the rule's own arguments (the groups' defaults), each group's own numbers)
GROUPS = {
    "adamw": (dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05),
              [dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1), {}, dict(lr=1e-2, betas=(0.9, 0.9),
                                                                                     weight_decay=0.0)]),
    "adam": (dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
             [dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1), {}, dict(lr=1e-2, weight_decay=0.02)]),
    "lion": (dict(betas=(0.9, 0.99), weight_decay=0.1),
             [dict(lr=1e-2, betas=(0.95, 0.98), weight_decay=0.0), {}, dict(betas=(0.8, 0.99), weight_decay=0.3)]),
    "sgd": (dict(momentum=0.9),
            [dict(lr=3e-2, nesterov=True, weight_decay=0.01), {},
             dict(momentum=0.5, dampening=0.2, weight_decay=0.05)]),
}


def groups_of(params, name):
    return [dict(params=ps, **own) for ps, own in zip(split(params), GROUPS[name][1], strict=True)]


def torch_optimizer(name, params, grouped):
    if not grouped:
        return TORCH[name](params, lr=LR, **({} if name == "lion" else dict(foreach=False)))
    kw = {} if name == "lion" else dict(foreach=False)
    return TORCH[name](groups_of(params, name), lr=LR, **GROUPS[name][0], **kw)


def run_torch(opt, params, grads, *, rounded=(), scheduler=None):
    """A torch optimizer over ``grads``: the weights after every step. ``rounded``: the state names rounded to bf16
    (nearest even) in the matrices after each step, as a host holding bf16 state keeps them; ``scheduler`` stepped
    after each step."""
    history = []
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()
        for p in params:
            if p.dim() == 2:
                for key in rounded:
                    opt.state[p][key].copy_(opt.state[p][key].bfloat16().float())
        if scheduler is not None:
            scheduler.step()
        history.append(snapshot(params))
    return history


def torch_host(cls):
    """``cls`` without its host kernels: the host steps with ``UpdateRule``'s default, the rule's torch ``step_``."""
    return type(f"TorchHost{cls.__name__}", (cls,), dict(host_step_=UpdateRule.host_step_,
                                                         host_accumulate_step_=UpdateRule.host_accumulate_step_,
                                                         fuses_last=False))


DEVICE_ONLY = dict(topk_ratio=1.0, update_interval=2, select_strategy="step", select_interval=4, overlap_step=False)
HOST_EVERY_STEP = dict(topk_ratio=0.0, update_interval=1, select_strategy="step", select_interval=4,
                       overlap_step=False)


def run_zenflow(rule, groups, params, grads, zen, backend, scheduler=None):
    """ZenFlow with ``rule`` over ``groups`` (of ``params``) on the ``backend`` fast path: the weights after every
    step (``scheduler(opt)``: an LR scheduler, stepped after each step)."""
    with ops.use_backend(backend), ZenFlow(groups, rule, lr=LR, zenflow=zen) as opt:
        sched = None if scheduler is None else scheduler(opt)
        history = []
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
            if sched is not None:
                sched.step()
            history.append(snapshot(params))
        for name in rule.state_names:
            assert opt.host_shard.fields[name].dtype == rule.state_dtype
    return history


def tolerance(name, backend):
    """Torch's single-tensor optimizers against our kernels: a few fp32 ulps (AdamW/Adam: the kernels' reciprocal
    against ATen's sqrt and division; Lion: lerp against the paper's multiply-add, an ulp of p per step; the Triton
    AdamW kernel's fp32 bias corrections a few more)."""
    if name == "lion" or (backend == "triton" and name in ("adamw", "adam")):
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-6, atol=1e-7)


def assert_histories_close(got, want, what, **tol):
    assert len(got) == len(want), what
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(x, y, **tol, msg=lambda m, t=t, i=i: f"{what} step {t} p{i} {SHAPES[i]}: {m}")


_GRADS = grad_sequence(STEPS)
_WANT: dict = {}


def want_history(name, grouped):
    """The torch optimizer (with the rule's groups, or with its own defaults) over ``_GRADS``, computed once."""
    if (name, grouped) not in _WANT:
        params = make_params()
        _WANT[name, grouped] = run_torch(torch_optimizer(name, params, grouped), params, _GRADS)
    return _WANT[name, grouped]


# -- defaults and per-group hyper-parameters ------------------------------------------------------------------

REDUCTIONS = [("device-only", "torch", "numba"), ("device-only", "numba", "numba"),
              ("host-every-step", "numba", "numba"), ("host-every-step", "numba", "torch")]


@pytest.mark.parametrize("where, backend, host", REDUCTIONS, ids=[f"{w}-{b}fast-{h}host" for w, b, h in REDUCTIONS])
@pytest.mark.parametrize("grouped", [False, True], ids=["defaults", "groups"])
@pytest.mark.parametrize("name", list(RULE))
def test_each_rule_with_its_defaults_and_groups_is_its_torch_optimizer(name, grouped, where, backend, host):
    """``rules.X()`` against ``torch.optim.X(params, lr=...)`` (defaults: AdamW's weight decay 0.01, Adam's 0, SGD's
    momentum 0; Lion the paper's), and each rule with three param groups of their own numbers against the torch
    optimizer with the same groups: where ZenFlow reduces to the rule (every column on the device, on the torch and
    numba fast paths; every column on the host at every step, with the numba kernels and with the rule's torch
    ``host_step_``), every step's weights. The Triton fast path: the next test."""
    zen = DEVICE_ONLY if where == "device-only" else HOST_EVERY_STEP
    params = make_params()
    rule = (RULE[name] if host == "numba" else torch_host(RULE[name]))(**(GROUPS[name][0] if grouped else {}))
    got = run_zenflow(rule, groups_of(params, name) if grouped else params, params, _GRADS, zen, backend)
    assert_histories_close(got, want_history(name, grouped), f"{name} {where} {backend}", **tolerance(name, backend))


def decay(t):
    return 0.75**t


@pytest.mark.parametrize("name", list(RULE))
def test_the_triton_fast_path_is_each_rules_torch_optimizer(name):
    """The Triton kernels (interpreted: numpy per program, so one run per rule covers it all): every column on the
    device, three param groups of their own numbers, bf16 host state (the device's stays fp32) and a LambdaLR schedule
    (a new lr at every step, one selection's layout kept): the torch optimizer with the same groups and schedule."""
    steps = _GRADS[:5]
    params = make_params()
    opt = torch_optimizer(name, params, grouped=True)
    want = run_torch(opt, params, steps, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, decay))
    params = make_params()
    rule = RULE[name](**GROUPS[name][0], state_dtype=torch.bfloat16)
    got = run_zenflow(rule, groups_of(params, name), params, steps, DEVICE_ONLY, "triton",
                      scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, decay))
    assert_histories_close(got, want, f"{name} triton", **tolerance(name, "triton"))


def test_the_defaults_are_torchs():
    """The rules' defaults as torch's optimizers (and the Lion paper) set them."""
    assert rules.AdamW().group_defaults() == dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    assert rules.Adam().group_defaults() == dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert rules.Lion().group_defaults() == dict(betas=(0.9, 0.99), weight_decay=0.0)
    assert rules.SGD().group_defaults() == dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
    for name in ("adamw", "adam", "sgd"):
        defaults = TORCH[name]([torch.nn.Parameter(torch.zeros(1))], lr=LR).defaults
        for key, value in RULE[name]().group_defaults().items():
            assert defaults[key] == value, (name, key)


# -- bf16 state on every path ---------------------------------------------------------------------------------

BF16_RULES = {  # the rule's arguments (its groups' defaults)
    "adamw": ("adamw", dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)),
    "adam": ("adam", dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)),
    "lion": ("lion", dict(betas=(0.9, 0.99), weight_decay=0.1)),
    "sgd-momentum": ("sgd", dict(momentum=0.9, weight_decay=0.01)),
    "sgd-dampening": ("sgd", dict(momentum=0.8, dampening=0.1)),
    "sgd-nesterov": ("sgd", dict(momentum=0.9, nesterov=True)),
}
BF16_PATHS = ["numba-host", "torch-host", "torch-fast", "numba-fast"]  # (Triton: the test above)


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("case", list(BF16_RULES))
def test_bf16_state_on_every_path_is_the_rule_with_its_host_state_rounded(case, path):
    """``state_dtype=torch.bfloat16``. On the host (every column there at every step; the numba kernels, or the torch
    ``host_step_`` of a rule without a host kernel): the torch optimizer whose matrices' state is rounded to bf16 after
    each step. On the fast path (every column on the device; torch, numba): the torch optimizer itself (the device's
    state stays fp32)."""
    name, kw = BF16_RULES[case]
    where, kind = path.split("-")
    params = make_params()
    want = run_torch(TORCH[name](params, lr=LR, **kw, **({} if name == "lion" else dict(foreach=False))), params,
                     _GRADS, rounded=STATE[name] if kind == "host" else ())
    cls = torch_host(RULE[name]) if path == "torch-host" else RULE[name]
    params = make_params()
    got = run_zenflow(cls(**kw, state_dtype=torch.bfloat16), params, params, _GRADS,
                      HOST_EVERY_STEP if kind == "host" else DEVICE_ONLY, where if kind == "fast" else "numba")
    assert_histories_close(got, want, f"{case} {path}", **tolerance(name, "numba"))


# -- an LR scheduler on every fast path -------------------------------------------------------------------------

SCHEDULED = {
    "adamw": lambda: rules.AdamW(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05),
    "adam": lambda: rules.Adam(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05),
    "lion": lambda: rules.Lion(betas=(0.9, 0.99), weight_decay=0.1),
    "sgd": lambda: rules.SGD(momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda: rules.SGD(momentum=0.9, nesterov=True),
}
# columns on both paths, one selection kept for 6 steps (the fast path's launches laid out once), a re-selection
SCHEDULED_ZEN = dict(topk_ratio=0.5, update_interval=2, select_strategy="step", select_interval=6, overlap_step=False,
                     full_warm_up_rounds=1)


def scheduled_history(name, mode, scheduler):
    params = make_params()
    if mode == "reference":
        opt = ReferenceZenFlow(params, lr=LR, zenflow=SCHEDULED_ZEN, rule=SCHEDULED[name]())
    else:
        opt = ZenFlow(params, SCHEDULED[name](), lr=LR, zenflow=SCHEDULED_ZEN)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.75**t) if scheduler == "lambda" else
             torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    history, lrs = [], []
    with ops.use_backend(mode if mode != "reference" else "torch"):
        for step in grad_sequence(10):
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            history.append(snapshot(params))
    if mode != "reference":
        opt.close()
    return history, lrs


# the Triton interpreter is slow: AdamW with LambdaLR only (every rule's Triton kernel follows a schedule in
# test_the_triton_fast_path_is_each_rules_torch_optimizer)
SCHEDULES = [(name, backend, scheduler) for name in SCHEDULED for backend in FAST_BACKENDS
             for scheduler in ("lambda", "step")
             if backend != "triton" or (scheduler == "lambda" and name == "adamw")]


@pytest.mark.parametrize("name, backend, scheduler", SCHEDULES, ids=["-".join(c) for c in SCHEDULES])
def test_an_lr_scheduler_is_followed_on_every_fast_path(name, backend, scheduler):
    """LambdaLR (a new lr every step) and StepLR (every other step): the reference with the same schedule, every
    step's weights within the stated bound (tests/tolerance.py), on each fast-path backend."""
    want, want_lrs = scheduled_history(name, "reference", scheduler)
    got, lrs = scheduled_history(name, backend, scheduler)
    assert lrs == want_lrs and len(set(lrs)) > 3
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_within_stated_bound(x, y, lr=LR, steps=t + 1, what=f"{name} {backend} step {t} param {i}")
