"""ZenFlowAdamW against the reference algorithm, torch.optim.AdamW, checkpoints, faults and telemetry.

Tests that take ``device`` run once per link: "cpu" (the synchronous CPU link), "chaos0".."chaos2"
(the asynchronous CPU link that runs the CUDA protocol, with seeded random delays: ``testing.chaos``)
and, when CUDA is present, "cuda" (parameters on the GPU, the CUDA link, the Triton kernels).
"""

import contextlib
import copy
import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
from support import (
    HYPER,
    SWEEP,
    _ids,
    adamw_history,
    adamw_tol,
    drive,
    grad_sequence,
    make_params,
    quiet,
    snapshot,
)

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.config import ZenFlowWarning
from zenflow_kernels.link.worker import HostWorkerError
from zenflow_kernels.ops import use_backend
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.testing import chaos

HAS_CUDA = torch.cuda.is_available()
MODES = ["cpu", "chaos0", "chaos1", "chaos2"] + (["cuda"] if HAS_CUDA else [])


def _mode(request) -> str:
    callspec = getattr(request.node, "callspec", None)
    return callspec.params.get("device", "cpu") if callspec else "cpu"


@pytest.fixture(autouse=True)
def cpu_backend(request):
    """The optimizer's logic, not the kernels, is under test here: on CPU use the fast path a user gets
    (numba AdamW); the tests set TRITON_INTERPRET=1, which would otherwise send every op through the
    slow Triton interpreter. On CUDA the device rule picks Triton. One test below runs the same
    training through every backend."""
    if _mode(request) == "cuda":
        yield
        return
    with use_backend("numba"):
        yield


@pytest.fixture(params=MODES)
def device(request):
    """Where the parameters live and which link moves them (see the module docstring): every optimizer
    the test creates uses it."""
    mode = request.param
    if mode.startswith("chaos"):
        with chaos(seed=int(mode[len("chaos"):])):
            yield torch.device("cpu")
    else:
        yield torch.device(mode)


def zenflow_threads():
    return [t for t in threading.enumerate() if t.name.startswith("zenflow")]


# -- equivalence with the oracle --------------------------------------------------------------------

# every case on the synchronous CPU link and under chaos (the seed rotates), and on CUDA when present
SWEEP_RUNS = [
    pytest.param(case, mode, id=f"{_ids(case)}-{mode}")
    for n, case in enumerate(SWEEP)
    for mode in ("cpu", f"chaos{n % 3}") + (("cuda",) if HAS_CUDA else ())
]


@pytest.mark.parametrize("case, device", SWEEP_RUNS, indirect=["device"])
def test_matches_reference(case, device):
    topk, upd, overlap, dtype, warmup, (strategy, interval, epoch), importance = case
    zenflow = dict(
        topk_ratio=topk,
        update_interval=upd,
        overlap_step=overlap,
        full_warm_up_rounds=warmup,
        select_strategy=strategy,
        select_interval=interval,
        importance=importance,
        max_update_interval=5,
        auto_ratio=0.5,
    )
    if epoch is not None and strategy != "step":
        zenflow["steps_per_epoch"] = epoch
    steps = 30
    grads = grad_sequence(steps)
    zp = make_params(dtype, device=device)
    rp = [torch.nn.Parameter(p.detach().float().cpu()) for p in zp]  # the oracle runs fp32 on the same values
    ref = quiet(ReferenceZenFlow, rp, **HYPER, zenflow=zenflow, max_grad_norm=8.0)
    with quiet(ZenFlowAdamW, zp, **HYPER, zenflow=zenflow, max_grad_norm=8.0) as opt:
        for t, step_grads in enumerate(grads):
            for p, q, g in zip(zp, rp, step_grads, strict=True):
                p.grad = g.to(device, dtype)
                q.grad = g.to(dtype).float()
            opt.step()
            ref.step()
            for i, (p, q) in enumerate(zip(snapshot(zp), rp, strict=True)):
                if dtype == torch.float32:
                    torch.testing.assert_close(
                        p, q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, t=t, i=i: f"step {t} param {i}: {m}"
                    )
                else:  # within one bf16 ulp of the oracle's value rounded to bf16
                    torch.testing.assert_close(
                        p.float(),
                        q.detach().to(dtype).float(),
                        rtol=2**-7,
                        atol=1e-5,
                        msg=lambda m, t=t, i=i: f"step {t} param {i}: {m}",
                    )
        assert (opt.t, opt.host_updates, opt.selections) == (ref.t, ref.host_updates, ref.selections)
        opt.flush()
        ref.flush()
        for p, q in zip(snapshot(zp), rp, strict=True):
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
            torch.testing.assert_close(p.float(), q.detach().to(dtype).float(), **tol)


