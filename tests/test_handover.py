"""The loops people write, on the asynchronous link (docs/design.md sections 5.1 and 12; docs/custom-loop.md,
"What the optimizer assumes about your gradients").

Gradients cross to the host from backward's hooks into a landing area; ``step()`` checks each against the
fingerprint its hook took and folds into the host sums only what is still the step's gradient (copying again
whatever changed). So whatever a loop does between backward and ``step()`` (GradScaler, clipping in place or
routed into the optimizer, ``.data`` edits, a NaN repaired, a second backward, a skipped batch or step, a save
or an evaluation), the run is the synchronous link's, bit for bit, at every step, with no interval restart
and no warning; the hand-over stays on unless the loop rewrites its gradients step after step. Run on a model
many times larger than a fold job (the unit the next step's hooks wait for), under ``testing.chaos``. Also the
modeled device itself (``testing.chaos`` bandwidths)."""

import contextlib
import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.handover import HandOver
from zenflow_kernels.link import AsyncLink
from zenflow_kernels.testing import Timeline, chaos

HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
WIDTH, LAYERS = 32, 6  # 4 KiB of fp32 gradient per matrix: 6 matrices, 48x a fold job of 512 B (see chunks())
ZENFLOW = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


@pytest.fixture(autouse=True)
def chunks(monkeypatch):
    """Fold jobs of 512 bytes: the model's matrix gradients (6 x 4 KiB) are 48x one."""
    monkeypatch.setattr(AsyncLink, "FOLD_CHUNK_BYTES", 512)


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    mods = []
    for _ in range(LAYERS):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods).to(dtype)


def batches(steps, micro=2, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(8, WIDTH, generator=g).to(dtype), torch.randn(8, WIDTH, generator=g).to(dtype))
             for _ in range(micro)] for _ in range(steps)]


def snapshot(params):
    return [p.detach().to("cpu", copy=True) for p in params]


def make(params, zenflow, seed, **kwargs):
    """A ZenFlowAdamW on the synchronous link (seed None) or under chaos."""
    if seed is None:
        return ZenFlowAdamW(params, **HYPER, zenflow=zenflow, **kwargs)
    with chaos(seed=seed, max_delay=0.002):
        return ZenFlowAdamW(params, **HYPER, zenflow=zenflow, **kwargs)


def train(model, opt, data, *, micro=1, declare=False, nan_steps=(), before_step=None):
    """One step per entry of ``data``: ``micro`` backward passes (the first ``micro - 1`` inside
    ``opt.no_sync()`` when ``declare``), a NaN loss at ``nan_steps``, ``before_step(t, model, opt)`` between the
    last backward and ``step()`` (returning False skips the step: it zeroes the gradients itself)."""
    history = []
    for t, batch in enumerate(data):
        for k, (x, y) in enumerate(batch[:micro]):
            loss = F.mse_loss(model(x).float(), y.float())
            if t in nan_steps:
                loss = loss * float("nan")
            with opt.no_sync() if declare and k < micro - 1 else contextlib.nullcontext():
                loss.backward()
        if before_step is None or before_step(t, model, opt) is not False:
            opt.step()
            opt.zero_grad()
        history.append(snapshot(model.parameters()))
    return history


def run(model, zenflow, data, *, seed=None, max_grad_norm=None, **kw):
    """``train`` on a copy of ``model``, on the synchronous link (seed None) or under chaos: the history, the
    stats and the host sums of the current interval."""
    model = copy.deepcopy(model)
    opt = make(model.parameters(), zenflow, seed, max_grad_norm=max_grad_norm)
    with opt:
        history = train(model, opt, data, **kw)
        stats = opt.stats()
        sums = interval_sums(opt)
    return history, stats, sums


def interval_sums(opt):
    """The current interval's host sums and counts (after every fold landed)."""
    opt.link.synchronize()
    acc = opt.interval.sums_flat()
    return [(opt.host_shard.view(acc, i).clone(), opt.interval.counted(i)) for i in sorted(opt.host_shard.slots)]


def assert_same(a, b):
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        for i, (p, q) in enumerate(zip(x, y, strict=True)):
            assert torch.equal(p, q), f"step {t} param {i}: max diff {(p.float() - q.float()).abs().max()}"


