"""ZenFlowAdamW's surface beyond step(): copies, repr, the epoch length, and loading other state dicts."""

import contextlib
import copy
import gc
import pickle
import re
import warnings

import pytest
import torch
from support import HYPER, drive, grad_sequence, make_params, snapshot

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.config import ZenFlowWarning
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


ZEN = dict(topk_ratio=0.2, select_strategy="step", select_interval=6, update_interval=3, overlap_step=True)


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
@pytest.mark.parametrize("stepped", [False, True])
def test_copies_raise_a_clear_error_naming_state_dict(tmp_path, how, stepped):
    params = make_params()
    with ZenFlowAdamW(params, **HYPER, zenflow=ZEN) as opt:
        if stepped:
            drive(opt, params, grad_sequence(4))
        before = snapshot(params)
        copier = {
            "deepcopy": copy.deepcopy,
            "copy": copy.copy,
            "pickle": pickle.dumps,
            "torch.save": lambda o: torch.save(o, tmp_path / "opt.pt"),
        }[how]
        message = (
            "ZenFlowAdamW cannot be copied or pickled (copy.copy, copy.deepcopy, pickle, torch.save(opt)): it owns "
            "background threads, host buffers and, on a GPU, streams. Save opt.state_dict() and load it into a new "
            "ZenFlowAdamW with load_state_dict() instead"
        )
        with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
            copier(opt)
        # and the original is untouched and trains on
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(params), strict=True))
        drive(opt, params, grad_sequence(2))


def test_repr_shows_the_zenflow_settings_beside_the_groups():
    opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=ZEN, max_grad_norm=2.5)
    text = repr(opt)
    assert text.startswith("ZenFlowAdamW (\nParameter Group 0\n") and text.endswith(")")
    # torch's listing whole, then the ZenFlow block before its closing parenthesis
    base = torch.optim.Optimizer.__repr__(opt)
    assert text.startswith(base[:-1] + "ZenFlow\n") and text.endswith("\n    max_grad_norm: 2.5\n)")
    assert "    lr: 0.02\n" in text
    for key, value in opt.config.to_dict().items():
        assert f"\n    {key}: {value!r}\n" in text, key
    assert "\n    max_grad_norm: 2.5\n" in text
    opt.close()


def test_set_steps_per_epoch_turns_never_reselected_into_per_epoch():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZenFlowWarning)  # the "never re-selected" warning of the constructor
        opt = ZenFlowAdamW(make_params(), zenflow=dict(select_strategy="epoch", select_interval=2, update_interval=2))
    assert opt.schedule.select_interval == 0
    opt.set_steps_per_epoch(5)
    assert (opt.schedule.select_interval, opt.schedule.steps_per_epoch) == (10, 5)
    assert opt.schedule.steps_per_epoch_source == "argument"
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        opt.set_steps_per_epoch(0)
    assert opt.schedule.select_interval == 10  # unchanged by the failed call
    opt.close()


# -- continuing a torch.optim.AdamW run --------------------------------------------------------------------


def _adamw_then(grads, split, make_opt):
    """AdamW for ``split`` steps; then (a) AdamW on, (b) ZenFlowAdamW loaded from AdamW's state dict."""
    params = make_params()
    adam = torch.optim.AdamW(params, **HYPER, foreach=False)
    drive(adam, params, grads[:split])
    saved = copy.deepcopy(adam.state_dict())
    start = snapshot(params)
    straight = drive(adam, params, grads[split:])
    fresh = [torch.nn.Parameter(x.clone()) for x in start]
    opt = make_opt(fresh)
    opt.load_state_dict(saved)
    return straight, fresh, opt


@pytest.mark.parametrize(
    "zenflow",
    [
        dict(topk_ratio=1.0, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True),
        dict(topk_ratio=0.3, select_strategy="step", select_interval=10_000, update_interval=1),
        dict(topk_ratio=0.0, select_strategy="step", select_interval=10_000, update_interval=1),
        dict(topk_ratio=0.3, select_strategy="step", select_interval=10_000, update_interval=1, full_warm_up_rounds=2),
    ],
    ids=["topk1", "single-selection", "host-only", "warm-up"],
)
def test_a_torch_adamw_state_dict_continues_as_adamw(zenflow):
    grads = grad_sequence(16)
    lr_before = 1e-5
    straight, fresh, opt = _adamw_then(
        grads, 6, lambda ps: ZenFlowAdamW(ps, lr=lr_before, zenflow=zenflow))
    with opt:
        assert opt.param_groups[0]["lr"] == HYPER["lr"]  # the saved hyper-parameters, as torch does
        resumed = drive(opt, fresh, grads[6:])
    for t, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7, msg=lambda m, t=t, i=i: f"step {6 + t} p{i}: {m}")