@pytest.mark.parametrize("warmup", [0, 2])
def test_matches_reference_on_a_real_model(device, warmup):
    """Gradients from an actual forward/backward (they depend on the weights); on an asynchronous link
    backward hooks start each gradient's copy early."""
    torch.manual_seed(0)
    model_b = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    )
    model_a = copy.deepcopy(model_b).to(device)
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=8, update_interval=2, overlap_step=True,
                   full_warm_up_rounds=warmup)
    ref = ReferenceZenFlow(model_b.parameters(), **HYPER, zenflow=zenflow)
    g = torch.Generator().manual_seed(5)
    with ZenFlowAdamW(model_a.parameters(), **HYPER, zenflow=zenflow) as opt:
        for _ in range(25):
            x, y = torch.randn(20, 16, generator=g), torch.randn(20, 8, generator=g)
            for model, o in ((model_a, opt), (model_b, ref)):
                o.zero_grad()
                torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
                o.step()
        for a, b in zip(snapshot(model_a.parameters()), model_b.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


# -- identities with torch.optim.AdamW ------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_topk_one_equals_adamw(device, overlap):
    grads = grad_sequence(20)
    zp = make_params(device=device)
    zenflow = dict(topk_ratio=1.0, select_strategy="step", select_interval=4, update_interval=2, overlap_step=overlap)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        for t, (z, a) in enumerate(zip(drive(opt, zp, grads), adamw_history(grads), strict=True)):
            for i, (x, y) in enumerate(zip(z, a, strict=True)):
                torch.testing.assert_close(x, y, **adamw_tol(device), msg=lambda m, t=t, i=i: f"step {t} p{i}: {m}")


@pytest.mark.parametrize("topk_ratio", [0.0, 0.1, 0.3, 0.5, 1.0])
def test_single_selection_update_every_step_equals_adamw_at_any_topk(device, topk_ratio):
    """Pins the whole fast/host split: host columns at interval 1, fast columns, vectors."""
    grads = grad_sequence(20)
    zp = make_params(device=device)
    zenflow = dict(topk_ratio=topk_ratio, select_strategy="step", select_interval=10_000, update_interval=1)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        for t, (z, a) in enumerate(zip(drive(opt, zp, grads), adamw_history(grads), strict=True)):
            for i, (x, y) in enumerate(zip(z, a, strict=True)):
                torch.testing.assert_close(x, y, **adamw_tol(device), msg=lambda m, t=t, i=i: f"step {t} p{i}: {m}")


BIG_SHAPES = [(256, 300), (300,), (24, 16)]  # 76800 elements: at least ZenFlowAdamW.FUSE_MIN_NUMEL


@pytest.mark.parametrize("max_grad_norm", [None, 1e3])
def test_update_every_step_equals_adamw_with_a_matrix_large_enough_to_fuse(device, max_grad_norm):
    """A synchronous CPU update folds the last gradient of a large matrix into its AdamW pass instead of
    accumulating it: the matrix must still be part of the update (its count includes that gradient).
    ``max_grad_norm`` far above the norm must change nothing (the clip coefficient is capped at 1)."""
    assert BIG_SHAPES[0][0] * BIG_SHAPES[0][1] >= ZenFlowAdamW.FUSE_MIN_NUMEL
    g = torch.Generator().manual_seed(11)
    grads = [[torch.randn(s, generator=g) for s in BIG_SHAPES] for _ in range(6)]
    zp = make_params(device=device, shapes=BIG_SHAPES)
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=10_000, update_interval=1)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow, max_grad_norm=max_grad_norm) as opt:
        history = drive(opt, zp, grads)
        assert opt.host_updates == 6
    for t, (z, a) in enumerate(zip(history, adamw_history(grads, shapes=BIG_SHAPES), strict=True)):
        for i, (x, y) in enumerate(zip(z, a, strict=True)):
            torch.testing.assert_close(x, y, **adamw_tol(device), msg=lambda m, t=t, i=i: f"step {t} p{i}: {m}")


def _auto_case(name):
    """(shapes, zenflow overrides, gradient of step t) for Zen-auto scenarios whose votes hinge on details."""
    g = torch.Generator().manual_seed(7)
    if name == "full-matrix-first":  # a matrix with k == C does not vote, and must not stop the others voting
        shapes = [(3, 1), (4, 6), (4,)]
        return shapes, dict(topk_ratio=0.34, auto_ratio=0.5), lambda t: [torch.randn(s, generator=g) for s in shapes]
    if name == "single-voter":
        shapes = [(4, 6), (4,)]
        return shapes, dict(topk_ratio=0.34, auto_ratio=1.0), lambda t: [torch.randn(s, generator=g) for s in shapes]
    if name == "exact-tie":  # a matrix with two equal columns needs an update at once (>=); half the voters suffice
        shapes = [(3, 2), (4, 6)]

        def grads(t):
            tie = torch.full((3, 2), 0.5)
            other = torch.ones(4, 6)
            other[:, :2] = 40.0  # the selected columns dominate: no need yet
            return [tie, other]

        return shapes, dict(topk_ratio=0.5, auto_ratio=0.5), grads
    if name == "small-gradients":  # magnitudes far below 1: any offset in the running sums shows
        shapes = [(4, 6), (5, 3)]
        return shapes, dict(topk_ratio=0.34, auto_ratio=0.5), lambda t: [1e-3 * torch.randn(s, generator=g)
                                                                         for s in shapes]
    raise ValueError(name)


