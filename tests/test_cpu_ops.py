"""Host kernels (zenflow_kernels.cpu_ops): Adam/AdamW, accumulation, sum of squares, errors, threads.

Oracle: ``torch.optim.AdamW`` / ``torch.optim.Adam`` with ``foreach=False`` (and, for
``bias_correction=False``, which torch lacks, ``torch_adam_step`` below: torch's single-tensor ops
in torch's order, checked bit-for-bit against torch.optim first).

Tolerance. "Within 1e-6 relative" is measured against the tensor's scale: every element must satisfy
``|ours - torch| <= 1e-6 * (|torch| + max|torch|)``. A purely element-wise relative bound is
meaningless for elements that pass through zero during 100 steps (a one-ulp difference in the
update of an element near 0 is a large relative error of that element), and torch's own CPU sqrt
is not correctly rounded, so bit equality with torch is not a property any other implementation
can have. What is exact is tested exactly: the copy-out equals ``param.to(dtype)`` bit for bit, the
accumulation equals torch's fp32 addition, and results do not depend on the thread count.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zenflow_kernels.cpu_ops import (
    accumulate_,
    accumulate_adam_,
    cpu_adam_,
    multi_accumulate_,
    multi_sum_squares,
    sum_squares,
)

RTOL = 1e-6
DTYPES_16 = (torch.bfloat16, torch.float16)
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, name: str, rtol: float = RTOL) -> None:
    """|actual - expected| <= rtol * (|expected| + max|expected|) everywhere; reports the worst element."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    if expected.numel() == 0:
        return
    a, e = actual.double(), expected.double()
    bound = rtol * (e.abs() + e.abs().max())
    excess = (a - e).abs() - bound
    worst = int(excess.argmax())
    assert excess[worst] <= 0, (
        f"{name}: worst element {worst}: ours {a[worst].item()!r}, torch {e[worst].item()!r}, "
        f"|diff| {abs(a[worst] - e[worst]).item():.3g} > bound {bound[worst].item():.3g}"
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (exact comparison that tells -0.0 from 0.0 and holds for NaN)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def torch_adam_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction):
    """torch's ``_single_tensor_adam`` (foreach=False, no amsgrad), with DeepSpeed's bias_correction switch."""
    if weight_decay != 0:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = (v.sqrt() / bc2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bc1))


def make_state(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    return p, torch.zeros(n), torch.zeros(n), gen


def run_torch_optim(p0, grads, *, adamw, weight_decay, grad_scale):
    """torch.optim over the sequence of (already scaled-down) gradients; returns p, m, v."""
    tp = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(
        [tp],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=weight_decay,
        foreach=False,
    )
    for g in grads:
        tp.grad = g.float() / grad_scale
        opt.step()
    if not grads:
        return tp.data, torch.zeros_like(p0), torch.zeros_like(p0)
    s = opt.state[tp]
    return tp.data, s["exp_avg"], s["exp_avg_sq"]


# ---------------------------------------------------------------------------------------------
# The oracle itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adamw", [True, False])
def test_reference_step_is_torch_optim_bit_for_bit(adamw):
    p0, m, v, gen = make_state(1001, 0)
    grads = [torch.randn(1001, generator=gen) for _ in range(5)]
    tp, tm, tv = run_torch_optim(p0, grads, adamw=adamw, weight_decay=0.1, grad_scale=1.0)
    p = p0.clone()
    for step, g in enumerate(grads, 1):
        torch_adam_step(p, g, m, v, step=step, weight_decay=0.1, adamw=adamw, bias_correction=True, **HYPER)
    assert torch.equal(p, tp) and torch.equal(m, tm) and torch.equal(v, tv)


# ---------------------------------------------------------------------------------------------
# cpu_adam_ against torch
# ---------------------------------------------------------------------------------------------

MODES = [
    (adamw, bias_correction, wd, scale)
    for adamw in (True, False)
    for bias_correction in (True, False)
    for wd in (0.0, 0.1)
    for scale in (1.0, 3.0)
]


@pytest.mark.parametrize(("adamw", "bias_correction", "weight_decay", "grad_scale"), MODES)
def test_cpu_adam_matches_torch_100_steps(adamw, bias_correction, weight_decay, grad_scale):
    n = 1000
    p0, m, v, gen = make_state(n, 1)
    grads = [torch.randn(n, generator=gen) * grad_scale for _ in range(100)]
    p = p0.clone()
    if bias_correction:
        ref = run_torch_optim(p0, grads, adamw=adamw, weight_decay=weight_decay, grad_scale=grad_scale)
    else:  # torch.optim has no switch for it: its own ops, checked above against torch.optim
        ref = (p0.clone(), torch.zeros(n), torch.zeros(n))
        for step, g in enumerate(grads, 1):
            torch_adam_step(
                ref[0],
                g / grad_scale,
                ref[1],
                ref[2],
                step=step,
                weight_decay=weight_decay,
                adamw=adamw,
                bias_correction=False,
                **HYPER,
            )
    for step, g in enumerate(grads, 1):
        cpu_adam_(
            p,
            g,
            m,
            v,
            step=step,
            weight_decay=weight_decay,
            adamw=adamw,
            bias_correction=bias_correction,
            grad_scale=grad_scale,
            **HYPER,
        )
    for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref, strict=True):
        assert_scaled_close(ours, theirs, name)
    assert (p - p0).abs().max() > 0.1  # the parameter did move: the comparison above is not vacuous


