"""Gradients crossing during backward (docs/design.md section 9), on a staging ring many times smaller than
the model: full slots go to the host from backward's hooks once the step's gradients are known final
there (declared, and seen so in a whole step), exactly as the synchronous link computes; undeclared
micro-batches and in-place changes stay exact by crossing at step(); what a hand-over cannot take back
(a pattern that changes later, an inf/NaN produced after finite gradients crossed) restarts those
parameters' host interval, loudly. Also the modeled device itself (``testing.chaos`` bandwidths)."""

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_optim import HYPER, snapshot

from zenflow_kernels import ZenFlowAdamW, ZenFlowWarning
from zenflow_kernels.link import RingLink
from zenflow_kernels.ops import use_backend
from zenflow_kernels.testing import Timeline, chaos

WIDTH, LAYERS = 32, 6  # 4 KiB of fp32 gradient per matrix: 6 matrices, ~12x a ring of 4 x 512 B... see ring()
ZENFLOW = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)


@pytest.fixture(autouse=True)
def numba_backend():
    with use_backend("numba"):
        yield


@pytest.fixture
def ring(monkeypatch):
    """A ring of 4 x 512 bytes: the model's matrices (6 x 4 KiB) are 12x its size."""
    monkeypatch.setattr(RingLink, "STAGING_SLOTS", 4)
    monkeypatch.setattr(RingLink, "STAGING_SLOT_BYTES", 512)


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


def train(model, opt, data, *, micro=1, declare=False, nan_steps=(), poison=None, clip=False):
    """One step per entry of ``data``: ``micro`` backward passes (the first ``micro - 1`` inside
    ``opt.no_sync()`` when ``declare``), a NaN loss at ``nan_steps``, ``poison(t)`` a context for step t."""
    history = []
    for t, batch in enumerate(data):
        with poison(t) if poison is not None else contextlib.nullcontext():
            for k, (x, y) in enumerate(batch[:micro]):
                loss = F.mse_loss(model(x).float(), y.float())
                if t in nan_steps:
                    loss = loss * float("nan")
                with opt.no_sync() if declare and k < micro - 1 else contextlib.nullcontext():
                    loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        history.append(snapshot(model.parameters()))
    return history


def run(model, zenflow, data, *, seed=None, max_delay=0.002, **kw):
    """``train`` on the synchronous link (seed None) or under chaos; the history and the stats."""
    model = copy.deepcopy(model)
    if seed is None:
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow, max_grad_norm=kw.pop("max_grad_norm", None))
    else:
        with chaos(seed=seed, max_delay=max_delay):
            opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow,
                               max_grad_norm=kw.pop("max_grad_norm", None))
    with opt:
        history = train(model, opt, data, **kw)
        stats = opt.stats()
    return history, stats, opt


def assert_same(a, b):
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        for i, (p, q) in enumerate(zip(x, y, strict=True)):
            assert torch.equal(p, q), f"step {t} param {i}: max diff {(p.float() - q.float()).abs().max()}"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("overlap, max_grad_norm, dtype", [(True, None, torch.float32), (False, 0.5, torch.float32),
                                                          (True, 0.5, torch.bfloat16)])
def test_hooks_hand_slots_over_during_backward_with_the_synchronous_bits(ring, seed, overlap, max_grad_norm, dtype):
    """One backward per step, a model 12x the ring: from the second step on, full slots go to the host from
    the hooks (most of each step's gradient bytes cross during backward); warm-up, re-selections, host
    updates in both modes, clipping and a step whose loss is NaN (skipped: the first slot handed over
    already holds NaN, so nothing was added) give the synchronous link's bits."""
    model, data = mlp(dtype), batches(14, micro=1, dtype=dtype)
    zenflow = dict(ZENFLOW, overlap_step=overlap)
    want, _, _ = run(model, zenflow, data, nan_steps={6}, max_grad_norm=max_grad_norm)
    got, stats, _ = run(model, zenflow, data, seed=seed, nan_steps={6}, max_grad_norm=max_grad_norm)
    assert_same(want, got)
    assert stats["handover"] == "on" and stats["skipped_steps"] == 1 and stats["interval_restarts"] == 0
    # warm-up: every parameter crosses; after it the matrices: >= half of the bytes in backward
    assert stats["d2h_bytes_in_backward"] >= 0.5 * stats["d2h_bytes"]


