"""The Triton fast paths of rules.Adam (L2 decay), rules.Lion and rules.SGD against their torch reference
(``UpdateRule.fast_step_`` of the base class: each item's columns stepped with the rule's plain-torch ``step_``),
applied to clones of the same tensors: several items per launch (mixed dtypes, shapes, lr, weight decay, dense and
selected, masters, per-column steps), several steps each, from non-zero state.

Bit-exactness under TRITON_INTERPRET: torch's CPU kernels compute ``lerp`` and ``add(x, alpha=a)`` as fused
multiply-adds, and the Lion and SGD kernels write ``tl.fma`` there, so they are bit-identical to torch on CPU (the
reference steps a low-precision parameter without a master in fp32 and rounds once, as the kernels do). The Adam
kernel is the AdamW kernel: its lerp and moment updates are unfused, it
divides by ``grad_scale`` where torch multiplies by the reciprocal, and its per-column bias corrections are fp32
(``_one_minus_pow``) where torch's are double: its results are within a few fp32 ulps, not bit-identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from zenflow_kernels import rules
from zenflow_kernels.launch_plan import LaunchItems
from zenflow_kernels.rules.base import UpdateRule

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or a CUDA device")

sa = pytest.importorskip("zenflow_kernels.triton.selective_adamw")
sl = pytest.importorskip("zenflow_kernels.triton.selective_lion")
ss = pytest.importorskip("zenflow_kernels.triton.selective_sgd")
from zenflow_kernels.triton._util import count_launches  # noqa: E402

RTOL, ATOL = 1e-6, 1e-7  # fp32 tensors (a few ulps at the tensors' scale)
STEPS = 3
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Spec:
    """One item: param [R, C] (``pdtype``), grad (``gdtype``), k selected columns (None: dense), its step counts."""

    R: int = 17
    C: int = 33
    k: int | None = 7
    pdtype: torch.dtype = FP32
    gdtype: torch.dtype | None = None  # None: as pdtype
    master: bool = False
    per_col: bool = False  # int64 counts [k], some of them 1 (columns that just entered the selection)
    start: int = 4  # the int step count of the first step (1: SGD's fresh buffer)
    lr: float = 1e-2
    wd: float = 0.1
    transposed: bool = False  # param and grad are transposed views (strided)


@dataclass(frozen=True)
class Scenario:
    """One launch's items and the rule's launch_hyperparams, run STEPS times."""

    rule: str  # "adam", "lion", "sgd"
    hyper: dict = field(default_factory=dict)  # the rule's constructor arguments (weight decay is per item)
    grad_scale: float = 1.0
    items: tuple = ()
    no_wd: bool = False  # every item's weight decay 0


MIX = (
    Spec(),
    Spec(R=5, C=9, k=None, transposed=True, lr=3e-2, wd=0.0),
    Spec(R=1, C=1500, k=None, lr=2e-3),  # a vector as [1, n]: two 1024-wide tiles, ragged
    Spec(R=17, C=33, k=12, pdtype=BF16, gdtype=FP32, master=True, per_col=True, start=1),
    Spec(R=5, C=9, k=4, pdtype=FP16, gdtype=BF16, master=True, lr=5e-3, wd=0.05),
    Spec(R=9, C=300, k=200, gdtype=FP16, per_col=True, transposed=True),  # 128-wide tiles, ragged both ways
    Spec(R=4, C=6, k=0),  # nothing selected: no work, no launch
    Spec(R=1, C=1300, k=None, pdtype=BF16, master=True, per_col=True, wd=0.0),
    Spec(R=6, C=20, k=5, pdtype=BF16, gdtype=FP16, start=1),  # low precision without a master (selected)
    Spec(R=3, C=40, k=None, pdtype=FP16, lr=1e-3),  # low precision without a master, dense: torch steps it as is
)
SMALL = (Spec(R=5, C=9, k=3, start=1), Spec(R=1, C=1100, k=None, pdtype=BF16, master=True, per_col=True))

SCENARIOS = [
    Scenario("adam", dict(betas=(0.9, 0.999), eps=1e-8), 1.0, MIX),
    Scenario("adam", dict(betas=(0.3, 0.5), eps=1e-6), 2.0**-7, MIX),  # lerp weight >= 0.5: torch's other branch
    Scenario("adam", dict(betas=(0.9, 0.95), eps=1e-8), 1024.0, SMALL, no_wd=True),
    Scenario("lion", dict(betas=(0.9, 0.99)), 1.0, MIX),
    Scenario("lion", dict(betas=(0.4, 0.45)), 2.0**-7, MIX),  # lerp weights >= 0.5: torch's other branch
    Scenario("lion", dict(betas=(0.95, 0.98)), 1024.0, SMALL, no_wd=True),
    Scenario("sgd", dict(momentum=0.0), 1.0, MIX),  # no buffer
    Scenario("sgd", dict(momentum=0.9), 2.0**-7, MIX),
    Scenario("sgd", dict(momentum=0.9, nesterov=True), 1024.0, MIX),
    Scenario("sgd", dict(momentum=0.5, dampening=0.3), 1.0, MIX),
    Scenario("sgd", dict(momentum=0.9, dampening=0.1), 1.0, SMALL, no_wd=True),
]


def rule_of(sc: Scenario):
    """(rule, its launch_hyperparams) of a scenario."""
    if sc.rule == "adam":
        b1, b2 = sc.hyper["betas"]
        return rules.Adam(**sc.hyper), dict(beta1=b1, beta2=b2, eps=sc.hyper["eps"])
    if sc.rule == "lion":
        b1, b2 = sc.hyper["betas"]
        return rules.Lion(**sc.hyper), dict(beta1=b1, beta2=b2)
    r = rules.SGD(**sc.hyper)
    return r, dict(momentum=r.momentum, dampening=r.dampening, nesterov=r.nesterov)


def kernel_step(sc: Scenario, items, launch_hyperparams: dict) -> None:
    h = launch_hyperparams
    if sc.rule == "adam":
        sa.multi_selective_adamw_items_(items, h["beta1"], h["beta2"], h["eps"], sc.grad_scale, decoupled=False)
    elif sc.rule == "lion":
        sl.multi_selective_lion_items_(items, h["beta1"], h["beta2"], sc.grad_scale)
    else:
        ss.multi_selective_sgd_items_(items, h["momentum"], h["dampening"], h["nesterov"], sc.grad_scale)


def build(spec: Spec, n_state: int, device: str, seed: int) -> dict:
    """Initial tensors of one item (state non-zero: mid-training) and its per-step gradients."""
    gen = torch.Generator().manual_seed(seed)
    R, C = spec.R, spec.C
    p32 = torch.randn(R, C, generator=gen)
    idx = None if spec.k is None else torch.sort(torch.randperm(C, generator=gen)[: spec.k]).values
    k = C if idx is None else spec.k
    cols = torch.arange(C) if idx is None else idx
    master = p32[:, cols].clone() if spec.master else None
    param = p32.to(spec.pdtype)
    if spec.master:  # the param holds the rounded master
        param[:, cols] = master.to(spec.pdtype)
    grads = [(torch.randn(R, C, generator=gen) * 0.5).to(spec.gdtype or spec.pdtype) for _ in range(STEPS)]
    state = [torch.randn(R, k, generator=gen) * 0.01 if i == 0 else torch.rand(R, k, generator=gen) * 1e-3
             for i in range(n_state)]
    if spec.per_col:
        step = torch.randint(2, 40, (k,), generator=gen)
        step[: min(k, 3)] = 1
    else:
        step = spec.start

    def strided(t):  # param and grad only: the compact state is contiguous
        return t.t().contiguous().to(device).t() if spec.transposed else t.to(device)

    return dict(param=strided(param), grads=[strided(g) for g in grads], idx=None if idx is None else idx.to(device),
                state=[s.to(device) for s in state], master=None if master is None else master.to(device),
                step=step.to(device) if spec.per_col else step)


def clone(d: dict) -> dict:
    return dict(d, param=d["param"].clone(), state=[s.clone() for s in d["state"]],
                master=None if d["master"] is None else d["master"].clone(),
                step=d["step"].clone() if isinstance(d["step"], torch.Tensor) else d["step"])


def items_at(sc: Scenario, data: list[dict], t: int) -> list[tuple]:
    """The items of step ``t`` (0-based), laid out as ``UpdateRule.fast_step_`` takes them."""
    return [(d["param"], d["grads"][t], d["idx"], *d["state"], d["master"], d["step"] + t, s.lr,
             0.0 if sc.no_wd else s.wd) for s, d in zip(sc.items, data, strict=True)]


def ulps(a: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> float:
    """|a - ref| in units in the last place of ``dtype`` at ``ref`` (or at ``scale``, elementwise)."""
    mant = {BF16: 8, FP16: 11}[dtype]
    tiny = {BF16: 2.0**-133, FP16: 2.0**-24}[dtype]
    _, e = torch.frexp((ref if scale is None else scale).float())
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float64), (e - mant).to(torch.int64)).clamp_min(tiny)
    return float(((a.double() - ref.double()).abs() / ulp).max()) if ref.numel() else 0.0


def excess(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far fp32 ``a`` is outside ``isclose(a, b, RTOL, atol)`` (<= 0: within), ``atol`` ATOL or four ulps at
    the tensor's scale (its largest magnitude), whichever is larger: a moment is a difference (``lerp``), and an
    unfused evaluation of one that cancels to near zero differs from torch's fused one by an ulp of the operands,
    not of the result (grad_scale 2**-7 makes those operands ~100). Non-finite values must match."""
    a, b = a.double(), b.double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)) or not torch.equal(a[~torch.isfinite(a)],
                                                                                b[~torch.isfinite(b)]):
        return float("inf")
    fin = torch.isfinite(a)
    if not fin.any():
        return -1.0
    atol = max(ATOL, 2.0**-21 * float(b[fin].abs().max()))
    return float(((a - b).abs()[fin] - atol - RTOL * b.abs()[fin]).max())


