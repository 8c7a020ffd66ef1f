"""Every combination of the features a loop brings, against an independent oracle (``ReferenceZenFlow``), on both
links: a test that compares the asynchronous link with the synchronous one only would pass a bug both share.

* GradScaler (off, a power-of-two scale, a scale that is not one; growing and backing off, with an overflow
  step) x strided (transposed) gradients, ``device_accumulation``, a matrix large enough for the fused host update,
  a callable importance, per-group ``topk_ratio`` and importance x overlap on and off: the reference's weights at
  every step, its counters, and the synchronous link's bits on the asynchronous one.
* Clipping requests routed into the optimizer (``clip_grad_norm_``): none, one, two in a step, a dropped batch's
  request (``opt.zero_grad()`` drops it), a loop that zeroes with ``model.zero_grad()`` (the request then stays
  for the next step), the norm only (``inf``): the reference's weights and the norms the requests return.
* Lightning's ``gradient_clip_algorithm="value"`` (in place, by the trainer): the reference's weights.
"""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from support import backward_and_step
from tolerance import assert_all_within_stated_bound

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)
STEPS = 12
OVERFLOW_AT = 5  # a step whose loss is inf: GradScaler's found_inf (or, without one, a non-finite gradient)


def saliency(grad, param):
    """A researcher's column criterion: |gradient x weight| summed over rows, plus a prior on the weights' size. Not
    homogeneous in the gradient: handed a gradient still scaled by a GradScaler it would rank other columns."""
    return (grad * param.detach()).abs().sum(0) + 0.05 * param.detach().abs().sum(0)


