"""The fast path's fused kernels of Adam, Lion and SGD (``ops.multi_selective_{adamw,lion,sgd}_items_`` on CPU:
numba) against the rules' plain torch step on the gathered columns (``UpdateRule.reference_fast_step_``), over a
table of items: parameter dtypes with and without an fp32 master, gradient dtypes, dense and indexed columns, int
and per-column step counts (first steps included), grad_scale, weight decay, every SGD form, strided tensors (the
torch step), and a layout kept across calls while the gradients, step counts and lr change. Lion and SGD are
bit-identical (the kernels round as ATen's AVX2/AVX-512 ops do, as their host kernels); Adam divides by grad_scale
and fuses as the AdamW kernel does, so it is held to AdamW's tolerance against torch."""

from __future__ import annotations

import pytest
import torch

from zenflow_kernels import ops, rules
from zenflow_kernels.launch_plan import LaunchItems

RULES = {
    "adam": (rules.Adam(weight_decay=0.1), dict(beta1=0.9, beta2=0.999, eps=1e-8)),
    "adam-nowd": (rules.Adam(), dict(beta1=0.8, beta2=0.99, eps=1e-6)),
    "lion": (rules.Lion(), dict(beta1=0.9, beta2=0.99)),
    "lion-b1-0.6": (rules.Lion(), dict(beta1=0.6, beta2=0.3)),
    "sgd": (rules.SGD(), dict(momentum=0.0, dampening=0.0, nesterov=False)),
    "sgd-momentum": (rules.SGD(momentum=0.9), dict(momentum=0.9, dampening=0.0, nesterov=False)),
    "sgd-dampening": (rules.SGD(momentum=0.5, dampening=0.3), dict(momentum=0.5, dampening=0.3, nesterov=False)),
    "sgd-nesterov": (rules.SGD(momentum=0.9, nesterov=True), dict(momentum=0.9, dampening=0.0, nesterov=True)),
    # a param group with momentum 0 under a rule that keeps a buffer: the buffer is left alone
    "sgd-group-momentum-0": (rules.SGD(momentum=0.9), dict(momentum=0.0, dampening=0.0, nesterov=False)),
}
EXACT = {"lion", "lion-b1-0.6", "sgd", "sgd-momentum", "sgd-dampening", "sgd-nesterov", "sgd-group-momentum-0"}


def make_item(rule, gen, *, R, C, k, pdtype, gdtype, master, per_column, step=3, lr=1e-2, wd=0.1, strided=False):
    """One item as the fast path builds it, mid-training (non-zero state)."""
    p = torch.randn(R, C, generator=gen).to(pdtype)
    g = torch.randn(R, C, generator=gen).to(gdtype)
    if strided:
        g = torch.randn(C, R, generator=gen).to(gdtype).t()
    cols = None if k is None else torch.randperm(C, generator=gen)[:k].sort().values
    kk = C if k is None else k
    state = [torch.randn(R, kk, generator=gen) for _ in rule.state_names]
    if "exp_avg_sq" in rule.state_names:
        state[1] = state[1].abs()
    w = None
    if master:
        w = (p.float() if cols is None else p.float()[:, cols]) + 1e-3 * torch.randn(R, kk, generator=gen)
    if per_column:  # first steps among later ones
        steps = torch.randint(1, 4, (kk,), generator=gen)
        steps[0] = 1
        step = steps
    return (p, g, cols, *state, w, step, lr, wd)


def clone(items):
    return [tuple(x.clone() if torch.is_tensor(x) else x for x in it) for it in items]


def advance(items):
    """The next step's items: counts + 1, new gradients (new tensors, as after a backward), a new lr."""
    out = []
    for it in items:
        *head, step, lr, wd = it
        head[1] = torch.randn_like(head[1].float()).to(head[1].dtype)
        out.append((*head, step + 1, lr * 0.9, wd))
    return out


def compare(a, b, exact: bool):
    for ia, ib in zip(a, b, strict=True):
        for x, y in zip(ia, ib, strict=True):
            if not torch.is_tensor(x) or x.dtype == torch.int64:
                continue
            if exact:
                assert torch.equal(x, y) or torch.equal(x.isnan(), y.isnan()) and torch.equal(
                    x.nan_to_num(), y.nan_to_num()), (x - y).abs().max()
            elif x.dtype == torch.float32:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
            else:  # a low-precision parameter: the same rounding of fp32 values within the tolerance above
                torch.testing.assert_close(x.float(), y.float(), rtol=torch.finfo(x.dtype).eps, atol=0)


