"""Hugging Face accelerate custom loops (docs/accelerate.md): ``Accelerator.prepare`` wraps ZenFlowAdamW in an
``AcceleratedOptimizer``, and the loop (``accelerator.backward``, ``accumulate``, ``clip_grad_norm_``, bf16
autocast) gives the weights of the same loop written in plain PyTorch, bit for bit, after every optimizer step,
on the synchronous CPU link and under ``testing.chaos`` (the CUDA link's asynchronous protocol on CPU)."""

import contextlib
import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402  (after the importorskip)
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from zenflow_kernels import ZenFlowAdamW  # noqa: E402
from zenflow_kernels.testing import chaos  # noqa: E402

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True,
           full_warm_up_rounds=1)
BATCH, BATCHES = 8, 16
LINKS = [pytest.param(None, id="sync"), pytest.param(0, id="chaos")]

torch.manual_seed(0)
TEMPLATE = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8))
_g = torch.Generator().manual_seed(1)
X, Y = torch.randn(BATCH * BATCHES, 16, generator=_g), torch.randn(BATCH * BATCHES, 8, generator=_g)
MATRIX_BYTES = 4 * (16 * 32 + 32 * 32 + 32 * 8)  # one step's matrix gradients (vectors stay on the fast path)


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """AcceleratorState and GradientState are singletons: every test starts and ends without them (as
    accelerate's own AccelerateTestCase does)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@dataclass
class Run:
    weights: list  # after every optimizer step: a copy of every parameter
    norms: list  # the gradient norms the clipping returned, one per step
    stats: dict  # opt.stats() at the end
    steps: int  # opt.t at the end
    flushed: list  # every parameter after opt.flush() at the end


def mlp():
    return copy.deepcopy(TEMPLATE)


def loader(batches=BATCHES):
    ds = torch.utils.data.TensorDataset(X[:BATCH * batches], Y[:BATCH * batches])
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)


def zenflow(params, link):
    """ZenFlowAdamW on the synchronous CPU link (link None) or the asynchronous one under chaos(seed=link)."""
    if link is None:
        return ZenFlowAdamW(params, **HYPER, zenflow=ZEN)
    with chaos(seed=link, max_delay=0.002):
        return ZenFlowAdamW(params, **HYPER, zenflow=ZEN)


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def plain_loop(link, *, batches=BATCHES, micro=1, clip=None, opt_clip=None, bf16=False) -> Run:
    """The loop without accelerate: ``micro`` backward passes of ``loss / micro`` per step (accelerate divides by
    ``gradient_accumulation_steps`` also on a short last step), the forward under CPU bf16 autocast and its
    output cast to float32 (what accelerate's prepared forward does) with ``bf16``; ``clip``: torch's in-place
    clipping; ``opt_clip``: the optimizer's."""
    model = mlp()
    opt = zenflow(model.parameters(), link)
    data = list(loader(batches))
    weights, norms = [], []
    try:
        for start in range(0, len(data), micro):
            for x, y in data[start:start + micro]:
                with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    out = model(x)
                (F.mse_loss(out.float(), y) / micro).backward()
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            if opt_clip is not None:
                norms.append(opt.clip_grad_norm_(opt_clip))
            opt.step()
            opt.zero_grad()
            weights.append(snapshot(model))
        opt.flush()
        return Run(weights, norms, opt.stats(), opt.t, snapshot(model))
    finally:
        opt.close()


def accelerate_loop(link, *, batches=BATCHES, micro=1, clip=None, opt_clip=None, mixed_precision="no",
                    declare=False) -> Run:
    """The accelerate recipe of docs/accelerate.md: prepare, ``accelerator.backward``, step and zero_grad on
    the wrapped optimizer at every batch (inside ``accumulate`` with ``micro > 1``), clipping on sync steps."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=micro, mixed_precision=mixed_precision)
    model = mlp()
    zen = zenflow(model.parameters(), link)
    try:
        model, opt, dl = accelerator.prepare(model, zen, loader(batches))
        assert isinstance(opt, AcceleratedOptimizer) and opt.optimizer is zen
        # the wrapper forwards torch.optim's surface only: ZenFlowAdamW's own methods are on opt.optimizer
        assert not any(hasattr(opt, name) for name in ("clip_grad_norm_", "flush", "flushed", "stats", "close"))
        if declare:
            zen.set_requires_gradient_sync(lambda: accelerator.sync_gradients)
        weights, norms = [], []
        for x, y in dl:
            with accelerator.accumulate(model) if micro > 1 else contextlib.nullcontext():
                accelerator.backward(F.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    if clip is not None:
                        norms.append(accelerator.clip_grad_norm_(model.parameters(), clip))
                    if opt_clip is not None:
                        norms.append(opt.optimizer.clip_grad_norm_(opt_clip))
                t = zen.t
                opt.step()
                opt.zero_grad()
                # the wrapper steps only on the last micro-batch of a step
                assert zen.t == t + accelerator.sync_gradients
                if accelerator.sync_gradients:
                    weights.append(snapshot(model))
        zen.flush()  # the wrapper has no flush(): the ZenFlowAdamW itself
        return Run(weights, norms, zen.stats(), zen.t, snapshot(model))
    finally:
        zen.close()


def assert_same_at_every_step(run: Run, ref: Run) -> None:
    assert run.steps == ref.steps == len(run.weights) == len(ref.weights)
    for t, (got, want) in enumerate(zip(run.weights, ref.weights, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"step {t}, parameter {i}: max abs diff {(a - b).abs().max().item()}"
    for i, (a, b) in enumerate(zip(run.flushed, ref.flushed, strict=True)):
        assert torch.equal(a, b), f"after flush(), parameter {i}"
    assert len(run.norms) == len(ref.norms)
    for t, (a, b) in enumerate(zip(run.norms, ref.norms, strict=True)):
        assert torch.equal(a, b), f"step {t}: gradient norm {a.item()} != {b.item()}"


def assert_hand_over(run: Run, link, mode: str) -> None:
    """On the synchronous link nothing crosses during backward ("off" from the first step); under chaos, ``mode``."""
    if link is None:
        assert run.stats["handover"] == "off" and "synchronous" in run.stats["handover_why"]
    else:
        assert run.stats["handover"] == mode, run.stats["handover_why"]


# -- 1. prepare --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("link", LINKS)
def test_prepared_loop_is_the_plain_loop_bit_for_bit(link):
    run = accelerate_loop(link)
    assert_same_at_every_step(run, plain_loop(link))
    assert run.steps == BATCHES and run.stats["host_updates"] > 0 and run.stats["selections"] > 0
    assert_hand_over(run, link, "on")
    if link is not None:  # every step after the first (which builds the optimizer) crossed during backward
        assert run.stats["d2h_bytes_in_backward"] == (BATCHES - 1) * MATRIX_BYTES
        assert run.stats["d2h_bytes_unused"] == 0


# -- 2. gradient accumulation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("batches", [BATCHES, BATCHES - 1], ids=["even", "short-last-step"])
@pytest.mark.parametrize("link", LINKS)
def test_accumulate_is_two_backward_passes_of_half_the_loss_and_one_step(link, batches):
    run = accelerate_loop(link, batches=batches, micro=2)
    assert_same_at_every_step(run, plain_loop(link, batches=batches, micro=2))
    assert run.steps == (batches + 1) // 2
    assert_hand_over(run, link, "on")


def test_declaring_micro_batches_under_accelerate_saves_copies_only():
    """Undeclared, the optimizer learns the step's two backward passes: the first step after it is built copies
    the first micro-batch's gradients for nothing, and the short last step copies at step(). Declared from
    accelerate's ``sync_gradients``, only the last micro-batch of each step crosses, during its backward. Both
    are the plain loop's run, with the hand-over on."""
    ref = plain_loop(0, batches=BATCHES - 1, micro=2)
    undeclared = accelerate_loop(0, batches=BATCHES - 1, micro=2)
    declared = accelerate_loop(0, batches=BATCHES - 1, micro=2, declare=True)
    assert_same_at_every_step(undeclared, ref)
    assert_same_at_every_step(declared, ref)
    steps = (BATCHES - 1 + 1) // 2
    assert declared.stats["handover"] == undeclared.stats["handover"] == "on"
    assert declared.stats["d2h_bytes_unused"] == 0
    assert declared.stats["d2h_bytes_in_backward"] == (steps - 1) * MATRIX_BYTES
    assert undeclared.stats["d2h_bytes_unused"] == MATRIX_BYTES
    assert undeclared.stats["d2h_bytes_in_backward"] == (steps - 2) * MATRIX_BYTES


# -- 3. clipping -------------------------------------------------------------------------------------------------

MAX_NORM = 0.05  # below every step's gradient norm here: every step clips


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("link", LINKS)
def test_accelerator_clip_grad_norm_is_torch_in_place_clipping_bit_for_bit(link, micro):
    run = accelerate_loop(link, micro=micro, clip=MAX_NORM)
    assert_same_at_every_step(run, plain_loop(link, micro=micro, clip=MAX_NORM))
    assert all(n > MAX_NORM for n in run.norms)
    # every step's gradients rewritten after their hooks copied them: exact, and after 3 such steps in a row
    # the gradients cross at step()
    assert_hand_over(run, link, "off")
    if link is not None:
        assert "changed between backward and step()" in run.stats["handover_why"]


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("link", LINKS)
def test_optimizer_clip_grad_norm_under_accelerate_keeps_the_hand_over(link, micro):
    run = accelerate_loop(link, micro=micro, opt_clip=MAX_NORM, declare=micro > 1)
    assert_same_at_every_step(run, plain_loop(link, micro=micro, opt_clip=MAX_NORM))
    assert all(n > MAX_NORM for n in run.norms)  # the returned tensors hold each step's global norm
    assert_hand_over(run, link, "on")
    if link is not None:
        assert run.stats["d2h_bytes_unused"] == 0
    # not the run of in-place clipping: the host clips the interval's mean gradient instead of averaging
    # clipped ones (docs/custom-loop.md, "Clipping")
    in_place = plain_loop(link, micro=micro, clip=MAX_NORM)
    assert not all(torch.equal(a, b) for a, b in zip(run.weights[-1], in_place.weights[-1], strict=True))


# -- 4. mixed precision ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("link", LINKS)
def test_bf16_mixed_precision_is_the_plain_cpu_autocast_loop(link):
    run = accelerate_loop(link, micro=2, mixed_precision="bf16")
    assert_same_at_every_step(run, plain_loop(link, micro=2, bf16=True))
    # autocast did run: not the float32 run
    fp32 = plain_loop(link, micro=2)
    assert not all(torch.equal(a, b) for a, b in zip(run.weights[0], fp32.weights[0], strict=True))


def test_fp16_on_cpu_is_float32_training():
    """accelerate accepts ``mixed_precision="fp16"`` on CPU but sets up neither autocast nor a GradScaler (its
    fp16 branch excludes the CPU), without a warning: the run is the plain float32 loop's."""
    probe = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    assert probe.mixed_precision == "fp16" and probe.scaler is None and not probe.native_amp
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert_same_at_every_step(accelerate_loop(None, mixed_precision="fp16"), plain_loop(None))


@pytest.mark.parametrize("kind", ["zenflow", "fused-adamw"])
def test_an_overflow_skipped_inside_the_optimizer_is_not_reported_to_accelerate(kind):
    """Where accelerate drives a GradScaler (fp16 off CPU), its wrapper learns of an overflow skip from whether
    ``scaler.step`` called ``step()``. GradScaler always calls it for optimizers that unscale inside their step
    (ZenFlowAdamW, torch's fused AdamW), which then skip the step themselves: the step is skipped (weights and
    step count unchanged, the scale backs off) but ``step_was_skipped`` stays False, so a prepared LR scheduler
    steps anyway. Shown with a CPU GradScaler given to the wrapper by hand."""
    accelerate.Accelerator(cpu=True)
    model = mlp()
    if kind == "zenflow":
        inner = zenflow(model.parameters(), None)
    else:
        inner = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    opt = AcceleratedOptimizer(inner, scaler=scaler)
    try:
        for t, (x, y) in enumerate(loader(3)):
            before, scale = snapshot(model), scaler.get_scale()
            loss = F.mse_loss(model(x), y) * (float("inf") if t == 1 else 1.0)
            scaler.scale(loss).backward()
            opt.step()
            opt.zero_grad()
            assert not opt.step_was_skipped
            if t == 1:
                assert all(torch.equal(a, b) for a, b in zip(snapshot(model), before, strict=True))
                assert scaler.get_scale() == scale / 2
        if kind == "zenflow":
            assert inner.skipped_steps == 1 and inner.t == 2
        else:
            assert int(inner.state[model[0].weight]["step"]) == 2
    finally:
        if kind == "zenflow":
            inner.close()