def same_norms(a, b) -> bool:
    """Lists of norms (None, NaN or numbers) equal, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b, strict=True))


def assert_same_sums(a, b):
    for i, ((x, n), (y, m)) in enumerate(zip(a, b, strict=True)):
        assert n == m and torch.equal(x, y), f"parameter {i}: counts {n} / {m}, sums differ"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("overlap, max_grad_norm, dtype", [(True, None, torch.float32), (False, 0.5, torch.float32),
                                                          (True, 0.5, torch.bfloat16)])
def test_hooks_copy_during_backward_with_the_synchronous_bits(seed, overlap, max_grad_norm, dtype):
    """One backward per step, a model 48x a fold job: gradients cross during backward at every step after the
    first (whose hooks do not exist yet); warm-up, re-selections, host updates in both modes, clipping and a step
    whose loss is NaN (skipped: nothing of it reached the sums) give the synchronous link's bits."""
    model, data = mlp(dtype), batches(14, micro=1, dtype=dtype)
    zenflow = dict(ZENFLOW, overlap_step=overlap)
    want, _, want_sums = run(model, zenflow, data, nan_steps={6}, max_grad_norm=max_grad_norm)
    got, stats, sums = run(model, zenflow, data, seed=seed, nan_steps={6}, max_grad_norm=max_grad_norm)
    assert_same(want, got)
    assert_same_sums(want_sums, sums)
    assert stats["handover"] == "on" and stats["skipped_steps"] == 1
    # warm-up: every parameter crosses at step(); after it the matrices, during backward; the NaN step's copies
    # are dropped
    step_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    assert stats["d2h_bytes_in_backward"] == 12 * step_bytes and stats["d2h_bytes_unused"] == step_bytes


def test_isolated_rewrites_leave_the_hand_over_on_and_three_in_a_row_switch_it_off():
    """The policy itself (handover.py): a step where most of what the hooks copied changed before step() counts
    as a rewrite; isolated ones (a repaired NaN, clipping on a spike) leave the hand-over on however many there
    are, ``REWRITES_BEFORE_OFF`` consecutive ones switch it off with the steps and bytes named. A step whose hooks
    copied nothing (all crossed at step()) breaks the row: rewrites every other step never switch it off."""
    policy = HandOver("on", "why")
    for t in range(30):
        assert policy.copy_now(0)
        policy.stepped(t, 100, 100 if t % 3 == 0 else 10)  # a rewrite every third step
        assert policy.mode == "on", t
    for t in range(30, 60):  # rewrites with a step between them whose hooks copied nothing: not in a row
        policy.stepped(t, *((100, 60) if t % 2 == 0 else (0, 0)))
        assert policy.mode == "on", t
    for t in range(60, 60 + HandOver.REWRITES_BEFORE_OFF):
        assert policy.mode == "on"
        policy.stepped(t, 100, 60)
    last = 59 + HandOver.REWRITES_BEFORE_OFF
    assert policy.mode == "off" and policy.why.startswith(f"step {last}:")
    assert f"step {last}: 60 of 100 bytes" in policy.why and "step 60: 60 of 100 bytes" in policy.why


@pytest.mark.parametrize("seed", [0, 1])
def test_declared_micro_batches_cross_in_the_last_backward(seed):
    """``opt.no_sync()`` around all but the last micro-batch's backward: hooks copy nothing while it is in force
    and copy during the last backward; the synchronous link's bits."""
    model, data = mlp(), batches(10, micro=3)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, micro=3)
    got, stats, _ = run(model, zenflow, data, seed=seed, micro=3, declare=True)
    assert_same(want, got)
    assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == 0
    assert stats["d2h_bytes_in_backward"] >= 0.5 * stats["d2h_bytes"]
    # nothing copied for the two declared micro-batches: the bytes of one gradient per step cross
    assert stats["d2h_bytes"] < 1.3 * sum(p.numel() * 4 for p in model.parameters()) * len(data)


def test_set_requires_gradient_sync_is_the_same_declaration():
    """The setter form (FSDP2's idiom), and a callable asked at each backward (an integration's), give what
    ``no_sync()`` gives; bad values are refused, naming them."""
    model, data = mlp(), batches(6, micro=2)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, micro=2)
    for form in ("bool", "callable"):
        m = copy.deepcopy(model)
        opt = make(m.parameters(), zenflow, 0)
        last = {"now": True}
        if form == "callable":
            opt.set_requires_gradient_sync(lambda last=last: last["now"])
        with opt:
            got = []
            for batch in data:
                for k, (x, y) in enumerate(batch):
                    last["now"] = k == len(batch) - 1
                    if form == "bool":
                        opt.set_requires_gradient_sync(last["now"])
                    F.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
                got.append(snapshot(m.parameters()))
            stats = opt.stats()
            assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == 0
            with pytest.raises(TypeError, match="requires_gradient_sync=1 is invalid: allowed True, False or a"):
                opt.set_requires_gradient_sync(1)
        assert_same(want, got)