@pytest.mark.parametrize("name", ["full-matrix-first", "single-voter", "exact-tie", "small-gradients"])
def test_zen_auto_votes_match_the_oracle(device, name):
    shapes, overrides, grads_at = _auto_case(name)
    zenflow = dict(select_strategy="step", select_interval=12, update_interval="auto", max_update_interval=6,
                   overlap_step=False) | overrides
    zp = make_params(device=device, shapes=shapes)
    rp = make_params(shapes=shapes)
    ref = ReferenceZenFlow(rp, **HYPER, zenflow=zenflow)
    boundaries, ref_boundaries = [], []
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        for t in range(12):
            for p, q, gr in zip(zp, rp, grads_at(t), strict=True):
                p.grad, q.grad = gr.to(device), gr.clone()
            before = (opt.host_updates, ref.host_updates)
            opt.step()
            ref.step()
            boundaries.append(opt.host_updates - before[0])
            ref_boundaries.append(ref.host_updates - before[1])
            for i, (x, y) in enumerate(zip(snapshot(zp), rp, strict=True)):
                torch.testing.assert_close(x, y.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, t=t, i=i: f"{t} {i}: {m}")
    assert boundaries == ref_boundaries
    if name == "exact-tie":  # the tied matrix needs an update at every step, and its vote is enough
        assert boundaries == [1] * 12
    else:
        assert 0 < sum(boundaries) < 12  # the votes decided something: neither never nor always


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_parameters_and_their_strided_gradients_match_the_oracle(device, overlap, dtype):
    """Parameters stored transposed (``nn.Parameter(w.t())``), with gradients strided like them as autograd
    lays them out: the gradient norm, the fast step (the strided path of the kernels), the accumulation on
    either link, the host update and the write-back all read and write them; with clipping, the oracle's
    weights at every step (bf16: the oracle takes fp32 only, so the same optimizer on contiguous copies,
    within bf16 rounding)."""
    shapes = [(6, 9), (7, 5), (5,)]
    g = torch.Generator().manual_seed(8)
    base = [torch.randn(s[::-1], generator=g).t() if len(s) == 2 else torch.randn(s, generator=g) for s in shapes]
    zp = [torch.nn.Parameter(b.to(device, dtype).t().contiguous().t() if b.dim() == 2 else b.to(device, dtype))
          for b in base]
    rp = [torch.nn.Parameter(b.clone().to(dtype)) for b in base]
    assert not zp[0].is_contiguous() and zp[0].stride() == (1, 6)
    zenflow = dict(topk_ratio=0.34, select_strategy="step", select_interval=4, update_interval=2,
                   overlap_step=overlap, full_warm_up_rounds=1)
    oracle = ReferenceZenFlow if dtype == torch.float32 else ZenFlowAdamW
    ref = oracle(rp, **HYPER, zenflow=zenflow, max_grad_norm=3.0)
    with ref if dtype != torch.float32 else contextlib.nullcontext(), ZenFlowAdamW(
            zp, **HYPER, zenflow=zenflow, max_grad_norm=3.0) as opt:
        for t in range(9):
            grads = [torch.randn(s, generator=g) for s in shapes]
            for p, q, gr in zip(zp, rp, grads, strict=True):
                # autograd's layout: a gradient strided like its parameter
                p.grad = torch.empty_like(p).copy_(gr.to(dtype))
                q.grad = gr.to(dtype)
            assert not zp[0].grad.is_contiguous()
            opt.step()
            ref.step()
            opt.flush()
            ref.flush()
            for i, (x, y) in enumerate(zip(snapshot(zp), rp, strict=True)):
                tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(x, y.detach(), **tol, msg=lambda m, t=t, i=i: f"step {t}, param {i}: {m}")


@pytest.mark.parametrize("topk_ratio", [0.0, 1.0])
def test_clipping_of_tiny_gradients_matches_the_oracle(device, topk_ratio):
    """Gradients of ~1e-4 clipped to a norm of 1e-5, with eps=1 so that AdamW's step is nearly linear in
    the clipped gradient: the clip coefficient, its 1e-6 guard and the squared norm it comes from are seen
    to a part in 10^3 (topk_ratio 0: the host's clip of the mean gradient; 1: the fast path's clip)."""
    shapes = [(6, 5), (5,)]
    g = torch.Generator().manual_seed(4)
    grads = [[1e-4 * torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    zenflow = dict(topk_ratio=topk_ratio, select_strategy="step", select_interval=100, update_interval=2)
    hyper = dict(HYPER, eps=1.0, lr=1.0, weight_decay=0.0)  # the clipped gradient is all that moves them
    zp, rp = make_params(device=device, shapes=shapes), make_params(shapes=shapes)
    start = snapshot(zp)
    ref = ReferenceZenFlow(rp, **hyper, zenflow=zenflow, max_grad_norm=1e-5)
    with ZenFlowAdamW(zp, **hyper, zenflow=zenflow, max_grad_norm=1e-5) as opt:
        for step_grads in grads:
            for p, q, gr in zip(zp, rp, step_grads, strict=True):
                p.grad, q.grad = gr.to(device), gr.clone()
            opt.step()
            ref.step()
        opt.flush()
        ref.flush()
    for x0, x, y in zip(start, snapshot(zp), rp, strict=True):
        moved, expected = x - x0, y.detach() - x0
        assert expected.abs().max() > 1e-7  # the clipped steps moved the weights
        torch.testing.assert_close(moved, expected, rtol=1e-3, atol=1e-9)


def test_lr_scheduler_matches_the_oracle(device):
    grads = grad_sequence(24)
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=4, overlap_step=True)
    zp, rp = make_params(device=device), make_params()
    ref = ReferenceZenFlow(rp, **HYPER, zenflow=zenflow)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=5, gamma=0.5)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        for step_grads in grads:
            for p, q, g in zip(zp, rp, step_grads, strict=True):
                p.grad, q.grad = g.to(device, copy=True), g.clone()
            opt.step()
            ref.step()
            sched.step()
            ref_sched.step()
            for p, q in zip(snapshot(zp), rp, strict=True):
                torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < HYPER["lr"]


