"""The research surface: per-group ``topk_ratio`` and ``importance``, the random control, a researcher's own
scorer; each against the reference, across checkpoints, with clear errors.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from support import HYPER, adamw_history, adamw_tol, drive, grad_sequence, make_params, snapshot

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.config import ZenFlowConfigError
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.testing import chaos

ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=5, update_interval=2, overlap_step=True,
           full_warm_up_rounds=1)
LINKS = ["cpu", "chaos0"]


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


def _optimizer(link, params, **kwargs):
    if link == "cpu":
        return ZenFlowAdamW(params, **kwargs)
    with chaos(seed=int(link[len("chaos"):])):
        return ZenFlowAdamW(params, **kwargs)


def groups_of(params, **settings):
    """SHAPES' matrices are 0 (24x16), 2 (12x24) and 5 (40x12): one group each, with its vectors."""
    g0, g1, g2 = settings.get("g0", {}), settings.get("g1", {}), settings.get("g2", {})
    return [dict(params=params[0:2], **g0), dict(params=params[2:5], **g1), dict(params=params[5:6], **g2)]


def _scorer_weight_magnitude(grad, param):
    """A researcher's criterion: the columns whose weights are largest (not the gradient)."""
    return param.detach().float().abs().sum(0)


def _scorer_saliency(grad, param):
    """Gradient-times-weight saliency."""
    return (grad.float() * param.detach().float()).abs().sum(0)


POLICIES = {
    "ratios 0 / 1 / 0.25": dict(g0=dict(topk_ratio=0.0), g1=dict(topk_ratio=1.0), g2=dict(topk_ratio=0.25)),
    "l1 / l2 / random": dict(g0=dict(importance="l1"), g1=dict(importance="l2"), g2=dict(importance="random")),
    "scorers": dict(g0=dict(importance=_scorer_weight_magnitude), g2=dict(importance=_scorer_saliency,
                                                                          topk_ratio=0.5)),
    "random everywhere": dict(),
}


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("zenflow", [ZEN, dict(ZEN, overlap_step=False, update_interval="auto", auto_ratio=0.5)],
                         ids=["overlap", "sync-auto"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_per_group_settings_and_policies_match_the_reference(link, zenflow, policy):
    grads = grad_sequence(24)
    zen = dict(zenflow, importance="random") if policy == "random everywhere" else zenflow
    zp, rp = make_params(), make_params()
    opt = _optimizer(link, groups_of(zp, **POLICIES[policy]), **HYPER, zenflow=zen)
    ref = ReferenceZenFlow(groups_of(rp, **POLICIES[policy]), **HYPER, zenflow=zen)
    with opt:
        for t, step in enumerate(grads):
            for a, b, g in zip(zp, rp, step, strict=True):
                a.grad, b.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            for i, (a, b) in enumerate(zip(zp, rp, strict=True)):
                torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, t=t, i=i: f"{policy} step {t} param {i}: {m}")
            for i in (0, 2, 5):
                got = opt.selected_columns(zp[i])
                want = ref.state[rp[i]].get("selected")
                assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), (t, i)
        # topk_ratio 0: no fast column; 1: every column
        if policy.startswith("ratios"):
            assert opt.selected_columns(zp[0]).numel() == 0 and opt.selected_columns(zp[2]).numel() == 24


@pytest.mark.parametrize("link", ["cpu", "chaos1"])
def test_a_group_at_topk_one_is_adamw_for_that_group(link):
    """topk_ratio=1 in a group: that group's parameters follow torch.optim.AdamW (within the tolerance the
    whole-model identity has, tests/test_optim.py), whatever the other groups do."""
    grads = grad_sequence(16)
    zp = make_params()
    zenflow = dict(ZEN, update_interval=2, full_warm_up_rounds=0, select_interval=4)
    opt = _optimizer(link, [dict(params=zp[0:2], topk_ratio=0.0), dict(params=zp[2:5], topk_ratio=1.0),
                            dict(params=zp[5:6])], **HYPER, zenflow=zenflow)
    with opt:
        history = drive(opt, zp, grads)
    for t, (z, a) in enumerate(zip(history, adamw_history(grads), strict=True)):
        for i in (2, 3, 4):
            torch.testing.assert_close(z[i], a[i], **adamw_tol(torch.device("cpu")),
                                       msg=lambda m, t=t, i=i: f"step {t} p{i}: {m}")


