"""Host Lion and SGD kernels (zenflow_kernels.cpu_ops.lion / .sgd) against torch.

Oracles: ``torch.optim.SGD(foreach=False)`` for SGD, and for Lion ``torch_lion_step`` below, the torch op
sequence that lion.py states (torch has no Lion). Both run 10 steps on the same gradients, which the oracle
receives as ``grad.float() * (1 / grad_scale)``: exactly the kernels' ``g``, so the comparison is bit for bit
at every grad_scale, not only at 1 (with ``grad / grad_scale`` instead, g would differ by an ulp at
grad_scale 3).

Exactness. The kernels round like ATen's vectorised CPU kernels (an ``add`` with ``alpha`` is one fma), which
torch uses on x86 with AVX2 or AVX512. torch's non-vectorised DEFAULT kernels (a CPU without AVX2, or
``ATEN_CPU_CAPABILITY=default``) round the product and the sum separately, and there the comparisons fall back
to ``DEFAULT_RTOL`` (measured: that run's largest difference is one or two ulps of the parameter's scale).
NaNs compare as NaN, whatever their payload (x86 and ATen may propagate different payloads).
"""

from __future__ import annotations

import numba
import pytest
import torch

from zenflow_kernels.cpu_ops.lion import cpu_lion_
from zenflow_kernels.cpu_ops.sgd import cpu_sgd_

EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
DEFAULT_RTOL = 5e-7  # measured worst 2.3e-7 of the scale (1.9 ulps) over the size, scale and config sweeps
SIZES = (0, 1, 15, 16, 17, 1000, 65537)
SCALES = (1.0, 2.0, 3.0)
OUT_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
# (grad dtype, zero_grad): zero_grad needs an fp32 gradient (it is an accumulation buffer it zeroes); the
# 16-bit ones with zero_grad are a TypeError, tested with the other errors
GRAD_MODES = ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.float16, False))
STEPS = 10
LION = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}
SGD_CONFIGS = (
    {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.01},
    {"momentum": 0.9, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.1, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.1, "nesterov": False, "weight_decay": 0.01},
    {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01},
)
SGD_LR = 0.05


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (exact comparison that tells -0.0 from 0.0)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bit for bit where expected is not NaN, NaN where it is."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"{name}: NaN at different elements"
    wrong = ((bits(actual) != bits(expected)) & ~nan).nonzero()
    if len(wrong):
        i = int(wrong[0])
        raise AssertionError(f"{name}: {len(wrong)} elements differ, first {i}: ours {actual[i].item()!r}, "
                             f"torch {expected[i].item()!r}")


def assert_same(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """``assert_bits_equal`` with ATen's vector kernels; DEFAULT_RTOL of the tensor's scale without them."""
    if EXACT:
        assert_bits_equal(actual, expected, name)
    else:
        assert torch.equal(actual.isnan(), expected.isnan()), f"{name}: NaN at different elements"
        finite = expected.isfinite()
        assert torch.equal(actual[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()]), name
        scale = expected[finite].abs().max().item() if finite.any() else 0.0
        torch.testing.assert_close(actual[finite], expected[finite], rtol=DEFAULT_RTOL, atol=DEFAULT_RTOL * scale,
                                   msg=name)


def assert_out_is_param(out, param):
    """The copy-out is ``param.to(out.dtype)`` exactly (the cast rounds the same on every path)."""
    if out is not None:
        assert_bits_equal(out, param.to(out.dtype), f"out ({out.dtype})")


def torch_lion_step(param, g, exp_avg, *, lr, beta1, beta2, weight_decay):
    """Lion as lion.py states it, in torch ops (g already scaled)."""
    update = exp_avg.lerp(g, 1 - beta1).sign_()
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr)
    exp_avg.lerp_(g, 1 - beta2)


def gradients(n, seed, dtype, scale, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(steps)]


def scaled(g, grad_scale):
    """The gradient the kernels step with: fp32, times float32(1 / grad_scale) (torch rounds the scalar so)."""
    return g.float() * (1.0 / grad_scale)