def test_an_imported_run_checkpoints_and_resumes_before_its_first_selection():
    grads = grad_sequence(12)
    zen = dict(topk_ratio=1.0, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)
    straight, fresh, opt = _adamw_then(grads, 5, lambda ps: ZenFlowAdamW(ps, zenflow=zen))
    saved = copy.deepcopy(opt.state_dict())  # built, nothing selected yet: the seeding must survive the save
    assert saved["zenflow"]["seed_from_host"] is True
    opt.close()
    again = [torch.nn.Parameter(x.detach().clone()) for x in fresh]
    with ZenFlowAdamW(again, zenflow=zen) as opt2:
        opt2.load_state_dict(saved)
        resumed = drive(opt2, again, grads[5:])
    for a, b in zip(straight, resumed, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)


def _adam_state(**group):
    params = make_params()
    adam = torch.optim.AdamW(params, **HYPER)
    drive(adam, params, grad_sequence(2))
    sd = copy.deepcopy(adam.state_dict())
    sd["param_groups"][0].update(group)
    return sd


W = r"^ZenFlowAdamW\.load_state_dict"


def _with_state(per_param):
    sd = _adam_state()
    sd["state"].update(per_param)
    return sd


def _with_shape(key, shape):
    sd = _adam_state()
    sd["state"][0][key] = torch.zeros(shape)
    return sd