def test_param_groups_missing_grads_and_closure(device):
    zp, ap = make_params(device=device), make_params()

    def groups(ps):
        return [{"params": ps[:3], "lr": 5e-3}, {"params": ps[3:], "weight_decay": 0.0}]

    zenflow = dict(topk_ratio=0.3, select_strategy="step", select_interval=10_000, update_interval=1)
    adam = torch.optim.AdamW(groups(ap), **HYPER, foreach=False)
    grads = grad_sequence(10)
    for step_grads in grads:
        step_grads[4] = None  # this parameter never has a gradient
    with ZenFlowAdamW(groups(zp), **HYPER, zenflow=zenflow) as opt:
        for step_grads in grads:

            def closure(step_grads=step_grads):
                for p, g in zip(zp, step_grads, strict=True):
                    p.grad = None if g is None else g.to(device, copy=True)
                return torch.tensor(1.5)

            assert opt.step(closure).item() == 1.5
            for p, g in zip(ap, step_grads, strict=True):
                p.grad = None if g is None else g.clone()
            adam.step()
            opt.zero_grad(set_to_none=False)
            assert all(p.grad is None or not p.grad.any() for p in zp)
            opt.zero_grad()
            assert all(p.grad is None for p in zp)
        for x, y in zip(snapshot(zp), ap, strict=True):
            torch.testing.assert_close(x, y.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(snapshot(zp)[4], make_params()[4].detach())


def test_offloaded_fast_state_in_buckets_matches_resident_state(device, monkeypatch):
    """offload=True keeps the fast-path state in host memory and streams it through the kernels in
    buckets. On the asynchronous CPU link and on CUDA it really is copied to the device and back (state
    not copied back would be lost); on the synchronous CPU link there is nothing to move. Bit for bit
    the same as resident state."""
    monkeypatch.setattr(ZenFlowAdamW, "OFFLOAD_BUCKET_NUMEL", 100)  # several buckets for these shapes
    grads = grad_sequence(16)
    runs = []
    for offload in (False, True):
        zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=5, update_interval=2, offload=offload)
        zp = make_params(torch.bfloat16, device=device)
        with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
            runs.append(drive(opt, zp, grads))
            assert opt.fast_path.offload == (offload and opt.stats()["link"] != "cpu")
            if opt.fast_path.offload:
                assert all(st["exp_avg"].device.type == "cpu" for st in opt.state.values() if st)
                states = [(None,) * 3 + (st["exp_avg"],) for st in opt.state.values()]
                assert len(opt.fast_path.buckets(states)) > 2
    for t, (a, b) in enumerate(zip(*runs, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {t}"


def test_fused_host_update_is_bit_identical_to_accumulate_then_step(monkeypatch):
    """Synchronous CPU updates fold the last gradient into the AdamW pass for large tensors; forcing it
    for every tensor, or for none, gives the same bits."""
    from zenflow_kernels import cpu_ops

    fused_calls = []
    real = cpu_ops.accumulate_adam_
    monkeypatch.setattr(cpu_ops, "accumulate_adam_", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    grads = grad_sequence(14)
    zenflow = dict(topk_ratio=0.2, select_strategy="step", select_interval=6, update_interval=3, full_warm_up_rounds=2)
    runs, calls = [], []
    for threshold in (1, 10**12, 300, 288):  # 300: some tensors fused, others merged around them; 288: one
        # matrix has exactly that many elements (at least the threshold fuses)
        zp = make_params(torch.bfloat16)
        with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
            opt.FUSE_MIN_NUMEL = threshold
            runs.append(drive(opt, zp, grads))
        calls.append(len(fused_calls))
    # cumulative: warm-up 2 steps x 6 tensors, then 4 boundaries x 3 matrices, all fused; then none; then the
    # two matrices of more than 300 elements; then all three matrices (288, 384 and 480 elements)
    all_fused = 2 * 6 + 4 * 3
    assert calls == [all_fused, all_fused, all_fused + 2 * 2 + 4 * 2, all_fused + 2 * 2 + 4 * 2 + 2 * 3 + 4 * 3]
    for other in runs[1:]:
        for t, (a, b) in enumerate(zip(runs[0], other, strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), f"step {t}"


# -- checkpoints --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "zenflow",
    [
        dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=3, overlap_step=True),
        dict(
            topk_ratio=0.2,
            select_strategy="step",
            select_interval=12,
            update_interval="auto",
            overlap_step=True,
            max_update_interval=4,
            full_warm_up_rounds=2,
        ),
        dict(topk_ratio=0.1, select_strategy="step", select_interval=6, update_interval=3, overlap_step=False),
        dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=3, overlap_step=True,
             device_accumulation=True),
    ],
    ids=["overlap", "auto-warmup", "sync", "device-acc"],
)
def test_checkpoint_mid_interval_resumes_bit_identically(device, zenflow, dtype):
    grads = grad_sequence(24)
    zp = make_params(dtype, device=device)
    opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow, max_grad_norm=10.0)
    drive(opt, zp, grads[:10])  # step 10: mid-interval, an overlapped host update in flight
    saved = copy.deepcopy(opt.state_dict())
    saved_params = snapshot(zp)
    straight = drive(opt, zp, grads[10:])
    opt.close()

    fresh = [torch.nn.Parameter(p.to(device)) for p in saved_params]
    other = dict(topk_ratio=0.5, select_strategy="step", select_interval=1, update_interval=1)
    with ZenFlowAdamW(fresh, lr=1.0, zenflow=other) as opt2:  # everything comes from the checkpoint
        with pytest.warns(ZenFlowWarning, match=r"zenflow\.topk_ratio=0\.\d+ \(this optimizer: 0\.5\).*"
                                                r"max_grad_norm=10\.0 \(this optimizer: None\)"):
            opt2.load_state_dict(saved)
        resumed = drive(opt2, fresh, grads[10:])
        for t, (a, b) in enumerate(zip(straight, resumed, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"step {10 + t} param {i} differs after resume"
        assert (opt2.t, opt2.host_updates, opt2.selections) == (opt.t, opt.host_updates, opt.selections)


def test_state_dict_before_first_step_and_mismatched_load():
    zp = make_params()
    opt = ZenFlowAdamW(zp, zenflow=dict(select_strategy="step", select_interval=5, update_interval=5))
    sd = opt.state_dict()
    assert sd["state"] == {} and sd["zenflow"]["t"] == 0
    other = ZenFlowAdamW(
        [torch.nn.Parameter(torch.zeros(3, 3))],
        zenflow=dict(select_strategy="step", select_interval=5, update_interval=5),
    )
    with pytest.raises(ValueError, match="param group"):
        other.load_state_dict(sd)
    opt.close()
    other.close()


# -- non-finite gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_step_is_skipped_on_both_paths(device, bad, overlap):
    grads = grad_sequence(12)
    zenflow = dict(topk_ratio=0.2, select_strategy="step", select_interval=6, update_interval=3, overlap_step=overlap)
    clean = make_params(device=device)
    with ZenFlowAdamW(clean, **HYPER, zenflow=zenflow) as opt:
        never_poisoned = drive(opt, clean, grads)
    zp = make_params(device=device)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        drive(opt, zp, grads[:7])
        before_params = snapshot(zp)
        before = copy.deepcopy(opt.state_dict())
        poisoned = [g.clone() for g in grads[7]]
        poisoned[0][3, 5] = bad  # on a matrix: both paths would see it
        drive(opt, zp, [poisoned])
        after = opt.state_dict()
        assert opt.skipped_steps == 1
        for x, y in zip(before_params, snapshot(zp), strict=True):
            assert torch.equal(x, y)
        for idx, st in before["state"].items():
            for key, value in st.items():
                other = after["state"][idx][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (idx, key)
        assert {k: v for k, v in after["zenflow"].items() if k != "skipped_steps"} == {
            k: v for k, v in before["zenflow"].items() if k != "skipped_steps"
        }
        assert opt.stats()["skipped_steps"] == 1
        # and the run goes on as if the poisoned step had never been
        for t, (a, b) in enumerate(zip(drive(opt, zp, grads[7:]), never_poisoned[7:], strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), f"step {7 + t}"


# -- the background worker ----------------------------------------------------------------------------


def test_worker_failure_surfaces_in_step_within_seconds(device):
    zp = make_params(device=device)
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=2, overlap_step=True)
    opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
    grads = grad_sequence(8)
    drive(opt, zp, grads[:1])

    def broken_update(*args, **kwargs):
        raise RuntimeError("injected host failure")

    opt.host_shard.update = broken_update
    t0 = time.perf_counter()
    with pytest.raises(HostWorkerError, match="injected host failure") as info:
        drive(opt, zp, grads[1:8])
    assert time.perf_counter() - t0 < 10
    assert "broken_update" in str(info.value)  # the worker's traceback travels with the error
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(HostWorkerError):  # and it stays failed
        drive(opt, zp, grads[:1])
    opt.close()
    assert not zenflow_threads()


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_host_worker_runs_no_torch_compute(monkeypatch, max_grad_norm):
    """A parallel torch op from a second thread starts a second OpenMP team in torch's runtime; while that
    thread lives, torch's libgomp counts more threads than cores and its idle threads stop spinning, so
    every parallel op of the training thread pays a wake-up (measured on 2 cores: forward + backward
    20-30% slower for the rest of the run). The host worker therefore does its work in numba only: in
    the worker thread no aten op but views may run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zenflow_kernels.host import HostShard

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((str(func), func.is_view))
            return func(*args, **(kwargs or {}))

    seen = []
    original = HostShard.update

    def update(self, *args, **kwargs):
        with Record() as rec:  # dispatch modes are thread-local: this records the worker's own ops
            result = original(self, *args, **kwargs)
        seen.append((threading.current_thread().name, rec.ops))
        return result

    monkeypatch.setattr(HostShard, "update", update)
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((256, 300), (300,), (40, 8))]
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)
    with ZenFlowAdamW(params, **HYPER, zenflow=zenflow, max_grad_norm=max_grad_norm) as opt:
        for _ in range(7):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        opt.flush()
    assert len(seen) >= 3 and all(name.startswith("zenflow") for name, _ in seen), [n for n, _ in seen]
    assert any(ops for _, ops in seen)  # the recorder works: the update takes views
    compute = sorted({op for _, ops in seen for op, is_view in ops if not is_view})
    assert not compute, compute


@pytest.mark.parametrize("perc", [0.5, 1.0])
def test_host_worker_threads_leave_the_training_threads_alone(host_workers_made, perc):
    """The worker's numba threads: its own cores when the split gives it some, else (CPU-only, cores
    shared with training) only what torch's threads leave free, at least one (see the test above for why)."""
    from zenflow_kernels.cpu_ops import split_cores

    made = host_workers_made
    train, host = split_cores(perc)
    threads_before = torch.get_num_threads()
    params = make_params()
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True,
                   pt_reserved_cores_perc=perc)
    with ZenFlowAdamW(params, **HYPER, zenflow=zenflow) as opt:
        drive(opt, params, grad_sequence(1))
        if set(train) & set(host):  # shared: torch keeps its threads, the worker takes the rest
            assert torch.get_num_threads() == threads_before
            expected = max(1, len(set(train) | set(host)) - threads_before)
        else:
            assert torch.get_num_threads() == len(train)
            expected = len(host)
    assert [m["num_threads"] for m in made] == [expected]
    assert [m["cores"] for m in made] == [host]
    assert torch.get_num_threads() == threads_before


@pytest.fixture
def two_torch_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("perc", [0.5, 1.0])
def test_a_synchronous_cpu_run_leaves_torch_threads_alone(two_torch_threads, perc):
    """Without overlap nothing runs beside training: no worker, and torch keeps all its threads."""
    before = torch.get_num_threads()
    params = make_params()
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=4, update_interval=2,
                   pt_reserved_cores_perc=perc)
    with ZenFlowAdamW(params, **HYPER, zenflow=zenflow) as opt:
        drive(opt, params, grad_sequence(3))
        assert torch.get_num_threads() == before and not zenflow_threads()


