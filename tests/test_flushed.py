"""Saving and evaluating leave training bit-identical (``ZenFlowAdamW.flushed()``, docs/design.md section 5.2).

Inside ``opt.flushed()`` the parameters hold the flushed weights (what ``flush()`` gives at that point);
after it they hold again, bit for bit, the weights training continues from. A run that saves and
evaluates inside it every few steps ends with the same weights as the run that never does; a checkpoint
taken inside it holds the flushed model and an optimizer state that resumes the uninterrupted run exactly.
"""

import contextlib
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from support import HYPER, snapshot

from zenflow_kernels import ZenFlowAdamW, ZenFlowWarning
from zenflow_kernels.testing import chaos

WIDTH, STEPS, SAVES = 24, 14, (5, 9)  # saves mid-interval, with a host update in flight and one pending
ZENFLOW = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, full_warm_up_rounds=1,
               overlap_step=True)


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


def mlp(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, 4)).to(dtype)


def data(dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, WIDTH, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype))
            for _ in range(STEPS)]


def make(dtype, mode, seed=0):
    model = mlp(dtype, seed)
    with chaos(seed=int(mode[-1]), max_delay=0.002) if mode.startswith("chaos") else contextlib.nullcontext():
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZENFLOW, max_grad_norm=1.0)
    return model, opt


def train(model, opt, batches, start=0, *, at=None):
    """Steps ``start..``; ``at(t)`` after step t (a save, an evaluation). The weights after every step."""
    history = {}
    for t in range(start, len(batches)):
        x, y = batches[t]
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()
        opt.zero_grad()
        history[t] = snapshot(model.parameters())
        if at is not None:
            at(t)
    return history


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_same(a, b, what):
    for n, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what}: parameter {n} differs by {(x.float() - y.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sync", "chaos1"])
def test_saving_and_evaluating_inside_flushed_leave_the_run_and_resume_bit_identical(dtype, mode):
    batches = data(dtype)
    model, opt = make(dtype, mode)
    with opt:
        plain = train(model, opt, batches)

    # the same run, saving and evaluating inside flushed() after the steps in SAVES
    saved, inside = {}, {}
    model, opt = make(dtype, mode)

    def save_and_evaluate(t):
        if t not in SAVES:
            return
        live = snapshot(model.parameters())
        with opt.flushed():
            inside[t] = snapshot(model.parameters())
            with torch.no_grad():
                model(batches[0][0])  # an evaluation forward
            saved[t] = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
        assert_same(snapshot(model.parameters()), live, f"restored after the save at step {t}")

    with opt:
        history = train(model, opt, batches, at=save_and_evaluate)
    for t in plain:
        assert_same(history[t], plain[t], f"step {t} of the run that saves")

    for t in SAVES:
        # what was saved and evaluated: what flush() gives at that point (a run that flushes there)
        model, opt = make(dtype, mode)
        with opt:
            train(model, opt, batches[: t + 1])
            opt.flush()
            flushed = snapshot(model.parameters())
        assert_same(inside[t], flushed, f"the weights inside flushed() at step {t}")
        assert any(not torch.equal(a, b) for a, b in zip(flushed, plain[t], strict=True)), \
            f"nothing was pending at step {t}: the case tests nothing"
        assert_same(snapshot(saved[t]["model"].values()), flushed, f"the saved model at step {t}")

        # resume: a fresh model (other weights) loads the model, then the optimizer
        model, opt = make(dtype, mode, seed=7)
        model.load_state_dict(saved[t]["model"])
        with opt:
            opt.load_state_dict(saved[t]["opt"])
            resumed = train(model, opt, batches, start=t + 1)
        for s in resumed:
            assert_same(resumed[s], plain[s], f"step {s} resumed from the save at step {t}")


def test_inside_flushed_step_and_load_are_refused_flush_keeps_and_contexts_nest():
    dtype, batches = torch.float32, data(torch.float32)
    model, opt = make(dtype, "sync")
    with opt:
        train(model, opt, batches[:6])
        live = snapshot(model.parameters())
        sd = opt.state_dict()
        with opt.flushed():
            flushed = snapshot(model.parameters())
            with opt.flushed():  # nested: the inner exit restores nothing
                pass
            assert_same(snapshot(model.parameters()), flushed, "after the inner context")
            with pytest.raises(RuntimeError, match=r"step\(\) inside opt.flushed\(\)"):
                opt.step()
            with pytest.raises(RuntimeError, match=r"load_state_dict\(\) inside opt.flushed\(\)"):
                opt.load_state_dict(sd)
            assert opt.t == 6
        assert_same(snapshot(model.parameters()), live, "after the outer context")
        assert any(not torch.equal(a, b) for a, b in zip(flushed, live, strict=True))

        with opt.flushed():
            opt.flush()  # lands for real: the flushed weights stay
        assert_same(snapshot(model.parameters()), flushed, "flush() inside flushed()")
        rest = train(model, opt, batches, start=6)

    # ... and the run continues as one that called flush() there
    model, opt = make(dtype, "sync")
    with opt:
        train(model, opt, batches[:6])
        opt.flush()
        expected = train(model, opt, batches, start=6)
    for t in expected:
        assert_same(rest[t], expected[t], f"step {t} after flush() inside flushed()")


def test_flushed_before_the_first_step_and_in_sync_mode_changes_nothing():
    batches = data(torch.float32)
    model = mlp(torch.float32)
    opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=dict(ZENFLOW, overlap_step=False))
    with opt:
        with opt.flushed():  # not built yet
            pass
        train(model, opt, batches[:5])
        live = snapshot(model.parameters())
        with opt.flushed():  # synchronous host updates: nothing is ever pending
            assert_same(snapshot(model.parameters()), live, "sync mode inside flushed()")
            assert "unflushed" not in str(opt.state_dict()["state"][0].keys())


def test_a_callback_that_never_restores_is_caught_at_the_next_step():
    """The integrations hold the flushed weights from a callback to the next batch's start; if no callback
    restores them, step() restores them with a warning saying the run now differs."""
    batches = data(torch.float32)
    model, opt = make(torch.float32, "sync")
    with opt:
        opt.hold_flushed(True)  # before the first step (Lightning's sanity-check validation): nothing held
        assert not opt.flushed_weights.held
        train(model, opt, batches[:5])
        opt.hold_flushed(True)
        with pytest.warns(ZenFlowWarning, match="still in place when this step's forward ran"):
            train(model, opt, batches[:7], start=5)
        assert opt.interval.unflushed is None


def test_unflushed_state_of_another_shape_is_refused_before_anything_changes():
    batches = data(torch.float32)
    model, opt = make(torch.float32, "sync")
    with opt:
        train(model, opt, batches[:5])
        with opt.flushed():
            sd = copy.deepcopy(opt.state_dict())
        sd["state"][0]["unflushed"] = torch.zeros(3, 3)
        before = snapshot(model.parameters())
        with pytest.raises(ValueError, match=r"parameter 0 was saved with shape \(3, 3\) \(unflushed\)"):
            opt.load_state_dict(sd)
        assert_same(snapshot(model.parameters()), before, "after a refused load")
        assert opt.t == 5