@pytest.mark.parametrize("seed", [0, 1])
def test_declared_micro_batches_hand_over_in_the_last_backward(ring, seed):
    """``opt.no_sync()`` around all but the last micro-batch's backward: hooks copy nothing while it is in
    force, and hand over during the last backward; the synchronous link's bits, no warning."""
    model, data = mlp(), batches(10, micro=3)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, micro=3)
    got, stats, _ = run(model, zenflow, data, seed=seed, micro=3, declare=True)
    assert_same(want, got)
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] >= 0.5 * stats["d2h_bytes"]
    # nothing copied for the two declared micro-batches: the bytes of one gradient per step cross
    assert stats["d2h_bytes"] < 1.3 * sum(p.numel() * 4 for p in model.parameters()) * len(data)


def test_set_requires_gradient_sync_is_the_same_declaration(ring):
    """The setter form (FSDP2's idiom) gives what ``no_sync()`` gives; bad values are refused, naming them."""
    model, data = mlp(), batches(6, micro=2)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, micro=2)
    m = copy.deepcopy(model)
    with chaos(seed=0):
        opt = ZenFlowAdamW(m.parameters(), **HYPER, zenflow=zenflow)
    with opt:
        got = []
        for batch in data:
            for k, (x, y) in enumerate(batch):
                opt.set_requires_gradient_sync(k == len(batch) - 1)
                F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            got.append(snapshot(m.parameters()))
        assert opt.stats()["handover"] == "on"
        with pytest.raises(TypeError, match="requires_gradient_sync=1 is invalid: allowed True or False"):
            opt.set_requires_gradient_sync(1)
    assert_same(want, got)


@pytest.mark.parametrize("seed", [0, 1])
def test_undeclared_micro_batches_warn_once_and_stay_exact(ring, seed):
    """Two backward passes per step from the first step, undeclared: the first step shows it (a hook fires
    twice), one warning names the way to declare it, and gradients cross at step(): exact."""
    model, data = mlp(), batches(8, micro=2)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, micro=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, stats, _ = run(model, zenflow, data, seed=seed, micro=2)
    assert_same(want, got)
    messages = [str(w.message) for w in caught if issubclass(w.category, ZenFlowWarning)]
    assert len(messages) == 1 and "fired twice" in messages[0] and "opt.no_sync()" in messages[0]
    assert stats["handover"] == "off" and stats["d2h_bytes_in_backward"] == 0


def test_gradients_changed_in_place_after_backward_cross_at_step_exactly(ring):
    """Clipping with ``clip_grad_norm_`` between backward and step() (as the Hugging Face Trainer does):
    gradients are final only at step(); seen in the first step, hand-over stays off (no warning: nothing is
    wrong, only later), and the synchronous link's bits."""
    model, data = mlp(), batches(8, micro=1)
    zenflow = dict(ZENFLOW, overlap_step=True)
    want, _, _ = run(model, zenflow, data, clip=True)
    got, stats, _ = run(model, zenflow, data, seed=0, clip=True)
    assert_same(want, got)
    assert stats["handover"] == "off" and "changed between backward and step()" in stats["handover_why"]


def _interval_sums(opt, i):
    opt._link.synchronize()
    return opt._host.view(opt._host.acc[opt._acc_buf], i).reshape(-1).clone()


def test_a_second_backward_after_hand_over_restarts_the_interval_loudly(ring):
    """The loop changes after hand-over was learned: a second, undeclared backward at step 3. What the first
    backward's hooks handed over cannot be taken out of the fp32 sums, so those parameters' interval restarts
    at this step: their sum is exactly this step's gradient and their count 1; the others' sums are the
    synchronous link's; one warning; hand-over is off afterwards."""
    model, data = mlp(), batches(5, micro=2)
    zenflow = dict(ZENFLOW, select_interval=8, update_interval=8, overlap_step=True)
    m = copy.deepcopy(model)
    with chaos(seed=0):
        opt = ZenFlowAdamW(m.parameters(), **HYPER, zenflow=zenflow)
    ref_model = copy.deepcopy(model)
    ref = ZenFlowAdamW(ref_model.parameters(), **HYPER, zenflow=zenflow)
    with opt, ref:
        for t, batch in enumerate(data[:4]):
            micro = 2 if t == 3 else 1
            for mm in (m, ref_model):
                for x, y in batch[:micro]:
                    F.mse_loss(mm(x), y).backward()
            grads = [p.grad.clone() for p in m.parameters()]
            if t == 3:
                with pytest.warns(ZenFlowWarning, match="changed after backward's hooks had handed them"):
                    opt.step()
            else:
                opt.step()
            ref.step()
            for o in (opt, ref):
                o.zero_grad()
        stats = opt.stats()
        assert stats["handover"] == "off" and stats["interval_restarts"] > 0
        matrices = [i for i, p in enumerate(m.parameters()) if p.dim() == 2]
        restarted = [i for i in matrices if opt._counts[opt._acc_buf][i] == 1]
        assert restarted and len(restarted) == stats["interval_restarts"]
        for i in matrices:
            if i in restarted:
                assert torch.equal(_interval_sums(opt, i), grads[i].reshape(-1))
            else:
                assert opt._counts[opt._acc_buf][i] == ref._counts[ref._acc_buf][i] == 3
                assert torch.equal(_interval_sums(opt, i), _interval_sums(ref, i))
        assert all(torch.isfinite(p).all() for p in m.parameters())