@pytest.mark.parametrize("seed", [0, 1])
def test_undeclared_micro_batches_are_exact_and_learned(seed):
    """Two backward passes per step, undeclared: exact, no warning; after the first step with hooks the
    optimizer knows a step has two, and only the second backward's hooks copy (as if declared)."""
    model, data = mlp(), batches(8, micro=2)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, want_sums = run(model, zenflow, data, micro=2)
    got, stats, sums = run(model, zenflow, data, seed=seed, micro=2)
    _, declared, _ = run(model, zenflow, data, seed=seed, micro=2, declare=True)
    assert_same(want, got)
    assert_same_sums(want_sums, sums)
    matrices = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == matrices  # step 1's first copies
    assert stats["d2h_bytes"] == declared["d2h_bytes"] + matrices
    assert stats["d2h_bytes_in_backward"] == declared["d2h_bytes_in_backward"]


def _clip_in_place(t, model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the norms here are ~0.1-1: it always clips


@pytest.mark.parametrize("seed", [0, 1])
def test_gradients_changed_in_place_at_every_step_are_exact_and_then_cross_at_step(seed):
    """Clipping with ``clip_grad_norm_`` between backward and step(), at every step: each step's fingerprints
    differ from the hooks', so step() copies again; the synchronous link's bits, no warning. After three steps
    in a row of wasted copies, hooks stop copying (the run then moves what it moved before hand-over existed)."""
    model, data = mlp(), batches(8, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, want_sums = run(model, zenflow, data, before_step=_clip_in_place)
    got, stats, sums = run(model, zenflow, data, seed=seed, before_step=_clip_in_place)
    assert_same(want, got)
    assert_same_sums(want_sums, sums)
    assert stats["handover"] == "off" and "step 3: gradients changed between backward and step()" in \
        stats["handover_why"] and "in 3 consecutive steps (step 1: " in stats["handover_why"]
    matrices = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    assert stats["d2h_bytes_unused"] == 3 * matrices and stats["d2h_bytes_in_backward"] == 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("at", [3, 4])  # steps 3 and 4 accumulate into either buffer of the overlapped update
def test_a_second_backward_after_hand_over_is_exact_without_restart(seed, at):
    """The loop changes after hand-over ran for steps: a second, undeclared backward at one step. The first
    backward's copies never reached the sums: the second one's hooks copy again over them (the copy stream runs
    in order), and the interval's sums and counts are the synchronous link's, whichever accumulation buffer
    the step fills (the overlapped update reads the other one meanwhile)."""
    model, data = mlp(), batches(8, micro=2)
    zenflow = dict(ZENFLOW, overlap_step=True)
    micro = [2 if t == at else 1 for t in range(len(data))]

    def go(seed):
        m = copy.deepcopy(model)
        opt = make(m.parameters(), zenflow, seed)
        history, sums = [], []
        with opt:
            for t, batch in enumerate(data):
                for x, y in batch[: micro[t]]:
                    F.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
                history.append(snapshot(m.parameters()))
                sums.append(interval_sums(opt))
            stats = opt.stats()
        return history, sums, stats

    want, want_sums, _ = go(None)
    got, sums, stats = go(seed)
    assert_same(want, got)
    for a, b in zip(want_sums, sums, strict=True):
        assert_same_sums(a, b)
    assert stats["handover"] == "on"
    assert stats["d2h_bytes_unused"] == sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)


def _poison_first_layer(model, steps):
    """A NaN only in the first layer's weight gradient (the last one backward produces) at ``steps``."""
    state = {"t": -1}
    model[0].weight.register_hook(lambda g: g * float("nan") if state["t"] in steps else g)
    return state


@pytest.mark.parametrize("seed", [0, 1])
def test_an_inf_produced_late_in_backward_skips_the_step_exactly(seed):
    """A NaN only in the first layer's gradient, produced last in backward, after every other gradient crossed:
    the step is skipped, none of its gradients reached the sums (they are folded only at step()), so the sums,
    counts, weights and moments are the synchronous link's; no warning."""
    model, data = mlp(), batches(6, micro=1)
    zenflow = dict(ZENFLOW, select_interval=8, update_interval=8, overlap_step=True)

    def go(seed):
        m = copy.deepcopy(model)
        state = _poison_first_layer(m, {2})
        opt = make(m.parameters(), zenflow, seed)

        def tick(t, model, opt):
            state["t"] = t + 1  # the next step's backward

        with opt:
            state["t"] = 0
            history = train(m, opt, data, before_step=tick)
            return history, opt.stats(), interval_sums(opt), opt.state_dict()

    want, _, want_sums, want_state = go(None)
    got, stats, sums, state = go(seed)
    assert_same(want, got)
    assert_same_sums(want_sums, sums)
    assert stats["skipped_steps"] == 1 and stats["handover"] == "on"
    for i, st in want_state["state"].items():
        for key, value in st.items():
            other = state["state"][i][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (i, key)


def _repair_nan(t, model, opt):
    for p in model.parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_nan_repaired_before_step_is_exact(seed):
    """A NaN produced in backward in one gradient and repaired before ``step()`` (``nan_to_num_`` of that gradient
    only): its fingerprint differs from its hook's, so step() copies it again; every other gradient's copy from
    backward is used. The synchronous link's bits and sums, the hand-over on."""
    model, data = mlp(), batches(8, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)

    def go(seed):
        m = copy.deepcopy(model)
        state = _poison_first_layer(m, {2, 5})
        opt = make(m.parameters(), zenflow, seed)

        def repair(t, model, opt):
            _repair_nan(t, model, opt)
            state["t"] = t + 1

        with opt:
            state["t"] = 0
            return train(m, opt, data, before_step=repair), opt.stats(), interval_sums(opt)

    want, _, want_sums = go(None)
    got, stats, sums = go(seed)
    assert_same(want, got)
    assert_same_sums(want_sums, sums)
    assert stats["skipped_steps"] == 0 and stats["handover"] == "on"
    assert stats["d2h_bytes_unused"] == 2 * model[0].weight.numel() * 4  # the repaired gradient, twice


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("how", ["opt.zero_grad()", "model.zero_grad()"])
def test_a_skipped_batch_is_a_skip_not_accumulation(seed, how):
    """A backward followed by ``zero_grad()`` without ``step()`` (a gradient-norm guard), twice: the copies its
    hooks made are dropped, the next step's hooks copy at its one backward (not mistaken for a second
    micro-batch), no warning, the hand-over on; the synchronous link's bits and sums. With the module's
    ``zero_grad()`` (which the optimizer does not see) it is exact too: the next step looks like two
    micro-batches (its copy replaces the dropped one's) and the step after it copies at ``step()``."""
    model, data = mlp(), batches(10, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)

    def guard(t, model, opt):
        if t in (3, 6):  # skip this batch
            model.zero_grad() if how == "model.zero_grad()" else opt.zero_grad()
            return False
        return True

    want, _, want_sums = run(model, zenflow, data, before_step=guard)
    got, stats, sums = run(model, zenflow, data, seed=seed, before_step=guard)
    assert_same(want, got)
    assert_same_sums(want_sums, sums)
    matrices = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == 2 * matrices
    # steps 1..9 but the two skipped; with model.zero_grad(), the two steps after the steps after them at step()
    used = 7 if how == "opt.zero_grad()" else 5
    assert stats["d2h_bytes_in_backward"] == used * matrices


def _scaler_loop(model, opt, data, *, unscale=False, clip=None, routed_clip=None):
    """fp16 mixed precision with GradScaler's own calls: scale, backward, (unscale_, clip), step, update. A scale
    high enough to overflow at the first steps, growth every 2 steps: backoff, skipped steps and growth."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    history, scales, norms, by_hand = [], [], [], []
    for batch in data:
        x, y = batch[0]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        norm = opt.clip_grad_norm_(routed_clip) if routed_clip is not None else None
        # the unscaled gradient norm, in float64 from the scaled gradients (the reference for the returned one)
        by_hand.append(float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in model.parameters()
                                                                 if p.grad is not None])) / scaler.get_scale()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append(snapshot(model.parameters()))
        scales.append(scaler.get_scale())
        norms.append(None if norm is None else float(norm))
    return history, scales, norms, by_hand


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grad_scaler_unscales_inside_the_optimizer_and_keeps_the_hand_over(seed, dtype):
    """``torch.amp.GradScaler`` with its own calls on CPU, fp32 parameters under fp16 autocast and fp16 parameters
    (fp32 host master): the optimizer takes the scale (``_step_supports_amp_scaling``) and unscales in the fast
    path's AdamW and in the host's fold; the gradients are never rewritten, so they cross during backward (the
    hand-over on at the end). Overflow steps (the scale starts at 2^24) are skipped exactly, the scale backs off
    and grows. The synchronous link's bits; for fp32 gradients also the bits of unscaling in place
    (``scaler.unscale_(opt)``: a power-of-two scale multiplies exactly)."""
    model = mlp(dtype)
    data = batches(16, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)

    def go(seed, **kw):
        m = copy.deepcopy(model)
        opt = make(m.parameters(), zenflow, seed)
        with opt:
            history, scales, _, _ = _scaler_loop(m, opt, data, **kw)
            return history, scales, opt.stats()

    want, scales, want_stats = go(None)
    got, got_scales, stats = go(seed)
    assert_same(want, got)
    assert got_scales == scales and scales[0] < 2.0**24 and max(scales[1:]) > min(scales)  # backoff, then growth
    assert 0 < stats["skipped_steps"] == want_stats["skipped_steps"] < len(data) - 4
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0 and stats["d2h_bytes_unused"] > 0
    if dtype == torch.float32:  # the user's own unscale_ (in place, before step): exact too, and the same bits
        unscaled, unscaled_scales, unscaled_stats = go(seed, unscale=True)
        assert_same(want, unscaled)
        assert unscaled_scales == scales
        assert unscaled_stats["handover"] == "off"  # rewritten at every step: crossing at step()


@pytest.mark.parametrize("seed", [0, 1])
def test_grad_scaler_with_clipping_in_place_or_routed(seed):
    """The standard recipe for clipping under GradScaler (``scaler.unscale_(opt)`` then ``clip_grad_norm_``) is
    exact on the asynchronous link; ``opt.clip_grad_norm_`` instead clips inside the optimizer (no unscale_, no
    rewrite: the hand-over stays on) and returns the step's unscaled gradient norm, filled by ``step()``: the
    synchronous link's bits and norms."""
    model, data = mlp(), batches(12, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)

    def go(seed, **kw):
        m = copy.deepcopy(model)
        opt = make(m.parameters(), zenflow, seed)
        with opt:
            history, _, norms, by_hand = _scaler_loop(m, opt, data, **kw)
            return history, norms, by_hand, opt.stats()

    for kw in (dict(unscale=True, clip=0.05), dict(routed_clip=0.05)):
        want, want_norms, _, _ = go(None, **kw)
        got, norms, by_hand, stats = go(seed, **kw)
        assert_same(want, got)
        assert same_norms(norms, want_norms)
        if "routed_clip" in kw:  # (an overflow step's norm is inf or NaN)
            assert stats["handover"] == "on"
            finite = [(n, h) for n, h in zip(norms, by_hand, strict=True) if math.isfinite(n)]
            assert len(finite) == len(data) - stats["skipped_steps"] > 0
            # the norm of the unscaled gradients: each as computed by hand in float64 (float32 sums: 1e-5)
            assert all(n == pytest.approx(h, rel=1e-5) for n, h in finite), finite


def test_routed_clipping_is_max_grad_norm_for_the_step():
    """``opt.clip_grad_norm_(c)`` before a step clips that step as ``max_grad_norm=c`` would (the smaller of the two
    applies; inf only reports the norm), without touching ``.grad``: the bits of ``max_grad_norm=0.05``, on the
    asynchronous link, the hand-over on. It returns the step's gradient norm once ``step()`` ran, NaN before. Bad
    arguments are refused, naming them."""
    model, data = mlp(), batches(8, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, max_grad_norm=0.05)
    m = copy.deepcopy(model)
    opt = make(m.parameters(), zenflow, 0, max_grad_norm=1.0)
    history = []
    with opt:
        for batch in data:
            x, y = batch[0]
            F.mse_loss(m(x), y).backward()
            grads = [p.grad.clone() for p in m.parameters()]
            norm = opt.clip_grad_norm_(0.05)
            inf_norm = opt.clip_grad_norm_(float("inf"))  # reports only; 0.05 still applies
            assert math.isnan(norm) and all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters(), strict=True))
            opt.step()
            want_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            assert float(norm) == float(inf_norm) == pytest.approx(want_norm, rel=1e-6)
            opt.zero_grad()
            history.append(snapshot(m.parameters()))
        assert opt.stats()["handover"] == "on"
        for bad, match in ((0, "max_norm=0 is invalid"), (float("nan"), "max_norm=nan is invalid"),
                           (True, "max_norm=True is invalid")):
            with pytest.raises(ValueError, match=match):
                opt.clip_grad_norm_(bad)
        with pytest.raises(ValueError, match="norm_type=1 is invalid: allowed 2"):
            opt.clip_grad_norm_(1.0, norm_type=1)
    assert_same(want, history)