def test_cpu_adam_beta_table():
    """betas across their domain (beta1 < 0.5 takes torch's other lerp form; beta2 = 0 makes v = g^2)."""
    n, failures = 257, []
    for beta1 in (0.0, 0.3, 0.5, 0.9, 0.99):
        for beta2 in (0.0, 0.5, 0.999, 0.9999):
            p0, m, v, gen = make_state(n, 11)
            grads = [torch.randn(n, generator=gen) for _ in range(30)]
            tp = torch.nn.Parameter(p0.clone())
            opt = torch.optim.AdamW([tp], lr=1e-2, betas=(beta1, beta2), eps=1e-8, weight_decay=0.1, foreach=False)
            p = p0.clone()
            for step, g in enumerate(grads, 1):
                tp.grad = g
                opt.step()
                cpu_adam_(p, g, m, v, step=step, lr=1e-2, beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=0.1)
            s = opt.state[tp]
            for name, ours, theirs in zip(
                ("param", "exp_avg", "exp_avg_sq"), (p, m, v), (tp.data, s["exp_avg"], s["exp_avg_sq"]), strict=True
            ):
                try:
                    assert_scaled_close(ours, theirs, name)
                except AssertionError as exc:
                    failures.append((beta1, beta2, str(exc)))
    assert not failures, failures


@pytest.mark.parametrize("grad_dtype", [torch.float32, *DTYPES_16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, *DTYPES_16])
def test_cpu_adam_dtypes_grad_and_out(grad_dtype, out_dtype):
    n = 1000
    p0, m, v, gen = make_state(n, 2)
    grads = [(torch.randn(n, generator=gen) * 4).to(grad_dtype) for _ in range(100)]
    ref = run_torch_optim(p0, grads, adamw=True, weight_decay=0.01, grad_scale=2.0)
    p = p0.clone()
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
    for step, g in enumerate(grads, 1):
        cpu_adam_(p, g, m, v, step=step, weight_decay=0.01, grad_scale=2.0, out=out, **HYPER)
        if out is not None:
            assert torch.equal(bits(out), bits(p.to(out_dtype))), f"step {step}: out != param.to({out_dtype})"
    for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref, strict=True):
        assert_scaled_close(ours, theirs, name)


@pytest.mark.parametrize("n", [0, 1, 7, 1000003])
def test_cpu_adam_sizes_and_thread_counts(n):
    steps = 100 if n < 1000 else 4
    p0, _, _, gen = make_state(n, 3)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    ref = run_torch_optim(p0, grads, adamw=True, weight_decay=0.1, grad_scale=1.0)
    results = {}
    for threads in (1, 2):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.zeros(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads, 1):
            cpu_adam_(p, g, m, v, step=step, weight_decay=0.1, out=out, num_threads=threads, **HYPER)
        for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref, strict=True):
            assert_scaled_close(ours, theirs, f"{name} (threads={threads})")
        assert torch.equal(bits(out), bits(p.to(torch.bfloat16)))
        results[threads] = (p, m, v, out)
    # an element-wise kernel: the thread count must not change a single bit
    for a, b in zip(results[1], results[2], strict=True):
        assert torch.equal(bits(a), bits(b))


def test_cpu_adam_shapes_are_flattened_and_params_may_require_grad():
    p0, m, v, gen = make_state(6 * 7, 4)
    g = torch.randn(6, 7, generator=gen)
    flat = p0.clone()
    cpu_adam_(flat, g.view(-1), m, v, step=1, weight_decay=0.0, **HYPER)
    param = torch.nn.Parameter(p0.clone().view(6, 7))
    m2, v2 = torch.zeros(6, 7), torch.zeros(6, 7)
    version = param._version
    cpu_adam_(param, g, m2, v2, step=1, weight_decay=0.0, **HYPER)
    assert torch.equal(param.detach().view(-1), flat) and torch.equal(m2.view(-1), m)
    assert param._version > version  # autograd is told about the in-place write


def test_cpu_adam_inf_nan_propagate_like_torch():
    p0 = torch.tensor([1.0, float("inf"), -2.0, 0.5, float("nan"), 3.0])
    g = torch.tensor([0.1, 0.2, float("inf"), float("nan"), 0.3, -0.4])
    for adamw in (True, False):
        ref = run_torch_optim(p0, [g], adamw=adamw, weight_decay=0.1, grad_scale=1.0)
        p, m, v = p0.clone(), torch.zeros(6), torch.zeros(6)
        out = torch.zeros(6, dtype=torch.bfloat16)
        cpu_adam_(p, g, m, v, step=1, weight_decay=0.1, adamw=adamw, out=out, **HYPER)
        for ours, theirs in zip((p, m, v), ref, strict=True):
            assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.isinf(), theirs.isinf())
            finite = ours.isfinite()
            assert_scaled_close(ours[finite], theirs[finite], "finite entries")
            assert torch.equal(ours[ours.isinf()], theirs[theirs.isinf()])  # same signs of inf
        assert torch.equal(out.float().isnan(), p.isnan()) and torch.equal(out.float()[p.isinf()], p[p.isinf()])