@pytest.mark.parametrize(
    "state_dict, match",
    [
        (_adam_state(amsgrad=True), W + r": param group 0 was saved with amsgrad=True, which ZenFlowAdamW does not "
         r"do: only plain AdamW/Adam state can be continued$"),
        (_adam_state(maximize=True), W + r": param group 0 was saved with maximize=True, which ZenFlowAdamW does "
         r"not do: only plain AdamW/Adam state can be continued$"),
        (_adam_state(decoupled_weight_decay=False), W + r": param group 0 is torch\.optim\.Adam with "
         r"weight_decay=0\.05 \(an L2 term in the gradient\); ZenFlowAdamW decays decoupled \(AdamW\) and cannot "
         r"continue it exactly: continue from a torch\.optim\.AdamW run, or an Adam run without weight decay$"),
        (_adam_state(lr=-1.0), W + r" group 0: lr=-1\.0 is invalid"),
        ({"state": {}, "param_groups": [{"params": list(range(6))}]},
         W + r": param group 0 has no \['lr', 'betas', 'eps', 'weight_decay'\]: neither a ZenFlowAdamW nor a "
         r"torch\.optim\.AdamW/Adam state dict$"),
        ({"state": {0: {"momentum_buffer": torch.zeros(24, 16)}},
          "param_groups": [{"params": list(range(6)), "lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8,
                            "weight_decay": 0.0}]},
         W + r": the state of parameter 0 holds \['momentum_buffer'\], not AdamW's exp_avg, exp_avg_sq and step$"),
        (_with_state({"3": 5}), W + r": state of parameter '3', which no param group lists$"),
        (_with_state({2: 5}), W + r": the state of parameter 2 holds 5, not AdamW's exp_avg, exp_avg_sq and step$"),
        (_with_shape("exp_avg_sq", (16, 24)), W + r": parameter 0's exp_avg_sq has shape \(16, 24\), the parameter "
         r"\(24, 16\)$"),
        ({"weights": 1}, r"expected a state dict with 'state' and 'param_groups'.*\['weights'\]"),
        ([1, 2], "got list"),
        ({"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}, "has 2 param groups, this optimizer 1"),
    ],
    ids=["amsgrad", "maximize", "adam-l2", "bad-lr", "no-hyper", "sgd", "unlisted", "not-a-dict-state", "shape",
         "no-groups", "not-a-dict", "groups"],
)
def test_other_state_dicts_are_clear_errors_that_change_nothing(state_dict, match):
    params = make_params()
    grads = grad_sequence(6)
    with ZenFlowAdamW(params, **HYPER, zenflow=ZEN) as opt:
        drive(opt, params, grads[:3])
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(state_dict)
        after = opt.state_dict()
        assert after["zenflow"] == before["zenflow"] and after["param_groups"] == before["param_groups"]
        drive(opt, params, grads[3:])  # and it trains on


def test_an_old_adamw_state_dict_loads_with_its_groups_and_from_step_zero():
    """Older torch saved no ``decoupled_weight_decay`` and plain int steps; the saved hyper-parameters
    (eps included) take over and ZenFlow's counters start from zero, even on an optimizer that stepped."""
    sd = _adam_state(eps=1e-6)
    del sd["param_groups"][0]["decoupled_weight_decay"]
    for st in sd["state"].values():
        st["step"] = int(st["step"])
    params = make_params()
    with ZenFlowAdamW(params, **HYPER, zenflow=ZEN) as opt:
        drive(opt, params, grad_sequence(4))
        moved = opt.stats()["d2h_bytes"]
        opt.load_state_dict(sd)
        assert opt.stats()["d2h_bytes"] == moved > 0  # the replaced link's counters are kept
        assert opt.param_groups[0]["eps"] == 1e-6 and opt.param_groups[0]["weight_decay"] == HYPER["weight_decay"]
        assert (opt.t, opt.skipped_steps, opt.host_updates, opt.selections, opt.steps_accumulated) == (0, 0, 0, 0, 0)
        assert opt.host_shard.host_step == [2] * len(params)


def test_an_adam_state_dict_without_weight_decay_is_accepted():
    params = make_params()
    adam = torch.optim.Adam(params, lr=1e-2)
    drive(adam, params, grad_sequence(2))
    with ZenFlowAdamW(make_params(), zenflow=ZEN) as opt:
        opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["weight_decay"] == 0 and opt.host_shard.host_step[0] == 2


def test_a_narrow_matrix_gets_one_fast_column_like_the_oracle():
    """k = max(1, floor(topk_ratio * C)): a LoRA-like factor with 4 columns at topk_ratio=0.1 gets one fast
    column in the optimizer and in the oracle alike, and the two agree step by step."""
    from zenflow_kernels.reference import ReferenceZenFlow

    shapes = [(16, 4), (4, 16), (16,)]
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=4, update_interval=2)
    g = torch.Generator().manual_seed(2)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(8)]
    zp, rp = make_params(shapes=shapes), make_params(shapes=shapes)
    ref = ReferenceZenFlow(rp, **HYPER, zenflow=zenflow)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        for step_grads in grads:
            for p, q, gr in zip(zp, rp, step_grads, strict=True):
                p.grad, q.grad = gr.clone(), gr.clone()
            opt.step()
            ref.step()
            assert opt.selected_columns(zp[0]).numel() == 1 and opt.selected_columns(zp[1]).numel() == 1
            assert torch.equal(opt.selected_columns(zp[0]), ref.state[rp[0]]["selected"])
            for x, y in zip(snapshot(zp), rp, strict=True):
                torch.testing.assert_close(x, y.detach(), rtol=1e-5, atol=1e-6)


def test_fast_state_has_the_documented_shapes():
    """A matrix [R, C] keeps compact fp32 moments (and, below fp32, a master) [R, k] and per-column steps
    [k]; a vector of n elements keeps them as [1, n] and one step count."""
    params = make_params(torch.bfloat16)
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2,
                   full_warm_up_rounds=1)
    with ZenFlowAdamW(params, **HYPER, zenflow=zenflow) as opt:
        drive(opt, params, grad_sequence(3))
        for p in params:
            st = opt.state[p]
            if p.dim() == 2:
                k = opt.config.num_selected(p.shape[1])
                shape = (p.shape[0], k)
                assert st["selected"].shape == (k,) and st["step"].shape == (k,) and st["step"].dtype == torch.int64
            else:
                shape = (1, p.numel())
                assert st["step"] == 3  # one warm-up step on the host, two on the fast path
            for key in ("exp_avg", "exp_avg_sq", "master"):
                assert st[key].shape == shape and st[key].dtype == torch.float32, (tuple(p.shape), key)


def test_an_empty_param_group_is_allowed_as_in_torch():
    zenflow = dict(select_strategy="step", select_interval=4, update_interval=2)
    with ZenFlowAdamW([{"params": []}], zenflow=zenflow) as opt:
        opt.step()
        opt.step()
        assert opt.t == 2 and opt.stats()["link"] == "cpu"
        assert opt.state_dict()["state"] == {}