# -- random loops mixing everything ------------------------------------------------------------------------------


PATTERNS = ("declared", "undeclared", "nan_loss", "repair", "data_edit", "clip", "routed", "skip", "save", "reload")


def _plan(loop_seed: int, steps: int) -> tuple[dict, list[dict]]:
    """A loop drawn from ``loop_seed``: its settings (dtype, a GradScaler or not, the ZenFlow config) and, each step,
    1-3 micro-batches (declared or not), then maybe a NaN loss, a NaN in one gradient repaired, a ``.data`` edit,
    clipping in place or routed, a skipped batch, an evaluation and a save inside ``flushed()``, reloaded into a
    fresh optimizer, and whether ``zero_grad`` sets to None."""
    rng = random.Random(loop_seed)
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    setup = dict(dtype=dtype, scaler=dtype != torch.bfloat16 and rng.random() < 0.6,
                 zenflow=dict(ZENFLOW, overlap_step=rng.random() < 0.7, update_interval=rng.choice([1, 2, 3]),
                              select_interval=rng.choice([3, 6])))
    plan = []
    for _ in range(steps):
        micro = rng.choice([1, 1, 2, 3])
        step = dict(micro=micro, declared=micro > 1 and rng.random() < 0.5, nan_loss=rng.random() < 0.08,
                    repair=rng.random() < 0.12, data_edit=rng.random() < 0.12, clip=rng.random() < 0.15,
                    routed=rng.random() < 0.2, skip=rng.random() < 0.1, save=rng.random() < 0.15,
                    set_to_none=rng.random() < 0.7)
        step["undeclared"] = micro > 1 and not step["declared"]
        step["reload"] = step["save"] and rng.random() < 0.6
        plan.append(step)
    return setup, plan