# (parameter dtype, gradient dtype, an fp32 master): the optimizer's three, a gradient of another dtype and a
# low-precision parameter without a master; each a compiled signature of the kernels, so few
DTYPES = [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, True),
          (torch.float16, torch.float16, True), (torch.bfloat16, torch.float32, True),
          (torch.float16, torch.float16, False)]
LAYOUTS = [(*d, k, per_column) for d in DTYPES for k in (None, 5) for per_column in (False, True)]


@pytest.mark.parametrize("grad_scale", [1.0, 1024.0, 3.0])
@pytest.mark.parametrize("name", list(RULES))
def test_fused_fast_path_equals_the_rules_torch_step(name, grad_scale):
    """Every layout in one launch list (several launch groups), three steps with changing gradients, counts and lr,
    the layout kept (LaunchItems) against a plain list stepped by the torch reference."""
    rule, launch_hyperparams = RULES[name]
    gen = torch.Generator().manual_seed(len(name))
    items = []
    for n, (pdtype, gdtype, master, k, per_column) in enumerate(LAYOUTS):
        items.append(make_item(rule, gen, R=3 + n % 4, C=11, k=k, pdtype=pdtype, gdtype=gdtype, master=master,
                               per_column=per_column and k is not None, step=1 + n % 3, wd=0.1 * (n % 2)))
    items.append(make_item(rule, gen, R=1, C=5000, k=None, pdtype=torch.float32, gdtype=torch.float32, master=False,
                           per_column=False))  # a long vector: split across work items
    items.append(make_item(rule, gen, R=4, C=9, k=3, pdtype=torch.float32, gdtype=torch.float32, master=False,
                           per_column=True, strided=True))  # strided gradient: the torch step
    fused, ref = clone(items), clone(items)
    cache: dict = {}
    for _ in range(3):
        with ops.use_backend("numba"):
            rule.fast_step_(LaunchItems(fused, cache), grad_scale=grad_scale, **launch_hyperparams)
        rule.reference_fast_step_(ref, grad_scale=grad_scale, **launch_hyperparams)
        compare(fused, ref, name in EXACT)
        nxt = advance(fused)
        fused = nxt
        ref = [(*r[:1], n[1].clone(), *r[2:-3], n[-3].clone() if torch.is_tensor(n[-3]) else n[-3], n[-2], n[-1])
               for r, n in zip(ref, nxt, strict=True)]
    assert "numba" in cache  # the layout was kept and checked against the new gradients at every call


@pytest.mark.parametrize("name", ["lion", "sgd-momentum", "sgd-nesterov", "adam"])
def test_specials_like_the_torch_step(name):
    """inf and NaN in parameters, gradients and state, with and without weight decay: what the torch step does
    (Lion's sign of NaN is 0; no 0 * inf from a weight decay of 0)."""
    rule, launch_hyperparams = RULES[name]
    vals = torch.tensor([0.0, -0.0, 1.0, -2.0, float("inf"), float("-inf"), float("nan"), 1e-30])
    n = vals.numel()
    p = vals.repeat(n, 1).t().contiguous()  # [8, 8]: every parameter value against every gradient value
    g = vals.repeat(n, 1).contiguous()
    for wd in (0.0, 0.1):
        state = [torch.full((n, n), 0.5) for _ in rule.state_names]
        items = [(p.clone(), g.clone(), None, *state, None, 2, 1e-2, wd)]
        fused, ref = clone(items), clone(items)
        with ops.use_backend("numba"):
            rule.fast_step_(fused, grad_scale=1.0, **launch_hyperparams)
        rule.reference_fast_step_(ref, grad_scale=1.0, **launch_hyperparams)
        for x, y in zip(fused[0], ref[0], strict=True):
            if torch.is_tensor(x):
                torch.testing.assert_close(x, y, equal_nan=True, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["lion", "sgd-momentum", "adam"])
def test_dispatch_goes_to_the_fused_kernel(name, monkeypatch):
    """On CPU tensors the rule's fast step is the numba kernel, not the torch step (a path nothing runs is broken)."""
    rule, launch_hyperparams = RULES[name]
    calls = []
    monkeypatch.setattr(type(rule), "reference_fast_step_", lambda self, *a, **k: calls.append(a))
    gen = torch.Generator().manual_seed(0)
    items = [make_item(rule, gen, R=3, C=7, k=2, pdtype=torch.float32, gdtype=torch.float32, master=False,
                       per_column=True)]
    before = items[0][0].clone()
    with ops.use_backend("numba"):
        rule.fast_step_(items, grad_scale=1.0, **launch_hyperparams)
    assert not calls and not torch.equal(items[0][0], before)