def test_an_unbuilt_state_dict_loaded_into_a_stepped_optimizer_starts_it_afresh():
    """A checkpoint taken before the first step, loaded into an optimizer that already stepped: the old
    workers and buffers go, and training continues as a new optimizer's would."""
    grads = grad_sequence(6)
    fresh_params = make_params()
    with ZenFlowAdamW(fresh_params, **HYPER, zenflow=ZEN) as fresh:
        saved = copy.deepcopy(fresh.state_dict())
        expected = drive(fresh, fresh_params, grads)
    params = make_params()
    with ZenFlowAdamW(params, **HYPER, zenflow=ZEN) as opt:
        drive(opt, params, grad_sequence(3, seed=5))
        opt.load_state_dict(saved)
        with torch.no_grad():
            for p, q in zip(params, make_params(), strict=True):
                p.copy_(q)
        got = drive(opt, params, grads)
    for a, b in zip(expected, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_zero_arguments_are_checked():
    """The ZeRO arguments, checked in one process (tests/test_zero.py runs several ranks)."""
    params = make_params()
    for bad in (3, -1, True, "1"):
        with pytest.raises(ValueError, match=rf"zero_stage={bad!r} is invalid: allowed 0, 1 or 2"):
            ZenFlowAdamW(params, zero_stage=bad)
    for stage, bad in [(0, True), (1, True), (2, 1), (2, "yes")]:
        with pytest.raises(ValueError, match=rf"release_gradients={bad!r} with zero_stage={stage} is invalid: "
                                             r"allowed None, or True/False with zero_stage=2"):
            ZenFlowAdamW(params, zero_stage=stage, release_gradients=bad)
    for stage, release, expected in [(0, None, False), (1, False, False), (2, None, True), (2, True, True),
                                     (2, False, False)]:
        zen = dict(topk_ratio=0.1, select_strategy="step", select_interval=6, update_interval=3)
        with ZenFlowAdamW(params, zenflow=zen, zero_stage=stage, release_gradients=release) as opt:
            assert opt.release_gradients is expected
    for bad in (0, -5.0, float("inf"), "10"):
        with pytest.raises(ValueError, match=r"collective_timeout=.* is invalid: allowed a positive number"):
            ZenFlowAdamW(params, collective_timeout=bad)
    with pytest.raises(ValueError, match="process_group was given but torch.distributed is not initialised"):
        ZenFlowAdamW(params, zero_stage=1, process_group=object())


def test_an_invalid_gradient_is_a_clear_error_that_changes_nothing():
    """torch itself refuses a .grad of another shape or dtype; a sparse one reaches step()."""
    params = make_params()
    zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2)
    with ZenFlowAdamW(params, zenflow=zen) as opt:
        drive(opt, params, grad_sequence(1))
        before = snapshot(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        params[0].grad = torch.zeros(24, 16).to_sparse()
        expected = ("ZenFlowAdamW: gradient of parameter 0 ((24, 16), torch.float32, cpu, sparse=True) is invalid: "
                    "allowed a dense float32, bfloat16 or float16 gradient of shape (24, 16) on cpu")
        with pytest.raises(ValueError, match=re.escape(expected) + "$"):
            opt.step()
        assert opt.t == 1 and all(torch.equal(a, b) for a, b in zip(snapshot(params), before, strict=True))


def test_parameters_and_param_groups_are_checked_with_whole_messages():
    zen = dict(select_strategy="step", select_interval=4, update_interval=2)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=re.escape("ZenFlowAdamW: parameters on several devices ['cpu', 'meta']: "
                                                   "allowed one") + "$"):
        ZenFlowAdamW([p, torch.nn.Parameter(torch.zeros(2, device="meta"))], zenflow=zen)
    with warnings.catch_warnings():  # torch warns of the duplicate first
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ValueError, match="^ZenFlowAdamW: a parameter appears more than once$"):
            ZenFlowAdamW([p, p], zenflow=zen)
    with ZenFlowAdamW([p], zenflow=zen) as opt:
        with pytest.raises(ValueError,
                           match=r"^ZenFlowAdamW group 1: lr=-1.0 is invalid: allowed a finite number >= 0"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -1.0})
        with pytest.raises(ValueError, match=re.escape("ZenFlowAdamW: parameters on several devices ['cpu', 'meta']")):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device="meta"))]})
        assert len(opt.param_groups) == 1 and len(opt._params) == 1  # nothing of a refused group stays
        p.grad = torch.ones(2, 2)
        opt.step()
        with pytest.raises(RuntimeError, match=re.escape(
                "ZenFlowAdamW.add_param_group after the first step() is not supported: the host buffers are laid "
                "out at the first step; create the optimizer with every param group instead") + "$"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_the_defaults_are_adamws_and_one_process():
    params = make_params()
    zen = dict(select_strategy="step", select_interval=4, update_interval=2)
    torch_defaults = torch.optim.AdamW(params).defaults
    with ZenFlowAdamW(params, zenflow=zen) as opt:
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert opt.defaults[key] == torch_defaults[key], key
        assert opt.zero_stage == 0 and opt.release_gradients is False
        drive(opt, params, grad_sequence(1))
        assert opt.state_dict()["zenflow"]["zero"]["stage"] == 0


def test_the_dataloader_gives_the_epoch_length():
    zen = dict(select_strategy="epoch", select_interval=2, update_interval=2)
    with ZenFlowAdamW(make_params(), zenflow=zen, dataloader=[None] * 5) as opt:
        assert opt.schedule.steps_per_epoch == 5 and opt.schedule.select_interval == 10
        assert opt.schedule.steps_per_epoch_source == "dataloader"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stepped_optimizer_loads_its_own_checkpoint(overlap):
    params = make_params()
    zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=overlap)
    with ZenFlowAdamW(params, **HYPER, zenflow=zen) as opt:
        drive(opt, params, grad_sequence(3))
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        assert opt.t == 3
        drive(opt, params, grad_sequence(2))
        assert opt.t == 5


