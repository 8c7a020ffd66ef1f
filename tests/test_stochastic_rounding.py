"""Stochastic rounding of bf16 host state (``zenflow_kernels.rounding``, the rules' ``state_rounding="stochastic"``):
the torch reference against the hash written in plain Python integers, its rounding against the two bf16 neighbours
and its mean against the value, the numba host kernels against the fp32 step on copies of the stored state rounded by
the reference (bit for bit), a rule without a kernel of its own (eager and compiled) likewise, and the optimizer:
resumed bit for bit, the setting recorded, bad input refused. The optimizer against torch's AdamW / Lion with the
rounding as its oracle: tests/test_rules.py; ZeRO and FSDP2 against one process: test_zero.py, test_fsdp2.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from support import drive, grad_sequence, make_params, params_at, snapshot

from zenflow_kernels import ZenFlow, rules
from zenflow_kernels.cpu_ops import accumulate_adam_, cpu_adam_, cpu_lion_, cpu_sgd_
from zenflow_kernels.rounding import StochasticRounding, random_bits, round_to_bf16

pytestmark = pytest.mark.usefixtures("numba_backend")

M32 = 0xFFFFFFFF


def fmix32_py(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def bits_py(seed: int, step: int, key: int, k: int) -> int:
    """The module docstring's formula, in Python integers (no torch, no int64 tricks)."""
    salt = fmix32_py(fmix32_py(seed ^ ((0x9E3779B9 * (k // 2 + 1)) & M32)) + step)
    h = fmix32_py((((key & M32) ^ salt) + (key >> 32) * 0x85EBCA6B) & M32)
    return h & 0xFFFF if k % 2 == 0 else h >> 16


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("seed, step, key", [(0, 1, 0), (7, 123, 2**32 - 40), (2**32 - 1, 2**32 - 1, 5 * 2**32 + 9)])
def test_random_bits_are_the_formula(seed, step, key, k):
    n = 97
    got = random_bits(n, StochasticRounding(seed, step, key), k).tolist()
    assert got == [bits_py(seed, step, key + i, k) for i in range(n)]


def test_the_bits_look_uniform_and_differ_by_step_seed_and_state():
    n = 1 << 16
    r = random_bits(n, StochasticRounding(3, 10, 0), 0)
    counts = torch.bincount(r >> 12, minlength=16).double()  # 16 buckets of 4096 values
    chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 50, chi2  # 15 degrees of freedom: 50 is p ~ 1e-5
    assert len(torch.unique(r)) > 0.6 * n  # (a bijection per 2^32 keys; 16 of the bits: ~63% distinct expected)
    for other in (StochasticRounding(3, 11, 0), StochasticRounding(4, 10, 0)):
        assert (random_bits(n, other, 0) == r).double().mean() < 0.01
    assert (random_bits(n, StochasticRounding(3, 10, 0), 1) == r).double().mean() < 0.01
    assert (random_bits(n, StochasticRounding(3, 10, 0), 2) == r).double().mean() < 0.01


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above |x| in magnitude (sign kept): truncated bits and the next pattern."""
    u = x.view(torch.int32).to(torch.int64) & M32
    lo = u >> 16
    return lo, lo + ((u & 0xFFFF) != 0).long()


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def test_round_to_bf16_picks_a_neighbour_and_keeps_bf16_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(10000, generator=gen) * 10.0 ** torch.randint(-30, 30, (10000,), generator=gen),
                   torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38])])
    y = _bits16(round_to_bf16(x, StochasticRounding(1, 2, 3), 0))
    lo, hi = _neighbours(x)
    assert bool(((y == lo) | (y == hi)).all())
    assert bool((y == hi).any()) and bool((y[lo != hi] == lo[lo != hi]).any())
    exact = torch.randn(5000, generator=gen).bfloat16()
    assert torch.equal(round_to_bf16(exact.float(), StochasticRounding(9, 9, 9), 1), exact)


def test_round_to_bf16_special_values():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 0.0, -0.0])
    for k in (0, 1):
        y = round_to_bf16(x, StochasticRounding(0, 1, 0), k)
        assert y[0].item() == float("inf") and y[1].item() == float("-inf")
        assert torch.isnan(y[2:4]).all() and (_bits16(y[2:4]) & 0x7FC0 == 0x7FC0).all()  # quiet NaNs
        assert torch.equal(torch.signbit(y[2:]), torch.signbit(x[2:]))
        assert y[4].item() == 0.0 and y[5].item() == 0.0
    big = torch.full((4096,), 3.3961e38)  # between bf16's largest finite (3.3895e38) and the next: up = inf
    y = round_to_bf16(big, StochasticRounding(0, 1, 0), 0).float()
    assert set(y.tolist()) == {3.3895313892515355e38, float("inf")}


@pytest.mark.parametrize("fraction", [2.0**-10, 0.25, 0.5, 0.9])
def test_round_to_bf16_is_unbiased(fraction):
    """The mean of 2^20 roundings of one value (2^20 keys) is the value, within 6 standard errors; round to
    nearest is off by the whole rounding error where the fraction is below half an ulp."""
    n = 1 << 20
    ulp = 2.0**-7
    value = 1.0 + fraction * ulp
    x = torch.full((n,), value)
    mean = round_to_bf16(x, StochasticRounding(5, 17, 0), 0).double().mean().item()
    stderr = ulp * (fraction * (1 - fraction) / n) ** 0.5
    assert abs(mean - value) <= 6 * stderr + 1e-12, (mean, value, stderr)


def test_a_slowly_moving_moment_still_moves():
    """``exp_avg_sq`` at beta2 = 0.999 under a constant gradient twice its start: each step moves it by 0.1% of the
    gap, below half a bf16 ulp (0.2%), so round to nearest stays at the start while stochastic rounding follows
    the fp32 moment (the stall docs/design.md names)."""
    n, steps = 4096, 300
    g = torch.full((n,), 2.0 ** 0.5)  # g*g = 2
    rtn = torch.ones(n, dtype=torch.bfloat16)
    sr = torch.ones(n, dtype=torch.bfloat16)
    exact = torch.ones(n)
    for t in range(1, steps + 1):
        exact = exact * 0.999 + 0.001 * g * g
        rtn = (rtn.float() * 0.999 + 0.001 * g * g).bfloat16()
        sr = round_to_bf16(sr.float() * 0.999 + 0.001 * g * g, StochasticRounding(0, t, 0), 1)
    assert rtn.float().mean().item() == 1.0
    assert abs(sr.float().mean().item() - exact[0].item()) < 0.01 * (exact[0].item() - 1.0), (
        sr.float().mean().item(), exact[0].item())


# -- the host kernels: bit for bit against the fp32 step on copies of the stored state, rounded by the reference ------

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
LION = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
SGD = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)


def _kernel(name):
    def adam(p, g, s, step, **kw):
        cpu_adam_(p, g, s[0], s[1], step=step, **ADAM, **kw)

    def adam_accumulate(p, g, s, step, **kw):
        acc = g * 0.25
        accumulate_adam_(p, acc, g - acc, s[0], s[1], step=step, **ADAM, **kw)

    def lion(p, g, s, step, **kw):
        cpu_lion_(p, g, s[0], **LION, **kw)

    def sgd(p, g, s, step, **kw):
        cpu_sgd_(p, g, s[0], step=step, **SGD, **kw)

    return {"adam": (adam, 2), "adam_accumulate": (adam_accumulate, 2), "lion": (lion, 1), "sgd": (sgd, 1)}[name]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, key", [(1, 0), (17, 2**32 - 5), (65537, 123456789)])
@pytest.mark.parametrize("name", ["adam", "adam_accumulate", "lion", "sgd"])
def test_host_kernels_round_as_the_reference(name, n, key, threads):
    step_fn, k = _kernel(name)
    gen = torch.Generator().manual_seed(n)
    p16 = torch.randn(n, generator=gen)
    p32 = p16.clone()
    state16 = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(k)]
    moved = 0
    for step in range(1, 9):
        grad = torch.randn(n, generator=gen) * 3
        state32 = [s.float() for s in state16]  # what the stored state holds, exactly
        rounding = StochasticRounding(seed=42, step=step, key=key)
        step_fn(p32, grad, state32, step, grad_scale=2.0)
        out = torch.empty(n, dtype=torch.bfloat16)
        step_fn(p16, grad, state16, step, grad_scale=2.0, out=out, rounding=rounding, num_threads=threads)
        assert torch.equal(p16.view(torch.int32), p32.view(torch.int32)), f"param, step {step}"
        assert torch.equal(out.view(torch.int16), p32.bfloat16().view(torch.int16))
        for j, (s16, s32) in enumerate(zip(state16, state32, strict=True)):
            want = round_to_bf16(s32, rounding, j)
            assert torch.equal(s16.view(torch.int16), want.view(torch.int16)), f"state {j}, step {step}"
            moved += int((s16.view(torch.int16) != s32.bfloat16().view(torch.int16)).sum())
    if n > 1:
        assert moved > 0  # (some values rounded otherwise than to nearest: the bits were used)


def test_host_kernels_refuse_bad_rounding_before_writing():
    n = 64
    p, g = torch.randn(n), torch.randn(n)
    m32, v16 = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    before = p.clone()
    with pytest.raises(ValueError, match="exp_avg has dtype float32"):
        cpu_adam_(p, g, m32, v16, step=1, **ADAM, rounding=StochasticRounding(0, 1, 0))
    with pytest.raises(TypeError, match="rounding must be None or"):
        cpu_lion_(p, g, v16, **LION, rounding=(0, 1))
    with pytest.raises(ValueError, match="momentum_buffer has dtype float32"):
        cpu_sgd_(p, g, torch.zeros(n), step=1, **SGD, rounding=StochasticRounding(0, 1, 0))
    assert torch.equal(p, before) and not v16.float().any()
    for bad in (dict(seed=-1, step=1), dict(seed=0, step=2**32), dict(seed=0, step=1, key=-3),
                dict(seed=True, step=1)):
        with pytest.raises(ValueError, match="StochasticRounding: (seed|step|key)="):
            StochasticRounding(**bad)


def test_rules_check_the_rounding_options():
    with pytest.raises(ValueError, match="rules.AdamW: state_rounding='stochastic' with state_dtype=torch.float32"):
        rules.AdamW(state_rounding="stochastic")
    with pytest.raises(ValueError, match="rules.Lion: state_rounding='up' is invalid: allowed 'nearest' or"):
        rules.Lion(state_dtype=torch.bfloat16, state_rounding="up")
    with pytest.raises(ValueError, match=r"rules.SGD: rounding_seed=-1 is invalid: allowed an integer in \[0, 2\*\*32"):
        rules.SGD(momentum=0.9, state_dtype=torch.bfloat16, state_rounding="stochastic", rounding_seed=-1)
    with pytest.raises(ValueError, match="from_torch.*state_rounding='stochastic' with state_dtype"):
        rules.from_torch(torch.optim.Adagrad, state_rounding="stochastic")
    rule = rules.AdamW(state_dtype=torch.bfloat16, state_rounding="stochastic", rounding_seed=9)
    assert "state_rounding='stochastic'" in repr(rule) and "rounding_seed=9" in repr(rule)
    assert rule.to_dict()["state_rounding"] == "stochastic" and rule.to_dict()["rounding_seed"] == 9
    assert "state_rounding" not in rules.AdamW(state_dtype=torch.bfloat16).to_dict()
    adagrad = rules.from_torch(torch.optim.Adagrad, state_dtype=torch.bfloat16, state_rounding="stochastic")
    assert "state_rounding='stochastic'" in repr(adagrad)


# -- a rule without a kernel of its own: its torch step, eager and compiled, rounded as the reference -----------------


class HalfSum(rules.UpdateRule):
    """A rule whose fp32 arithmetic is exact in any order (halving, then one add): eager and compiled give the same
    fp32 state, so the stored bits isolate the rounding."""

    name = "HalfSum"
    state_names = ("acc", "acc2")
    tensor_hyperparams = ("lr",)

    def __init__(self, compile_mode):
        self.set_state_storage("HalfSum", torch.bfloat16, "stochastic", 77)
        self.compile = compile_mode

    def group_defaults(self):
        return {}

    def hyperparams(self, group):
        return dict(lr=float(group["lr"]))

    def step_(self, param, grad, state, *, step, lr):
        state["acc"].mul_(0.5).add_(grad)
        state["acc2"].mul_(0.25).add_(grad)
        param.sub_(state["acc"], alpha=lr)


@pytest.mark.parametrize("compile_mode", [False, True])
def test_a_rule_of_ones_own_rounds_as_the_reference(compile_mode):
    from zenflow_kernels.rules import compiled

    rule = HalfSum(compile_mode)
    n = compiled.HOST_MIN_NUMEL + 5
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    state = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    for step in range(1, 5):
        grad = torch.randn(n, generator=gen)
        want = [s.float() * f + grad for s, f in zip(state, (0.5, 0.25), strict=True)]  # exact (before rounding)
        rounding = rule.rounding(step, 2**32 - 1000)
        rule.host_step_(p, grad.clone(), state, step=step, grad_scale=1.0, rounding=rounding, lr=0.1)
        for j, (s, w) in enumerate(zip(state, want, strict=True)):
            assert torch.equal(s.view(torch.int16), round_to_bf16(w, rounding, j).view(torch.int16)), (step, j)
    place = compiled.paths(rule)["host"]
    assert (place["compiled_calls"] > 0) == compile_mode, place


# -- the optimizer: resumed bit for bit on the other link --------------------------------------------------------------


def test_stochastic_bf16_state_resumes_bit_identically_and_differs_from_nearest():
    zen = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=3)
    grads = grad_sequence(12)

    def rule(rounding="stochastic"):
        return rules.AdamW(state_dtype=torch.bfloat16, state_rounding=rounding, rounding_seed=2)

    params = make_params()
    with ZenFlow(params, rule(), lr=2e-2, zenflow=zen) as opt:
        want = drive(opt, params, grads)
    params = make_params()
    with ZenFlow(params, rule("nearest"), lr=2e-2, zenflow=zen) as opt:
        nearest = drive(opt, params, grads)
    assert any(not torch.equal(x, y) for x, y in zip(want[-1], nearest[-1], strict=True))
    from zenflow_kernels.testing import chaos

    with chaos(seed=3, max_delay=0.001):
        params = make_params()
        opt = ZenFlow(params, rule(), lr=2e-2, zenflow=zen)
    with opt:
        drive(opt, params, grads[:7])
        saved, weights = copy.deepcopy(opt.state_dict()), snapshot(params)
    assert saved["zenflow"]["rule"]["state_rounding"] == "stochastic"
    params = params_at(weights)
    with ZenFlow(params, rule(), lr=2e-2, zenflow=zen) as opt:
        opt.load_state_dict(saved)
        got = drive(opt, params, grads[7:])
    for a, b in zip(got, want[7:], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_numba_hash_matches_the_python_formula_on_its_own():
    """The kernel's hash (LLVM IR, 32-bit) against the formula in Python integers, not through the torch reference:
    cpu_lion_ with beta2 = 0 stores the gradient itself as the moment; a value whose 16 dropped bits are 0x8000
    rounds up exactly where the element's 16 bits are >= 0x8000."""
    n, key = 4096, 2**32 - 2048
    x = (torch.ones(n).view(torch.int32) + 0x8000).view(torch.float32)
    m = torch.zeros(n, dtype=torch.bfloat16)
    p, g = torch.zeros(n), x.clone()
    cpu_lion_(p, g, m, lr=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0, rounding=StochasticRounding(8, 3, key))
    up = (_bits16(m) == 0x3F81).numpy()
    want = np.array([bits_py(8, 3, key + i, 0) >= 0x8000 for i in range(n)])
    assert (up == want).all()


@pytest.mark.bench
def test_the_cost_benchmark_runs_quick(tmp_path):
    """bench.stochastic_rounding --quick: every candidate at every thread count, each ratio against round to nearest
    in the same rounds (the figures are the committed full run's, bench/results/stochastic_rounding.json)."""
    import json
    import subprocess
    import sys

    from support import ROOT

    proc = subprocess.run([sys.executable, "-m", "bench.stochastic_rounding", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "stochastic_rounding.json").read_text())["rows"]
    assert [r["candidate"] for r in rows[:3]] == ["fp32", "bf16_nearest", "bf16_stochastic"]
    assert all(r["vs_bf16_nearest"] == 1.0 for r in rows if r["candidate"] == "bf16_nearest")
    assert all(r["median_s"] > 0 and r["params_per_s"] > 0 for r in rows)
