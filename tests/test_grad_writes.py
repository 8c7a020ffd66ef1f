"""Gradients written in place while the link may still be copying them (docs/design.md section 6).

An asynchronous link starts each gradient's copy to the host from backward hooks and reuses that copy
at ``step()`` when the gradient object and its ``_version`` are unchanged. What users write around the
step must not change the bits:

* zeroing in place after ``step()`` (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``,
  ``opt.zero_grad(set_to_none=False)``) while that step's copies are still queued;
* micro-batches accumulating into the same ``.grad`` (in place, after a hook already staged it);
* writes that bump ``_version`` between backward and ``step()`` (unscaling, clipping in place).

Writes that do not bump ``_version`` (through ``.data``, raw-pointer kernels) cannot be seen: the
staged copy of the gradient as backward produced it is used, documented in docs/custom-loop.md with
the remedy (``torch.autograd.graph.increment_version``), both tested below.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW, ZenFlowWarning
from zenflow_kernels.ops import use_backend
from zenflow_kernels.testing import chaos

ZENFLOW = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2,
               full_warm_up_rounds=1)
HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
LINKS = ["cpu", "chaos0", "chaos1", "chaos2"]


@pytest.fixture(autouse=True)
def numba_backend():
    with use_backend("numba"):
        yield


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def _batches(steps, micro=1, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(10, 16, generator=g), torch.randn(10, 8, generator=g)) for _ in range(micro)]
            for _ in range(steps)]


def _train(link, batches, *, zero, overlap=True, device_accumulation=False, before_step=None, seed=0,
           declare=False):
    """Train a fresh model on ``batches`` (a list of micro-batch lists) with ``zero(model, opt)`` after
    every step (``declare``: all micro-batches but the last inside ``opt.no_sync()``); returns the flushed
    weights."""
    model = _model(seed)
    zenflow = dict(ZENFLOW, overlap_step=overlap, device_accumulation=device_accumulation)
    if link == "cpu":
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
    else:
        with chaos(seed=int(link[len("chaos"):])):
            opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
    with opt:
        for micro in batches:
            for k, (x, y) in enumerate(micro):
                with opt.no_sync() if declare and k < len(micro) - 1 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            if before_step is not None:
                before_step(model, opt)
            opt.step()
            zero(model, opt)
        opt.flush()
    return [p.detach().clone() for p in model.parameters()]


def _model_zero_grad_in_place(model, opt):
    model.zero_grad(set_to_none=False)


def _grad_zero_(model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _opt_zero_grad_in_place(model, opt):
    opt.zero_grad(set_to_none=False)


def _set_to_none(model, opt):
    opt.zero_grad()


ZEROS = {"model.zero_grad(False)": _model_zero_grad_in_place, "grad.zero_()": _grad_zero_,
         "opt.zero_grad(False)": _opt_zero_grad_in_place}


@pytest.mark.parametrize("link", LINKS[1:])
@pytest.mark.parametrize("zero", sorted(ZEROS))
@pytest.mark.parametrize("overlap,device_accumulation", [(True, False), (False, False), (True, True)])
def test_zeroing_in_place_after_step_gives_the_synchronous_bits(link, zero, overlap, device_accumulation):
    """The step's copies may still be queued when the user zeroes the gradients in place: the
    asynchronous link must give the synchronous link's bits (set_to_none there: nothing to race)."""
    batches = _batches(14)
    want = _train("cpu", batches, zero=_set_to_none, overlap=overlap, device_accumulation=device_accumulation)
    got = _train(link, batches, zero=ZEROS[zero], overlap=overlap, device_accumulation=device_accumulation)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs after zeroing in place with {zero} on {link}"


@pytest.mark.parametrize("link", LINKS[1:])
@pytest.mark.parametrize("zero", ["model.zero_grad(False)", "grad.zero_()"])
@pytest.mark.parametrize("declare", [False, True])
def test_micro_batches_accumulating_into_kept_gradients(link, zero, declare):
    """Three micro-batches add into the same ``.grad`` (undeclared: after backward hooks staged it, with one
    warning naming ``opt.no_sync()``; declared: hooks copy only in the last, handing slots over), then it is
    zeroed in place: the same bits as the synchronous link."""
    batches = _batches(12, micro=3)
    want = _train("cpu", batches, zero=_set_to_none)
    with contextlib.nullcontext() if declare else pytest.warns(ZenFlowWarning, match="fired twice"):
        got = _train(link, batches, zero=ZEROS[zero], declare=declare)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs with micro-batches on {link}"


def _halve_in_place(model, opt):
    for p in model.parameters():
        p.grad.mul_(0.5)  # bumps _version: step() copies the gradient again


def _halve_through_data_after_the_copies(model, opt):
    # whether a hook's copy ran before an unversioned write is a race (on a GPU too: the copy stream runs
    # when it runs); wait for the copies so that the write comes after them, the case that shows the hazard
    link = getattr(opt, "_link", None)  # (built at the first step: its hooks start copying after it)
    if link is not None:
        link._engine.device_waits_for_d2h()
    for p in model.parameters():
        p.grad.data.mul_(0.5)  # .data shares storage, not the version counter: invisible to the link


def _halve_through_data_and_say_so(model, opt):
    for p in model.parameters():
        p.grad.data.mul_(0.5)
        torch.autograd.graph.increment_version(p.grad)  # the documented remedy


@pytest.mark.parametrize("link", LINKS[1:])
def test_versioned_write_before_step_is_seen(link):
    batches = _batches(10)
    want = _train("cpu", batches, zero=_set_to_none, before_step=_halve_in_place)
    got = _train(link, batches, zero=_set_to_none, before_step=_halve_in_place)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("link", LINKS[1:])
def test_unversioned_write_before_step_is_not_seen_by_the_host_path_unless_the_version_is_bumped(link):
    """Documented behaviour: a write through ``.data`` after backward is invisible to an asynchronous
    link's staged copies once they ran (before, it is a race), so the host path accumulates the gradient
    as backward produced it while the fast path (which reads ``.grad`` at ``step()``) sees the write.
    ``increment_version`` makes the link copy again: then the bits are the synchronous link's."""
    batches = _batches(10)
    want = _train("cpu", batches, zero=_set_to_none, before_step=_halve_through_data_and_say_so)
    unseen = _train(link, batches, zero=_set_to_none, before_step=_halve_through_data_after_the_copies)
    assert any(not torch.equal(a, b) for a, b in zip(unseen, want, strict=True))
    # what the unseen write gives: the host path took the gradients before halving
    fixed = _train(link, batches, zero=_set_to_none, before_step=_halve_through_data_and_say_so)
    assert all(torch.equal(a, b) for a, b in zip(fixed, want, strict=True))

