"""Ground no other test covered (issue 54 item 6), each against an independent oracle: ``ReferenceZenFlow`` for the
algorithm, a checkpoint's saved expectation, a hand count.

* DeepSpeed's choices (``semantics="deepspeed"`` and each choice alone) where the state lives elsewhere: the fast
  path's state in host memory (``offload``), the interval's sums on the device (``device_accumulation``), the host
  state on disk (``offload_device="nvme"``): the reference's weights at every step.
* Freezing and thawing (thaw A, freeze A, thaw B, thaw A again; overlap on and off): each thaw lays the host state out
  again; what every parameter held before must be carried over, whether it steps now or not.
* Checkpoints of every committed format: format 1 (tests/fixtures/checkpoints, written before ``host_params`` existed,
  so holding every parameter's host state) loaded with a parameter frozen at the time of the load, continued to the
  saved weights bit for bit; format 2 saved with a frozen parameter (no host state for it), loaded, the parameter
  thawed, against the reference.
* The planner with vector parameters: the write-back carries the matrices' columns off the fast path only.
* The gradient's concentration with a callable ``importance``: the energies are the squared column norms of the
  gradient (the definition), not the scorer's output.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from support import HYPER, grad_sequence, make_params, snapshot
from tolerance import assert_within_stated_bound

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.config import CHOICES
from zenflow_kernels.planner import HostProbe, predict
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)

LR = HYPER["lr"]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"


def assert_close_history(got, want, what):
    """Ours (numba kernels) against the reference (plain torch): docs/design.md's numeric guarantee
    (tests/tolerance.py)."""
    assert len(got) == len(want), what
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_within_stated_bound(x, y, lr=LR, steps=t + 1, what=f"{what} step {t} param {i}")


# -- DeepSpeed's choices where the state lives elsewhere -----------------------------------------------------------

SWITCHES = {name: {name: theirs} for name, (_, theirs, _) in CHOICES.items()} | {"semantics": dict(
    semantics="deepspeed")}
STORAGE = ["offload", "device_accumulation", "nvme"]
DS_STEPS = 12
DS_ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)


def ds_zen(switch, storage, overlap, tmp_path):
    zen = dict(DS_ZEN, overlap_step=overlap, **SWITCHES[switch])
    if storage == "nvme":
        zen.update(offload_device="nvme", nvme_path=str(tmp_path))
    else:
        zen[storage] = True
    return zen


_DS_WANT: dict = {}


def stepped_history(opt, params) -> list:
    """``opt`` (ours or the reference) stepped through the DeepSpeed cases' gradients: the weights after each step,
    then after ``flush()``."""
    history = []
    for step in grad_sequence(DS_STEPS):
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()
        history.append(snapshot(params))
    opt.flush()
    history.append(snapshot(params))
    return history


def ds_reference(switch, overlap):
    """The reference's weights (where the state lives is no part of the algorithm: one run for every storage)."""
    key = (switch, overlap)
    if key not in _DS_WANT:
        params = make_params()
        ref = ReferenceZenFlow(params, **HYPER, zenflow=dict(DS_ZEN, overlap_step=overlap, **SWITCHES[switch]),
                               max_grad_norm=2.0)
        _DS_WANT[key] = stepped_history(ref, params), (ref.t, ref.host_updates, ref.selections)
    return _DS_WANT[key]


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_deepspeed_choices_with_offloaded_state_match_the_reference(switch, storage, tmp_path):
    """Each of DeepSpeed's choices alone, and ``semantics="deepspeed"``, with the fast path's state in host memory, the
    sums on the device, or the host state on disk (overlap on for half the choices, off for the others), on the
    asynchronous link (the GPU's protocol; only a link that moves state offloads it): the reference's weights at every
    step and after ``flush()``, and its counters."""
    overlap = list(SWITCHES).index(switch) % 2 == 0
    want, counters = ds_reference(switch, overlap)
    params = make_params()
    with chaos(seed=3, max_delay=0.001):
        opt = ZenFlowAdamW(params, **HYPER, zenflow=ds_zen(switch, storage, overlap, tmp_path), max_grad_norm=2.0)
    with opt:
        got = stepped_history(opt, params)
        assert (opt.t, opt.host_updates, opt.selections) == counters
        assert opt.fast_path.offload == (storage == "offload")
    assert_close_history(got, want, f"{switch} with {storage}")