def test_random_selection_is_reproducible_from_the_seed_and_across_a_checkpoint():
    grads = grad_sequence(20)
    zen = dict(ZEN, importance="random", selection_seed=7)

    def run(seed_override=None, stop_at=None):
        zp = make_params()
        opt = ZenFlowAdamW(zp, **HYPER, zenflow=dict(zen, selection_seed=seed_override or 7))
        selections = []
        for t, step in enumerate(grads):
            if stop_at is not None and t == stop_at:
                saved, at = opt.state_dict(), snapshot(zp)
                opt.close()
                zp = make_params()
                with torch.no_grad():
                    for p, v in zip(zp, at, strict=True):
                        p.copy_(v)
                opt = ZenFlowAdamW(zp, **HYPER, zenflow=dict(zen, selection_seed=seed_override or 7))
                opt.load_state_dict(saved)
            for p, g in zip(zp, step, strict=True):
                p.grad = g.clone()
            opt.step()
            selections.append([opt.selected_columns(zp[i]) for i in (0, 2, 5)])
        opt.close()
        return selections, snapshot(zp)

    once, weights = run()
    again, weights_again = run()
    resumed, weights_resumed = run(stop_at=8)
    other, _ = run(seed_override=8)

    def same(a, b):
        return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                   for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))

    assert same(once, again) and same(once, resumed)
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_resumed, strict=True))
    assert not same(once, other)  # another seed draws other columns
    # a new draw at every selection (t = 1, 6, 11, 16), k = floor(0.25 * 12) = 3 sorted distinct columns
    draws = [tuple(s[2].tolist()) for s in once if s[2] is not None]
    assert len(set(draws)) == 4 and all(len(set(d)) == 3 and list(d) == sorted(d) for d in draws)


def test_a_scorer_is_called_with_the_gradient_and_the_parameter_and_its_top_k_is_selected():
    calls = []

    def scorer(grad, param):
        calls.append((grad.clone(), param))
        return torch.arange(grad.shape[1], dtype=torch.float32).flip(0) * (1 + grad.abs().sum(0) * 0)  # first k

    zp = make_params()
    grads = grad_sequence(12)
    with ZenFlowAdamW([dict(params=zp[:5]), dict(params=zp[5:], importance=scorer, topk_ratio=0.25)], **HYPER,
                      zenflow=ZEN) as opt:
        for t, step in enumerate(grads):
            for p, g in zip(zp, step, strict=True):
                p.grad = g.clone()
            opt.step()
            if t in (1, 6, 11):  # selections: after warm-up, then every 5 steps
                grad, param = calls[-1]
                assert param is zp[5] and torch.equal(grad, step[5])
        assert len(calls) == 3
        # its scores rank the first columns highest: those are selected (k = floor(0.25 * 12) = 3)
        assert opt.selected_columns(zp[5]).tolist() == [0, 1, 2]