def ulps_at_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in fp32 ulps of the tensor's largest finite magnitude (reported, not asserted)."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not fin.any():
        return 0.0
    _, e = torch.frexp(b[fin].abs().max().float())
    return float((a - b)[fin].abs().max() / 2.0 ** (int(e) - 24))


def exact_expected(sc: Scenario, spec: Spec, device: str) -> bool:
    """Whether the kernel is bit-identical to torch here (module docstring)."""
    return device == "cpu" and sc.rule != "adam"


def n_groups(sc: Scenario, n_state: int) -> int:
    """The launches a scenario's call should take: one per (param dtype, grad dtype, dense?, master?, per-column
    steps? (where the kernel reads them: Adam, SGD with a buffer), tile shape), items with work only."""
    reads_steps = sc.rule == "adam" or (sc.rule == "sgd" and n_state == 1)
    keys = set()
    for s in sc.items:
        k = s.C if s.k is None else s.k
        if s.R * k == 0:
            continue
        keys.add((s.pdtype, s.gdtype or s.pdtype, s.k is None, s.master, s.per_col and reads_steps,
                  sa.tile_for(s.R, k)))
    return len(keys)


KERNEL = {"adam": "_multi_selective_adamw_kernel", "lion": "_multi_selective_lion_kernel",
          "sgd": "_multi_selective_sgd_kernel"}