def _random_loop(loop_seed: int, link_seed, steps: int = 14):
    """Run ``_plan(loop_seed)`` on the synchronous link (``link_seed`` None) or under chaos: the weights after every
    step, the norms ``clip_grad_norm_`` returned, and the last optimizer's stats. The same calls either way."""
    setup, plan = _plan(loop_seed, steps)
    dtype, zenflow = setup["dtype"], setup["zenflow"]
    model = mlp(dtype, seed=loop_seed)
    data = batches(steps, micro=3, seed=loop_seed, dtype=dtype)
    poison = {"on": False}
    model[2].weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    opt = make(model.parameters(), zenflow, link_seed)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3) if setup["scaler"] else None
    autocast = scaler is not None and dtype == torch.float32
    history, norms, crossed = [], [], 0
    for t, step in enumerate(plan):
        micro = step["micro"]
        for k, (x, y) in enumerate(data[t][:micro]):
            poison["on"] = step["repair"] and k == micro - 1
            with torch.autocast("cpu", dtype=torch.float16) if autocast else contextlib.nullcontext():
                loss = F.mse_loss(model(x).float(), y.float())
            if step["nan_loss"] and k == micro - 1:
                loss = loss * float("nan")
            with opt.no_sync() if step["declared"] and k < micro - 1 else contextlib.nullcontext():
                (scaler.scale(loss) if scaler is not None else loss).backward()
        poison["on"] = False
        if step["repair"]:
            _repair_nan(t, model, opt)
        if step["data_edit"]:
            model[4].weight.grad.data.mul_(0.5)
        if step["skip"]:  # a guard drops this batch (no unscale_ happened: the scaler's state allows it)
            opt.zero_grad()
            history.append(snapshot(model.parameters()))
            continue
        if step["clip"]:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        norm = opt.clip_grad_norm_(0.2) if step["routed"] else None
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=step["set_to_none"])
        norms.append(None if norm is None else float(norm))
        if step["save"]:
            with opt.flushed(), torch.no_grad():
                model(data[t][0][0])  # an evaluation reads the flushed weights
                saved = (copy.deepcopy(model.state_dict()), opt.state_dict(),
                         None if scaler is None else scaler.state_dict())
            if step["reload"]:
                crossed += opt.stats()["d2h_bytes_in_backward"]
                opt.close()
                opt = make(model.parameters(), zenflow, link_seed)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                if scaler is not None:
                    scaler.load_state_dict(saved[2])
        history.append(snapshot(model.parameters()))
    crossed += opt.stats()["d2h_bytes_in_backward"]
    opt.close()
    return history, norms, crossed


