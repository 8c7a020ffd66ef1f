"""column_scores / multi_column_scores: Triton kernels (interpreted on CPU, compiled on CUDA) against
the torch path and against a naive float64 row loop written here."""

from __future__ import annotations

import os

import pytest
import torch

from zenflow_kernels import ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or a CUDA device")

cs = pytest.importorskip("zenflow_kernels.triton.column_scores")
from zenflow_kernels.triton._util import count_launches, force_config  # noqa: E402

RTOL = 1e-6  # fp32 accumulation of exactly representable inputs, against exact float64


def naive_scores(g: torch.Tensor, importance: str) -> torch.Tensor:
    """Row-by-row float64 accumulation: independent of both implementations."""
    g64 = g.to(torch.float64).cpu()
    acc = torch.zeros(g.shape[1], dtype=torch.float64)
    for r in range(g.shape[0]):
        row = g64[r]
        acc += row.abs() if importance == "l1" else row * row
    return acc


def make(shape, dtype, layout, device, seed=0):
    """A [R, C] gradient in the given memory layout: contiguous, transposed view, or column-strided view."""
    R, C = shape
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(R, C, generator=gen).to(device=device, dtype=dtype)
    if layout == "transposed":
        return torch.randn(C, R, generator=gen).to(device=device, dtype=dtype).t()
    return torch.randn(R, 2 * C, generator=gen).to(device=device, dtype=dtype)[:, ::2]  # stride_c == 2


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(torch.float64).cpu()
    got = got.to(torch.float64).cpu()
    denom = ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return float(((got - ref).abs() / denom).max()) if ref.numel() else 0.0


SHAPES = [(1, 1), (1, 7), (9, 1), (3, 5), (17, 33), (257, 1000), (1000, 3)]


@pytest.mark.parametrize("device", DEVICES)
def test_scores_sweep(device):
    """Shapes x dtypes x layouts x importance, every row of the table within RTOL of both references."""
    table = []
    for shape in SHAPES:
        big = shape == (257, 1000)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for layout in ("contiguous", "transposed", "strided"):
                for importance in ("l2", "l1"):
                    if big and (dtype != torch.float32 or layout == "strided" or importance == "l1") and (
                        device == "cpu"
                    ):
                        continue  # keep interpreter time bounded; the small shapes cover these combinations
                    g = make(shape, dtype, layout, device)
                    with ops.use_backend("triton"):
                        got = ops.column_scores(g, importance)
                    with ops.use_backend("torch"):
                        ref_torch = ops.column_scores(g, importance)
                    ref = naive_scores(g, importance)
                    assert got.dtype == torch.float32 and got.shape == (shape[1],) and got.device == g.device
                    table.append((shape, dtype, layout, importance, rel_err(got, ref), rel_err(ref_torch, ref),
                                  rel_err(got, ref_torch)))
    bad = [row for row in table if max(row[4:]) > RTOL]
    assert not bad, "rows over tolerance (shape, dtype, layout, importance, kernel, torch, kernel-vs-torch):\n" + \
        "\n".join(map(str, bad))
    assert len(table) >= 100


@pytest.mark.parametrize("device", DEVICES)
def test_every_autotune_config(device):
    """Each config's tiling (ragged edges on both axes) gives the right answer, in both layouts."""
    kernel = cs._column_scores_kernel
    errs = []
    for i in range(len(kernel.configs)):
        with force_config(kernel, i) as cfg:
            for layout in ("contiguous", "transposed"):
                g = make((37, 70), torch.float32, layout, device, seed=i)
                errs.append((str(cfg), layout, rel_err(cs.column_scores(g), naive_scores(g, "l2"))))
    assert len(errs) == 2 * len(cs._CONFIGS)
    assert max(e[2] for e in errs) <= RTOL, errs


