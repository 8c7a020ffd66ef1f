"""Gradient concentration (ZenFlow's premise, zenflow_kernels.concentration): the shares against a plain sort of the
columns' squared norms over a table of shapes, the optimizer's record at every selection against the gradients it
selected from (l2 scores, and l1 scored again in l2), and the report's three verdicts."""

from __future__ import annotations

import math

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW, concentration_report, gradient_concentration
from zenflow_kernels.concentration import PREMISE_TOP10, SPREAD_TOP10, top_count

pytestmark = pytest.mark.usefixtures("numba_backend")


def expected_shares(grads: list[torch.Tensor], selected: list[torch.Tensor]) -> dict:
    """The definition, written out: per matrix the largest ceil(f * C) squared column norms (at least one column),
    summed over matrices, over the total; float64 throughout."""
    tops = {"top1": 0.0, "top10": 0.0, "selected": 0.0}
    total = 0.0
    for g, sel in zip(grads, selected, strict=True):
        e = (g.double() ** 2).sum(0)
        ordered = e.sort(descending=True).values
        C = e.numel()
        tops["top1"] += float(ordered[: max(1, math.ceil(0.01 * C))].sum())
        tops["top10"] += float(ordered[: max(1, math.ceil(0.10 * C))].sum())
        tops["selected"] += float(e[sel].sum())
        total += float(e.sum())
    return {k: v / total for k, v in tops.items()}


