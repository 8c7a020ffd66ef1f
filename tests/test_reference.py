"""Identities of the reference algorithm (the oracle every fast path is tested against)."""

import copy
import warnings

import pytest
import torch

from zenflow_kernels.config import ZenFlowWarning
from zenflow_kernels.reference import ReferenceZenFlow, adamw_step_

SHAPES = [(6, 10), (10,), (3, 7), (5,), (1, 4)]  # matrices and vectors, a 1-row matrix too
HYPER = dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def make_params(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def grad_sequence(steps, dtype=torch.float64, seed=1):
    """Gradients that do not depend on the weights (a linear loss), fixed in advance."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=dtype) for s in SHAPES] for _ in range(steps)]


def run(opt, params, grads):
    snapshots = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
        snapshots.append([p.detach().clone() for p in params])
    return snapshots


def reference(params, weight_decay=HYPER["weight_decay"], **zenflow):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZenFlowWarning)
        return ReferenceZenFlow(params, **(HYPER | {"weight_decay": weight_decay}), zenflow=zenflow)


def adamw(params):
    return torch.optim.AdamW(params, **HYPER, foreach=False)


def assert_all_equal(a_list, b_list, what=""):
    for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        assert torch.equal(a, b), f"{what} tensor {i}: max |diff| {float((a - b).abs().max()):.3e}"


STEPS = 17


@pytest.mark.parametrize("importance", ["l2", "l1"])
@pytest.mark.parametrize("update_interval", [1, 3])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_one_is_adamw_step_for_step(importance, update_interval, overlap, dtype):
    grads = grad_sequence(STEPS, dtype)
    zp, ap = make_params(dtype), make_params(dtype)
    z = reference(
        zp,
        topk_ratio=1.0,
        select_strategy="step",
        select_interval=3,
        update_interval=update_interval,
        overlap_step=overlap,
        importance=importance,
    )
    for t, (zs, as_) in enumerate(zip(run(z, zp, grads), run(adamw(ap), ap, grads), strict=True)):
        assert_all_equal(zs, as_, f"step {t}")
    assert z.selections == 6  # re-selections at 0, 3, ..., 15: all columns stay, state kept


def test_warmup_covering_every_step_is_adamw():
    grads = grad_sequence(STEPS)
    zp, ap = make_params(), make_params()
    z = reference(zp, topk_ratio=0.1, full_warm_up_rounds=STEPS, update_interval=4)
    for zs, as_ in zip(run(z, zp, grads), run(adamw(ap), ap, grads), strict=True):
        assert_all_equal(zs, as_)
    assert z.host_updates == STEPS and z.selections == 0


def test_topk_zero_update_every_step_no_overlap_is_adamw():
    grads = grad_sequence(STEPS)
    zp, ap = make_params(), make_params()
    z = reference(zp, topk_ratio=0.0, select_strategy="step", select_interval=5, update_interval=1)
    for zs, as_ in zip(run(z, zp, grads), run(adamw(ap), ap, grads), strict=True):
        assert_all_equal(zs, as_)


@pytest.mark.parametrize("topk_ratio", [0.0, 0.1, 0.3, 0.5, 1.0])
def test_single_selection_update_every_step_is_adamw_at_any_topk(topk_ratio):
    grads = grad_sequence(STEPS)
    zp, ap = make_params(), make_params()
    z = reference(zp, topk_ratio=topk_ratio, select_strategy="step", select_interval=1000, update_interval=1)
    for zs, as_ in zip(run(z, zp, grads), run(adamw(ap), ap, grads), strict=True):
        assert_all_equal(zs, as_)


def test_overlap_host_columns_are_one_step_stale():
    grads = grad_sequence(STEPS)
    zp, ap = make_params(), make_params()
    z = reference(
        zp, topk_ratio=0.3, select_strategy="step", select_interval=1000, update_interval=1, overlap_step=True
    )
    initial = [p.detach().clone() for p in ap]
    zsnap = run(z, zp, grads)
    asnap = run(adamw(ap), ap, grads)
    for t in range(STEPS):
        before = initial if t == 0 else asnap[t - 1]
        for i, p in enumerate(zp):
            if p.dim() != 2:
                assert torch.equal(zsnap[t][i], asnap[t][i]), "vectors are on the fast path: never stale"
                continue
            sel = z.state[p]["selected"]
            host = torch.ones(p.shape[1], dtype=torch.bool)
            host[sel] = False
            assert host.any()
            assert torch.equal(zsnap[t][i][:, host], before[i][:, host]), f"step {t} param {i}: host columns"
            assert torch.equal(zsnap[t][i][:, sel], asnap[t][i][:, sel]), f"step {t} param {i}: fast columns"
    z.flush()  # the pending update lands: everything is now AdamW after the last step
    assert_all_equal([p.detach() for p in zp], asnap[-1])


def test_overlap_is_drained_at_a_reselection():
    grads = grad_sequence(12)
    zp = make_params()
    z = reference(zp, topk_ratio=0.3, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)
    old_sel = {}
    for t, step_grads in enumerate(grads):
        for p, g in zip(zp, step_grads, strict=True):
            p.grad = g.clone()
        if t == 4:
            old_sel = {id(p): z.state[p]["selected"].clone() for p in zp if p.dim() == 2}
        z.step()
        if t == 4:
            for p in zp:
                if p.dim() != 2:
                    continue
                st = z.state[p]
                stayed_on_host = torch.ones(p.shape[1], dtype=torch.bool)
                stayed_on_host[st["selected"]] = False
                stayed_on_host[old_sel[id(p)]] = False
                assert not st["pending"]
                assert torch.equal(p.detach()[:, stayed_on_host], st["master"][:, stayed_on_host])


def test_reselection_keeps_staying_state_and_resets_entering_columns():
    p = torch.nn.Parameter(torch.zeros(3, 6, dtype=torch.float64))
    z = reference([p], topk_ratio=0.5, select_strategy="step", select_interval=2, update_interval=2, weight_decay=0.0)
    big = torch.tensor([5.0, 4.0, 3.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    for _ in range(2):  # steps 0, 1: columns 0, 1, 2 selected; one host update at step 1
        p.grad = big.expand(3, 6).clone()
        z.step()
    st = z.state[p]
    assert st["selected"].tolist() == [0, 1, 2] and st["fast_step"].tolist() == [2, 2, 2]
    assert st["host_step"] == 1
    m_before = st["fast_exp_avg"].clone()
    live_before = p.detach().clone()
    # the host master of a selected column lags the live one (1 host step against 2 fast steps)
    assert not torch.equal(st["master"][:, 0], live_before[:, 0])
    # step 2: re-selection; columns 1, 2 stay, 0 leaves, 4 enters; not an update boundary
    p.grad = torch.tensor([0.0, 4.0, 3.0, 0.1, 9.0, 0.1], dtype=torch.float64).expand(3, 6).clone()
    z.step()
    assert st["selected"].tolist() == [1, 2, 4]
    assert st["fast_step"].tolist() == [3, 3, 1]
    # stayed: m continued from the old state; entered: m from zero (one step of lerp)
    torch.testing.assert_close(st["fast_exp_avg"][:, 0], 0.9 * m_before[:, 1] + 0.1 * 4.0, rtol=0, atol=1e-15)
    torch.testing.assert_close(st["fast_exp_avg"][:, 2], torch.full((3,), 0.9, dtype=torch.float64), rtol=0, atol=1e-15)
    # column 0 left: the host master took over the live value, so no fast-path update is lost
    assert torch.equal(st["master"][:, 0], live_before[:, 0])
    assert torch.equal(p.detach()[:, 0], live_before[:, 0])
    assert z.selections == 2


def test_ties_go_to_the_lower_index_and_l1_differs_from_l2():
    p = torch.nn.Parameter(torch.zeros(2, 5, dtype=torch.float64))
    z = reference([p], topk_ratio=0.4, update_interval=1, select_strategy="step", select_interval=10)
    p.grad = torch.ones(2, 5, dtype=torch.float64)
    z.step()
    assert z.state[p]["selected"].tolist() == [0, 1]
    # l2 prefers one large entry, l1 prefers many medium ones
    g = torch.tensor([[3.0, 1.6, 0.0, 0.0, 0.0], [0.0, 1.6, 2.0, 0.0, 0.0]], dtype=torch.float64)
    for importance, expected in (("l2", [0]), ("l1", [1])):
        q = torch.nn.Parameter(torch.zeros(2, 5, dtype=torch.float64))
        z = reference(
            [q], topk_ratio=0.2, update_interval=1, select_strategy="step", select_interval=10, importance=importance
        )
        q.grad = g.clone()
        z.step()
        assert z.state[q]["selected"].tolist() == expected, importance


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_step_changes_nothing(bad, overlap):
    grads = grad_sequence(8)
    zp = make_params()
    z = reference(
        zp,
        topk_ratio=0.3,
        select_strategy="step",
        select_interval=4,
        update_interval=2,
        overlap_step=overlap,
        full_warm_up_rounds=1,
    )
    run(z, zp, grads[:5])  # mid-interval, a pending update in flight when overlapping
    params_before = [p.detach().clone() for p in zp]
    state_before = copy.deepcopy(z.state_dict())
    poisoned = [g.clone() for g in grads[5]]
    poisoned[2].view(-1)[3] = bad
    for p, g in zip(zp, poisoned, strict=True):
        p.grad = g
    z.step()
    assert z.skipped_steps == 1
    assert_all_equal([p.detach() for p in zp], params_before)
    after = z.state_dict()
    for idx, st in state_before["state"].items():
        for key, value in st.items():
            got = after["state"][idx][key]
            if torch.is_tensor(value):
                assert torch.equal(value, got), (idx, key)
            else:
                assert value == got, (idx, key)
    assert {k: v for k, v in after["zenflow"].items() if k != "skipped_steps"} == {
        k: v for k, v in state_before["zenflow"].items() if k != "skipped_steps"
    }


@pytest.mark.parametrize(
    "zenflow",
    [
        dict(topk_ratio=0.3, select_strategy="step", select_interval=6, update_interval=3, overlap_step=True),
        dict(
            topk_ratio=0.3,
            select_strategy="step",
            select_interval=6,
            update_interval=3,
            overlap_step=False,
            full_warm_up_rounds=2,
        ),
        dict(
            topk_ratio=0.2,
            select_strategy="step",
            select_interval=8,
            update_interval="auto",
            overlap_step=True,
            max_update_interval=4,
            auto_ratio=0.5,
        ),
    ],
)
def test_save_load_mid_interval_continues_identically(zenflow):
    grads = grad_sequence(20)
    zp = make_params()
    z = ReferenceZenFlow(zp, **HYPER, zenflow=zenflow, max_grad_norm=1.5)
    run(z, zp, grads[:10])  # step 10 sits mid-interval
    saved = copy.deepcopy(z.state_dict())
    saved_params = [p.detach().clone() for p in zp]
    straight = run(z, zp, grads[10:])

    fresh = [torch.nn.Parameter(p.clone()) for p in saved_params]
    z2 = ReferenceZenFlow(
        fresh, lr=1.0, zenflow=dict(topk_ratio=0.9, select_strategy="step", select_interval=1, update_interval=1)
    )  # all overwritten by load
    z2.load_state_dict(saved)
    resumed = run(z2, fresh, grads[10:])
    for t, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        assert_all_equal(a, b, f"resumed step {t}")
    assert (z2.t, z2.host_updates, z2.selections) == (z.t, z.host_updates, z.selections)


def test_load_state_dict_rejects_a_mismatch_and_changes_nothing():
    zp = make_params()
    z = reference(zp, topk_ratio=0.3, update_interval=1)
    run(z, zp, grad_sequence(2))
    saved = z.state_dict()
    other = [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))]
    z_other = reference(other, topk_ratio=0.3, update_interval=1)
    with pytest.raises(ValueError, match="param group"):
        z_other.load_state_dict(saved)
    assert z_other.t == 0 and not z_other.state


def test_zen_auto_triggers_when_accumulated_small_columns_catch_up():
    # one 4x10 matrix, k = 1: the selected column has norm 10 per step, every other column norm 1,
    # so the non-selected accumulate 1 per step and catch up with 10 after exactly 10 steps
    p = torch.nn.Parameter(torch.zeros(4, 10, dtype=torch.float64))
    z = reference(
        [p],
        topk_ratio=0.1,
        select_strategy="step",
        select_interval=100,
        update_interval="auto",
        max_update_interval=50,
        auto_ratio=1.0,
        weight_decay=0.0,
    )
    g = torch.full((4, 10), 0.5, dtype=torch.float64)  # column norm 1
    g[:, 3] = 5.0  # column norm 10
    updates = []
    for _ in range(25):
        p.grad = g.clone()
        z.step()
        updates.append(z.host_updates)
    assert updates[8] == 0 and updates[9] == 1 and updates[18] == 1 and updates[19] == 2


def test_zen_auto_bound_and_ratio_zero():
    p = torch.nn.Parameter(torch.zeros(4, 10, dtype=torch.float64))
    z = reference(
        [p],
        topk_ratio=0.1,
        select_strategy="step",
        select_interval=100,
        update_interval="auto",
        max_update_interval=3,
        auto_ratio=1.0,
    )
    g = torch.full((4, 10), 0.01, dtype=torch.float64)
    g[:, 0] = 100.0
    for _ in range(9):
        p.grad = g.clone()
        z.step()
    assert z.host_updates == 3  # the bound, every 3 steps
    q = torch.nn.Parameter(torch.zeros(4, 10, dtype=torch.float64))
    z = reference(
        [q], topk_ratio=0.1, select_strategy="step", select_interval=100, update_interval="auto", auto_ratio=0.0
    )
    for _ in range(5):
        q.grad = g.clone()
        z.step()
    assert z.host_updates == 5  # ratio 0: every step


def test_clipping_matches_clip_grad_norm_during_warmup():
    grads = grad_sequence(5)
    zp, ap = make_params(), make_params()
    z = ReferenceZenFlow(
        zp,
        **HYPER,
        zenflow=dict(full_warm_up_rounds=5, update_interval=1, select_strategy="step", select_interval=1),
        max_grad_norm=0.5,
    )
    a = adamw(ap)
    for step_grads in grads:
        for p, q, g in zip(zp, ap, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(ap, 0.5)
        z.step()
        a.step()
    for p, q in zip(zp, ap, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)


def test_param_groups_and_missing_grads():
    zp, ap = make_params(), make_params()
    groups = lambda ps: [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    z = ReferenceZenFlow(
        groups(zp), **HYPER, zenflow=dict(topk_ratio=1.0, select_strategy="step", select_interval=4, update_interval=2)
    )
    a = torch.optim.AdamW(groups(ap), **HYPER, foreach=False)
    grads = grad_sequence(9)
    for step_grads in grads:
        step_grads[3] = None  # a parameter without a gradient takes no part
    for zs, as_ in zip(run(z, zp, grads), run(a, ap, grads), strict=True):
        assert_all_equal(zs, as_)
    assert zp[3] not in z.state or not z.state[zp[3]]


def test_rejects_low_precision_params_and_bad_hyperparameters():
    with pytest.raises(TypeError, match="bfloat16.*allowed float32, float64"):
        ReferenceZenFlow([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))], zenflow=dict(update_interval=1))
    with pytest.raises(ValueError, match="lr=-1"):
        ReferenceZenFlow([torch.nn.Parameter(torch.zeros(2, 2))], lr=-1, zenflow=dict(update_interval=1))


def test_adamw_step_matches_torch_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    p = torch.randn(5, 7, generator=g)
    q = torch.nn.Parameter(p.clone())
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    opt = torch.optim.AdamW([q], **HYPER, foreach=False)
    for step in range(1, 6):
        grad = torch.randn(5, 7, generator=g)
        q.grad = grad.clone()
        opt.step()
        adamw_step_(p, grad, m, v, step=step, lr=HYPER["lr"], beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
        assert torch.equal(p, q.detach())