def run_scenario(sc: Scenario, device: str, seed: int = 0):
    """Kernel and torch on clones of the same items, STEPS steps. Returns per item (index, spec, asserted measures
    (<= 0 passes), measured differences), the launches of each call, and the number of groups expected."""
    rule, launch_hyperparams = rule_of(sc)
    n_state = len(rule.state_names)
    data = [build(s, n_state, device, seed + i) for i, s in enumerate(sc.items)]
    got, ref = [clone(d) for d in data], [clone(d) for d in data]
    launches = []
    for t in range(STEPS):
        with count_launches() as n:
            kernel_step(sc, items_at(sc, got, t), launch_hyperparams)
        launches.append(dict(n))
        UpdateRule.fast_step_(rule, items_at(sc, ref, t), grad_scale=sc.grad_scale, **launch_hyperparams)
    rows = []
    for i, (s, d0, a, b) in enumerate(zip(sc.items, data, got, ref, strict=True)):
        m, seen = {}, {}  # asserted (<= 0 passes); measured (fp32: ulps at scale, low precision: ulps)
        for j, name in enumerate(rule.state_names):
            m[name] = excess(a["state"][j], b["state"][j])
            seen[name] = ulps_at_scale(a["state"][j], b["state"][j])
        if s.master:
            m["master"] = excess(a["master"], b["master"])
            seen["master"] = ulps_at_scale(a["master"], b["master"])
            cols = slice(None) if s.k is None else a["idx"]
            m["param!=round(master)"] = float(not torch.equal(a["param"][:, cols], a["master"].to(s.pdtype)))
        if s.pdtype == FP32:
            m["param"] = excess(a["param"], b["param"])
            seen["param"] = ulps_at_scale(a["param"], b["param"])
        elif s.k is None and not s.master:
            # torch steps a dense low-precision param in its own dtype: Lion rounds after the decay and again after
            # the update, where the kernel rounds once; a step's rounding difference is an ulp at the magnitude w had
            # then, at most |w0| + STEPS * lr (not at the result's, which may be near zero)
            scale = d0["param"].float().abs() + STEPS * s.lr
            seen[f"param ({s.pdtype})"] = ulps(a["param"], b["param"].float(), s.pdtype, scale)
            m["param ulps"] = seen[f"param ({s.pdtype})"] - STEPS
        else:  # one rounding of a few-ulp fp32 difference
            seen[f"param ({s.pdtype})"] = ulps(a["param"], b["param"].float(), s.pdtype)
            m["param ulps"] = seen[f"param ({s.pdtype})"] - 1.0
        if exact_expected(sc, s, device):
            tensors = [(a["param"], b["param"]), *zip(a["state"], b["state"], strict=True)]
            if s.master:
                tensors.append((a["master"], b["master"]))
            m["not bit-identical"] = float(not all(torch.equal(x, y) for x, y in tensors))
        k = s.C if s.k is None else s.k
        m["not moved"] = float(s.R * k > 0 and torch.equal(a["param"], d0["param"]))
        m["moved with k=0"] = float(s.R * k == 0 and not torch.equal(a["param"], d0["param"]))
        rows.append((i, s, m, seen))
    return rows, launches, n_groups(sc, n_state)