def test_an_inf_produced_late_in_backward_restarts_what_had_crossed(ring):
    """A NaN only in the first layer's gradient (the last one backward produces), hand-over on: the step is
    skipped; the slots the worker added before it cannot be taken back, so those parameters' interval
    restarts (sums zero, counts 0), the parameters whose pieces met the NaN or came later keep the synchronous
    link's sums; weights, moments and the fast path as the synchronous link's; one warning."""
    model, data = mlp(), batches(4, micro=1)
    zenflow = dict(ZENFLOW, select_interval=8, update_interval=8, overlap_step=True)
    poisoned = {"on": False}

    def poison(t):
        poisoned["on"] = t == 2
        return contextlib.nullcontext()

    def make(seed):
        mm = copy.deepcopy(model)
        w = mm[0].weight
        w.register_hook(lambda g: g * float("nan") if poisoned["on"] else g)
        if seed is None:
            return mm, ZenFlowAdamW(mm.parameters(), **HYPER, zenflow=zenflow)
        with chaos(seed=seed):
            return mm, ZenFlowAdamW(mm.parameters(), **HYPER, zenflow=zenflow)

    (m, opt), (rm, ref) = make(0), make(None)
    with opt, ref, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(m, opt, data, poison=poison)
        want = train(rm, ref, data, poison=poison)
        messages = [str(w.message) for w in caught if issubclass(w.category, ZenFlowWarning)]
        stats = opt.stats()
        assert opt.skipped_steps == ref.skipped_steps == 1
        assert len(messages) == 1 and "inf/NaN" in messages[0]
        assert stats["interval_restarts"] > 0 and stats["handover"] == "on"
        # the skipped step moved nothing: the last step's fast path and host state agree where nothing restarted
        matrices = [i for i, p in enumerate(m.parameters()) if p.dim() == 2]
        restarted = [i for i in matrices if opt._counts[opt._acc_buf][i] != ref._counts[ref._acc_buf][i]]
        assert 0 < len(restarted) < len(matrices) and 0 not in restarted  # param 0 held the NaN
        for i in matrices:
            if i in restarted:  # restarted after step 2: one step (3) counted since
                assert opt._counts[opt._acc_buf][i] == 1
            else:
                assert torch.equal(_interval_sums(opt, i), _interval_sums(ref, i))
    assert_same(want, got)  # no host update before step 8: the weights are the fast path's and warm-up's