def test_host_state_is_fp32_whatever_the_default_dtype():
    params = make_params()
    zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with ZenFlowAdamW(params, **HYPER, zenflow=zen) as opt:
            drive(opt, params, grad_sequence(2))
            host = opt.host_shard
            assert {t.dtype for t in [host.master, host.exp_avg, host.exp_avg_sq, *host.acc]} == {torch.float32}
    finally:
        torch.set_default_dtype(previous)


# -- loading its own checkpoint into a stepped optimizer ----------------------------------------------------

# warm-up t = 0, 1; selections at t = 2, 8, 14; host updates at t = 4, 7, 10, 13, 16, 19 (overlapped: the one of
# t = 10 is still pending at the save after step 10)
SELF_LOAD = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=3, overlap_step=True,
                 full_warm_up_rounds=2)
SELF_LOAD_VARIANTS = {
    "fp32": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "device-acc": dict(zenflow=dict(device_accumulation=True)),
    "offload-bf16": dict(dtype=torch.bfloat16, zenflow=dict(offload=True)),
    "auto": dict(zenflow=dict(update_interval="auto", max_update_interval=4)),
    "sync": dict(zenflow=dict(overlap_step=False)),
    "twice-bf16": dict(dtype=torch.bfloat16, loads=2),
    "at-first-selection": dict(split=2),  # built in warm-up, nothing selected yet
    "at-reselection-bf16": dict(dtype=torch.bfloat16, split=8),
}


def _two_groups(ps):
    """Two param groups with their own lr, weight decay and betas (two launch sets on the fast path)."""
    return [{"params": ps[:3], "lr": 5e-3}, {"params": ps[3:], "weight_decay": 0.0, "betas": (0.8, 0.95)}]


def _gappy_grads(steps):
    """The optimizer tests' gradients, with parameter 4 (a vector) never given one and parameter 2 (a
    matrix) missing every fourth step (t = 1, 5, 9, 13, 17: in warm-up, and in the intervals around the save)."""
    grads = grad_sequence(steps)
    for t, step in enumerate(grads):
        step[4] = None
        if t % 4 == 1:
            step[2] = None
    return grads