def _worst(rows) -> dict:
    return {key: max(seen[key] for *_, seen in rows if key in seen) for key in {k for *_, seen in rows for k in seen}}


@pytest.mark.parametrize("device", DEVICES)
def test_rules_sweep(device):
    """Every scenario: kernel vs torch on every item and tensor; one launch per group at every step."""
    bad, worst = [], {}
    for sc in SCENARIOS:
        rows, launches, groups = run_scenario(sc, device)
        want = {KERNEL[sc.rule]: groups}
        if any(n != want for n in launches):
            bad.append((sc.rule, sc.hyper, sc.grad_scale, "launches", launches, want))
        for i, s, m, _ in rows:
            if max(m.values()) > 0:
                bad.append((sc.rule, sc.hyper, sc.grad_scale, i, s, {k: v for k, v in m.items() if v > 0}))
        w = _worst(rows)
        for key, v in w.items():
            worst[(sc.rule, key)] = max(worst.get((sc.rule, key), -1.0), v)
    summary = "\n".join(f"  {key}: {worst[key]:.3g}" for key in sorted(worst))
    assert not bad, "\n".join(map(str, bad)) + (
        "\nlargest kernel-torch difference by rule and tensor (fp32: ulps at the tensor's scale; bf16/fp16: ulps):\n"
        + summary)


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_items_unchanged_by_default(device):
    """decoupled=True (the default) is still AdamW: the same results as passing it explicitly, and L2 differs."""
    sc = Scenario("adam", dict(betas=(0.9, 0.999), eps=1e-8), 1.0, MIX[:4])
    data = [build(s, 2, device, i) for i, s in enumerate(sc.items)]
    a, b, c = ([clone(d) for d in data] for _ in range(3))
    for t in range(STEPS):
        sa.multi_selective_adamw_items_(items_at(sc, a, t), 0.9, 0.999, 1e-8, 1.0)
        sa.multi_selective_adamw_items_(items_at(sc, b, t), 0.9, 0.999, 1e-8, 1.0, decoupled=True)
        sa.multi_selective_adamw_items_(items_at(sc, c, t), 0.9, 0.999, 1e-8, 1.0, decoupled=False)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["param"], y["param"]) and all(map(torch.equal, x["state"], y["state"]))
    assert not torch.equal(a[0]["param"], c[0]["param"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["adam", "lion", "sgd"])
def test_launch_items_plan_reused(device, rule):
    """LaunchItems keep their plan across steps (new gradient tensors at new addresses, per-column step tensors
    advanced in place) and stay correct; a gradient of another layout gets a new plan."""
    hyper = {"adam": dict(betas=(0.9, 0.99), eps=1e-8), "lion": dict(betas=(0.9, 0.99)),
             "sgd": dict(momentum=0.9, nesterov=True)}[rule]
    sc = Scenario(rule, hyper, 2.0**-7, (MIX[0], MIX[3], MIX[5], MIX[7]))
    r, launch_hyperparams = rule_of(sc)
    n_state = len(r.state_names)
    data = [build(s, n_state, device, 10 + i) for i, s in enumerate(sc.items)]
    got, ref = [clone(d) for d in data], [clone(d) for d in data]
    cache: dict = {}
    plans, keep = [], []
    for t in range(STEPS):
        items = LaunchItems([(d["param"], d["grads"][t].clone(), d["idx"], *d["state"], d["master"], d["step"], s.lr,
                              s.wd) for s, d in zip(sc.items, got, strict=True)], cache, same_tensors=t % 2 == 1)
        keep.append(items)  # the old gradients stay alive: the new ones are at new addresses
        kernel_step(sc, items, launch_hyperparams)
        plans.append(cache["triton"])
        UpdateRule.fast_step_(r, [(d["param"], d["grads"][t], d["idx"], *d["state"], d["master"], d["step"], s.lr,
                                   s.wd) for s, d in zip(sc.items, ref, strict=True)],
                              grad_scale=sc.grad_scale, **launch_hyperparams)
        for d in (*got, *ref):
            d["step"] += 1  # a step tensor in place: the same object at the next step
    assert all(p is plans[0] for p in plans)
    for s, a, b in zip(sc.items, got, ref, strict=True):
        fp32 = [(x, y) for x, y in zip(a["state"], b["state"], strict=True)]
        if s.master:
            fp32.append((a["master"], b["master"]))
        if s.pdtype == FP32:
            fp32.append((a["param"], b["param"]))
        else:
            assert ulps(a["param"], b["param"].float(), s.pdtype) <= 1.0, s
        assert max(excess(x, y) for x, y in fp32) <= 0, s
    # a gradient with other strides: laid out again
    items = LaunchItems([(d["param"], d["grads"][0].t().contiguous().t(), d["idx"], *d["state"], d["master"],
                          d["step"], s.lr, s.wd) for s, d in zip(sc.items, got, strict=True)], cache)
    kernel_step(sc, items, launch_hyperparams)
    assert cache["triton"] is not plans[0]


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_edges(device):
    """torch's semantics at non-finite values: Lion moves nothing through the sign of NaN (sign(NaN) = 0), and an
    inf parameter stays inf with weight decay 0 (no 0 * inf NaN) in all three rules."""
    p = torch.tensor([[1.0, 2.0, float("inf"), -float("inf"), -3.0, 0.0]], device=device)
    g = torch.tensor([[0.5, -0.5, 1.0, 1.0, 0.0, 0.0]], device=device)
    nan_m = torch.tensor([[float("nan"), float("nan"), 0.1, -0.1, 0.0, 0.0]], device=device)
    cases = [
        ("lion", dict(betas=(0.9, 0.99)), [nan_m]),
        ("lion", dict(betas=(0.9, 0.99)), [torch.zeros_like(p)]),
        ("adam", dict(betas=(0.9, 0.999), eps=1e-8), [torch.zeros_like(p), torch.zeros_like(p)]),
        ("sgd", dict(momentum=0.9), [torch.ones_like(p)]),
        ("sgd", dict(momentum=0.0), []),
    ]
    for name, hyper, state in cases:
        sc = Scenario(name, hyper, 1.0)
        r, launch_hyperparams = rule_of(sc)
        a = [p.clone(), *(s.clone() for s in state)]
        b = [p.clone(), *(s.clone() for s in state)]
        kernel_step(sc, [(a[0], g, None, *a[1:], None, 2, 0.1, 0.0)], launch_hyperparams)
        UpdateRule.fast_step_(r, [(b[0], g, None, *b[1:], None, 2, 0.1, 0.0)], grad_scale=1.0, **launch_hyperparams)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.isinf(a[0][0, 2:4]).all(), (name, a[0])
        if state and state[0] is nan_m:
            assert torch.equal(a[0][0, :2], p[0, :2])  # sign(NaN) = 0: not moved
            assert torch.isnan(a[1][0, :2]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_momentum_needs_a_buffer(device):
    p = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="momentum buffer"):
        ss.multi_selective_sgd_items_([(p, p, None, None, 1, 0.1, 0.0)], 0.9, 0.0, False, 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_buffer_with_momentum_zero_is_left_alone(device):
    """Items with a buffer but momentum 0 (a param group of a momentum rule): the buffer is not touched (torch)."""
    d = build(Spec(R=5, C=9, k=4), 1, device, 3)
    buf, p0 = d["state"][0].clone(), d["param"].clone()
    items = [(d["param"], d["grads"][0], d["idx"], d["state"][0], None, 3, 0.1, 0.0)]
    ref = clone(d)
    ss.multi_selective_sgd_items_(items, 0.0, 0.0, False, 1.0)
    UpdateRule.fast_step_(rules.SGD(momentum=0.9), [(ref["param"], d["grads"][0], d["idx"], ref["state"][0], None, 3,
                                                     0.1, 0.0)], grad_scale=1.0, momentum=0.0, dampening=0.0,
                          nesterov=False)
    assert torch.equal(d["state"][0], buf) and torch.equal(ref["state"][0], buf)
    assert excess(d["param"], ref["param"]) <= 0 and not torch.equal(d["param"], p0)