@pytest.mark.parametrize("device", DEVICES)
def test_row_split_two_pass(device):
    """Tall matrices split over rows: partial rows per group plus a second, ordered reduction; the same
    bits as one pass."""
    g = make((1200, 45), torch.bfloat16, "contiguous", device, seed=3)
    ref = naive_scores(g, "l2")
    with count_launches() as n:
        a = cs.column_scores(g, rows_per_split=64)  # rounded up to one group: 3 splits, the last one ragged
    assert n == {"_column_scores_kernel": 1, "_sum_partials_kernel": 1}
    b = cs.column_scores(g, rows_per_split=1000)  # two groups, then the ragged rest
    assert rel_err(a, ref) <= RTOL
    with count_launches() as n:
        c = cs.column_scores(g, rows_per_split=1200)
    assert n == {"_column_scores_kernel": 1}
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_default_split_policy_fills_the_machine(device):
    g = make((4096, 3), torch.float32, "contiguous", device)
    S, rows = cs._split(4096, 1, g.device)
    assert S > 1 and rows % cs.GROUP_ROWS == 0 and S * rows >= 4096 > (S - 1) * rows
    assert cs._split(1000, 1, g.device) == (1, 1024)  # too short to split (less than two groups)
    with ops.use_backend("triton"), count_launches() as n:
        got = ops.column_scores(g)
    assert n["_sum_partials_kernel"] == 1
    assert rel_err(got, naive_scores(g, "l2")) <= RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_empty_shapes(device):
    with ops.use_backend("triton"):
        z = ops.column_scores(torch.empty(0, 4, device=device))
        e = ops.column_scores(torch.empty(3, 0, device=device))
    assert torch.equal(z.cpu(), torch.zeros(4)) and e.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("importance", ["l2", "l1"])
def test_multi_equals_single_and_launches_are_constant(device, importance):
    specs = [((17, 33), torch.float32, "contiguous"), ((5, 300), torch.bfloat16, "contiguous"),
             ((40, 9), torch.float16, "transposed"), ((0, 6), torch.float32, "contiguous"),
             ((1, 1), torch.bfloat16, "strided"), ((1100, 20), torch.float32, "contiguous")]
    grads = [make(s, d, lay, device, seed=i) for i, (s, d, lay) in enumerate(specs)]
    with ops.use_backend("triton"), count_launches() as n_small:
        got = ops.multi_column_scores(grads, importance)
    with ops.use_backend("torch"):
        ref_torch = ops.multi_column_scores(grads, importance)
    assert len(got) == len(grads)
    for g, a, b in zip(grads, got, ref_torch, strict=True):
        ref = naive_scores(g, importance)
        with ops.use_backend("triton"):
            single = ops.column_scores(g, importance)
        assert a.shape == (g.shape[1],) and a.dtype == torch.float32
        assert max(rel_err(a, ref), rel_err(b, ref)) <= RTOL
        assert torch.equal(a, single)  # one summation order for both launchers
    # three dtype groups; only the fp32 group holds a tall matrix that needs the partial-sum pass
    assert n_small == {"_multi_column_scores_kernel": 3, "_multi_sum_partials_kernel": 1}
    with ops.use_backend("triton"), count_launches() as n_large:
        ops.multi_column_scores(grads * 4, importance)
    # 24 tensors: still one launch per dtype group (plus at most one partial-sum launch for the fp32 group,
    # depending on whether the machine is filled without splitting the tall matrix)
    assert n_large["_multi_column_scores_kernel"] == 3
    assert n_large.get("_multi_sum_partials_kernel", 0) <= 1 and len(n_large) <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_multi_empty_list(device):
    with ops.use_backend("triton"), count_launches() as n:
        assert ops.multi_column_scores([]) == []
    assert sum(n.values()) == 0


# ----------------------------------------------------------------------------------------------------
# One summation order: the same input gives the same fp32 bits whatever config or row split runs (two
# ZeRO ranks, or a run and its resumption, whose autotuners chose differently, select the same columns).