def assert_same_state_dict(a, b, where=""):
    """Two state dicts equal: tensors bit for bit (dtype and shape included), everything else by ==."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same_state_dict(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for n, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state_dict(x, y, f"{where}[{n}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("variant", list(SELF_LOAD_VARIANTS))
@pytest.mark.parametrize("link", ["cpu", "chaos3"])
def test_a_stepped_optimizer_reloading_its_checkpoint_continues_like_a_fresh_one(link, variant):
    """``opt.load_state_dict(opt.state_dict())`` after warm-up, a re-selection and mid-interval (an overlapped
    host update pending): the optimizer continues bit for bit like a new optimizer, on a copy of the weights,
    that loaded the same dict. Whatever the old optimizer kept per selection (the fast step's plan, views of
    its step counts, the link's buffers) must not survive the load."""
    spec = SELF_LOAD_VARIANTS[variant]
    dtype, zen = spec.get("dtype", torch.float32), dict(SELF_LOAD, **spec.get("zenflow", {}))
    grads = _gappy_grads(20)
    split = spec.get("split", 11)  # steps t = 0..split-1 before the save

    def make(params):
        ctx = chaos(seed=3) if link.startswith("chaos") else contextlib.nullcontext()
        with ctx:
            return ZenFlowAdamW(_two_groups(params), **HYPER, zenflow=zen, max_grad_norm=10.0)

    params = make_params(dtype)
    with make(params) as opt:
        drive(opt, params, grads[:split])
        assert opt.selections == {2: 0, 8: 1}.get(split, 2)
        sd = opt.state_dict()
        if split == 11 and zen["overlap_step"] and zen["update_interval"] == 3:
            assert any(st["pending"] for st in sd["state"].values())  # a host result awaits its write-back
        pristine = copy.deepcopy(sd)
        at_save = snapshot(params)
        for _ in range(spec.get("loads", 1)):
            opt.load_state_dict(sd)
        reloaded = drive(opt, params, grads[split:])
        reloaded_sd = copy.deepcopy(opt.state_dict())
        opt.flush()
        reloaded_flushed = snapshot(params)
        assert opt.selections == 3
    assert_same_state_dict(sd, pristine, "the loaded dict was changed by training on")

    fresh = [torch.nn.Parameter(x.clone()) for x in at_save]
    with make(fresh) as opt2:
        opt2.load_state_dict(sd)
        expected = drive(opt2, fresh, grads[split:])
        expected_sd = copy.deepcopy(opt2.state_dict())
        opt2.flush()
        expected_flushed = snapshot(fresh)
    for t, (a, b) in enumerate(zip(expected, reloaded, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {split + t} param {i}: the reloaded optimizer differs from a fresh one"
    assert_same_state_dict(reloaded_sd, expected_sd, "state_dict")
    assert all(torch.equal(x, y) for x, y in zip(reloaded_flushed, expected_flushed, strict=True))


@pytest.mark.parametrize("link", ["cpu", "chaos3"])
def test_a_stepped_optimizer_loading_an_adamw_state_dict_continues_like_a_fresh_one(link):
    """The same for a torch.optim.AdamW state dict: nothing of the stepped run (its selections, plan, host
    buffers, counters) shows through the imported one."""
    grads = _gappy_grads(14)
    zen = dict(SELF_LOAD, full_warm_up_rounds=1)

    def make(params):
        ctx = chaos(seed=3) if link.startswith("chaos") else contextlib.nullcontext()
        with ctx:
            return ZenFlowAdamW(_two_groups(params), **HYPER, zenflow=zen)

    sd = copy.deepcopy(_adam_state())
    sd["param_groups"] = [dict(sd["param_groups"][0], params=[0, 1, 2]),
                          dict(sd["param_groups"][0], params=[3, 4, 5], lr=5e-3)]
    start = make_params(seed=4)
    params = [torch.nn.Parameter(x.detach().clone()) for x in start]
    with make(params) as opt:
        drive(opt, params, grad_sequence(11, seed=3))
        with torch.no_grad():
            for p, x in zip(params, start, strict=True):
                p.copy_(x)
        opt.load_state_dict(sd)
        reloaded = drive(opt, params, grads)
        reloaded_sd = copy.deepcopy(opt.state_dict())
    fresh = [torch.nn.Parameter(x.detach().clone()) for x in start]
    with make(fresh) as opt2:
        opt2.load_state_dict(sd)
        expected = drive(opt2, fresh, grads)
        expected_sd = copy.deepcopy(opt2.state_dict())
    for t, (a, b) in enumerate(zip(expected, reloaded, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {t} param {i}: the reloaded optimizer differs from a fresh one"
    assert_same_state_dict(reloaded_sd, expected_sd, "state_dict")


# -- backward hooks: one per parameter while built, none after close ----------------------------------------


def _hook_counts(params, baseline):
    """ZenFlow's post-accumulate-grad hooks on each parameter: torch keeps them in
    ``p._post_accumulate_grad_hooks`` (an OrderedDict, None before the first), less the ones the test set."""
    return [len(p._post_accumulate_grad_hooks or {}) - b for p, b in zip(params, baseline, strict=True)]


def _hook_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


HOOK_ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True,
                full_warm_up_rounds=1)


def test_the_asynchronous_link_keeps_one_backward_hook_per_parameter_across_reloads_and_none_after_close():
    model = _hook_model()
    params = list(model.parameters())
    fired = [0] * len(params)
    for n, p in enumerate(params):  # the user's own hook: ZenFlow must leave it alone
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired[n] + 1))
    baseline = [len(p._post_accumulate_grad_hooks) for p in params]
    one, none = [1] * len(params), [0] * len(params)
    with chaos(seed=1):
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=HOOK_ZEN)
        unbuilt = ZenFlowAdamW(_hook_model().parameters(), **HYPER, zenflow=HOOK_ZEN)
    assert _hook_counts(params, baseline) == none  # hooks come with the first step
    _train(model, opt, 3)
    assert _hook_counts(params, baseline) == one
    opt.load_state_dict(opt.state_dict())  # mid-interval, a host update pending
    assert _hook_counts(params, baseline) == one
    _train(model, opt, 2, seed=1)
    for _ in range(3):
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert _hook_counts(params, baseline) == one
    opt.load_state_dict(_adam_state_of(model))  # a torch.optim.AdamW run continued
    assert _hook_counts(params, baseline) == one
    opt.load_state_dict(unbuilt.state_dict())  # a checkpoint of an optimizer that never stepped
    assert max(_hook_counts(params, baseline)) <= 1
    _train(model, opt, 3, seed=2)
    assert _hook_counts(params, baseline) == one
    assert fired == [3 + 2 + 3] * len(params)  # the user's hook fired once per backward throughout
    opt.close()
    assert _hook_counts(params, baseline) == none
    unbuilt.close()

    # an optimizer dropped without close(): collected, it takes its hooks with it
    with chaos(seed=2):
        dropped = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=HOOK_ZEN)
    _train(model, dropped, 2)
    dropped.load_state_dict(dropped.state_dict())
    assert _hook_counts(params, baseline) == one
    del dropped
    gc.collect()
    assert _hook_counts(params, baseline) == none
    assert [len(p._post_accumulate_grad_hooks) for p in params] == baseline