def test_bad_hyperparameters_set_after_construction_fail_the_step_naming_the_group():
    params = make_params()
    with ZenFlowAdamW([{"params": params[:3]}, {"params": params[3:]}], **HYPER,
                      zenflow=dict(select_strategy="step", select_interval=4, update_interval=2)) as opt:
        drive(opt, params, grad_sequence(1))
        opt.param_groups[1]["lr"] = -1.0  # as a broken scheduler would
        before = snapshot(params)
        with pytest.raises(ValueError, match=r"^ZenFlowAdamW group 1: lr=-1.0 is invalid: allowed a finite number"):
            drive(opt, params, grad_sequence(1))
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(params), strict=True))


def test_dead_worker_is_detected_not_waited_on_forever(device):
    zp = make_params(device=device)
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=2, overlap_step=True)
    opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
    grads = grad_sequence(8)
    drive(opt, zp, grads[:1])

    def dying_update(*args, **kwargs):
        raise SystemExit("the worker thread ends here")  # not an Exception: the thread dies mid-job

    opt.host_shard.update = dying_update
    t0 = time.perf_counter()
    with pytest.raises(HostWorkerError, match="died"):
        drive(opt, zp, grads[1:8])
    assert time.perf_counter() - t0 < 10
    opt.close()
    assert not zenflow_threads()