def test_the_random_loops_cover_every_pattern():
    """The ten loops below draw every pattern, each in several steps, with and without a GradScaler, in fp32,
    bf16 and fp16, with and without overlap (a check of the draws, so that the loops cannot quietly lose one)."""
    setups, steps = zip(*(_plan(seed, 14) for seed in range(10)), strict=True)
    counts = {name: sum(step[name] for plan in steps for step in plan) for name in PATTERNS}
    assert min(counts.values()) >= 3, counts
    assert {s["scaler"] for s in setups} == {True, False} and {s["zenflow"]["overlap_step"] for s in setups} == {
        True, False}
    assert {s["dtype"] for s in setups} == {torch.float32, torch.bfloat16, torch.float16}


@pytest.mark.parametrize("loop_seed", range(10))
def test_random_loops_mixing_every_pattern_are_bit_identical(loop_seed):
    """Ten loops drawn at random from everything above, on the asynchronous link with a model 48x a fold job:
    bit-identical to the synchronous link at every step, norms included, no warning (ZenFlowWarning is an error
    in this suite); gradients crossed during backward."""
    want, want_norms, _ = _random_loop(loop_seed, None)
    got, norms, crossed = _random_loop(loop_seed, loop_seed % 3)
    assert_same(want, got)
    assert same_norms(norms, want_norms)
    assert crossed > 0