class ColumnMajorLinear(torch.nn.Linear):
    """A Linear whose weight is stored transposed (column-major): its gradient has the same strides."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.weight = torch.nn.Parameter(self.weight.detach().t().contiguous().t())


def model(feature: str):
    torch.manual_seed(0)
    if feature == "fuse":  # a 256 x 260 matrix: past ZenFlowAdamW.FUSE_MIN_NUMEL
        assert ZenFlowAdamW.FUSE_MIN_NUMEL <= 256 * 260
        return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 260),
                                   torch.nn.Tanh(), torch.nn.Linear(260, 8))
    lin = ColumnMajorLinear if feature == "strided" else torch.nn.Linear
    return torch.nn.Sequential(lin(16, 24), torch.nn.Tanh(), torch.nn.LayerNorm(24), lin(24, 8))


def param_groups(m, feature: str):
    if feature != "groups":
        return m.parameters()
    first, last = list(m[0].parameters()), list(m[-1].parameters())
    rest = [p for p in m.parameters() if all(p is not q for q in first + last)]
    return [dict(params=first, topk_ratio=0.5, importance=saliency), dict(params=last, topk_ratio=0.0),
            dict(params=rest)]


def settings(feature: str, overlap: bool) -> tuple[dict, float | None]:
    """The zenflow block and ``max_grad_norm`` of a case: clipping on, except where it would keep the fused
    update from running (it runs without clipping and without a scale)."""
    zen = dict(ZEN, overlap_step=overlap, device_accumulation=feature == "devacc")
    if feature == "scorer":
        zen["importance"] = saliency
    return zen, None if feature == "fuse" else 1.0


def batches(steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, 16, generator=g), torch.randn(10, 8, generator=g)) for _ in range(steps)]


def make(m, mode, zen, feature, **kw):
    cls = ReferenceZenFlow if mode == "reference" else ZenFlowAdamW
    with chaos(seed=int(mode[5:]), max_delay=0.002) if mode.startswith("chaos") else contextlib.nullcontext():
        return cls(param_groups(m, feature), **HYPER, zenflow=zen, **kw)


def scaled_run(m0, mode, feature, overlap, scale):
    """The loop with a GradScaler (``scale``: its initial scale, doubling every 3 steps; None: none) and an inf loss at
    ``OVERFLOW_AT``: the weights after every step, the counters and the scales used."""
    m = copy.deepcopy(m0)
    zen, max_norm = settings(feature, overlap)
    opt = make(m, mode, zen, feature, max_grad_norm=max_norm)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=3) if scale else None
    history, scales = [], []
    for t, (x, y) in enumerate(batches()):
        loss = F.mse_loss(m(x), y) * (math.inf if t == OVERFLOW_AT else 1.0)
        if scaler is not None:
            scales.append(scaler.get_scale())
        backward_and_step(opt, loss, scaler)
        opt.zero_grad()
        history.append([p.detach().clone() for p in m.parameters()])
    opt.flush()
    history.append([p.detach().clone() for p in m.parameters()])
    counters = (opt.t, opt.skipped_steps, opt.host_updates, opt.selections)
    if mode != "reference":
        opt.close()
    return history, counters, scales


def assert_close_history(got, want, what):
    """Ours against the reference (plain torch against numba kernels): as docs/design.md's numeric guarantees state
    (tests/tolerance.py: all but a few elements within 1e-5, none beyond 2 * lr * steps; the few are Adam's first
    step on a column whose gradient is rounding noise)."""
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_all_within_stated_bound(a, b, lr=HYPER["lr"], steps=t + 1, what=f"{what} step {t}")


def assert_same_history(got, want, what):
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"{what} step {t} param {i}: max diff {(x - y).abs().max()}"


FEATURES = ["strided", "devacc", "fuse", "scorer", "groups"]
SCALES = {"off": None, "pow2": 2.0**10, "other": 1000.0}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("scale", list(SCALES))
def test_every_combination_matches_the_reference_on_both_links(scale, feature, overlap):
    m0 = model(feature)
    if feature == "strided":
        assert not m0[0].weight.is_contiguous() and m0[0].weight.stride() == (1, 24)
    want, counters, scales = scaled_run(m0, "reference", feature, overlap, SCALES[scale])
    assert counters[1] == 1 and (scale == "off" or len(set(scales)) > 1)  # the overflow skipped; the scale moved
    sync = scaled_run(m0, "sync", feature, overlap, SCALES[scale])
    assert_close_history(sync[0], want, "sync vs reference")
    assert sync[1:] == (counters, scales)
    asynchronous = scaled_run(m0, "chaos1", feature, overlap, SCALES[scale])
    assert_same_history(asynchronous[0], sync[0], "chaos vs sync")
    assert asynchronous[1:] == (counters, scales)


# -- clipping requests ----------------------------------------------------------------------------------------

PATTERNS = ["none", "one", "two", "dropped", "model_zero_grad", "norm_only", "two_scaled"]


def request_run(m0, mode, pattern):
    """The loop of ``pattern`` (see the module docstring); every 4th step from step 2 a batch is dropped in the
    patterns that drop one. Returns the weights after every step and the norms the requests returned."""
    m = copy.deepcopy(m0)
    opt = make(m, mode, dict(ZEN, overlap_step=True), "base", max_grad_norm=1.0 if pattern.startswith("two") else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=3) if pattern == "two_scaled" else None
    # "two" asks three times: the smallest is neither the first nor the last
    asks = {"one": [0.3], "two": [2.0, 0.2, 1.0], "two_scaled": [2.0, 0.2, 1.0], "dropped": [0.5],
            "model_zero_grad": [0.5], "norm_only": [math.inf]}.get(pattern, [])
    history, norms, data = [], [], iter(batches(STEPS + 3))
    for t in range(STEPS):
        x, y = next(data)
        loss = F.mse_loss(m(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if pattern in ("dropped", "model_zero_grad") and t % 4 == 2:
            norms.append(opt.clip_grad_norm_(0.01))  # asked for a batch that is then dropped
            opt.zero_grad() if pattern == "dropped" else m.zero_grad()
            x, y = next(data)
            F.mse_loss(m(x), y).backward()
        norms += [opt.clip_grad_norm_(n) for n in asks]
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad() if pattern != "model_zero_grad" else m.zero_grad()
        history.append([p.detach().clone() for p in m.parameters()])
    if mode != "reference":
        opt.close()
    return history, [float(n) for n in norms]


@pytest.mark.parametrize("mode", ["sync", "chaos0"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_clipping_requests_match_the_reference(pattern, mode):
    """The smallest request (and ``max_grad_norm``) of a step clips it; ``opt.zero_grad()`` drops a dropped
    batch's request (its norm stays NaN), ``model.zero_grad()`` does not (it clips the next step, and its tensor
    holds that step's norm); every returned tensor holds its step's global norm."""
    m0 = model("base")
    want, want_norms = request_run(m0, "reference", pattern)
    got, norms = request_run(m0, mode, pattern)
    assert_close_history(got, want, f"{pattern} {mode} vs reference")
    assert len(norms) == len(want_norms)
    for k, (a, b) in enumerate(zip(norms, want_norms, strict=True)):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5), (k, a, b)
    if pattern == "dropped":
        assert sum(math.isnan(n) for n in norms) == 3  # the three dropped batches' requests
    if pattern == "model_zero_grad":
        assert not any(math.isnan(n) for n in norms)
    if pattern != "none":
        unclipped, _ = request_run(m0, "reference", "none")
        assert not torch.equal(unclipped[-1][0], got[-1][0])  # the requests did clip


# -- Lightning's clipping by value ------------------------------------------------------------------------------

L = pytest.importorskip("lightning")


class Tiny(L.LightningModule):
    def __init__(self, factory):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))
        self.factory = factory

    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.factory(self.parameters())


def test_lightning_clipping_by_value_matches_the_reference_on_both_links():
    """``gradient_clip_algorithm="value"``: Lightning clips every gradient element in place before the optimizer
    step (the callback routes only clipping by norm); the optimizer sees the clipped gradients: a plain loop
    clipping by value into the reference gives the same weights, both links alike (the asynchronous one copies the
    rewritten gradients again at step(), and after three such steps lets them cross at step())."""
    from zenflow_kernels.integrations.lightning import ZenFlowCallback

    data = batches(STEPS)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]),
                                                                        torch.cat([y for _, y in data])),
                                         batch_size=10)
    zen = dict(ZEN, overlap_step=True)
    weights, stats = {}, {}
    for mode in ("sync", "chaos1"):
        module = Tiny(lambda ps: ZenFlowAdamW(ps, **HYPER, zenflow=zen))
        trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[ZenFlowCallback()],
                            gradient_clip_val=0.01, gradient_clip_algorithm="value", num_sanity_val_steps=0)
        with chaos(seed=1) if mode.startswith("chaos") else contextlib.nullcontext():
            trainer.fit(module, loader)
        weights[mode] = [p.detach().clone() for p in module.parameters()]
        stats[mode] = trainer.optimizers[0].stats()
    m = Tiny(None).net
    ref = ReferenceZenFlow(m.parameters(), **HYPER, zenflow=zen)
    for x, y in data:
        F.mse_loss(m(x), y).backward()
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
        ref.step()
        ref.zero_grad()
    ref.flush()  # (the callback lands the last host update at the end of fit)
    assert_same_history([weights["chaos1"]], [weights["sync"]], "chaos vs sync")
    assert_close_history([weights["sync"]], [[p.detach() for p in m.parameters()]], "sync vs reference")
    assert stats["chaos1"]["handover"] == "off" and "changed between backward" in stats["chaos1"]["handover_why"]