def test_stuck_worker_times_out(device):
    zp = make_params(device=device)
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=1, overlap_step=True)
    opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow, host_timeout=0.5)
    release = threading.Event()
    real = None
    drive(opt, zp, grad_sequence(1))
    real = opt.host_shard.update

    def stuck_update(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    opt.host_shard.update = stuck_update
    with pytest.raises(HostWorkerError, match="host_timeout=0.5"):
        drive(opt, zp, grad_sequence(3))
    release.set()
    opt.close()


def test_accumulation_failure_surfaces_within_seconds(device, monkeypatch):
    """On an asynchronous link the accumulation runs in a worker: its failure reaches the training
    thread at the next wait on it (a fold, the host update), with its traceback."""
    zp = make_params(device=device)
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=2, overlap_step=True)
    opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
    drive(opt, zp, grad_sequence(1))

    def broken_accumulate(*args, **kwargs):
        raise RuntimeError("injected accumulation failure")

    import zenflow_kernels.host as host_module
    import zenflow_kernels.link.cpu as link_module

    monkeypatch.setattr(host_module, "accumulate_unchecked", broken_accumulate)  # the asynchronous links'
    monkeypatch.setattr(link_module, "accumulate_unchecked", broken_accumulate)  # the synchronous CPU link's
    t0 = time.perf_counter()
    with pytest.raises((HostWorkerError, RuntimeError), match="injected accumulation failure") as info:
        drive(opt, zp, grad_sequence(6))
    assert time.perf_counter() - t0 < 10
    assert "broken_accumulate" in str(info.value) or info.type is RuntimeError  # the traceback travels
    monkeypatch.undo()
    opt.close()
    assert not zenflow_threads()


def test_no_thread_outlives_the_optimizer(two_torch_threads):
    # pt 0.5 on two or more cores: the optimizer narrows torch to the training cores, and must restore it
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=2, overlap_step=True,
                   pt_reserved_cores_perc=0.5)
    threads_before = torch.get_num_threads()
    with ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow) as opt:
        drive(opt, opt._params, grad_sequence(5))
        assert zenflow_threads()
    assert not zenflow_threads()
    assert torch.get_num_threads() == threads_before
    # dropped without close(): the finalizer stops the worker when the optimizer is collected
    opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
    drive(opt, opt._params, grad_sequence(5))
    assert zenflow_threads()
    del opt
    gc.collect()
    deadline = time.time() + 10
    while zenflow_threads() and time.time() < deadline:
        time.sleep(0.05)
    assert not zenflow_threads()
    assert torch.get_num_threads() == threads_before  # the finalizer restored torch's threads too


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_dropped_optimizer_is_freed_at_once_without_the_cycle_collector(asynchronous):
    """The parts hold the optimizer's param groups and state, the backward hooks a weak method: no reference cycle
    runs through the optimizer, so dropping the last reference runs its finalizer at once (workers stopped, hooks
    removed), not at some later garbage collection."""
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)
    params = make_params()
    with chaos(seed=0, max_delay=0) if asynchronous else contextlib.nullcontext():
        opt = ZenFlowAdamW(params, **HYPER, zenflow=zenflow)
    drive(opt, params, grad_sequence(5))
    assert zenflow_threads() and opt.stats()["handover"] == ("on" if asynchronous else "off")
    ref = weakref.ref(opt)
    gc.disable()
    try:
        del opt
        assert ref() is None
    finally:
        gc.enable()
    deadline = time.time() + 10
    while zenflow_threads() and time.time() < deadline:
        time.sleep(0.05)
    assert not zenflow_threads()
    assert all(not p._post_accumulate_grad_hooks for p in params)