@pytest.mark.parametrize("group, message", [
    (dict(topk_ratio=2.0), r"ZenFlowAdamW param group 1: zenflow.topk_ratio=2.0 is invalid: allowed a number in "
                           r"\[0, 1\]"),
    (dict(topk_ratio=True), r"param group 1: zenflow.topk_ratio=True is invalid"),
    (dict(importance="l3"), r"param group 1: zenflow.importance='l3' is invalid: allowed 'l2', 'l1', 'random' or a "
                            r"callable"),
    (dict(update_interval=3), r"ZenFlowAdamW param group 1: 'update_interval' cannot be set per param group: allowed "
                              r"per group 'topk_ratio', 'importance'"),
    (dict(overlap_step=True, select_interval=3), r"'overlap_step', 'select_interval' cannot be set per param group"),
])
def test_bad_group_settings_are_clear_errors_and_change_nothing(group, message):
    zp = make_params()
    with pytest.raises(ZenFlowConfigError, match=message):
        ZenFlowAdamW([dict(params=zp[:3]), dict(params=zp[3:], **group)], zenflow=ZEN)
    opt = ZenFlowAdamW([dict(params=zp[:3])], zenflow=ZEN)
    with pytest.raises(ZenFlowConfigError, match=message):
        opt.add_param_group(dict(params=zp[3:], **group))
    assert len(opt.param_groups) == 1  # the refused group was taken back
    with pytest.raises(ZenFlowConfigError, match=re.sub("(ZenFlowAdamW )?param group 1", "ReferenceZenFlow param group",
                                                        message)):
        ReferenceZenFlow([dict(params=zp[:3]), dict(params=zp[3:], **group)], zenflow=ZEN)


def test_a_group_setting_changed_after_construction_fails_the_step_naming_the_group():
    zp = make_params()
    opt = ZenFlowAdamW([dict(params=zp[:3]), dict(params=zp[3:])], zenflow=ZEN)
    opt.param_groups[1]["topk_ratio"] = -1
    for p, g in zip(zp, grad_sequence(1)[0], strict=True):
        p.grad = g
    with pytest.raises(ZenFlowConfigError, match=r"ZenFlowAdamW param group 1: zenflow.topk_ratio=-1 is invalid"):
        opt.step()
    opt.close()


def test_a_scorer_that_returns_the_wrong_shape_is_a_clear_error():
    zp = make_params()
    opt = ZenFlowAdamW([dict(params=zp[:5]), dict(params=zp[5:], importance=lambda g, p: g.sum(1))], zenflow=ZEN)
    for t, step in enumerate(grad_sequence(2)):
        for p, g in zip(zp, step, strict=True):
            p.grad = g
        if t == 1:
            with pytest.raises(ValueError, match=r"the importance scorer '<lambda>' returned a tensor of shape \(40,\) "
                                                 r"and dtype torch.float32: allowed a real tensor of shape \(12,\)"):
                opt.step()
        else:
            opt.step()
    opt.close()


def test_group_settings_survive_a_checkpoint_and_show_in_repr():
    zp = make_params()
    opt = ZenFlowAdamW(groups_of(zp, g0=dict(topk_ratio=0.0), g2=dict(importance="l1")), **HYPER, zenflow=ZEN)
    text = repr(opt)
    assert "topk_ratio: 0.0" in text and "importance: l1" in text
    drive(opt, zp, grad_sequence(4))
    saved = copy.deepcopy(opt.state_dict())
    opt.close()
    zq = make_params()
    other = ZenFlowAdamW(groups_of(zq), **HYPER, zenflow=ZEN)
    other.load_state_dict(saved)
    assert other.param_groups[0]["topk_ratio"] == 0.0 and other.param_groups[2]["importance"] == "l1"
    other.close()


def test_explain_shows_each_groups_settings_and_k():
    zp = make_params()
    opt = ZenFlowAdamW(groups_of(zp, g0=dict(topk_ratio=0.0), g1=dict(topk_ratio=1.0),
                                 g2=dict(importance=_scorer_saliency)), zenflow=ZEN)
    text = opt.explain(steps=8)
    assert "select_interval   = 5 steps" in text  # the schedule, as the CLI prints it
    assert "group 0: topk_ratio=0.0, importance=l2 (its own: topk_ratio)" in text
    assert "matrix (24, 16): host only" in text
    assert "matrix (12, 24): every column on the device (AdamW)" in text
    assert "group 2: topk_ratio=0.25, importance=_scorer_saliency (its own: importance)" in text
    assert "matrix (40, 12): 3 of 12 columns on the device" in text