def power_law_grad(R: int, C: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """A gradient whose column j has scale (j + 1) ** -alpha, columns shuffled: alpha 0 is flat, larger is more
    concentrated."""
    scale = torch.arange(1, C + 1, dtype=torch.float64).pow(-alpha)[torch.randperm(C, generator=gen)]
    return (torch.randn(R, C, generator=gen, dtype=torch.float64) * scale).float()


@pytest.mark.parametrize("shape", [(3, 1), (4, 7), (16, 150), (2, 1000)])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
def test_shares_are_the_sorted_columns_energy(shape, alpha):
    gen = torch.Generator().manual_seed(shape[1])
    grads = [power_law_grad(*shape, alpha, gen), power_law_grad(shape[0] + 1, shape[1] + 3, alpha, gen)]
    selected = [torch.randperm(g.shape[1], generator=gen)[: max(1, g.shape[1] // 4)].sort().values for g in grads]
    got = gradient_concentration([(g.double() ** 2).sum(0).float() for g in grads], selected)
    want = expected_shares(grads, selected)
    for name in ("top1", "top10", "selected"):
        assert got[name] == pytest.approx(want[name], rel=1e-5), name
    assert got["top1"] <= got["top10"] <= 1.0 + 1e-6
    assert len(got["per_matrix"]) == 2
    for row, g, sel in zip(got["per_matrix"], grads, selected, strict=True):
        assert row["top10"] == pytest.approx(expected_shares([g], [sel])["top10"], rel=1e-5)


def test_edges():
    assert top_count(0, 0.01) == 0 and top_count(1, 0.01) == 1 and top_count(150, 0.01) == 2
    assert top_count(1000, 0.10) == 100
    zero = gradient_concentration([torch.zeros(5)], [torch.tensor([0, 1])])
    assert all(math.isnan(zero[k]) for k in ("top1", "top10", "selected"))
    unselected = gradient_concentration([torch.arange(10.0)])
    assert math.isnan(unselected["selected"]) and unselected["top1"] == pytest.approx(9 / 45)
    assert math.isnan(gradient_concentration([])["top10"])


@pytest.mark.parametrize("importance", ["l2", "l1"])
def test_the_optimizer_records_the_shares_at_every_selection(importance):
    """Two matrices with power-law gradients (one flat, one concentrated) and a vector; gradients set by hand, so
    each selection's shares are known: the record equals the definition applied to the gradients selected from."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(8, 40)), torch.nn.Parameter(torch.randn(6, 200))
    v = torch.nn.Parameter(torch.randn(5))
    zen = dict(topk_ratio=0.1, select_strategy="step", select_interval=3, update_interval=3, full_warm_up_rounds=0,
               importance=importance)
    expected = []
    with ZenFlowAdamW([a, b, v], lr=1e-3, zenflow=zen) as opt:
        for t in range(7):
            grads = [power_law_grad(8, 40, 0.0, gen), power_law_grad(6, 200, 2.0, gen)]
            a.grad, b.grad, v.grad = grads[0], grads[1], torch.randn(5, generator=gen)
            before = opt.stats()["selections"] if t else 0
            opt.step()
            if opt.stats()["selections"] > before:
                expected.append(expected_shares(grads, [opt.state[a]["selected"], opt.state[b]["selected"]]))
        stats = opt.stats()
    c = stats["concentration"]
    assert len(expected) == len(c["top10"]) == stats["selections"] >= 3
    for n, want in enumerate(expected):
        for name in ("top1", "top10", "selected"):
            assert c[name][n] == pytest.approx(want[name], rel=1e-5), (n, name)
    assert set(c["per_matrix"]) == {0, 1}
    assert c["per_matrix"][1]["top10"] > 0.8 > c["per_matrix"][0]["top10"]  # the concentrated one
    if importance == "l2":  # the l2 selection takes each matrix's largest columns
        assert c["selected"][-1] == pytest.approx(c["top10"][-1], rel=1e-6)
    assert "gradient concentration at the last of" in concentration_report(stats)


@pytest.mark.parametrize("top10, words", [(0.95, "concentrated (top 10%"), (0.6, "partly concentrated"),
                                          (0.2, "spread (top 10%")])
def test_the_report_says_what_the_shares_imply(top10, words):
    stats = {"concentration": {"top1": [top10 / 3], "top10": [0.5, top10], "selected": [top10]}}
    report = concentration_report(stats)
    assert words in report and f"{1 - top10:.0%} of the energy" in report
    assert f"{min(0.5, top10):.0%}-{max(0.5, top10):.0%}" in report
    assert SPREAD_TOP10 < PREMISE_TOP10
    assert "not measured" in concentration_report({"concentration": {"top10": []}})


def test_a_model_of_vectors_only_says_no_matrix_is_selected():
    """Selections run (the counter says 2) but none selects from a matrix: the report says that, not "no selection
    has run"."""
    v, w = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7))
    zen = dict(topk_ratio=0.1, select_strategy="step", select_interval=2, update_interval=2)
    with ZenFlowAdamW([v, w], lr=1e-3, zenflow=zen) as opt:
        for _ in range(4):
            v.grad, w.grad = torch.ones(5), torch.ones(7)
            opt.step()
        stats = opt.stats()
    assert stats["selections"] == 2 and stats["concentration"]["top10"] == []
    report = concentration_report(stats)
    assert report.startswith("gradient concentration: not measured (2 selection(s) ran, but no matrix was selected")
    assert "no selection has run" not in report
    assert concentration_report({"selections": 0, "concentration": {"top10": []}}).endswith("(no selection has run)")
    with pytest.raises(TypeError, match=r"^concentration_report: stats=ZenFlowAdamW is invalid: allowed the dict "):
        concentration_report(opt)


def test_a_single_tensor_is_one_matrix():
    e = torch.arange(10.0)
    one = gradient_concentration(e)
    assert repr(one) == repr(gradient_concentration([e]))  # (NaN: no selection given, compared as printed)
    both = gradient_concentration(e, torch.tensor([8, 9]))
    assert both == gradient_concentration([e], [torch.tensor([8, 9])])
    assert both["selected"] == pytest.approx(17 / 45)


@pytest.mark.parametrize("energies, selected, exc, message", [
    (torch.ones(4, 3), None, TypeError, "gradient_concentration: energies[0] is (4, 3): allowed a 1-D tensor of one "
                                        "matrix's per-column squared L2 norms"),
    ([torch.ones(3), 2.0], None, TypeError, "gradient_concentration: energies[1] is float: allowed a 1-D tensor"),
    ({"a": torch.ones(3)}, None, TypeError, "gradient_concentration: energies=dict is invalid: allowed a list of "
                                            "1-D tensors"),
    ([torch.ones(3)], 5, TypeError, "gradient_concentration: selected=int is invalid: allowed None, or a list"),
    ([torch.ones(3), torch.ones(4)], [None], ValueError, "gradient_concentration: selected has 1 entries, energies 2"),
    ([torch.ones(3), torch.ones(4)], torch.tensor([0]), ValueError, "selected has 1 entries, energies 2"),
])
def test_bad_arguments_are_named(energies, selected, exc, message):
    with pytest.raises(exc) as err:
        gradient_concentration(energies, selected)
    assert message in str(err.value)
