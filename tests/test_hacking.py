"""docs/hacking.md's two worked ablations (examples/ablations.py), each changing one part of ZenFlowAdamW, checked
against an independent reference: the stock optimizer at the neutral setting, the rule recomputed from the scores,
and torch.optim.AdamW stepping once per interval."""

import importlib.util

import pytest
import torch
from support import HYPER, adamw_tol, drive, grad_sequence, make_params, params_at, snapshot

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.ops import use_backend
from zenflow_kernels.optim.selection import Selection
from zenflow_kernels.schedule import Schedule

_spec = importlib.util.spec_from_file_location("ablations", __import__("support").ROOT / "examples" / "ablations.py")
ablations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablations)

ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=3, update_interval=2, overlap_step=False)


@pytest.fixture(autouse=True)
def torch_backend():
    with use_backend("torch"):
        yield


def run(cls, zenflow, steps=24, dtype=torch.float32):
    params = make_params(dtype)
    with cls(params, **HYPER, zenflow=zenflow) as opt:
        history = drive(opt, params, grad_sequence(steps))
        opt.flush()
        return history + [snapshot(params)], opt.stats()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sticky_columns_with_margin_one_is_the_stock_optimizer_bit_for_bit(monkeypatch, overlap, dtype):
    monkeypatch.setattr(ablations.StickySelection, "margin", 1.0)
    zenflow = dict(ZEN, overlap_step=overlap)
    want, _ = run(ZenFlowAdamW, zenflow, dtype=dtype)
    got, _ = run(ablations.StickyColumns, zenflow, dtype=dtype)
    assert all(torch.equal(a, b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))


def test_sticky_columns_choose_by_the_rule_and_change_fewer_columns(monkeypatch):
    """At every re-selection each matrix's columns are the k best of its scores with the current columns' scores
    times the margin (recomputed here with numpy's stable argsort); fewer columns change hands than with top-k, and
    the run stays on the rule's columns after the first selection too."""
    seen = []
    real = Selection.scores

    def recording(self, indices, scale, inv_scale):
        importances, scores = real(self, indices, scale, inv_scale)
        seen.append([(self.run.fast_state(i).get("selected"), s.clone()) for i, s in zip(indices, scores, strict=True)])
        return importances, scores

    monkeypatch.setattr(Selection, "scores", recording)
    chosen = []
    real_reselect = Selection.reselect

    def after(self, t, indices, *a):
        real_reselect(self, t, indices, *a)
        chosen.append([self.run.fast_state(i)["selected"].clone() for i in indices])

    monkeypatch.setattr(Selection, "reselect", after)
    _, sticky = run(ablations.StickyColumns, ZEN)
    assert len(seen) == len(chosen) == 8  # the first selection and 7 re-selections in 24 steps
    for before, after_sel in zip(seen, chosen, strict=True):
        for (old, scores), new in zip(before, after_sel, strict=True):
            boosted = scores.double().numpy().copy()
            if old is not None:
                boosted[old.numpy()] *= ablations.StickySelection.margin
            k = new.numel()
            want = sorted((-boosted).argsort(kind="stable")[:k].tolist())
            assert new.tolist() == want
    seen.clear()
    chosen.clear()
    _, stock = run(ZenFlowAdamW, ZEN)
    churn = lambda stats: sum(1 - j for j in stats["selection_jaccard"] if j == j)  # noqa: E731
    assert churn(sticky) < churn(stock)


SHAPES = [(24, 16), (12, 24)]  # matrices only: with topk_ratio=0 everything is the host's


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("cls,times", [(ZenFlowAdamW, False), ("LrTimesInterval", True)])
def test_lr_times_interval_is_adamw_on_the_interval_means_with_the_scaled_rate(cls, times, interval):
    """With every column on the host (``topk_ratio=0``) and a synchronous update, each host update is one AdamW
    step on the interval's mean gradient; the ablation takes it with ``lr * interval`` (the stock optimizer with
    ``lr``). torch.optim.AdamW stepping at the same steps with the same means gives the same weights."""
    cls = getattr(ablations, cls) if isinstance(cls, str) else cls
    zenflow = dict(topk_ratio=0.0, select_strategy="step", select_interval=100, update_interval=interval,
                   overlap_step=False)
    steps = 12
    grads = [g[:1] + g[2:3] for g in grad_sequence(steps)]
    params = make_params(shapes=SHAPES)
    with cls(params, **HYPER, zenflow=zenflow) as opt:
        got = drive(opt, params, grads)
        updates = set(opt.schedule.update_steps(steps))
    ref = make_params(shapes=SHAPES)
    adamw = torch.optim.AdamW(ref, **(HYPER | dict(lr=HYPER["lr"] * (interval if times else 1))), foreach=False)
    sums, count, want = [torch.zeros_like(p) for p in ref], 0, []
    for t, step_grads in enumerate(grads):
        for s, g in zip(sums, step_grads, strict=True):
            s.add_(g)
        count += 1
        if t in updates:
            for p, s in zip(ref, sums, strict=True):
                p.grad = s / count
                s.zero_()
            adamw.step()
            count = 0
        want.append(snapshot(ref))
    assert sorted(updates) == list(range(interval - 1, steps, interval))
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **adamw_tol(torch.device("cpu")))


def test_the_ablations_script_trains_each_and_reports_churn(capsys):
    ablations.main()
    lines = capsys.readouterr().out.splitlines()
    names = ["ZenFlowAdamW", "StickyColumns", "LrTimesInterval", "Signum"]
    assert [line.split(":")[0].strip() for line in lines] == names
    churn = {line.split(":")[0].strip(): float(line.rsplit(" ", 1)[1]) for line in lines}
    assert churn["StickyColumns"] < churn["ZenFlowAdamW"]


class OddStepsToo(Schedule):
    """A researcher's schedule: the stock boundaries, and a re-selection at every step ``t % 5 == 1`` too."""

    def is_select_boundary(self, t):
        return super().is_select_boundary(t) or (t >= self.warmup and t % 5 == 1)


class OddStepsOptimizer(ZenFlowAdamW):
    schedule_class = OddStepsToo


def test_a_subclass_schedule_is_made_once_and_survives_a_load():
    """``schedule_class``: the schedule the optimizer makes at construction, at ``set_steps_per_epoch`` and at
    ``load_state_dict`` is the subclass's, so a run saved and loaded continues with it, bit for bit."""
    zen = dict(ZEN, select_interval=6)
    grads = grad_sequence(14)
    params = make_params()
    with OddStepsOptimizer(params, **HYPER, zenflow=zen) as opt:
        want = drive(opt, params, grads)
        assert type(opt.schedule) is OddStepsToo
        assert opt.selections == len(OddStepsToo.from_dict(opt.schedule.to_dict()).select_steps(14)) > len(
            Schedule.from_dict(opt.schedule.to_dict()).select_steps(14))
        opt.set_steps_per_epoch(5)
        assert type(opt.schedule) is OddStepsToo
    params = make_params()
    with OddStepsOptimizer(params, **HYPER, zenflow=zen) as opt:
        drive(opt, params, grads[:6])
        saved, weights = opt.state_dict(), snapshot(params)
    params = params_at(weights)
    with OddStepsOptimizer(params, **HYPER, zenflow=zen) as opt:
        opt.load_state_dict(saved)
        assert type(opt.schedule) is OddStepsToo
        got = drive(opt, params, grads[6:])
    for a, b in zip(got, want[6:], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