# -- saving between backward and step ----------------------------------------------------------------------------


def test_a_save_between_backward_and_step_resumes_exactly():
    """Nothing of a step reaches the host sums before ``step()``, so a checkpoint taken after the hooks copied the
    step's gradients (between backward and ``step()``) holds whole steps only: the stepped run and a fresh
    optimizer loaded from it (stepping the same gradients) continue bit-identically."""
    model, data = mlp(), batches(8, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data)
    m = copy.deepcopy(model)
    opt = make(m.parameters(), zenflow, 0)
    got = []
    for t, batch in enumerate(data):
        x, y = batch[0]
        F.mse_loss(m(x), y).backward()
        if t == 4:
            state = opt.state_dict()
            grads = [p.grad.clone() for p in m.parameters()]
            opt.close()
            opt = make(m.parameters(), zenflow, 0)
            opt.load_state_dict(state)
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters(), strict=True))
        opt.step()
        opt.zero_grad()
        got.append(snapshot(m.parameters()))
    assert opt.stats()["handover"] == "on"
    opt.close()
    assert_same(want, got)


# -- the modeled device ------------------------------------------------------------------------------------------


def test_modeled_copies_take_bytes_over_bandwidth():
    """Each copy job of the modeled device takes at least bytes / bandwidth (it sleeps the rest of the time a
    memcpy did not take); the timeline records every D2H and H2D job with its bytes, the folds, and the training
    thread's waits. (A lower bound: sleeping never returns early; nothing here times how fast anything is.)"""
    model, data = mlp(), batches(6, micro=1)
    timeline = Timeline()
    d2h, h2d = 2e6, 4e6  # bytes per second: ~2 ms per 4 KiB gradient
    with chaos(seed=0, max_delay=0, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, timeline=timeline):
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=dict(ZENFLOW, overlap_step=True))
    with opt:
        train(model, opt, data)
        stats = opt.stats()
    copies = [s for s in timeline.spans if s[0] in ("d2h", "h2d")]
    assert {s[0] for s in copies} == {"d2h", "h2d"}
    for lane, _, start, end, nbytes in copies:
        assert end - start >= nbytes / (d2h if lane == "d2h" else h2d) - 1e-6
    assert sum(s[4] for s in copies if s[0] == "d2h") == stats["d2h_bytes"]
    assert sum(s[4] for s in copies if s[0] == "h2d") == stats["h2d_bytes"]
    assert timeline.busy("d2h", 0.0, math.inf) >= stats["d2h_bytes"] / d2h - 1e-6
    folds = [s for s in timeline.spans if s[0] == "accumulate"]
    assert folds and {s[1] for s in folds} == {"fold"} and any(s[0] == "update" for s in timeline.spans)
    # every step's gradient bytes were folded once (the landing area is in the gradients' dtype: fp32 here)
    assert sum(s[4] for s in folds) == stats["d2h_bytes"] - stats["d2h_bytes_unused"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(d2h_bytes_per_s=0), "d2h_bytes_per_s=0 is invalid"),
    (dict(h2d_bytes_per_s=float("inf")), "h2d_bytes_per_s=inf is invalid"),
    (dict(d2h_bytes_per_s=True), "d2h_bytes_per_s=True is invalid"),
    (dict(timeline=[]), "timeline=\\[\\] is invalid"),
])
def test_chaos_refuses_bad_device_models(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match), chaos(**kwargs):
        pass


