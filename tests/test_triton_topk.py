"""topk_columns / multi_topk_columns: the radix-select kernel against the torch path and a naive
Python sort written here (ties to the lower index, result sorted ascending)."""

from __future__ import annotations

import os

import pytest
import torch

from zenflow_kernels import ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or a CUDA device")

tk = pytest.importorskip("zenflow_kernels.triton.topk_columns")
from zenflow_kernels.triton._util import count_launches  # noqa: E402


def naive_topk(scores: torch.Tensor, k: int) -> list[int]:
    """Sort (score descending, index ascending) in Python, keep k, sort the indices."""
    vals = [float(x) for x in scores.float().cpu()]
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
    return sorted(order[:k])


def scores_of(kind: str, C: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":  # signed, mostly distinct
        return torch.randn(C, generator=gen)
    if kind == "equal":
        return torch.full((C,), 0.25)
    if kind == "ties":  # a handful of distinct values, so the threshold value is shared by many
        return torch.randint(0, 5, (C,), generator=gen).float() * 0.5
    if kind == "zeros":  # -0.0 and +0.0 must count as equal
        s = torch.zeros(C)
        s[::3] = -0.0
        s[C // 2:: 7] = 1.0
        return s
    if kind == "inf":
        s = torch.rand(C, generator=gen)
        s[::5] = float("inf")
        s[1::9] = float("-inf")
        return s
    raise ValueError(kind)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_sweep(device):
    """C up to several chunks (the kernel reads CHUNK=2048 scores at a time) x k x distributions."""
    assert tk._CHUNK == 2048
    rows = []
    for C in (1, 2, 7, 100, 2048, 2049, 5000):
        for kind in ("randn", "equal", "ties", "zeros", "inf"):
            s = scores_of(kind, C, seed=C).to(device)
            for k in sorted({0, 1, C // 10, C}):
                with ops.use_backend("triton"):
                    got = ops.topk_columns(s, k)
                with ops.use_backend("torch"):
                    ref_torch = ops.topk_columns(s, k)
                ref = naive_topk(s, k)
                ok = (got.dtype == torch.int64 and got.device == s.device and got.cpu().tolist() == ref
                      and ref_torch.cpu().tolist() == ref)
                rows.append((C, kind, k, ok))
    bad = [r for r in rows if not r[3]]
    assert not bad, bad
    assert len(rows) > 100


@pytest.mark.parametrize("device", DEVICES)
def test_all_equal_takes_lowest_indices(device):
    s = torch.ones(3000, device=device)
    with ops.use_backend("triton"):
        assert ops.topk_columns(s, 300).cpu().tolist() == list(range(300))
        assert ops.topk_columns(s, 3000).cpu().tolist() == list(range(3000))
        assert ops.topk_columns(s, 0).shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_and_strided_scores(device, dtype):
    base = torch.randn(2 * 3001, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    s = base[::2]  # stride 2, and many exact ties after rounding to 16 bits
    assert s.stride(0) == 2
    with ops.use_backend("triton"):
        got = ops.topk_columns(s, 400)
    assert got.cpu().tolist() == naive_topk(s, 400)


@pytest.mark.parametrize("device", DEVICES)
def test_vocabulary_sized(device):
    """C = 256K (an embedding's vocabulary): 128 chunks per pass, with ties at the threshold."""
    C = 1 << 18
    gen = torch.Generator().manual_seed(7)
    s = (torch.rand(C, generator=gen) * 1000).round()  # ~1000 distinct values: ties everywhere
    s = s.to(device)
    k = C // 10
    with ops.use_backend("triton"):
        got = ops.topk_columns(s, k).cpu()
    # naive reference: stable descending sort in torch (a Python sort of 256K floats is slow, not wrong)
    ref = torch.sort(torch.sort(-s.cpu(), stable=True).indices[:k]).values
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_is_an_error(device):
    s = torch.rand(50, device=device)
    s[17] = float("nan")
    for backend in ("triton", "torch"):
        with ops.use_backend(backend), pytest.raises(ValueError, match=r"scores holds NaN \(first at column 17\)"):
            ops.topk_columns(s, 5)
    nan_in_second = r"scores_list\[1\] holds NaN"
    with ops.use_backend("triton"), count_launches() as n, pytest.raises(ValueError, match=nan_in_second):
        ops.multi_topk_columns([torch.rand(4, device=device), s], [1, 2])
    assert sum(n.values()) == 0  # rejected before any launch


@pytest.mark.parametrize("device", DEVICES)
def test_multi_equals_single_and_one_launch_per_dtype(device):
    gen = torch.Generator().manual_seed(5)
    scores = [torch.randn(c, generator=gen).to(device) for c in (1, 33, 700, 2500, 64, 4096)]
    scores[3] = scores[3].round()  # ties
    scores[4] = scores[4].to(torch.bfloat16)
    ks = [1, 0, 70, 250, 64, 409]
    with ops.use_backend("triton"), count_launches() as n:
        got = ops.multi_topk_columns(scores, ks)
    assert n == {"_multi_topk_kernel": 2}  # fp32 group and bf16 group
    with ops.use_backend("torch"):
        ref_torch = ops.multi_topk_columns(scores, ks)
    for s, k, a, b in zip(scores, ks, got, ref_torch, strict=True):
        ref = naive_topk(s, k)
        assert a.dtype == torch.int64 and a.cpu().tolist() == ref and b.cpu().tolist() == ref
    with ops.use_backend("triton"), count_launches() as n:
        ops.multi_topk_columns(scores * 3, ks * 3)
    assert n == {"_multi_topk_kernel": 2}  # 18 tensors: still one launch per dtype


@pytest.mark.parametrize("device", DEVICES)
def test_selection_pipeline_three_launches(device):
    """Scores then selection for a model's matrices: at most 3 launches in all, whatever their number."""
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(r, c, generator=gen).to(device) for r, c in [(24, 40), (40, 24), (24, 96)] * 5]
    with ops.use_backend("triton"), count_launches() as n:
        scores = ops.multi_column_scores(grads)
        picks = ops.multi_topk_columns(scores, [max(1, g.shape[1] // 10) for g in grads])
    assert sum(n.values()) <= 3, n
    for g, p in zip(grads, picks, strict=True):
        assert p.cpu().tolist() == naive_topk((g.double() ** 2).sum(0), max(1, g.shape[1] // 10))