def test_modeled_copies_take_bytes_over_bandwidth():
    """Each copy job of the modeled device takes at least bytes / bandwidth (it sleeps the rest of the time a
    memcpy did not take); the timeline records every D2H and H2D job with its bytes, and the training
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
    assert any(s[0] == "accumulate" for s in timeline.spans) and any(s[0] == "update" for s in timeline.spans)


@pytest.mark.parametrize("kwargs, match", [
    (dict(d2h_bytes_per_s=0), "d2h_bytes_per_s=0 is invalid"),
    (dict(h2d_bytes_per_s=float("inf")), "h2d_bytes_per_s=inf is invalid"),
    (dict(d2h_bytes_per_s=True), "d2h_bytes_per_s=True is invalid"),
    (dict(timeline=[]), "timeline=\\[\\] is invalid"),
])
def test_chaos_refuses_bad_device_models(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match), chaos(**kwargs):
        pass



def test_a_model_many_times_the_ring_hides_its_transfer_behind_backward():
    """The modeled device (issue 23): a model 12x the staging ring (4 x 1 MiB), copies at a bandwidth where a
    step's transfer takes 60% of backward. What the transfer adds to the training thread, per step: with
    hand-over from hooks <= 25% of the transfer time; copying what the ring cannot hold at step()
    (EARLY_HANDOVER off, the link before) >= 50% of it, which shows the measurement can fail. Measured as
    the training thread's waits on the link (in hooks and in step()) against the same variant's step without
    the bandwidth model taken just before it (bench.overlap.measure_size): the modeled copies are sleeps on
    the copy thread, so waiting for them is the only way they can delay training, and the waits are the
    link's own clock, not a wall-clock difference that the machine's noise moves (bench.overlap reports
    that one, and its figures are in the README)."""
    from bench.overlap import measure_size

    result = measure_size(dict(size=12, d=512, slot_bytes=1 << 20, batch=128, steps=5, warmup=1,
                               bandwidths=["slow"], slow_share=0.6))
    rows = {r["variant"]: r for r in result["rows"]}
    on, off = rows["handover"], rows["at_step"]
    report = (f"transfer {on['transfer_s'] * 1e3:.1f} ms, backward {on['backward_s'] * 1e3:.1f} ms; waits added "
              f"{on['added_waits_s'] * 1e3:.1f} / {off['added_waits_s'] * 1e3:.1f} ms, wall added "
              f"{on['added_stall_s'] * 1e3:.1f} / {off['added_stall_s'] * 1e3:.1f} ms (hand-over on / off)")
    assert result["times_ring"] >= 12 and on["handover"] == "on" and off["handover"] == "off", report
    assert on["d2h_bytes_in_backward"] > 0.5 * on["d2h_bytes"] and off["d2h_bytes_in_backward"] == 0, report
    assert on["added_waits_s"] <= 0.25 * on["transfer_s"], report
    assert off["added_waits_s"] >= 0.5 * off["transfer_s"], report


@pytest.mark.parametrize("seed", [0, 1])
def test_user_patterns_around_hand_over_keep_the_synchronous_bits(ring, seed):
    """What users write around a hand-over, on a ring 12x smaller than the model, under chaos: two param
    groups with their own settings, a layer without a gradient every third step (frozen, then thawed),
    ``zero_grad(set_to_none=False)``, an evaluation between steps, and a save + load into a fresh optimizer
    mid-interval (whose hand-over starts learning again): the synchronous link's bits at every step."""
    model = mlp()
    zenflow = dict(ZENFLOW, overlap_step=True)
    data = batches(12, micro=1)

    def run_patterns(seed):
        m = copy.deepcopy(model)
        layers = [mod for mod in m if isinstance(mod, torch.nn.Linear)]
        groups = [dict(params=[p for layer in layers[:3] for p in layer.parameters()]),
                  dict(params=[p for layer in layers[3:] for p in layer.parameters()], lr=5e-3, topk_ratio=0.5)]

        def make():
            if seed is None:
                return ZenFlowAdamW(groups, **HYPER, zenflow=zenflow)
            with chaos(seed=seed):
                return ZenFlowAdamW(groups, **HYPER, zenflow=zenflow)

        opt, history = make(), []
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
                opt = make()
                opt.load_state_dict(state)
            history.append(snapshot(m.parameters()))
        stats = opt.stats()
        opt.close()
        return history, stats

    want, _ = run_patterns(None)
    got, stats = run_patterns(seed)
    assert_same(want, got)
    assert stats["handover"] == "on" and stats["interval_restarts"] == 0 and stats["d2h_bytes_in_backward"] > 0


def test_state_dict_between_backward_and_step_after_a_hand_over_is_refused(ring):
    """Once hooks added part of a step's gradients to the host sums, a checkpoint before step() would hold half
    a step: state_dict() says so instead; after step() it works, and nothing was changed by the refusal."""
    model, data = mlp(), batches(4, micro=1)
    with chaos(seed=0):
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=dict(ZENFLOW, overlap_step=True))
    with opt:
        for x, y in (b[0] for b in data[:3]):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert opt.stats()["handover"] == "on"
        x, y = data[3][0]
        F.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=r"state_dict\(\) between backward and step\(\)"):
            opt.state_dict()
        opt.step()
        assert opt.state_dict()["zenflow"]["t"] == 4
