"""selective_adamw_ / multi_selective_adamw_: the fused kernel against the torch path, against a naive
float64 per-column loop written here, and against torch.optim.AdamW(foreach=False) on the gathered
columns; several steps each, starting from non-zero moments."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest
import torch

from zenflow_kernels import ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or a CUDA device")

sa = pytest.importorskip("zenflow_kernels.triton.selective_adamw")
from zenflow_kernels.triton._util import count_launches  # noqa: E402

RTOL = 1e-6
STEPS = 3


@dataclass(frozen=True)
class Case:
    R: int = 17
    C: int = 33
    pdtype: torch.dtype = torch.float32
    gdtype: torch.dtype | None = None  # None: same as pdtype
    k: int | None = 7  # None: dense (indices=None)
    master: bool = False
    per_col: bool = False  # int64 step tensor [k] with differing counts
    start: int = 1  # first step count (int mode)
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    wd: float = 0.1
    grad_scale: float = 1.0
    transposed: bool = False  # param and grad are transposed views (strided)
    seed: int = 0


def build(case: Case, device: str):
    """Initial param, per-step grads, indices, state (m, v non-zero: mid-training) and step counts."""
    gen = torch.Generator().manual_seed(case.seed)
    R, C = case.R, case.C
    gdtype = case.gdtype or case.pdtype
    p32 = torch.randn(R, C, generator=gen)
    if case.k is None:
        idx, k = None, C
    else:
        idx = torch.sort(torch.randperm(C, generator=gen)[: case.k]).values
        k = case.k
    cols = torch.arange(C) if idx is None else idx
    master = p32[:, cols].clone() if case.master else None
    param = p32.to(case.pdtype)
    if case.master:  # the param holds the rounded master
        param[:, cols] = master.to(case.pdtype)
    grads = [(torch.randn(R, C, generator=gen) * 0.5).to(gdtype) for _ in range(STEPS)]
    m = torch.randn(R, k, generator=gen) * 0.01
    v = torch.rand(R, k, generator=gen) * 1e-3
    if case.per_col:
        step0 = torch.randint(1, 40, (k,), generator=gen)
        step0[: min(k, 2)] = 1  # columns that just entered the selection
    else:
        step0 = case.start
    to = dict(device=device)

    def strided(t):  # param and grad only: the compact state is always contiguous
        return t.t().contiguous().to(**to).t() if case.transposed else t.to(**to)

    return dict(param=strided(param), grads=[strided(g) for g in grads], idx=None if idx is None else idx.to(**to),
                m=m.to(**to), v=v.to(**to), master=None if master is None else master.to(**to),
                step0=step0.to(**to) if case.per_col else step0)


def run(case: Case, device: str, backend: str, data=None):
    """Apply STEPS updates through ``ops`` with the given backend; return the final tensors (on CPU)."""
    d = build(case, device) if data is None else data
    param, m, v = d["param"].clone(), d["m"].clone(), d["v"].clone()
    master = None if d["master"] is None else d["master"].clone()
    if case.transposed:
        param = d["param"].clone()  # keeps the transposed strides
    assert param.stride() == d["param"].stride()
    with ops.use_backend(backend):
        for t, g in enumerate(d["grads"]):
            step = d["step0"] + t
            ops.selective_adamw_(param, g, d["idx"], m, v, step=step, lr=case.lr, beta1=case.betas[0],
                                 beta2=case.betas[1], eps=case.eps, weight_decay=case.wd, master=master,
                                 grad_scale=case.grad_scale)
    return dict(param=param.cpu(), m=m.cpu(), v=v.cpu(), master=None if master is None else master.cpu())


def naive(case: Case, device: str):
    """Float64, one column at a time, the AdamW formulas as written (no shared code)."""
    d = build(case, "cpu")
    C = case.C
    cols = list(range(C)) if d["idx"] is None else d["idx"].tolist()
    b1, b2 = case.betas
    src = d["master"] if d["master"] is not None else d["param"][:, cols]
    P = src.double().clone()
    M, Vv = d["m"].double().clone(), d["v"].double().clone()
    for t, g in enumerate(d["grads"]):
        for j, c in enumerate(cols):
            s = (int(d["step0"][j]) if case.per_col else d["step0"]) + t
            gj = g[:, c].double() / case.grad_scale
            P[:, j] = P[:, j] * (1 - case.lr * case.wd)
            M[:, j] = b1 * M[:, j] + (1 - b1) * gj
            Vv[:, j] = b2 * Vv[:, j] + (1 - b2) * gj * gj
            bc1, bc2 = 1 - b1**s, 1 - b2**s
            P[:, j] = P[:, j] - (case.lr / bc1) * M[:, j] / (Vv[:, j].sqrt() / bc2**0.5 + case.eps)
    return dict(cols=cols, p=P, m=M, v=Vv)


def optim_oracle(case: Case):
    """torch.optim.AdamW(foreach=False) on the gathered fp32 columns; one optimizer per start count."""
    d = build(case, "cpu")
    cols = torch.arange(case.C) if d["idx"] is None else d["idx"]
    src = d["master"] if d["master"] is not None else d["param"][:, cols].float()
    out_p, out_m, out_v = src.clone(), d["m"].clone(), d["v"].clone()
    starts = d["step0"] if case.per_col else torch.full((len(cols),), d["step0"])
    for s0 in starts.unique().tolist():
        J = torch.nonzero(starts == s0).reshape(-1)
        P = src[:, J].clone().requires_grad_(True)
        opt = torch.optim.AdamW([P], lr=case.lr, betas=case.betas, eps=case.eps, weight_decay=case.wd,
                                foreach=False)
        opt.state[P] = {"step": torch.tensor(float(s0 - 1)), "exp_avg": d["m"][:, J].clone(),
                        "exp_avg_sq": d["v"][:, J].clone()}
        for g in d["grads"]:
            P.grad = g[:, cols[J]].float() / case.grad_scale
            opt.step()
        out_p[:, J] = P.detach()
        out_m[:, J] = opt.state[P]["exp_avg"]
        out_v[:, J] = opt.state[P]["exp_avg_sq"]
    return dict(p=out_p, m=out_m, v=out_v)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative error max|a - b| / max|b|.

    Elementwise relative error is the wrong yardstick here: m = beta1*m + (1-beta1)*g cancels, so two
    correct fp32 evaluations that differ by one rounding of an O(|g|) intermediate can differ by 1e-5
    relative at an entry that happens to be near zero. One ulp of the tensor's scale is ~6e-8.
    """
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def same(a: torch.Tensor, b: torch.Tensor, device: str) -> bool:
    """Two of our kernels on the same inputs: bit-identical under the interpreter (numpy, no FMA); when
    compiled, separately compiled kernels may contract multiply-adds differently: within an fp32 ulp."""
    if device == "cpu":
        return torch.equal(a, b)
    if a.dtype in (torch.bfloat16, torch.float16):
        return ulps(a, b.float(), a.dtype) <= 1.0
    return rel(a, b) <= 2.5e-7


