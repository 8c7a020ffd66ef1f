"""Gradients written in place while the link may still be copying them (docs/design.md sections 5.1 and 12).

An asynchronous link starts each gradient's copy to the host from backward hooks, with a fingerprint of the
gradient, and at ``step()`` uses that copy only if the gradient's fingerprint is unchanged; otherwise it copies
again. Nothing reaches the host sums before that check. What users write around the step must not change the
bits:

* zeroing in place after ``step()`` (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``,
  ``opt.zero_grad(set_to_none=False)``) while that step's copies are still queued;
* micro-batches accumulating into the same ``.grad`` (in place, after a hook already copied it), declared or not;
* writes between backward and ``step()``, whether or not they bump ``_version``: in place (clipping, unscaling),
  through ``.data``, racing the copies or after them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.testing import chaos

ZENFLOW = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2,
               full_warm_up_rounds=1)
HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
LINKS = ["cpu", "chaos0", "chaos1", "chaos2"]


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


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
        stats = opt.stats()
    return [p.detach().clone() for p in model.parameters()], stats


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
    want, _ = _train("cpu", batches, zero=_set_to_none, overlap=overlap, device_accumulation=device_accumulation)
    got, _ = _train(link, batches, zero=ZEROS[zero], overlap=overlap, device_accumulation=device_accumulation)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs after zeroing in place with {zero} on {link}"


@pytest.mark.parametrize("link", LINKS[1:])
@pytest.mark.parametrize("zero", ["model.zero_grad(False)", "grad.zero_()"])
@pytest.mark.parametrize("declare", [False, True])
def test_micro_batches_accumulating_into_kept_gradients(link, zero, declare):
    """Three micro-batches add into the same ``.grad``, then it is zeroed in place: the same bits as the
    synchronous link, no warning. Declared (``no_sync``), hooks copy only in the last backward; undeclared, the
    first step's hooks copy at every backward (each copy over the last), and from then on the optimizer knows a
    step has three and copies at the third only: the same bytes cross as when declared, plus two extra copies of
    the matrices in the first step with hooks (the second: the hooks are registered at the first ``step()``, and
    after warm-up only the matrices cross), and every used byte but the first step's during backward."""
    batches = _batches(12, micro=3)
    want, _ = _train("cpu", batches, zero=_set_to_none)
    got, stats = _train(link, batches, zero=ZEROS[zero], declare=declare)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs with micro-batches on {link}"
    _, declared = _train(link, batches, zero=ZEROS[zero], declare=True)
    params = list(_model().parameters())
    extra = 0 if declare else 2 * sum(p.numel() * 4 for p in params if p.dim() == 2)
    assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == extra
    assert stats["d2h_bytes"] == declared["d2h_bytes"] + extra
    first_step = sum(p.numel() * 4 for p in params)  # warm-up, before the hooks exist: every parameter at step()
    assert stats["d2h_bytes_in_backward"] == stats["d2h_bytes"] - extra - first_step > 0


def _halve_in_place(model, opt):
    for p in model.parameters():
        p.grad.mul_(0.5)  # bumps _version


def _halve_through_data_after_the_copies(model, opt):
    # wait for the hooks' copies first, so that the write comes after them: the copies then hold the gradient as
    # backward produced it, which step() must not use
    link = getattr(opt, "_link", None)  # (built at the first step: its hooks start copying after it)
    if link is not None:
        link.before_grad_write()  # (the synchronous reference's link has nothing to wait for)
    for p in model.parameters():
        p.grad.data.mul_(0.5)  # .data shares storage, not the version counter


def _halve_through_data(model, opt):
    for p in model.parameters():
        p.grad.data.mul_(0.5)  # racing the hooks' copies (queued on the copy thread, delayed by chaos)


WRITES = {"in place": _halve_in_place, ".data after the copies": _halve_through_data_after_the_copies,
          ".data racing the copies": _halve_through_data}


@pytest.mark.parametrize("link", LINKS[1:])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_any_write_before_step_is_seen(link, write):
    """A write between backward and ``step()`` that bumps ``_version``, or does not (through ``.data``, as
    GradScaler's unscale and raw-pointer kernels do), before or while the hooks' copies run: every step's
    fingerprint differs from its hook's, so ``step()`` copies the gradients again, and the bits are the
    synchronous link's. Rewritten at every step, the hand-over turns off after three steps."""
    batches = _batches(10)
    want, _ = _train("cpu", batches, zero=_set_to_none, before_step=WRITES[write])
    got, stats = _train(link, batches, zero=_set_to_none, before_step=WRITES[write])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert stats["handover"] == "off" and "changed between backward and step()" in stats["handover_why"]
    assert stats["d2h_bytes_unused"] > 0 and stats["d2h_bytes_in_backward"] == 0