# -- freezing and thawing -----------------------------------------------------------------------------------------

A, B = 0, 2  # two matrices of support.SHAPES (24 x 16 and 12 x 24), frozen at the start
THAW_STEPS = 16


def frozen_at(t: int) -> set[int]:
    """Thaw A (step 3), freeze A (6), thaw B (9), thaw A again (12)."""
    frozen = {A, B}
    if 3 <= t < 6 or t >= 12:
        frozen.discard(A)
    if t >= 9:
        frozen.discard(B)
    return frozen


def thaw_run(opt, params, grads, start=0, stop=None):
    history = []
    for t in range(start, len(grads) if stop is None else stop):
        frozen = frozen_at(t)
        for i, (p, g) in enumerate(zip(params, grads[t], strict=True)):
            p.requires_grad_(i not in frozen)
            p.grad = None if i in frozen else g.clone()
        opt.step()
        history.append(snapshot(params))
    return history


THAW_ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)


def reference_thaw_history(overlap, grads):
    params = make_params()
    for i in (A, B):
        params[i].requires_grad_(False)
    ref = ReferenceZenFlow(params, **HYPER, zenflow=dict(THAW_ZEN, overlap_step=overlap))
    history = thaw_run(ref, params, grads)
    ref.flush()
    return history + [snapshot(params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_thaw_freeze_thaw_sequences_match_the_reference(overlap):
    """A and B frozen at the first step (no host state); A thawed, frozen again, then B thawed while A is frozen (the
    host state is laid out again without A stepping: A's must be carried), then A thawed again: the reference's
    weights at every step; without overlap a frozen parameter does not move (with it, the host update of the interval
    it last stepped in lands one interval later)."""
    grads = grad_sequence(THAW_STEPS)
    want = reference_thaw_history(overlap, grads)
    params = make_params()
    for i in (A, B):
        params[i].requires_grad_(False)
    with ZenFlowAdamW(params, **HYPER, zenflow=dict(THAW_ZEN, overlap_step=overlap)) as opt:
        got = thaw_run(opt, params, grads)
        opt.flush()
        got.append(snapshot(params))
        assert opt.host_bytes()["per_parameter"] > 0
    assert_close_history(got, want, "thaw A, freeze A, thaw B, thaw A")
    for t in range(1, THAW_STEPS if not overlap else 0):
        for i in frozen_at(t) & frozen_at(t - 1):
            assert torch.equal(got[t][i], got[t - 1][i]), (t, i)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_checkpoint_with_a_frozen_parameter_resumes_as_the_reference(overlap):
    """Format 2: saved at step 7 while A and B are frozen (A has host state from its first thaw, B none), loaded into
    a new optimizer with both frozen, then B and A thawed: the reference's uninterrupted weights."""
    grads = grad_sequence(THAW_STEPS)
    want = reference_thaw_history(overlap, grads)
    zen = dict(THAW_ZEN, overlap_step=overlap)
    params = make_params()
    for i in (A, B):
        params[i].requires_grad_(False)
    with ZenFlowAdamW(params, **HYPER, zenflow=zen) as opt:
        thaw_run(opt, params, grads, stop=7)
        saved, weights = copy.deepcopy(opt.state_dict()), snapshot(params)
    assert saved["zenflow"]["format"] == 2 and A in saved["zenflow"]["host_params"]
    assert B not in saved["zenflow"]["host_params"]
    params = make_params()
    with torch.no_grad():
        for i, (p, w) in enumerate(zip(params, weights, strict=True)):
            p.copy_(w)
            p.requires_grad_(i not in frozen_at(6))
    with ZenFlowAdamW(params, **HYPER, zenflow=zen) as opt:
        opt.load_state_dict(saved)
        got = thaw_run(opt, params, grads, start=7)
        opt.flush()
        got.append(snapshot(params))
    assert_close_history(got, want[7:], "resumed at step 7")


# -- format 1 checkpoints (written before host_params existed) ----------------------------------------------------

OLD = sorted(p for p in FIXTURES.glob("*.pt") if not p.name.startswith("zero"))


@pytest.mark.parametrize("frozen_for", [0, 2], ids=["frozen-at-load", "frozen-two-steps"])
@pytest.mark.parametrize("path", OLD, ids=[p.stem for p in OLD])
def test_an_old_checkpoint_keeps_the_host_state_of_a_parameter_frozen_at_load(path, frozen_for, tmp_path):
    """A format-1 dict holds every parameter's host state. Loaded while the first matrix is frozen
    (``requires_grad=False``), it keeps that state: thawed at once (``frozen-at-load``), the run continues to the saved
    weights bit for bit; thawed after two steps without a gradient (``frozen-two-steps``), to the reference's weights
    for that loop (run from the stored initial weights and gradients)."""
    case = torch.load(path, weights_only=False)
    assert case["version"] == 1 and "format" not in case["optimizer"]["zenflow"]
    assert "host_params" not in case["optimizer"]["zenflow"]
    zenflow = dict(case["zenflow"])
    if zenflow.get("offload_device") == "nvme":
        zenflow["nvme_path"] = str(tmp_path)
    params = [torch.nn.Parameter(t.clone()) for t in case["model"]]
    params[0].requires_grad_(False)
    start = case["save_at"] + 1
    got = []
    with ZenFlowAdamW(params, **case["hyper"], zenflow=zenflow) as opt:
        opt.load_state_dict(case["optimizer"])
        for t in range(start, len(case["grads"])):
            held = t - start < frozen_for
            params[0].requires_grad_(not held)
            for i, (p, grad) in enumerate(zip(params, case["grads"][t], strict=True)):
                p.grad = None if (i == 0 and held) else grad.clone()
            opt.step()
            opt.zero_grad()
            got.append(snapshot(params))
        opt.flush()
        got.append(snapshot(params))
    if frozen_for == 0:
        for t, (a, b) in enumerate(zip(got, case["expected"], strict=True)):
            for n, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"step {start + t}, parameter {n}: {(x - y).abs().max()}"
        return
    # the reference, run from the start on the stored gradients up to the save, then the loop above, for the fp32
    # matrix and vector (no clipping, a fixed interval: parameters do not interact; the reference takes no bf16)
    ref_params = [torch.nn.Parameter(t.clone()) for t in case["init"][:2]]
    ref = ReferenceZenFlow(ref_params, **case["hyper"], zenflow=zenflow)
    want = []
    for t in range(len(case["grads"])):
        held = start <= t < start + frozen_for
        for i, (p, grad) in enumerate(zip(ref_params, case["grads"][t], strict=False)):
            p.grad = None if (i == 0 and held) else grad.clone()
        ref.step()
        if t >= start:
            want.append(snapshot(ref_params))
    ref.flush()
    want.append(snapshot(ref_params))
    lr = case["hyper"]["lr"]
    for t, (a, b) in enumerate(zip(got, want, strict=True)):
        for n, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_within_stated_bound(x, y, lr=lr, steps=start + t + 1, what=f"step {start + t} param {n}")


# -- the planner's write-back ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("handover", ["backward", "step"])
@pytest.mark.parametrize("overlap", [True, False])
def test_the_planner_writes_back_the_matrices_columns_off_the_fast_path_only(overlap, handover):
    """1.2 M parameters of which 0.2 M in vectors, ``topk_ratio=0.1``: the write-back carries 0.9 x 1 M matrix
    parameters (vectors stay on the device, so never cross back), synchronous offload all 1.2 M; the stall by hand."""
    M, V, k, S = 1_000_000, 200_000, 0.1, 4
    P = M + V
    probe = HostProbe(update_s_per_param=4e-8, accumulate_s_per_param=1e-9, step_work_s_per_param=0.0,
                      update_alone_s_per_param=3e-8, threads=2, params=1 << 22, grad_dtype="bfloat16")
    d2h, h2d, device, gb, pb = 1e9, 0.8e9, 10e-3, 2, 2
    plan = predict(matrix_params=M, vector_params=V, device_step_s=device, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d,
                   probe=probe, topk_ratio=k, update_interval=S, overlap_step=overlap, handover=handover,
                   grad_bytes=gb, param_bytes=pb, state_bytes=8)
    written = 900_000  # (1 - 0.1) x the matrices' parameters: no vector
    lanes = plan.zenflow_lanes
    assert lanes["write_back_s"] == pytest.approx(pb * written / h2d, rel=1e-12)
    # the stall, by hand (the planner's model, docs/planner.md)
    d2h_s = gb * P / d2h
    crossing = max(0.0, d2h_s - device * 2 / 3) if handover == "backward" else d2h_s
    accumulate = 1e-9 * P
    update = (4e-8 if overlap else 3e-8) * P
    step = device + crossing
    fold_excess = max(0.0, accumulate - step)
    window = S * (step + fold_excess) if overlap else 0.0
    update_wait = max(0.0, update + (accumulate if overlap else 0.0) - window)
    write_back = pb * written / h2d
    wb_wait = max(0.0, write_back - d2h_s) if overlap and handover == "step" else write_back
    assert lanes["update_wait_s"] == pytest.approx(update_wait, rel=1e-12, abs=1e-15)
    assert lanes["write_back_wait_s"] == pytest.approx(wb_wait, rel=1e-12, abs=1e-15)
    assert plan.zenflow_stall_s == pytest.approx(crossing + fold_excess + (update_wait + wb_wait) / S, rel=1e-12)
    # synchronous offload: every parameter on the host, written back at every step
    sync_update = 3e-8 * P
    assert plan.sync_offload_stall_s == pytest.approx(
        crossing + max(0.0, accumulate - step) + sync_update + pb * P / h2d, rel=1e-12)
    assert plan.host_params == P


# -- the concentration with a callable importance --------------------------------------------------------------------


def saliency(grad, param):
    """A researcher's criterion: |gradient x weight| over rows (not the squared column norm)."""
    return (grad * param.detach()).abs().sum(0)


def expected_shares(grads, selected):
    """The definition: per matrix the largest ceil(f * C) squared column norms (at least one), and the selected
    columns', summed over the matrices, over their total energy; float64."""
    tops = {"top1": 0.0, "top10": 0.0, "selected": 0.0}
    total = 0.0
    for g, sel in zip(grads, selected, strict=True):
        e = (g.double() ** 2).sum(0)
        ordered = e.sort(descending=True).values
        tops["top1"] += float(ordered[: max(1, math.ceil(0.01 * e.numel()))].sum())
        tops["top10"] += float(ordered[: max(1, math.ceil(0.10 * e.numel()))].sum())
        tops["selected"] += float(e[sel].sum())
        total += float(e.sum())
    return {k: v / total for k, v in tops.items()}


@pytest.mark.parametrize("where", ["config", "group"])
def test_the_concentration_with_a_callable_importance_is_the_gradients_energy(where):
    """``importance`` a callable (the config's, or a param group's): the shares recorded at each selection are the
    gradient's squared-l2 energies' (the definition), whatever the scorer returned; the selected share is that of the
    columns the scorer chose."""
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 40, generator=gen))
    b = torch.nn.Parameter(torch.randn(6, 120, generator=gen) * torch.linspace(0.1, 3.0, 120))
    v = torch.nn.Parameter(torch.randn(5, generator=gen))
    zen = dict(topk_ratio=0.1, select_strategy="step", select_interval=3, update_interval=3)
    if where == "config":
        zen["importance"] = saliency
        groups = [a, b, v]
    else:
        groups = [dict(params=[a, b], importance=saliency), dict(params=[v])]
    expected = []
    scale = torch.linspace(0.2, 4.0, 120)[torch.randperm(120, generator=gen)]
    with ZenFlowAdamW(groups, lr=1e-3, zenflow=zen) as opt:
        for _ in range(7):
            grads = [torch.randn(8, 40, generator=gen), torch.randn(6, 120, generator=gen) * scale]
            a.grad, b.grad, v.grad = grads[0].clone(), grads[1].clone(), torch.randn(5, generator=gen)
            before = opt.stats()["selections"]
            opt.step()
            if opt.stats()["selections"] > before:
                chosen = [opt.selected_columns(a), opt.selected_columns(b)]
                # the scorer's choice: top-k of its scores, computed on the weights it saw
                expected.append(expected_shares(grads, chosen))
        c = opt.stats()["concentration"]
    assert len(expected) == len(c["top10"]) >= 3
    for n, want in enumerate(expected):
        for name in ("top1", "top10", "selected"):
            assert c[name][n] == pytest.approx(want[name], rel=1e-5), (n, name)