def ulps(a: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """|a - ref| in units in the last place of ``dtype`` at ``ref``."""
    mant = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    tiny = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}[dtype]
    _, e = torch.frexp(ref.float())
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float64), (e - mant).to(torch.int64)).clamp_min(tiny)
    return float(((a.double() - ref.double()).abs() / ulp).max()) if ref.numel() else 0.0


FP32_CASES = [
    Case(),
    Case(wd=0.0),
    Case(grad_scale=4.0),
    Case(per_col=True),
    Case(per_col=True, wd=0.0, grad_scale=0.5),
    Case(start=1000),
    Case(R=1, C=1, k=1),
    Case(R=1, C=300, k=None),  # a vector parameter viewed as [1, n], dense
    Case(R=5, C=1, k=1),
    Case(R=3, C=5, k=None, per_col=True),
    Case(R=20, C=257, k=25),  # column tiles of 32, ragged
    Case(R=9, C=300, k=200),  # column tiles of 128, ragged on both axes
    Case(transposed=True),
    Case(transposed=True, k=None),
    Case(betas=(0.3, 0.5)),  # lerp weight >= 0.5: torch's other lerp branch
    Case(betas=(0.0, 0.0), wd=0.0),  # log(beta) = -inf in the per-column bias correction
    Case(betas=(0.0, 0.0), per_col=True),
    Case(master=True),
    Case(master=True, k=None, per_col=True),
    Case(gdtype=torch.bfloat16),
    Case(gdtype=torch.float16, per_col=True),
]


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_sweep(device):
    """fp32 params: kernel vs torch path vs naive float64 loop vs torch.optim.AdamW, all within 1e-6."""
    table = []
    for case in FP32_CASES:
        d = build(case, device)
        got = run(case, device, "triton", d)
        ref = run(case, device, "torch", d)
        nv = naive(case, device)
        orc = optim_oracle(case)
        cols = nv["cols"]
        p_sel = got["master"] if case.master else got["param"][:, cols]
        errs = {
            "kernel~torch": max(rel(got["param"], ref["param"]), rel(got["m"], ref["m"]), rel(got["v"], ref["v"])),
            "kernel~naive": max(rel(p_sel, nv["p"]), rel(got["m"], nv["m"]), rel(got["v"], nv["v"])),
            "kernel~optim": max(rel(p_sel, orc["p"]), rel(got["m"], orc["m"]), rel(got["v"], orc["v"])),
            "torch~optim": max(rel(ref["master"] if case.master else ref["param"][:, cols], orc["p"]),
                               rel(ref["m"], orc["m"])),
        }
        # untouched columns are bit-identical; with a master the param holds exactly the master
        untouched = [c for c in range(case.C) if c not in set(cols)]
        p0 = d["param"].cpu()
        errs["untouched_equal"] = float(not torch.equal(got["param"][:, untouched], p0[:, untouched]))
        if case.master:
            errs["param==master"] = float(not torch.equal(got["param"][:, cols], got["master"]))
        errs["not_moved"] = float(torch.equal(got["param"][:, cols], p0[:, cols]))  # the update did happen
        table.append((case, errs))
    bad = [(c, e) for c, e in table if max(e.values()) > RTOL]
    assert not bad, "\n".join(f"{c}: {e}" for c, e in bad)
    assert len(table) == len(FP32_CASES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(device, dtype):
    """bf16/fp16 params: with a master, within one ulp of the fp32 result and equal to the rounded master;
    without one, within one ulp per step of the torch path (the same fp32 math rounded to nearest even
    each step: an fp32 rounding difference can flip one rounding per step)."""
    rows = []
    for base in (Case(), Case(per_col=True, grad_scale=2.0), Case(k=None, R=4, C=40), Case(transposed=True)):
        lp = replace(base, pdtype=dtype, master=True)
        got = run(lp, device, "triton")
        nv = naive(lp, device)
        cols = nv["cols"]
        untouched = [c for c in range(base.C) if c not in set(cols)]
        p0 = build(lp, "cpu")["param"]
        rows.append(("master", base, {
            "master~naive": rel(got["master"], nv["p"]),
            "ulps(param, fp32 master)": ulps(got["param"][:, cols], nv["p"], dtype),
            "param!=round(master)": float(not torch.equal(got["param"][:, cols], got["master"].to(dtype))),
            "untouched changed": float(not torch.equal(got["param"][:, untouched], p0[:, untouched])),
        }))
        plain = replace(base, pdtype=dtype)
        a, b = run(plain, device, "triton"), run(plain, device, "torch")
        rows.append(("no master", base, {"ulps(kernel, torch)": ulps(a["param"], b["param"].float(), dtype),
                                         "m": rel(a["m"], b["m"]), "v": rel(a["v"], b["v"])}))
    limits = {"ulps(param, fp32 master)": 1.0, "ulps(kernel, torch)": float(STEPS)}
    bad = [r for r in rows if any(val > limits.get(key, RTOL) for key, val in r[2].items())]
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.parametrize("device", DEVICES)
def test_per_column_steps_equal_int_step(device):
    """A step tensor holding one count everywhere matches the Python-int step (bias corrections computed
    in the kernel vs in double by the launcher)."""
    case = Case(start=7)
    d = build(case, device)
    a = run(case, device, "triton", d)
    b = run(case, device, "triton", dict(d, step0=torch.full((case.k,), 7, dtype=torch.int64, device=device)))
    assert rel(a["param"], b["param"]) <= RTOL
    assert same(a["m"], b["m"], device) and same(a["v"], b["v"], device)  # moments do not see the step


# eps = 0 below: the masked-off lanes of the tile (loaded as zeros, never stored) compute 0/0, which
# the interpreter's numpy reports
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_bias_correction_accuracy(device):
    """1 - beta**s in the kernel (fp32, expm1 series) against double, over betas and step counts."""
    steps = torch.tensor([1, 2, 3, 10, 57, 100, 999, 1000, 5000, 10**5, 10**6], dtype=torch.int64)
    worst = 0.0
    for beta in (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9999):
        R, k = 1, steps.numel()
        p = torch.zeros(R, k, device=device)
        g = torch.ones(R, k, device=device)
        m = torch.zeros(R, k, device=device)
        v = torch.zeros(R, k, device=device)
        # one update from zero state with g = 1: m = 1-b1, v = 1-b2, so the step is lr*(1-b1)/bc1 /
        # (sqrt(1-b2)/sqrt(bc2)): with beta1 = beta and beta2 = 0 it is -lr*(1-beta)/(1-beta**s)
        with ops.use_backend("triton"):
            ops.selective_adamw_(p, g, None, m, v, step=steps.to(device), lr=1.0, beta1=beta, beta2=0.0, eps=0.0,
                                 weight_decay=0.0)
        exact = torch.tensor([-(1 - beta) / (1 - beta ** int(s)) for s in steps], dtype=torch.float64)
        worst = max(worst, rel(p.cpu()[0], exact))
    assert worst <= RTOL, worst  # a plain fp32 1 - beta**s would be off by ~1e-4 at beta=0.9999, s=1


@pytest.mark.parametrize("device", DEVICES)
def test_empty_selection_is_a_no_op(device):
    p = torch.randn(4, 6, device=device)
    p0 = p.clone()
    e = torch.empty(4, 0, device=device)
    with ops.use_backend("triton"), count_launches() as n:
        ops.selective_adamw_(p, torch.randn(4, 6, device=device), torch.empty(0, dtype=torch.int64, device=device),
                             e, e.clone(), step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    assert sum(n.values()) == 0 and torch.equal(p, p0)


MODEL = [
    Case(R=12, C=40, k=4, pdtype=torch.bfloat16, master=True, per_col=True, seed=1),
    Case(R=12, C=40, k=4, pdtype=torch.bfloat16, master=True, per_col=True, seed=2),
    Case(R=1, C=40, k=None, seed=3),  # bias / norm weight, dense
    Case(R=1, C=12, k=None, seed=4),
    Case(R=40, C=12, k=1, seed=5, transposed=True),
    Case(R=7, C=300, k=30, pdtype=torch.float16, seed=6, lr=3e-3, wd=0.0),
    Case(R=12, C=40, k=0, seed=7),
]


def _multi_args(cases, device):
    data = [build(c, device) for c in cases]
    state = [dict(param=d["param"].clone(),
                  m=d["m"].clone(), v=d["v"].clone(), master=None if d["master"] is None else d["master"].clone())
             for c, d in zip(cases, data, strict=True)]
    return data, state


@pytest.mark.parametrize("device", DEVICES)
def test_multi_equals_single_with_constant_launches(device):
    """The multi-tensor kernel reproduces the per-tensor kernel (bit for bit when interpreted; see ``same``)
    with per-tensor lr and weight decay, mixed dtypes, dense and selected, masters and per-column steps,
    in one launch per group."""
    data, multi = _multi_args(MODEL, device)
    _, single = _multi_args(MODEL, device)
    b1, b2, eps = 0.9, 0.95, 1e-8
    for t in range(STEPS):
        steps = [d["step0"] + t for d in data]
        with ops.use_backend("triton"), count_launches() as n:
            ops.multi_selective_adamw_(
                [s["param"] for s in multi], [d["grads"][t] for d in data], [d["idx"] for d in data],
                [s["m"] for s in multi], [s["v"] for s in multi], steps=steps, lrs=[c.lr for c in MODEL],
                beta1=b1, beta2=b2, eps=eps, weight_decays=[c.wd for c in MODEL],
                masters=[s["master"] for s in multi], grad_scale=2.0)
        # groups: bf16+master+per-col; fp32 dense [1, n]; fp32 selected k=1 (16-wide tiles); fp16 selected
        assert n == {"_multi_selective_adamw_kernel": 4}, n
        with ops.use_backend("triton"):
            for i, (c, d, s) in enumerate(zip(MODEL, data, single, strict=True)):
                ops.selective_adamw_(s["param"], d["grads"][t], d["idx"], s["m"], s["v"], step=steps[i],
                                     lr=c.lr, beta1=b1, beta2=b2, eps=eps, weight_decay=c.wd, master=s["master"],
                                     grad_scale=2.0)
    for c, a, b in zip(MODEL, multi, single, strict=True):
        for key in ("param", "m", "v", "master"):
            if a[key] is not None:
                assert same(a[key], b[key], device), (c, key)
    moved = [not torch.equal(s["param"], d["param"]) for s, d in zip(multi, data, strict=True)]
    assert moved == [c.k != 0 for c in MODEL]
    # twice the tensors (same groups): the same launches
    data2, multi2 = _multi_args(MODEL * 2, device)
    with ops.use_backend("triton"), count_launches() as n:
        ops.multi_selective_adamw_(
            [s["param"] for s in multi2], [d["grads"][0] for d in data2], [d["idx"] for d in data2],
            [s["m"] for s in multi2], [s["v"] for s in multi2], steps=[d["step0"] for d in data2], lrs=1e-3,
            beta1=b1, beta2=b2, eps=eps, weight_decays=0.01, masters=[s["master"] for s in multi2])
    assert n == {"_multi_selective_adamw_kernel": 4}, n


@pytest.mark.parametrize("device", DEVICES)
def test_multi_torch_path_matches_kernel(device):
    data, a = _multi_args(MODEL, device)
    _, b = _multi_args(MODEL, device)
    for state, backend in ((a, "triton"), (b, "torch")):
        with ops.use_backend(backend):
            for t in range(STEPS):
                ops.multi_selective_adamw_(
                    [s["param"] for s in state], [d["grads"][t] for d in data], [d["idx"] for d in data],
                    [s["m"] for s in state], [s["v"] for s in state], steps=[d["step0"] + t for d in data],
                    lrs=[c.lr for c in MODEL], beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decays=[c.wd for c in MODEL], masters=[s["master"] for s in state])
    for c, x, y in zip(MODEL, a, b, strict=True):
        if c.pdtype == torch.float32:
            assert rel(x["param"].cpu(), y["param"].cpu()) <= RTOL, c
        else:
            assert ulps(x["param"].cpu(), y["param"].cpu().float(), c.pdtype) <= 1.0, c
        assert rel(x["m"].cpu(), y["m"].cpu()) <= RTOL and rel(x["v"].cpu(), y["v"].cpu()) <= RTOL, c
