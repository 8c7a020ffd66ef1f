"""The bf16/fp16 bit conversions of the host kernels, against torch, and the kernels' vectorisation."""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llvmlite import binding as llvm

from zenflow_kernels.cpu_ops._common import as_numpy
from zenflow_kernels.cpu_ops.kernels.accumulate import convert_kernel, multi_accumulate_kernel, sum_squares_kernel
from zenflow_kernels.cpu_ops.kernels.adam import adam_kernel

HALF = (torch.bfloat16, torch.float16)


def to_16(x: torch.Tensor, dtype) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=dtype)
    convert_kernel(as_numpy(x), as_numpy(out))
    return out


def from_16(h: torch.Tensor) -> torch.Tensor:
    out = torch.empty(h.numel())
    convert_kernel(as_numpy(h), as_numpy(out))
    return out


def assert_same_as_torch(x: torch.Tensor, dtype) -> None:
    """Our fp32 -> 16-bit conversion equals ``x.to(dtype)`` bit for bit, except that NaN only has to
    stay NaN (torch itself writes different NaN patterns from its scalar and vector paths)."""
    ours = to_16(x, dtype).view(torch.int16)
    ref = x.to(dtype).view(torch.int16)
    nan = x.isnan()
    bad = (ours != ref) & ~nan
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} mismatches, e.g. x bits {x.view(torch.int32)[i].item() & 0xFFFFFFFF:#010x}: "
            f"ours {ours[i].item() & 0xFFFF:#06x}, torch {ref[i].item() & 0xFFFF:#06x}"
        )
    assert bool(to_16(x[nan], dtype).float().isnan().all())


@pytest.mark.parametrize("dtype", HALF)
def test_every_16_bit_pattern_converts_exactly_to_fp32(dtype):
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    ours, ref = from_16(h), h.float()
    same_bits = ours.view(torch.int32) == ref.view(torch.int32)
    assert bool((same_bits | (ours.isnan() & ref.isnan())).all())
    assert int(ref.isnan().sum()) > 0 and int(ref.isinf().sum()) == 2  # the table did cover the specials


def _special_floats() -> torch.Tensor:
    """Values around every rounding boundary that matters for bf16 and fp16."""
    f32 = np.float32
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0]
    vals += [65504.0, 65519.996, 65520.0, 65535.0, 65536.0, 1e10, -65520.0]  # fp16 largest / overflow
    vals += [2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-25 * 1.0000001, 2.0**-14, 2.0**-14 * (1 - 2**-11)]  # subnormals
    vals += [float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny), 1e-45, -1e-45]
    base = np.array(vals, dtype=f32)
    bit_cases = np.array(
        [
            0x7F7FFFFF,  # fp32 max: bf16 rounds it to inf
            0x7F7F7FFF,
            0x7F7F8000,  # ties at the top
            0x3F808000,  # 1.0039..: bf16 tie, even -> down
            0x3F818000,  # odd -> up
            0x3F801000,  # fp16 tie (bit 12 set, lower clear), even
            0x3F803000,  # fp16 tie, odd
            0x7FC00001,
            0x7F800001,  # NaN payloads (quiet and signalling)
            0xFF800001,
            0x00400000,  # fp32 subnormal
            0x80000001,
        ],
        dtype=np.uint32,
    ).view(f32)
    return torch.from_numpy(np.concatenate([base, bit_cases]))


@pytest.mark.parametrize("dtype", HALF)
def test_fp32_to_16_bit_on_special_values(dtype):
    assert_same_as_torch(_special_floats(), dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_fp32_to_16_bit_on_a_sweep_of_all_bit_patterns(dtype):
    """Every 4093rd of the 2^32 fp32 bit patterns (about a million, all exponents and signs)."""
    u = np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32)
    assert_same_as_torch(torch.from_numpy(u.view(np.float32)), dtype)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_fp32_to_16_bit_on_random_bit_patterns(patterns):
    x = torch.from_numpy(np.array(patterns, dtype=np.uint32).view(np.float32))
    for dtype in HALF:
        assert_same_as_torch(x, dtype)


def test_nan_keeps_its_sign():
    x = torch.tensor([float("nan"), -float("nan")])
    for dtype in HALF:
        out = to_16(x, dtype).view(torch.int16)
        assert out[0].item() > 0 > out[1].item()  # sign bit clear / set


# ---------------------------------------------------------------------------------------------
# Vectorisation: the compiled loops use 8-wide AVX2 instructions, or wider (AVX-512's zmm registers, which LLVM
# picks on machines that have them)
# ---------------------------------------------------------------------------------------------