def _adam_state_of(model):
    """A torch.optim.AdamW state dict for ``model``'s parameters (two steps on copies of them)."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    adam = torch.optim.AdamW(copies, **HYPER)
    drive(adam, copies, [[torch.ones_like(p) for p in copies]] * 2)
    return adam.state_dict()


# -- host_timeout, and a tensor lr ------------------------------------------------------------------------------------


def _facade_and_lion(params, **kwargs):
    from zenflow_kernels import ZenFlow, rules

    zen = dict(select_strategy="step", select_interval=4, update_interval=2)
    return [("ZenFlowAdamW", lambda: ZenFlowAdamW(params, zenflow=zen, **kwargs)),
            ("ZenFlow(Lion)", lambda: ZenFlow(params, rules.Lion(), zenflow=zen, **kwargs))]


@pytest.mark.parametrize("value, exc", [
    (-1, ValueError), (0, ValueError), (0.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    (-float("inf"), ValueError), ("10", TypeError), (True, TypeError), ([10], TypeError),
    (torch.tensor(10.0), TypeError),
])
def test_host_timeout_is_checked_at_construction(value, exc):
    """A real number of seconds > 0, or None (no limit, as documented): -1 used to fail later as a stuck worker, '10'
    as a bare TypeError, NaN turned the limit off. The message names host_timeout, its value and what is allowed."""
    for name, make in _facade_and_lion(make_params(), host_timeout=value):
        with pytest.raises(exc) as err:
            make()
        assert str(err.value) == (f"{name}: host_timeout={value!r} is invalid: allowed None (no limit) or a finite "
                                  "number of seconds > 0")


@pytest.mark.parametrize("value", [None, 0.5, 30, 600.0])
def test_host_timeouts_accepted(value):
    for _, make in _facade_and_lion(make_params(), host_timeout=value):
        with make() as opt:
            assert opt.host_timeout == value


@pytest.mark.parametrize("lr", [torch.tensor([1e-3, 2e-3]), torch.tensor(1, dtype=torch.int64), torch.tensor(-1e-3),
                                torch.tensor(float("nan")), "0.001"])
def test_a_bad_lr_is_refused_alike_by_the_facade_and_zenflow(lr):
    for name, make in _facade_and_lion(make_params(), lr=lr):
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value).startswith(f"{name}: lr={lr!r} is invalid: allowed a finite number >= 0, or a "
                                         "1-element floating-point tensor")


@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_tensor_lr_with_a_scheduler_follows_torch_adamw(shape):
    """A 1-element float tensor lr, as torch.optim.AdamW takes it (ZenFlowAdamW used to refuse it, ZenFlow(rule)
    took it): every column on the device (topk_ratio=1) follows torch.optim.AdamW at the same tensor lr under the
    same scheduler, which writes into the tensor in place; ZenFlow(rules.AdamW()) alike."""
    from zenflow_kernels import ZenFlow, rules

    grads = grad_sequence(12)
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    zen = dict(topk_ratio=1.0, select_strategy="step", select_interval=4, update_interval=2)

    def history(make):
        params = make_params()
        opt = make(params, torch.full(shape, HYPER["lr"]))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        out, lrs = [], []
        for step_grads in grads:
            out += drive(opt, params, [step_grads])
            sched.step()
            lrs.append(float(opt.param_groups[0]["lr"]))
        assert torch.is_tensor(opt.param_groups[0]["lr"])  # (still the tensor, written in place)
        if hasattr(opt, "close"):
            opt.close()
        return out, lrs

    want, want_lrs = history(lambda ps, lr: torch.optim.AdamW(ps, lr=lr, **hyper, foreach=False))
    assert want_lrs[2] == pytest.approx(HYPER["lr"] / 2) and want_lrs[-1] == pytest.approx(HYPER["lr"] / 16)
    for make in (lambda ps, lr: ZenFlowAdamW(ps, lr=lr, **hyper, zenflow=zen),
                 lambda ps, lr: ZenFlow(ps, rules.AdamW(hyper["betas"], hyper["eps"], hyper["weight_decay"]), lr=lr,
                                        zenflow=zen)):
        got, lrs = history(make)
        assert lrs == want_lrs
        for t, (a, b) in enumerate(zip(got, want, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=lambda m, t=t, i=i: f"step {t} p{i}: {m}")


def test_a_tensor_lr_checkpoint_is_copied_on_load():
    params = make_params()
    zen = dict(select_strategy="step", select_interval=4, update_interval=2)
    with ZenFlowAdamW(params, lr=torch.tensor(0.01), zenflow=zen) as opt:
        drive(opt, params, grad_sequence(2))
        saved = copy.deepcopy(opt.state_dict())
    assert torch.is_tensor(saved["param_groups"][0]["lr"])
    with ZenFlowAdamW(make_params(), lr=torch.tensor(0.5), zenflow=zen) as opt:
        opt.load_state_dict(saved)
        lr = opt.param_groups[0]["lr"]
        assert torch.is_tensor(lr) and float(lr) == pytest.approx(0.01)
        lr.fill_(0.02)  # (a scheduler's write) leaves the caller's state dict as it was
        assert float(saved["param_groups"][0]["lr"]) == pytest.approx(0.01)


def test_zenflow_adamw_takes_torch_adamws_arguments_and_zenflows_options():
    """ZenFlowAdamW writes only AdamW's arguments; ZenFlow's keyword-only ones are written once (on ZenFlow) and
    forwarded, its signature listing them all, an unknown keyword refused under its own name."""
    import inspect

    from zenflow_kernels import ZenFlow

    own = list(inspect.signature(ZenFlowAdamW).parameters)
    assert own[:5] == ["params", "lr", "betas", "eps", "weight_decay"]
    options = [n for n, p in inspect.signature(ZenFlow).parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert own[5:] == options and "zenflow" in options and "max_grad_norm" in options
    with pytest.raises(TypeError, match=r"^ZenFlowAdamW.__init__\(\) got an unexpected keyword argument 'zen_flow'"):
        ZenFlowAdamW(make_params(), zen_flow={})
    with pytest.raises(ValueError, match="max_grad_norm"):
        ZenFlowAdamW(make_params(), max_grad_norm=-1.0)