def test_interpreter_exits_with_an_open_optimizer():
    code = textwrap.dedent(
        """
        import torch
        from zenflow_kernels import ZenFlowAdamW
        from zenflow_kernels.ops import use_backend
        use_backend("numba")
        ps = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        opt = ZenFlowAdamW(ps, zenflow=dict(select_strategy="step", select_interval=4, update_interval=2,
                                            overlap_step=True))
        for _ in range(5):
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
        print("stepped", opt.host_updates)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stepped 2" in proc.stdout


# -- telemetry, errors, the Triton path ----------------------------------------------------------------


def test_stats_are_measured_and_sane(device):
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=6, update_interval=3, overlap_step=True)
    zp = make_params(device=device)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        t0 = time.perf_counter()
        drive(opt, zp, grad_sequence(18))
        opt.flush()  # the last interval's update was still in flight
        elapsed = time.perf_counter() - t0
        s = opt.stats()
    assert s["steps"] == 18 and s["host_updates"] == 6 and s["selections"] == 3 and s["skipped_steps"] == 0
    assert s["wall_s"] <= elapsed
    assert s["fast_path_s_mean"] == pytest.approx(sum(s["fast_path_s"]) / 18)
    assert s["host_update_s_mean"] == pytest.approx(sum(s["host_update_s"]) / 6)
    # overlapped, no warm-up: the stall is the accumulation the training thread did and its waits
    assert s["stall_s"] == pytest.approx(s["accumulate_s"] + s["worker_wait_s"])
    assert len(s["fast_path_s"]) == 18 and all(x > 0 for x in s["fast_path_s"])
    assert len(s["host_update_s"]) == 6 and all(x > 0 for x in s["host_update_s"])
    assert 0 <= s["stall_fraction"] <= 1 and 0 <= s["overlap_fraction"] <= 1
    assert s["wall_s"] >= s["step_s_mean"] * s["steps"] > 0  # wall time spans the whole run
    assert s["stall_fraction"] == pytest.approx(s["stall_s"] / s["wall_s"])
    assert len(s["score_mass_captured"]) == 3 and all(0.1 < c <= 1 for c in s["score_mass_captured"])
    assert len(s["selection_jaccard"]) == 3 and all(0 <= j <= 1 for j in s["selection_jaccard"][1:])
    # the hot columns (4x-6x) dominate: the captured score mass is far above the 10% a random pick gets
    assert min(s["score_mass_captured"]) > 0.3


def test_stats_before_the_first_step_are_zero():
    zenflow = dict(select_strategy="step", select_interval=4, update_interval=2)
    opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
    opt.zero_grad()  # nothing built yet: nothing to wait for
    opt.zero_grad(set_to_none=False)
    s = opt.stats()
    assert s["steps"] == 0 and s["wall_s"] == 0.0 and s["stall_s"] == 0.0 and s["stall_fraction"] == 0.0
    assert s["fast_path_s_mean"] == 0.0 and s["host_update_s_mean"] == 0.0 and s["step_s_mean"] == 0.0
    assert s["link"] is None and s["d2h_bytes"] == 0 and s["h2d_bytes"] == 0 and s["d2h_bytes_per_step"] == 0.0
    assert s["h2d_bytes_per_step"] == 0.0 and s["overlap_fraction"] == 0.0 and s["host_update_s"] == []
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_fraction_counts_the_hidden_host_time(overlap):
    """With training work between boundaries an overlapped host update hides behind it; a synchronous one
    hides nothing."""
    zp = make_params()
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=100, update_interval=3, overlap_step=overlap)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        for step_grads in grad_sequence(12):
            time.sleep(0.01)  # "forward and backward"
            drive(opt, zp, [step_grads])
        s = opt.stats()
    assert s["host_updates"] == 4
    if overlap:
        assert s["overlap_fraction"] > 0.5, s["overlap_fraction"]
    else:
        assert s["overlap_fraction"] == 0.0


def test_selection_telemetry_is_exact_on_a_constructed_run(device):
    """Selections {0, 1} then {1, 2} then {1, 2} of a 6-column matrix (k = 2): Jaccard |A & B| / |A | B| is
    1/3 then 1; the score mass captured is the selected columns' share of the step's scores."""
    p = torch.nn.Parameter(torch.zeros(3, 6, device=device))
    hot = [(0, 1), (1, 2), (1, 2)]
    zenflow = dict(topk_ratio=0.34, select_strategy="step", select_interval=1, update_interval=1)
    with ZenFlowAdamW([p], **HYPER, zenflow=zenflow) as opt:
        for cols in hot:
            g = torch.ones(3, 6)
            g[:, list(cols)] = 3.0  # l2 scores: 27 for a hot column, 3 for a cold one
            p.grad = g.to(device)
            opt.step()
            assert opt.selected_columns(p).tolist() == list(cols)
        s = opt.stats()
    assert s["selection_steps"] == [0, 1, 2]
    assert s["selection_jaccard"][0] != s["selection_jaccard"][0]  # nan: nothing to compare with
    assert s["selection_jaccard"][1:] == [pytest.approx(1 / 3), pytest.approx(1.0)]
    assert s["score_mass_captured"] == [pytest.approx(54 / 66)] * 3


def _beside_the_reference(device, zenflow, grads):
    """Step ZenFlowAdamW and ReferenceZenFlow side by side on ``grads`` (None: no gradient that step), every
    parameter within the bound of a step; returns both (the optimizer closed)."""
    zp, rp = make_params(device=device), make_params()
    ref = ReferenceZenFlow(rp, **HYPER, zenflow=zenflow)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        for t, step_grads in enumerate(grads):
            for p, q, g in zip(zp, rp, step_grads, strict=True):
                p.grad = None if g is None else g.to(device, copy=True)
                q.grad = None if g is None else g.clone()
            opt.step()
            ref.step()
            for i, (p, q) in enumerate(zip(snapshot(zp), rp, strict=True)):
                torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, t=t, i=i: f"{t} {i}: {m}")
    return opt, ref


@pytest.mark.parametrize("overlap", [False, True])
def test_matches_reference_with_gradients_missing_in_some_intervals(device, overlap):
    """Parameters that miss gradients get fewer in an interval than their flat neighbours: their mean is
    over their own count (neighbours with different counts must not share one host AdamW call)."""
    grads = grad_sequence(24)
    for t, step in enumerate(grads):
        if t % 4 in (1, 2):
            step[2] = None  # the middle one of three adjacent matrices of group 0
        if t % 5 == 3:
            step[5] = None
        if t % 6 == 0:
            step[1] = None  # a vector
    zenflow = dict(topk_ratio=0.2, select_strategy="step", select_interval=8, update_interval=4,
                   overlap_step=overlap, full_warm_up_rounds=1)
    opt, ref = _beside_the_reference(device, zenflow, grads)
    assert opt.host_updates == ref.host_updates


@pytest.mark.parametrize("overlap", [False, True])
def test_a_vector_joining_the_fast_path_between_selections_is_stepped_from_then_on(device, overlap):
    """A vector first gets a gradient after warm-up at a step with no selection (its first zenflow step): it joins
    the fast path there with the host's state, and the fast step's plan (laid out once per selection) includes
    it from that step on, as the reference does."""
    grads = grad_sequence(16)
    for t, step in enumerate(grads):
        if 1 <= t <= 4:
            step[1] = None  # a vector: its first gradient after warm-up at step 5
        if 1 <= t <= 2:
            step[3] = None  # another: at step 3
    zenflow = dict(topk_ratio=0.2, select_strategy="step", select_interval=8, update_interval=2,
                   overlap_step=overlap, full_warm_up_rounds=1)
    opt, _ = _beside_the_reference(device, zenflow, grads)
    assert opt.stats()["selection_steps"] == [1, 9]


def test_state_dict_waits_for_the_host_update_in_flight(device, monkeypatch):
    """Saving drains the overlapped host update: a slow one must be finished before master and moments
    are read, or the checkpoint holds half an interval."""
    from zenflow_kernels.host import HostShard

    real = HostShard.update

    def slow_update(self, *args, **kwargs):
        time.sleep(0.2)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HostShard, "update", slow_update)
    grads = grad_sequence(12)
    zenflow = dict(topk_ratio=0.2, select_strategy="step", select_interval=12, update_interval=3, overlap_step=True)
    zp = make_params(device=device)
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        drive(opt, zp, grads[:7])  # the update of steps 3-5 is in flight
        saved = copy.deepcopy(opt.state_dict())
        saved_params = snapshot(zp)
        straight = drive(opt, zp, grads[7:])
    fresh = [torch.nn.Parameter(p.to(device)) for p in saved_params]
    with ZenFlowAdamW(fresh, **HYPER, zenflow=zenflow) as opt2:
        opt2.load_state_dict(saved)
        for t, (a, b) in enumerate(zip(straight, drive(opt2, fresh, grads[7:]), strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"step {7 + t} param {i} differs after resume"


def test_selected_columns_accessor():
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)
    zp = make_params()
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        assert opt.selected_columns(zp[0]) is None
        drive(opt, zp, grad_sequence(1))  # warm-up: nothing selected yet
        assert opt.selected_columns(zp[0]) is None
        drive(opt, zp, grad_sequence(2))
        sel = opt.selected_columns(zp[0])
        assert sel.dtype == torch.int64 and sel.numel() == 4 and torch.equal(sel, sel.sort().values)
        assert opt.selected_columns(zp[1]) is None  # a vector: always on the fast path, no columns
        sel[0] = -1  # a copy: the optimizer's state is untouched
        assert opt.selected_columns(zp[0])[0] >= 0
        with pytest.raises(ValueError, match=r"^selected_columns: the tensor is not a parameter of this optimizer$"):
            opt.selected_columns(torch.zeros(3, 3))


def test_sync_stall_is_the_host_time_on_the_training_thread():
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=6, update_interval=3)
    zp = make_params()
    with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
        drive(opt, zp, grad_sequence(9))
        s = opt.stats()
    assert s["overlap_fraction"] == 0.0 and s["worker_wait_s"] == 0.0
    # synchronous: every host second is a second the training thread did not train
    assert s["stall_s"] == pytest.approx(sum(s["host_update_s"]) + s["accumulate_s"])
    assert s["accumulate_s"] > 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr=-1.0), ValueError, "lr=-1.0"),
        (dict(betas=(0.9, 1.0)), ValueError, "betas"),
        (dict(max_grad_norm=0), ValueError, "max_grad_norm"),
        (dict(zenflow={"topk_ratio": 7}), ValueError, "zenflow.topk_ratio=7"),
        (dict(zenflow={"topk": 0.1}), ValueError, "unknown zenflow key"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZenFlowAdamW(make_params(), **kwargs)


def test_unsupported_uses_raise_clearly():
    zenflow = dict(select_strategy="step", select_interval=4, update_interval=2)
    with pytest.raises(TypeError, match="float64"):
        ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))], zenflow=zenflow)
    zp = make_params()
    opt = ZenFlowAdamW(zp[:3], zenflow=zenflow)
    opt.add_param_group({"params": zp[3:], "lr": 1e-4})  # before the first step: fine
    drive(opt, zp, grad_sequence(1))
    with pytest.raises(RuntimeError, match="add_param_group after the first step"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    zp[0].grad = torch.zeros(24, 16).to_sparse()
    with pytest.raises(ValueError, match="gradient of parameter 0"):
        opt.step()
    opt.close()
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()


def test_every_backend_drives_the_optimizer_alike():
    """The same run through numba, the torch reference and the Triton kernels (interpreted on CPU)."""
    grads = grad_sequence(8)
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)
    results = []
    for backend in ("numba", "torch", "triton"):
        with use_backend(backend):
            zp = make_params(torch.bfloat16)
            with ZenFlowAdamW(zp, **HYPER, zenflow=zenflow) as opt:
                drive(opt, zp, grads)
                opt.flush()
            results.append([p.detach().float() for p in zp])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5)