def near_tie(device, dtype, layout, R=1100, C=45, a=7, b=30, seed=5):
    """A [R, C] gradient whose columns a and b hold the same values in different row orders: equal sums in
    exact arithmetic, fp32 sums apart by a few ulp at most (a near-tie at a selection boundary)."""
    g = make((R, C), torch.float32, "contiguous", "cpu", seed=seed)
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(seed))
    g[:, b] = g[perm, a]
    if layout == "transposed":
        return g.t().contiguous().to(device=device, dtype=dtype).t()
    if layout == "strided":
        wide = torch.zeros(R, 2 * C)
        wide[:, ::2] = g
        return wide.to(device=device, dtype=dtype)[:, ::2]
    return g.to(device=device, dtype=dtype)


def identity_cases(device, dtype):
    """(layout, importance) pairs of the sweep below. l1 changes one elementwise op, not the order: swept
    in fp32. On CUDA, where every new combination compiles each config once more (and the GPU suite's
    test stage has a time budget), bf16/fp16 run row-major only and l1 row-major only."""
    layouts = ("contiguous", "transposed", "strided")
    if dtype != torch.float32:
        return [("contiguous", "l2")] if device == "cuda" else [(lay, "l2") for lay in layouts]
    l1_layouts = layouts[:1] if device == "cuda" else layouts
    return [(lay, "l2") for lay in layouts] + [(lay, "l1") for lay in l1_layouts]


def suited_configs(g):
    args = dict(stride_r=g.stride(0), stride_c=g.stride(1), C=g.shape[1])
    return [i for i, c in enumerate(cs._CONFIGS) if cs._suited(c, args)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scores_bit_identical_under_every_config_and_split(device, dtype, monkeypatch):
    """On a tall near-tie, in each layout: column_scores under every suited config, split or not, and
    multi_column_scores under every config and split policy (SM count) give the bits of the default
    launch. (Under the interpreter only the strip width and the split can change anything; on a GPU the
    warps and stages too.)"""
    kernel, multi = cs._column_scores_kernel, cs._multi_column_scores_kernel
    cases = identity_cases(device, dtype)
    checked = expected = 0
    for layout, importance in cases:
        g = near_tie(device, dtype, layout)
        R = g.shape[0]
        configs = suited_configs(g)
        assert len(configs) == {"contiguous": 6, "transposed": 4, "strided": 10}[layout]
        expected += 2 * len(configs) + 2 * len(cs._MULTI_CONFIGS)
        with count_launches() as n:
            base = cs.column_scores(g, importance)  # the default split: two ranges of rows
        assert n["_sum_partials_kernel"] == 1
        assert rel_err(base, naive_scores(g, importance)) <= RTOL
        for i in configs:
            with force_config(kernel, i):
                for rows in (1, R):  # one group per split (the last one ragged); no split
                    got = cs.column_scores(g, importance, rows_per_split=rows)
                    assert torch.equal(got, base), (layout, importance, cs._CONFIGS[i], rows)
                    checked += 1
        for i in range(len(cs._MULTI_CONFIGS)):
            for sms in (1, 1000):  # no split; one group per split
                with monkeypatch.context() as m, force_config(multi, i):
                    m.setattr(cs, "num_sms", lambda device, n=sms: n)
                    got = cs.multi_column_scores([g[:37], g], importance)
                assert torch.equal(got[1], base), (layout, importance, cs._MULTI_CONFIGS[i], sms)
                checked += 1
    assert checked == expected > 0


@pytest.mark.parametrize("device", DEVICES)
def test_near_tie_is_within_a_few_ulp(device):
    """The sweep above tests a real near-tie: equal sums in exact arithmetic, fp32 scores a few ulp apart
    at most."""
    g = near_tie(device, torch.float32, "contiguous").cpu()
    assert torch.equal(g[:, 7].sort().values, g[:, 30].sort().values)
    s = cs.column_scores(g)
    ulp = torch.finfo(torch.float32).eps * float(s[7])
    assert abs(float(s[7]) - float(s[30])) <= 8 * ulp