# ---------------------------------------------------------------------------------------------
# accumulate_ and accumulate_adam_
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", [torch.float32, *DTYPES_16])
@pytest.mark.parametrize("n", [0, 1, 7, 100003])
def test_accumulate_is_torch_fp32_addition(grad_dtype, n):
    gen = torch.Generator().manual_seed(5)
    acc = torch.randn(n, generator=gen)
    expected = acc.clone()
    for _ in range(3):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        expected += g.float()
        accumulate_(acc, g)
    assert torch.equal(bits(acc), bits(expected))


@pytest.mark.parametrize("grad_dtype", [torch.float32, *DTYPES_16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("zero_acc", [False, True])
def test_accumulate_adam_equals_accumulate_then_adam(grad_dtype, out_dtype, zero_acc):
    n, interval = 10007, 4
    p0, m, v, gen = make_state(n, 6)
    p = p0.clone()
    p2, m2, v2 = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    out2 = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    sums = []
    for step in range(1, 6):
        acc, acc2 = torch.zeros(n), torch.zeros(n)
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(interval)]
        for g in grads[:-1]:
            accumulate_(acc, g)
            accumulate_(acc2, g)
        scale = interval * 1.5  # mean of the interval and a clip factor of 1/1.5
        accumulate_adam_(
            p, acc, grads[-1], m, v, step=step, weight_decay=0.1, grad_scale=scale, out=out, zero_acc=zero_acc, **HYPER
        )
        accumulate_(acc2, grads[-1])
        sums.append(acc2.clone())
        cpu_adam_(p2, acc2, m2, v2, step=step, weight_decay=0.1, grad_scale=scale, out=out2, **HYPER)
        assert torch.equal(bits(acc), bits(torch.zeros(n) if zero_acc else acc2)), "acc after the fused step"
        for a, b in zip((p, m, v), (p2, m2, v2), strict=True):
            assert torch.equal(bits(a), bits(b)), "fused and separate passes differ"
        if out is not None:
            assert torch.equal(bits(out), bits(out2)) and torch.equal(bits(out), bits(p.to(out_dtype)))
    ref = run_torch_optim(p0, sums, adamw=True, weight_decay=0.1, grad_scale=scale)
    for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref, strict=True):
        assert_scaled_close(ours, theirs, name)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 100003])
def test_cpu_adam_zero_grad_takes_the_same_step_and_zeroes_the_gradient(out_dtype, n):
    p, m, v, gen = make_state(n, 9)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    for step in range(1, 4):
        g = torch.randn(n, generator=gen) * 3
        g[: min(n, 2)] = -0.0  # negative zeros take the same step too
        g2 = g.clone()
        out = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
        out2 = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
        cpu_adam_(p, g, m, v, step=step, weight_decay=0.1, grad_scale=2.5, out=out, zero_grad=True, **HYPER)
        cpu_adam_(p2, g2, m2, v2, step=step, weight_decay=0.1, grad_scale=2.5, out=out2, **HYPER)
        assert torch.equal(bits(g), bits(torch.zeros(n))), "the gradient is +0.0 everywhere afterwards"
        for a, b in zip((p, m, v, out), (p2, m2, v2, out2), strict=True):
            assert a is None or torch.equal(bits(a), bits(b)), "zero_grad changed the step"
    assert n == 0 or not torch.equal(p, make_state(n, 9)[0])


# ---------------------------------------------------------------------------------------------
# sum_squares
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES_16])
@pytest.mark.parametrize("n", [0, 1, 7, 1000003])
def test_sum_squares_matches_torch_float64(dtype, n):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    expected = float((x.double() ** 2).sum())
    for threads in (1, 2):
        got = sum_squares(x, num_threads=threads)
        assert isinstance(got, float)
        assert got == pytest.approx(expected, rel=1e-12, abs=0.0)