def grad_arg(g, zero_grad):
    """What the kernel is given: with zero_grad an fp32 accumulation buffer holding g (consumed and zeroed)."""
    return g.float().clone() if zero_grad else g


# ---------------------------------------------------------------------------------------------
# Lion
# ---------------------------------------------------------------------------------------------


def run_lion(n, grads, grad_scale, zero_grad, out_dtype, hyper=LION, seed=1):
    gen = torch.Generator().manual_seed(seed)
    p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    rp, rm = p0.clone(), m0.clone()
    p, m = p0.clone(), m0.clone()
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
    for g in grads:
        torch_lion_step(rp, scaled(g, grad_scale), rm, **hyper)
        given = grad_arg(g, zero_grad)
        before = given.clone()
        cpu_lion_(p, given, m, grad_scale=grad_scale, out=out, zero_grad=zero_grad, **hyper)
        assert torch.equal(bits(given), bits(torch.zeros_like(given) if zero_grad else before)), "grad afterwards"
    return (p, m, out), (rp, rm)


@pytest.mark.parametrize("grad_scale", SCALES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(("grad_dtype", "zero_grad"), GRAD_MODES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_lion_matches_torch_ops_10_steps(n, grad_dtype, zero_grad, out_dtype, grad_scale):
    grads = gradients(n, 10 + n, grad_dtype, grad_scale)
    (p, m, out), (rp, rm) = run_lion(n, grads, grad_scale, zero_grad, out_dtype)
    assert_same(p, rp, "param")
    assert_same(m, rm, "exp_avg")
    assert_out_is_param(out, p)


@pytest.mark.parametrize("betas", [(0.0, 0.0), (0.3, 0.5), (0.5, 0.7), (0.9, 0.99), (0.99, 1.0), (1.0, 0.3)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_betas_take_both_lerp_forms(betas, weight_decay):
    """1 - beta < 0.5 and >= 0.5 are torch's two lerp forms; beta 0 and 1 the ends of the range."""
    hyper = {"lr": 1e-2, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay}
    (p, m, _), (rp, rm) = run_lion(1000, gradients(1000, 3, torch.float32, 1.0), 1.0, False, None, hyper)
    assert_same(p, rp, "param")
    assert_same(m, rm, "exp_avg")


def test_lion_specials_like_torch():
    """inf/NaN/-0.0 in gradient, moment and parameter, at 37 elements (vector body and tail): torch's results,
    where sign(NaN) = 0 (pytorch/pytorch#41245)."""
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 1e-40]
    n = 37
    gen = torch.Generator().manual_seed(7)
    for weight_decay in (0.0, 0.1):
        for beta1 in (0.9, 0.2):  # both lerp forms meet inf differently (fma(w - 1, inf, inf) is NaN)
            hyper = {**LION, "beta1": beta1, "weight_decay": weight_decay}
            p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            g = torch.randn(n, generator=gen)
            for k, s in enumerate(specials):
                p0[k], m0[k + 8], g[k + 16] = s, s, s
                g[k], g[k + 8] = specials[(k + 3) % 8], specials[(k + 5) % 8]
            p, m, rp, rm = p0.clone(), m0.clone(), p0.clone(), m0.clone()
            out = torch.empty(n, dtype=torch.bfloat16)
            for _ in range(2):
                torch_lion_step(rp, g, rm, **hyper)
                cpu_lion_(p, g, m, out=out, **hyper)
            assert_same(p, rp, f"param (wd={weight_decay}, beta1={beta1})")
            assert_same(m, rm, f"exp_avg (wd={weight_decay}, beta1={beta1})")
            assert_out_is_param(out, p)


def test_lion_zero_and_nan_gradient_leave_the_parameter():
    """sign(0) = 0 (and torch's sign(NaN) = 0): a zero gradient on a zero moment, or a NaN gradient, does not move
    the parameter; without weight decay inf and -0.0 parameters stay exactly what they were."""
    p0 = torch.tensor([1.5, -0.0, float("inf"), -float("inf"), 0.0, 2.0, -3.0])
    p, m = p0.clone(), torch.zeros(7)
    g = torch.tensor([0.0, -0.0, 0.0, 0.0, -0.0, float("nan"), float("nan")])
    cpu_lion_(p, g, m, **{**LION, "weight_decay": 0.0})
    assert torch.equal(bits(p), bits(p0))
    assert torch.equal(bits(m[:5]), bits(torch.zeros(5))) and m[5:].isnan().all()


# ---------------------------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------------------------


def run_sgd(n, grads, grad_scale, zero_grad, out_dtype, config, seed=2):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    tp = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([tp], lr=SGD_LR, foreach=False, **config)
    p = p0.clone()
    # the buffer's old contents must not matter on its first step (torch's buffer is None then)
    buf = torch.full((n,), float("nan")) if config["momentum"] else None
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
    for step, g in enumerate(grads, 1):
        tp.grad = scaled(g, grad_scale)
        opt.step()
        given = grad_arg(g, zero_grad)
        before = given.clone()
        cpu_sgd_(p, given, buf, step=step, lr=SGD_LR, grad_scale=grad_scale, out=out, zero_grad=zero_grad, **config)
        assert torch.equal(bits(given), bits(torch.zeros_like(given) if zero_grad else before)), "grad afterwards"
    ref_buf = opt.state[tp].get("momentum_buffer") if grads else None
    return (p, buf, out), (tp.detach(), ref_buf)


def _check_sgd(ours, theirs, config):
    (p, buf, out), (rp, rbuf) = ours, theirs
    assert_same(p, rp, "param")
    if config["momentum"] and rbuf is not None:
        assert_same(buf, rbuf, "momentum_buffer")
    assert_out_is_param(out, p)


@pytest.mark.parametrize("grad_scale", SCALES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_matches_torch_optim_10_steps(config, n, grad_scale):
    grads = gradients(n, 20 + n, torch.float32, grad_scale)
    _check_sgd(*run_sgd(n, grads, grad_scale, False, None, config), config)


@pytest.mark.parametrize("grad_scale", SCALES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(("grad_dtype", "zero_grad"), GRAD_MODES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_dtypes_and_zero_grad_match_torch_optim(n, grad_dtype, zero_grad, out_dtype, grad_scale):
    config = {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01}  # every fma of the step
    grads = gradients(n, 30 + n, grad_dtype, grad_scale)
    _check_sgd(*run_sgd(n, grads, grad_scale, zero_grad, out_dtype, config), config)


@pytest.mark.parametrize("config", SGD_CONFIGS[1::2] + SGD_CONFIGS[2:3], ids=lambda c: "-".join(map(str, c.values())))
def test_sgd_specials_like_torch(config):
    """inf/NaN/-0.0 in gradient and parameter (37 elements: vector body and tail), 3 steps."""
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 1e-40]
    n = 37
    gen = torch.Generator().manual_seed(8)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    for k, s in enumerate(specials):
        p0[k], grads[0][k + 8], grads[1][k + 16], grads[2][k + 24] = s, s, s, s
    tp = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([tp], lr=SGD_LR, foreach=False, **config)
    p, buf = p0.clone(), torch.zeros(n)
    out = torch.empty(n, dtype=torch.float16)
    for step, g in enumerate(grads, 1):
        tp.grad = g.clone()
        opt.step()
        cpu_sgd_(p, g, buf, step=step, lr=SGD_LR, out=out, **config)
    _check_sgd((p, buf, out), (tp.detach(), opt.state[tp].get("momentum_buffer")), config)


def test_sgd_without_weight_decay_leaves_inf_parameters_alone():
    """weight_decay == 0 skips the decay term (fma(inf, 0, g) would be NaN), as torch skips it."""
    p = torch.tensor([float("inf"), -float("inf"), 1.0])
    for momentum in (0.0, 0.9):
        buf = torch.zeros(3) if momentum else None
        cpu_sgd_(p, torch.tensor([0.5, -0.5, 0.0]), buf, step=1, lr=0.1, momentum=momentum)
        assert p[0] == float("inf") and p[1] == -float("inf") and p[2] == 1.0


def test_sgd_without_momentum_leaves_a_given_buffer_alone():
    p, g, buf = torch.randn(100), torch.randn(100), torch.randn(100)
    before = buf.clone()
    cpu_sgd_(p, g, buf, step=5, lr=0.1, momentum=0.0, weight_decay=0.01)
    assert torch.equal(bits(buf), bits(before))


# ---------------------------------------------------------------------------------------------
# Threads and shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one numba thread")
def test_thread_count_changes_no_bit():
    n = (1 << 17) + 5  # two threads get >= 2^16 elements each: both are used
    gen = torch.Generator().manual_seed(4)
    p0, m0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    for threads in (1, 2):
        p, m, out = p0.clone(), m0.clone(), torch.empty(n, dtype=torch.bfloat16)
        cpu_lion_(p, g, m, out=out, num_threads=threads, **LION)
        q, buf = p0.clone(), m0.clone()
        for step in (1, 2):
            cpu_sgd_(q, g, buf, step=step, lr=SGD_LR, momentum=0.9, weight_decay=0.01, num_threads=threads)
        results.append((p, m, out, q, buf))
    for a, b in zip(*results, strict=True):
        assert torch.equal(bits(a), bits(b))


def test_shapes_are_flattened_and_autograd_is_told():
    gen = torch.Generator().manual_seed(5)
    p0, g = torch.randn(6, 7, generator=gen), torch.randn(6, 7, generator=gen)
    for call in (lambda p, s: cpu_lion_(p, g, s, **LION),
                 lambda p, s: cpu_sgd_(p, g, s, step=2, lr=0.1, momentum=0.9)):
        param, state = torch.nn.Parameter(p0.clone()), torch.zeros(6, 7)
        flat, flat_state = p0.clone().view(-1), torch.zeros(42)
        version = param._version
        call(param, state)
        call(flat, flat_state)
        assert torch.equal(param.detach().view(-1), flat) and torch.equal(state.view(-1), flat_state)
        assert param._version > version


# ---------------------------------------------------------------------------------------------
# Errors: every bad argument raises before anything is written
# ---------------------------------------------------------------------------------------------

N = 17


def _noncontig():
    return torch.randn(N, 2)[:, 0]


def _tensors(state_name):
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(3 * N, generator=gen)
    return {
        "param": base[:N],
        "grad": torch.randn(N, generator=gen),
        state_name: base[N:2 * N],
        "out": torch.zeros(N, dtype=torch.bfloat16),
        "base": base,  # param and state are views of it (so a case can make them overlap)
    }


COMMON_ERRORS = [
    # (tensor name -> maker taking the tensors, or kwargs override), exception, words the message must hold
    ({"param": lambda t: _noncontig()}, {}, ValueError, ["param", "contiguous"]),
    ({"param": lambda t: torch.randn(N, dtype=torch.float64)}, {}, TypeError, ["param", "float64", "float32"]),
    ({"param": lambda t: [0.0] * N}, {}, TypeError, ["param", "torch.Tensor", "list"]),
    ({"grad": lambda t: torch.randn(N + 1)}, {}, ValueError, ["grad", str(N), str(N + 1)]),
    ({"grad": lambda t: torch.ones(N, dtype=torch.int32)}, {}, TypeError, ["grad", "int32"]),
    ({"grad": lambda t: t["base"][5:5 + N]}, {"zero_grad": True}, ValueError, ["overlap"]),
    ({"out": lambda t: torch.zeros(N, dtype=torch.float64)}, {}, TypeError, ["out", "float64"]),
    ({"out": lambda t: torch.zeros(N + 3, dtype=torch.float16)}, {}, ValueError, ["out", str(N + 3)]),
    ({"out": lambda t: t["base"][2 * N - 3:3 * N - 3]}, {}, ValueError, ["out", "overlap"]),
    ({"grad": lambda t: torch.randn(N).to(torch.bfloat16)}, {"zero_grad": True}, TypeError,
     ["grad", "float32", "zero_grad", "bfloat16"]),
    ({"grad": lambda t: torch.randn(N).to(torch.float16)}, {"zero_grad": True}, TypeError, ["grad", "float16"]),
    ({}, {"zero_grad": 1}, TypeError, ["zero_grad", "bool"]),
    ({}, {"lr": -1e-3}, ValueError, ["lr", ">= 0", "-0.001"]),
    ({}, {"lr": "0.1"}, TypeError, ["lr", "real", "str"]),
    ({}, {"lr": True}, TypeError, ["lr", "real", "bool"]),
    ({}, {"lr": float("nan")}, ValueError, ["lr", "finite"]),
    ({}, {"weight_decay": -0.5}, ValueError, ["weight_decay", ">= 0", "-0.5"]),
    ({}, {"grad_scale": 0.0}, ValueError, ["grad_scale", "> 0"]),
    ({}, {"grad_scale": -2.0}, ValueError, ["grad_scale", "> 0"]),
    ({}, {"grad_scale": float("inf")}, ValueError, ["grad_scale", "finite"]),
    ({}, {"num_threads": 0}, ValueError, ["num_threads", ">= 1", "0"]),
    ({}, {"num_threads": 10**6}, ValueError, ["num_threads", "NUMBA_NUM_THREADS"]),
    ({}, {"num_threads": 1.0}, TypeError, ["num_threads", "integer"]),
]

LION_ERRORS = COMMON_ERRORS + [
    ({"exp_avg": lambda t: torch.zeros(N, dtype=torch.float16)}, {}, TypeError, ["exp_avg", "float16"]),
    ({"exp_avg": lambda t: torch.zeros(N - 1)}, {}, ValueError, ["exp_avg", str(N - 1)]),
    ({"exp_avg": lambda t: t["base"][N - 1:2 * N - 1]}, {}, ValueError, ["param", "exp_avg", "overlap"]),
    ({"exp_avg": lambda t: _noncontig()}, {}, ValueError, ["exp_avg", "contiguous"]),
    ({}, {"beta1": 1.5}, ValueError, ["beta1", "<= 1", "1.5"]),
    ({}, {"beta1": -0.1}, ValueError, ["beta1", ">= 0"]),
    ({}, {"beta2": 1.0000001}, ValueError, ["beta2", "<= 1"]),
    ({}, {"beta2": None}, TypeError, ["beta2", "real", "NoneType"]),
]

SGD_ERRORS = COMMON_ERRORS + [
    ({"momentum_buffer": lambda t: torch.zeros(N, dtype=torch.float16)}, {}, TypeError,
     ["momentum_buffer", "float16"]),
    ({"momentum_buffer": lambda t: torch.zeros(N + 1)}, {}, ValueError, ["momentum_buffer", str(N + 1)]),
    ({"momentum_buffer": lambda t: t["base"][3:3 + N]}, {}, ValueError, ["momentum_buffer", "overlap"]),
    ({"momentum_buffer": lambda t: None}, {}, ValueError, ["momentum_buffer", "None", "momentum=0.9"]),
    ({}, {"step": 0}, ValueError, ["step", ">= 1", "0"]),
    ({}, {"step": 2.0}, TypeError, ["step", "integer", "2.0"]),
    ({}, {"step": True}, TypeError, ["step", "integer"]),
    ({}, {"momentum": -0.9}, ValueError, ["momentum", ">= 0", "-0.9"]),
    ({}, {"dampening": -0.1}, ValueError, ["dampening", ">= 0"]),
    ({}, {"nesterov": 1}, TypeError, ["nesterov", "bool"]),
    ({}, {"nesterov": True, "dampening": 0.1}, ValueError, ["Nesterov", "dampening=0.1"]),
    ({}, {"nesterov": True, "momentum": 0.0}, ValueError, ["Nesterov", "momentum=0.0"]),
]


def _apply(case, t, defaults):
    t = dict(t)
    for name, make in case[0].items():
        t[name] = make(t)
    return t, {**defaults, **case[1]}


def _ids(case):
    return f"{list(case[0]) or case[1]}-{case[2].__name__}"


def _check_error_and_unchanged(call, t, exc, words):
    before = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor) and v.is_contiguous()}
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"message {message!r} lacks {missing}"
    for k, v in before.items():
        assert torch.equal(bits(t[k]), bits(v)), f"{k} was written"


@pytest.mark.parametrize("case", LION_ERRORS, ids=_ids)
def test_lion_errors_leave_everything_unchanged(case):
    t, kw = _apply(case, _tensors("exp_avg"), LION)
    _check_error_and_unchanged(lambda: cpu_lion_(t["param"], t["grad"], t["exp_avg"], out=t["out"], **kw), t,
                               case[2], case[3])


@pytest.mark.parametrize("case", SGD_ERRORS, ids=_ids)
def test_sgd_errors_leave_everything_unchanged(case):
    defaults = {"step": 2, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    t, kw = _apply(case, _tensors("momentum_buffer"), defaults)
    _check_error_and_unchanged(
        lambda: cpu_sgd_(t["param"], t["grad"], t["momentum_buffer"], out=t["out"], **kw), t, case[2], case[3])


def test_size_zero_is_a_no_op_but_still_validated():
    e = torch.empty(0)
    cpu_lion_(e, e.clone(), e.clone(), out=torch.empty(0, dtype=torch.float16), zero_grad=True, **LION)
    cpu_sgd_(e, e.clone(), None, step=1, lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        cpu_lion_(e, e.clone(), e.clone(), **{**LION, "lr": -1.0})
    with pytest.raises(ValueError, match="momentum_buffer"):
        cpu_sgd_(e, e.clone(), None, step=1, lr=0.1, momentum=0.9)


# -- bf16 state (rules' state_dtype=torch.bfloat16): each step reads the stored values exactly, computes in fp32 and
# stores the new state rounded to nearest even; the parameter's update uses the unrounded values ----------------


def _bf16_state_cases():
    from zenflow_kernels.cpu_ops import cpu_adam_

    adam = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    return {
        "adam": (lambda p, g, s, step, **kw: cpu_adam_(p, g, s[0], s[1], step=step, **adam, **kw), 2),
        "lion": (lambda p, g, s, step, **kw: cpu_lion_(p, g, s[0], **LION, **kw), 1),
        "sgd": (lambda p, g, s, step, **kw: cpu_sgd_(p, g, s[0], step=step, lr=SGD_LR, **SGD_CONFIGS[6], **kw), 1),
    }


@pytest.mark.parametrize("n", (1, 17, 65537))
@pytest.mark.parametrize("name", ("adam", "lion", "sgd"))
def test_bf16_state_is_the_fp32_step_with_its_state_rounded(name, n):
    """Against the same kernel on fp32 copies of the stored state: the parameter bit for bit, the new state its
    fp32 result rounded to nearest even (torch's ``.to(torch.bfloat16)``), over 10 steps."""
    step_fn, k = _bf16_state_cases()[name]
    gen = torch.Generator().manual_seed(n)
    p16, p32 = torch.randn(n, generator=gen), None
    p32 = p16.clone()
    state16 = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(k)]
    for step in range(1, STEPS + 1):
        grad = torch.randn(n, generator=gen) * 3
        state32 = [s.float() for s in state16]  # what the stored state holds, exactly
        out = torch.empty(n, dtype=torch.bfloat16)
        step_fn(p32, grad, state32, step, grad_scale=2.0)
        step_fn(p16, grad, state16, step, grad_scale=2.0, out=out)
        assert_bits_equal(p16, p32, f"param, step {step}")
        assert_bits_equal(out, p32.to(torch.bfloat16), f"out, step {step}")
        for s16, s32 in zip(state16, state32, strict=True):
            assert_bits_equal(s16, s32.to(torch.bfloat16), f"state, step {step}")