def test_a_model_many_times_a_fold_job_moves_its_gradients_during_backward():
    """The modeled device (issue 23): a model 12x a fold job of 1 MiB, copies at a bandwidth where a step's
    transfer takes 60% of backward (bench.overlap.measure_size). With hand-over from hooks most gradient bytes
    cross during backward; copying at step() (orderings.early_handover off) none do. How much of the transfer
    that hides is a speed, measured by ``python -m bench.overlap`` (bench/results/overlap_cpu.json: the training
    thread's added waits with hand-over on and off), not asserted here: on a loaded machine the copy thread's
    modeled sleeps and the training thread's waits move with the scheduler."""
    from bench.overlap import measure_size

    result = measure_size(dict(size=12, d=256, fold_bytes=1 << 20, batch=32, steps=2, warmup=1,
                               bandwidths=["slow"], slow_share=0.6))
    rows = {r["variant"]: r for r in result["rows"]}
    on, off = rows["handover"], rows["at_step"]
    report = (f"transfer {on['transfer_s'] * 1e3:.1f} ms, backward {on['backward_s'] * 1e3:.1f} ms; waits added "
              f"{on['added_waits_s'] * 1e3:.1f} / {off['added_waits_s'] * 1e3:.1f} ms, wall added "
              f"{on['added_stall_s'] * 1e3:.1f} / {off['added_stall_s'] * 1e3:.1f} ms (hand-over on / off)")
    assert result["times_fold"] >= 12 and on["handover"] == "on" and off["handover"] == "off", report
    assert on["d2h_bytes_in_backward"] > 0.5 * on["d2h_bytes"] and off["d2h_bytes_in_backward"] == 0, report
    assert on["transfer_s"] > 0 and off["transfer_s"] > 0, report  # the bandwidth model was on


@pytest.mark.parametrize("seed", [0, 1])
def test_user_patterns_around_hand_over_keep_the_synchronous_bits(seed):
    """What users write around a hand-over, under chaos: two param groups with their own settings, a layer
    without a gradient every third step (frozen, then thawed), ``zero_grad(set_to_none=False)``, an evaluation
    between steps, and a save + load into a fresh optimizer mid-interval: the synchronous link's bits at every
    step."""
    model = mlp()
    zenflow = dict(ZENFLOW, overlap_step=True)
    data = batches(12, micro=1)

    def run_patterns(seed):
        m = copy.deepcopy(model)
        layers = [mod for mod in m if isinstance(mod, torch.nn.Linear)]
        groups = [dict(params=[p for layer in layers[:3] for p in layer.parameters()]),
                  dict(params=[p for layer in layers[3:] for p in layer.parameters()], lr=5e-3, topk_ratio=0.5)]
        opt, history = make(groups, zenflow, seed), []
        for t, batch in enumerate(data):
            x, y = batch[0]
            layers[2].weight.requires_grad_(t % 3 != 1)  # no gradient for it this step
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            with torch.no_grad():  # an evaluation between steps reads the live weights
                F.mse_loss(m(x), y)
            if t == 6:  # mid-interval: save, and continue in a fresh optimizer
                state = opt.state_dict()
                opt.close()
                opt = make(groups, zenflow, seed)
                opt.load_state_dict(state)
            history.append(snapshot(m.parameters()))
        stats = opt.stats()
        opt.close()
        return history, stats

    want, _ = run_patterns(None)
    got, stats = run_patterns(seed)
    assert_same(want, got)
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0