def test_sum_squares_of_extreme_finite_values_is_finite():
    big = torch.full((100003,), torch.finfo(torch.float32).max)
    big[::2] *= -1
    assert math.isfinite(sum_squares(big))
    assert sum_squares(big) == pytest.approx(100003 * float(torch.finfo(torch.float32).max) ** 2, rel=1e-12)
    assert math.isfinite(sum_squares(torch.full((1000,), torch.finfo(torch.float16).max, dtype=torch.float16)))


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES_16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_sum_squares_detects_every_inf_and_nan_position(dtype, bad):
    n = 70001  # two threads split it unevenly; probe the ends, the middle and the split point
    positions = [0, 1, n // 2 - 1, n // 2, n // 2 + 1, n - 2, n - 1, 12345]
    rows = []
    for pos in positions:
        x = torch.randn(n, generator=torch.Generator().manual_seed(pos)).to(dtype)
        x[pos] = bad
        rows.append((pos, sum_squares(x, num_threads=1), sum_squares(x, num_threads=2)))
    assert all(not math.isfinite(a) and not math.isfinite(b) for _, a, b in rows), rows
    if not math.isnan(bad):
        assert all(a == math.inf and b == math.inf for _, a, b in rows), rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 3000),
    dtype=st.sampled_from([torch.float32, *DTYPES_16]),
    specials=st.lists(
        st.tuples(st.integers(0, 10**9), st.sampled_from([math.inf, -math.inf, math.nan, 0.0, 65504.0])), max_size=4
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_sum_squares_is_finite_iff_input_is(n, dtype, specials, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    for pos, value in specials:
        x[pos % n] = value
    got = sum_squares(x)
    assert math.isfinite(got) == bool(torch.isfinite(x).all())
    if math.isfinite(got):
        assert got == pytest.approx(float((x.double() ** 2).sum()), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# multi_sum_squares (the gradient norm of a step)
# ---------------------------------------------------------------------------------------------


def _multi_case(seed: int):
    """Tensors of every dtype and awkward sizes: empty, one element, a chunk boundary +-1, several chunks."""
    from zenflow_kernels.cpu_ops.accumulate import SUM_CHUNK

    gen = torch.Generator().manual_seed(seed)
    sizes = [(0,), (1,), (7, 3), (SUM_CHUNK - 1,), (SUM_CHUNK,), (SUM_CHUNK + 1,), (3, SUM_CHUNK + 5), (64, 64)]
    dtypes = [torch.float32, *DTYPES_16]
    return [(torch.randn(shape, generator=gen) * 3).to(dtypes[(n + seed) % 3]) for n, shape in enumerate(sizes)]


@pytest.mark.parametrize("seed", range(3))
def test_multi_sum_squares_matches_float64_sums_and_ignores_the_thread_count(seed):
    tensors = _multi_case(seed)
    expected = sum(float((t.double() ** 2).sum()) for t in tensors)
    rows = [(threads, multi_sum_squares(tensors, num_threads=threads)) for threads in (1, 2)]
    for sub in (tensors[:1], tensors[1:4], tensors[::-1]):  # subsets and another order
        assert multi_sum_squares(sub) == pytest.approx(sum(float((t.double() ** 2).sum()) for t in sub), rel=1e-12)
    assert all(isinstance(got, float) for _, got in rows)
    assert all(got == pytest.approx(expected, rel=1e-12, abs=0.0) for _, got in rows), (expected, rows)
    assert rows[0][1] == rows[1][1]  # chunks fixed: the same bits on one thread and on two
    assert multi_sum_squares([]) == 0.0 and multi_sum_squares([torch.zeros(0, dtype=torch.float16)]) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_chunk_sums_of_pieces_rebuild_the_whole_tensors_sum_bit_for_bit(seed):
    """``sum_squares_chunks_unchecked``: each ``SUM_CHUNK`` chunk's float64 sum of squares (torch's, within 1e-12),
    the same partials whether the tensor is summed whole or in pieces starting at chunk multiples, at 1 or 2
    threads, and ``float(partials.sum())`` is ``sum_squares_unchecked([x])`` to the bit (the host update's
    clipping norm of sums fetched from the device block by block: tests/test_nvme_optim.py)."""
    from zenflow_kernels.cpu_ops.accumulate import SUM_CHUNK, sum_squares_chunks_unchecked, sum_squares_unchecked

    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, *DTYPES_16):
        x = (torch.randn(11 * SUM_CHUNK + 7 * seed + 1, generator=gen) * 3).to(dtype)
        chunks = -(-x.numel() // SUM_CHUNK)
        whole = np.full(chunks, np.nan)
        sum_squares_chunks_unchecked(x, whole)
        want = [float((c.double() ** 2).sum()) for c in x.split(SUM_CHUNK)]
        assert whole.tolist() == pytest.approx(want, rel=1e-12)
        for threads, step in ((1, 3 * SUM_CHUNK), (2, 5 * SUM_CHUNK), (2, SUM_CHUNK)):
            pieces = np.full(chunks, np.nan)
            for lo in range(0, x.numel(), step):
                hi = min(x.numel(), lo + step)
                sum_squares_chunks_unchecked(x[lo:hi].clone(), pieces[lo // SUM_CHUNK : -(-hi // SUM_CHUNK)], threads)
            assert np.array_equal(pieces, whole), (dtype, threads, step)
        assert float(whole.sum()) == sum_squares_unchecked([x]), dtype


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_multi_sum_squares_is_non_finite_iff_some_tensor_is(bad):
    from zenflow_kernels.cpu_ops.accumulate import SUM_CHUNK

    rows = []
    for which in range(1, 8):  # every non-empty tensor; positions at its ends and a chunk boundary
        for pos in sorted({0, SUM_CHUNK - 1, SUM_CHUNK, -1}):
            tensors = _multi_case(0)
            flat = tensors[which].view(-1)
            if -flat.numel() <= pos < flat.numel():
                flat[pos] = bad
                rows.append((which, pos, multi_sum_squares(tensors)))
    assert len(rows) >= 12 and all(not math.isfinite(got) for *_, got in rows), rows
    assert math.isfinite(multi_sum_squares(_multi_case(0)))


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_the_optimizers_gradient_norm_on_either_path(bad):
    """``sharding.sum_of_squares``, what step() reads the norm and the skip check from: the CPU path (this
    numba pass) and the GPU path (torch's multi-tensor fp32 norms, run here on CPU tensors) give the float64
    sum of squares, to float64 rounding and to fp32-norm rounding; non-finite exactly when a gradient is."""
    from zenflow_kernels.sharding.base import _foreach_sum_of_squares, sum_of_squares

    grads = _multi_case(1)
    if bad is not None:
        grads[3].view(-1)[7] = bad
    exact = sum(float((g.double() ** 2).sum()) for g in grads)
    cpu = sum_of_squares(grads, torch.device("cpu"))
    gpu_path = _foreach_sum_of_squares(grads, torch.device("cpu"))
    assert cpu.dtype == gpu_path.dtype == torch.float64 and cpu.shape == gpu_path.shape == (1,)
    if bad is None:
        assert float(cpu) == pytest.approx(exact, rel=1e-12) and float(gpu_path) == pytest.approx(exact, rel=1e-5)
    else:
        assert not math.isfinite(float(cpu)) and not math.isfinite(float(gpu_path))
    strided = [g.t() for g in grads if g.dim() == 2]  # copied to contiguous first on the CPU path
    want = sum(float((g.double() ** 2).sum()) for g in strided)
    assert math.isfinite(want) == math.isfinite(float(sum_of_squares(strided, torch.device("cpu"))))
    if math.isfinite(want):
        assert float(sum_of_squares(strided, torch.device("cpu"))) == pytest.approx(want, rel=1e-12)
    cpu_device = torch.device("cpu")
    assert float(sum_of_squares([], cpu_device)) == 0.0 == float(_foreach_sum_of_squares([], cpu_device))


@pytest.mark.parametrize("seed", range(3))
def test_multi_accumulate_is_fp32_addition_of_every_pair(seed):
    """Every dtype, empty and chunk-boundary sizes, mixed in one call: the bits of ``acc.add_(grad.float())``
    per pair on one thread and on two; versions bumped; the gradients untouched."""
    grads = _multi_case(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    accs = [torch.randn(g.numel(), generator=gen) for g in grads]
    want = [a.clone().add_(g.reshape(-1).float()) for a, g in zip(accs, grads, strict=True)]
    kept = [g.clone() for g in grads]
    for threads in (1, 2):
        got = [a.clone() for a in accs]
        versions = [t._version for t in got]
        multi_accumulate_(got, grads, num_threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), threads
        assert all(t._version > v for t, v in zip(got, versions, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads, kept, strict=True))
    multi_accumulate_([], [])  # nothing to do


@pytest.mark.parametrize("scale", [0.5, 2.0**-16, 1 / 3, 3.0])
def test_multi_accumulate_with_a_scale_rounds_the_product_then_adds(scale):
    """``scale``: each element is ``fp32(grad) * fp32(scale)`` rounded, then added (no fused multiply-add): the
    bits of ``acc.add_(grad.float() * scale)``, for every dtype, a loss scaler's power-of-two reciprocal as any
    number; a bad scale is refused, naming it."""
    grads = _multi_case(0)
    gen = torch.Generator().manual_seed(7)
    accs = [torch.randn(g.numel(), generator=gen) for g in grads]
    f32 = torch.tensor(scale, dtype=torch.float32)
    want = [a.clone().add_(g.reshape(-1).float() * f32) for a, g in zip(accs, grads, strict=True)]
    got = [a.clone() for a in accs]
    multi_accumulate_(got, grads, scale=scale, num_threads=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for bad in (float("nan"), float("inf"), "2", True):
        with pytest.raises((TypeError, ValueError), match="scale"):
            multi_accumulate_(got, grads, scale=bad)


def test_multi_accumulate_errors_name_the_tensor_and_write_nothing():
    accs, grads = [torch.zeros(4), torch.zeros(6)], [torch.ones(4), torch.ones(6, dtype=torch.bfloat16)]
    cases = [
        (lambda: multi_accumulate_(accs[0], grads), TypeError, ["accs", "list"]),
        (lambda: multi_accumulate_(accs, grads[:1]), ValueError, ["same length", "2", "1"]),
        (lambda: multi_accumulate_([accs[0], torch.zeros(6, dtype=torch.bfloat16)], grads), TypeError,
         ["accs[1]", "float32"]),
        (lambda: multi_accumulate_(accs, [grads[0], torch.ones(5)]), ValueError, ["grads[1]", "6 elements"]),
        (lambda: multi_accumulate_(accs, [grads[0], torch.ones(6, dtype=torch.int32)]), TypeError,
         ["grads[1]", "int32"]),
        (lambda: multi_accumulate_(accs, [grads[0], torch.ones(12)[::2]]), ValueError, ["grads[1]", "contiguous"]),
        (lambda: multi_accumulate_(accs, [grads[0], accs[1]]), ValueError, ["overlap"]),
        (lambda: multi_accumulate_(accs, grads, num_threads=0), ValueError, ["num_threads"]),
    ]
    for call, error, words in cases:
        with pytest.raises(error) as info:
            call()
        assert all(w in str(info.value) for w in words), (words, str(info.value))
    assert not any(a.any() for a in accs)  # nothing was written


def test_multi_sum_squares_errors_name_the_tensor():
    good = torch.ones(4)
    cases = [
        (lambda: multi_sum_squares(good), TypeError, ["tensors", "list", "Tensor"]),
        (lambda: multi_sum_squares([good, torch.ones(4, dtype=torch.int32)]), TypeError, ["tensors[1]", "int32"]),
        (lambda: multi_sum_squares([good, _noncontig()]), ValueError, ["tensors[1]", "contiguous"]),
        (lambda: multi_sum_squares([torch.ones(4, device="meta")]), ValueError, ["tensors[0]", "CPU"]),
        (lambda: multi_sum_squares([good, np.ones(4, np.float32)]), TypeError, ["tensors[1]", "ndarray"]),
        (lambda: multi_sum_squares([good], num_threads=0), ValueError, ["num_threads", "0"]),
    ]
    for call, error, words in cases:
        with pytest.raises(error) as info:
            call()
        assert all(w in str(info.value) for w in words), (words, str(info.value))


# ---------------------------------------------------------------------------------------------
# Errors: raised before any write, naming the argument
# ---------------------------------------------------------------------------------------------

N = 8


def _tensors():
    gen = torch.Generator().manual_seed(8)
    return {
        "param": torch.randn(N, generator=gen),
        "grad": torch.randn(N, generator=gen),
        "exp_avg": torch.randn(N, generator=gen),
        "exp_avg_sq": torch.rand(N, generator=gen),
        "acc": torch.randn(N, generator=gen),
        "out": torch.zeros(N, dtype=torch.bfloat16),
    }


def _adam_kwargs(**over):
    kw = {"step": 3, "weight_decay": 0.1, **HYPER}
    kw.update(over)
    return kw


def _noncontig():
    return torch.randn(N, 2)[:, 0]


ADAM_ERRORS = [
    # (what to change: tensor name -> replacement, or kwargs override), exception, words the message must hold
    ({"param": _noncontig}, {}, ValueError, ["param", "contiguous"]),
    ({"param": lambda: torch.randn(N, dtype=torch.float64)}, {}, TypeError, ["param", "float64", "float32"]),
    ({"param": lambda: torch.randn(N).to(torch.bfloat16)}, {}, TypeError, ["param", "bfloat16"]),
    ({"param": lambda: torch.empty(N, device="meta")}, {}, ValueError, ["param", "CPU", "meta"]),
    ({"param": lambda: torch.randn(N).to_sparse()}, {}, ValueError, ["param", "strided"]),
    ({"param": lambda: [0.0] * N}, {}, TypeError, ["param", "torch.Tensor", "list"]),
    ({"grad": lambda: torch.randn(N + 1)}, {}, ValueError, ["grad", str(N), str(N + 1)]),
    ({"grad": lambda: torch.ones(N, dtype=torch.int32)}, {}, TypeError, ["grad", "int32", "bfloat16", "float16"]),
    ({"grad": lambda: torch.randn(N, dtype=torch.float64)}, {}, TypeError, ["grad", "float64"]),
    ({"grad": _noncontig}, {}, ValueError, ["grad", "contiguous"]),
    ({"exp_avg": lambda: torch.zeros(N, dtype=torch.float16)}, {}, TypeError, ["exp_avg", "float16"]),
    ({"exp_avg_sq": lambda: torch.zeros(N - 1)}, {}, ValueError, ["exp_avg_sq", str(N - 1)]),
    ({"exp_avg_sq": _noncontig}, {}, ValueError, ["exp_avg_sq", "contiguous"]),
    ({"out": lambda: torch.zeros(N, dtype=torch.float64)}, {}, TypeError, ["out", "float64"]),
    ({"out": lambda: torch.zeros(N + 3, dtype=torch.float16)}, {}, ValueError, ["out", str(N + 3)]),
    ({"out": lambda: torch.zeros(N, dtype=torch.int16)}, {}, TypeError, ["out", "int16"]),
    ({}, {"step": 0}, ValueError, ["step", ">= 1", "0"]),
    ({}, {"step": -2, "bias_correction": False}, ValueError, ["step", ">= 0", "-2"]),
    ({}, {"step": 1.5}, TypeError, ["step", "integer", "1.5"]),
    ({}, {"step": True}, TypeError, ["step", "integer", "True"]),
    ({}, {"lr": -1e-3}, ValueError, ["lr", ">= 0"]),
    ({}, {"lr": "0.1"}, TypeError, ["lr", "real", "str"]),
    ({}, {"beta1": 1.0}, ValueError, ["beta1", "< 1"]),
    ({}, {"beta2": -0.1}, ValueError, ["beta2", ">= 0"]),
    ({}, {"eps": float("nan")}, ValueError, ["eps", "finite"]),
    ({}, {"weight_decay": -0.5}, ValueError, ["weight_decay", ">= 0"]),
    ({}, {"grad_scale": 0.0}, ValueError, ["grad_scale", "> 0"]),
    ({}, {"grad_scale": float("inf")}, ValueError, ["grad_scale", "finite"]),
    ({}, {"adamw": "yes"}, TypeError, ["adamw", "bool"]),
    ({}, {"bias_correction": 1}, TypeError, ["bias_correction", "bool"]),
    ({}, {"num_threads": 0}, ValueError, ["num_threads", ">= 1", "0"]),
    ({}, {"num_threads": -1}, ValueError, ["num_threads", ">= 1", "-1"]),
    ({}, {"num_threads": 10**6}, ValueError, ["num_threads", "NUMBA_NUM_THREADS"]),
    ({}, {"num_threads": True}, TypeError, ["num_threads", "integer"]),
    ({}, {"num_threads": 1.0}, TypeError, ["num_threads", "integer"]),
]


def _apply(case, t):
    swaps, kw = case[0], case[1]
    t = dict(t)
    for name, make in swaps.items():
        t[name] = make()
    return t, _adam_kwargs(**kw)


def _snapshot(t):
    return {
        k: v.clone()
        for k, v in t.items()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout == torch.strided
    }


def _assert_unchanged(before, t):
    for k, v in before.items():
        assert torch.equal(bits(t[k].contiguous()), bits(v.contiguous())), f"{k} was written"


def _check_error(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"message {message!r} lacks {missing}"


@pytest.mark.parametrize(
    "case",
    ADAM_ERRORS
    + [
        ({}, {"zero_grad": 1}, TypeError, ["zero_grad", "bool"]),
        ({"grad": lambda: torch.randn(N).to(torch.bfloat16)}, {"zero_grad": True}, TypeError,
         ["grad", "float32", "zero_grad", "bfloat16"]),
    ],
    ids=lambda c: f"{list(c[0]) or c[1]}-{c[2].__name__}",
)
def test_cpu_adam_errors_leave_everything_unchanged(case):
    t, kw = _apply(case, _tensors())
    before = _snapshot(t)
    _check_error(
        lambda: cpu_adam_(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], out=t["out"], **kw), case[2], case[3]
    )
    _assert_unchanged(before, t)


@pytest.mark.parametrize(
    "case",
    ADAM_ERRORS
    + [
        ({"acc": _noncontig}, {}, ValueError, ["acc", "contiguous"]),
        ({"acc": lambda: torch.zeros(N, dtype=torch.bfloat16)}, {}, TypeError, ["acc", "bfloat16"]),
        ({"acc": lambda: torch.zeros(N + 1)}, {}, ValueError, ["acc", str(N + 1)]),
        ({}, {"zero_acc": 1}, TypeError, ["zero_acc", "bool"]),
    ],
    ids=lambda c: f"{list(c[0]) or c[1]}-{c[2].__name__}",
)
def test_accumulate_adam_errors_leave_everything_unchanged(case):
    t, kw = _apply(case, _tensors())
    before = _snapshot(t)
    _check_error(
        lambda: accumulate_adam_(t["param"], t["acc"], t["grad"], t["exp_avg"], t["exp_avg_sq"], out=t["out"], **kw),
        case[2],
        case[3],
    )
    _assert_unchanged(before, t)


def test_overlapping_tensors_are_rejected_before_any_write():
    t = _tensors()
    before = _snapshot(t)
    buf = torch.zeros(2 * N)
    cases = [
        (
            lambda: cpu_adam_(t["param"], t["grad"], t["exp_avg"], t["exp_avg"], **_adam_kwargs()),
            ["exp_avg", "exp_avg_sq"],
        ),
        (
            lambda: cpu_adam_(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], out=t["param"], **_adam_kwargs()),
            ["param", "out"],
        ),
        (lambda: cpu_adam_(t["param"], t["param"], t["exp_avg"], t["exp_avg_sq"], **_adam_kwargs()), ["param", "grad"]),
        (
            lambda: cpu_adam_(buf[:N], t["grad"], buf[N // 2 : N // 2 + N], t["exp_avg_sq"], **_adam_kwargs()),
            ["param", "exp_avg"],
        ),
        (
            lambda: accumulate_adam_(t["param"], t["acc"], t["acc"], t["exp_avg"], t["exp_avg_sq"], **_adam_kwargs()),
            ["acc", "grad"],
        ),
        (lambda: accumulate_(t["acc"], t["acc"]), ["acc", "grad"]),
    ]
    for call, words in cases:
        _check_error(call, ValueError, words + ["overlap"])
    _assert_unchanged(before, t)
    assert torch.equal(buf, torch.zeros(2 * N))
    # reading the same gradient tensor twice is fine: grad is never written
    cpu_adam_(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], out=t["out"], **_adam_kwargs())


def test_accumulate_and_sum_squares_errors():
    t = _tensors()
    before = _snapshot(t)
    cases = [
        (lambda: accumulate_(t["acc"].to(torch.float16), t["grad"]), TypeError, ["acc", "float16"]),
        (lambda: accumulate_(t["acc"], torch.zeros(N + 2)), ValueError, ["grad", str(N + 2)]),
        (lambda: accumulate_(t["acc"], _noncontig()), ValueError, ["grad", "contiguous"]),
        (lambda: accumulate_(t["acc"], t["grad"], num_threads=0), ValueError, ["num_threads"]),
        (lambda: accumulate_(t["acc"], torch.zeros(N, dtype=torch.int64)), TypeError, ["grad", "int64"]),
        (lambda: sum_squares(torch.ones(N, dtype=torch.int32)), TypeError, ["x", "int32"]),
        (lambda: sum_squares(_noncontig()), ValueError, ["x", "contiguous"]),
        (lambda: sum_squares(torch.ones(N, device="meta")), ValueError, ["x", "CPU"]),
        (lambda: sum_squares(np.ones(N, np.float32)), TypeError, ["x", "torch.Tensor", "ndarray"]),
        (lambda: sum_squares(t["grad"], num_threads=-3), ValueError, ["num_threads", "-3"]),
    ]
    for call, exc, words in cases:
        _check_error(call, exc, words)
    _assert_unchanged(before, t)


def test_size_zero_is_a_no_op_but_still_validated():
    e = torch.zeros(0)
    cpu_adam_(e, e.clone(), e.clone(), e.clone(), out=torch.zeros(0, dtype=torch.float16), **_adam_kwargs())
    accumulate_adam_(e, e.clone(), e.clone(), e.clone(), e.clone(), **_adam_kwargs())
    accumulate_(e, torch.zeros(0, dtype=torch.bfloat16))
    assert sum_squares(torch.zeros(0, dtype=torch.float16)) == 0.0
    with pytest.raises(ValueError, match="step"):
        cpu_adam_(e, e.clone(), e.clone(), e.clone(), **_adam_kwargs(step=0))
    with pytest.raises(ValueError, match="grad"):
        accumulate_(e, torch.zeros(1))


def test_step_zero_is_allowed_without_bias_correction():
    t = _tensors()
    cpu_adam_(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], **_adam_kwargs(step=0, bias_correction=False))
    assert torch.isfinite(t["param"]).all()


# ---------------------------------------------------------------------------------------------
# Threads: the GIL is released, background use next to torch, concurrent launches
# ---------------------------------------------------------------------------------------------


def test_kernel_releases_the_gil_main_thread_runs_python_mid_kernel():
    """The main thread sees the parameter half updated: it ran Python while the kernel was running.

    With one kernel thread the elements are updated in order. Seeing element 0 updated and *then*
    the last element not yet updated means the kernel was running between those two Python-level
    reads. A kernel holding the GIL could never be observed that way (the main thread can only run
    before it started or after it finished), however the machine is loaded.
    """
    n = 1 << 24
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    g = torch.ones(n)
    pn = p.numpy()
    seen_mid_kernel = 0
    polls = 0
    worker = threading.Thread(target=lambda: cpu_adam_(p, g, m, v, step=1, weight_decay=0.0, num_threads=1, **HYPER))
    worker.start()
    while worker.is_alive():
        polls += 1
        if pn[0] != 0.0 and pn[n - 1] == 0.0:
            seen_mid_kernel += 1
    worker.join()
    assert bool((p != 0).all())  # the kernel finished its work
    assert seen_mid_kernel > 0, f"main thread never ran while the kernel ran ({polls} polls)"


def test_background_kernels_next_to_torch_work_in_the_main_thread():
    n = 300007
    p0, _, _, gen = make_state(n, 9)
    grads = [torch.randn(n, generator=gen) for _ in range(30)]
    serial = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    for step, g in enumerate(grads, 1):
        cpu_adam_(*serial[:1], g, *serial[1:], step=step, weight_decay=0.1, **HYPER)
    state = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    errors = []

    def host_work():
        try:
            for step, g in enumerate(grads, 1):
                acc = torch.zeros(n)
                accumulate_(acc, g)
                assert math.isfinite(sum_squares(acc))
                cpu_adam_(state[0], acc, state[1], state[2], step=step, weight_decay=0.1, num_threads=1, **HYPER)
        except Exception as exc:  # re-raised below in the main thread
            errors.append(exc)

    worker = threading.Thread(target=host_work, daemon=True)
    worker.start()
    a = torch.randn(256, 256)
    rounds = 0
    while worker.is_alive() and rounds < 100000:
        a = torch.tanh(a @ a.T / 256)  # torch's OpenMP pool busy in the main thread meanwhile
        rounds += 1
    worker.join(timeout=120)
    assert not worker.is_alive(), "host thread deadlocked"
    assert not errors, errors
    for ours, ref in zip(state, serial, strict=True):
        assert torch.equal(ours, ref)
    assert rounds > 0


def test_concurrent_launches_from_two_threads():
    n = 200003
    gen = torch.Generator().manual_seed(10)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(20)]
    expected = torch.zeros(n)
    for g in grads:
        expected += g.float()
    accs = [torch.zeros(n), torch.zeros(n)]
    norms: list[list[float]] = [[], []]
    barrier = threading.Barrier(2)

    def work(k):
        barrier.wait()
        for g in grads:
            accumulate_(accs[k], g)
            norms[k].append(sum_squares(accs[k]))

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert torch.equal(accs[0], expected) and torch.equal(accs[1], expected)
    assert norms[0] == norms[1] and len(norms[0]) == len(grads)


_WORKQUEUE_SCRIPT = textwrap.dedent(
    """
    import threading, torch, numba
    from zenflow_kernels.cpu_ops import accumulate_
    n = 1 << 18
    accs, g = [torch.zeros(n), torch.zeros(n)], torch.ones(n)
    def work(k):
        for _ in range(200):
            accumulate_(accs[k], g, num_threads=2)
    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(numba.threading_layer(), float(accs[0].min()), float(accs[1].max()))
    """
)


def test_concurrent_launches_are_serialised_on_the_workqueue_layer():
    """numba's workqueue layer aborts the process on concurrent launches (checked by hand: without
    the launch lock this script dies with 'Concurrent access has been detected'); ours serialise."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _WORKQUEUE_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["workqueue", "200.0", "200.0"], done.stdout


_TORCH_THREADS_SCRIPT = textwrap.dedent(
    """
    import sys, threading, torch
    from zenflow_kernels.cpu_ops import accumulate_
    torch.set_num_threads(1)
    acc, g = torch.zeros(1 << 18), torch.ones(1 << 18)
    if sys.argv[1] == "worker":  # the layer starts on a background thread, as under ZenFlowAdamW
        t = threading.Thread(target=accumulate_, args=(acc, g), kwargs=dict(num_threads=2))
        t.start(); t.join()
    else:
        accumulate_(acc, g, num_threads=2)
    accumulate_(acc, g, num_threads=2)
    print(torch.get_num_threads(), float(acc.max()))
    """
)


@pytest.mark.parametrize("starter", ["caller", "worker"])
def test_the_first_launch_keeps_the_callers_torch_thread_count(starter):
    """Starting numba's OpenMP layer resets the OpenMP thread count torch reads: without the
    launcher's guard a trainer's torch.set_num_threads(1) came back as 2 after the first host step
    (seen on this 2-core host; a fresh process, since the layer starts once)."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_THREADS_SCRIPT, starter], env=env, cwd=root, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "2.0"], done.stdout