_HAS_AVX2 = llvm.get_host_cpu_features().get("avx2", False)


def _fresh_asm(kernel, *args) -> str:
    """Assembly of ``kernel`` compiled now for ``args`` (cached code cannot be inspected)."""
    fresh = numba.njit(parallel=True, nogil=True, fastmath=kernel.targetoptions.get("fastmath", False))(kernel.py_func)
    fresh(*args)
    return fresh.inspect_asm(fresh.signatures[0])


def _count(asm: str, pattern: str) -> int:
    return len(re.findall(pattern, asm))


@pytest.mark.skipif(not _HAS_AVX2, reason="checks x86 AVX2 assembly")
def test_adam_and_sum_squares_loops_are_vectorised():
    from zenflow_kernels.cpu_ops.adam import _adam_scalars

    n = 1000
    f = [np.zeros(n, np.float32) for _ in range(4)]
    out = np.zeros(n, np.int16)  # bf16 copy-out
    scalars = _adam_scalars(
        step=1,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw=True,
        bias_correction=True,
        grad_scale=1.0,
    )
    asm = _fresh_asm(adam_kernel, f[0], f[1], f[2], f[3], None, out, False, *scalars, np.int64(0), None)
    assert _count(asm, r"vsqrtps\s+[^\n]*[yz]mm") >= 1, "Adam: no 8-wide sqrt"
    assert _count(asm, r"vdivps\s+[^\n]*[yz]mm") >= 1, "Adam: no 8-wide division"
    assert _count(asm, r"vfn?m(add|sub)\w*ps\s+[^\n]*[yz]mm") >= 2, "Adam: no 8-wide fma"
    assert _count(asm, r"vpsrld\s+[^\n]*[yz]mm") >= 1, "bf16 copy-out: no 8-wide integer shift"
    # bf16 moments rounded stochastically: the hash's 32-bit multiplies stay 8-wide (vpmulld), the loop vectorised
    m16, v16 = np.zeros(n, np.int16), np.zeros(n, np.int16)
    asm = _fresh_asm(adam_kernel, f[0], f[1], m16, v16, None, out, False, *scalars, np.int64(0), np.uint32(7))
    assert _count(asm, r"vpmulld\s+[^\n]*[yz]mm") >= 2, "stochastic rounding: no 8-wide 32-bit multiply"
    assert _count(asm, r"vsqrtps\s+[^\n]*[yz]mm") >= 1, "Adam with stochastic rounding: no 8-wide sqrt"
    asm = _fresh_asm(sum_squares_kernel, np.zeros(n, np.float32))
    assert _count(asm, r"v(fmadd\w*|add|mul)pd\s+[^\n]*[yz]mm") >= 1, "sum_squares: no 4-wide float64 sum"
    # the fold of the landing area into the sums (acc += grad * scale; the product rounded, then added: no fma)
    acc, grad = np.zeros(n, np.float32), np.zeros(n, np.int16)  # a bf16 gradient
    asm = _fresh_asm(multi_accumulate_kernel, np.array([acc.ctypes.data], np.int64),
                     np.array([grad.ctypes.data], np.int64), np.array([n], np.int64), np.array([0, 1], np.int64),
                     n, np.empty(0, np.int16), np.float32(0.5))
    assert _count(asm, r"vmulps\s+[^\n]*[yz]mm") >= 1 and _count(asm, r"vaddps\s+[^\n]*[yz]mm") >= 1, \
        "fold: no 8-wide multiply and add"
    assert _count(asm, r"vfn?m(add|sub)\w*ps") == 0, "fold: the product must be rounded before the addition"


def test_the_vectorisation_check_accepts_avx2_and_avx512_registers():
    """The patterns above match 8-wide AVX2 (``ymm``) and 16-wide AVX-512 (``zmm``) instructions alike, and
    neither 4-wide SSE (``xmm``) nor a scalar instruction (a check that would fail on AVX-512 machines, or pass
    a scalar loop, would be no check)."""
    pattern = r"vsqrtps\s+[^\n]*[yz]mm"
    assert _count("vsqrtps %ymm1, %ymm2\n", pattern) == 1 and _count("vsqrtps %zmm1, %zmm2\n", pattern) == 1
    assert _count("vsqrtps %xmm1, %xmm2\n", pattern) == 0 and _count("vsqrtss %xmm1, %xmm2\n", pattern) == 0
