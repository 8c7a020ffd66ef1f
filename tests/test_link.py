"""The link (device <-> host movement) and its asynchronous CPU test link (``testing.chaos``).

The optimizer tests in test_optim.py run under every link; here: chaos is bit-identical to the
synchronous link across the config space, the landing area is allocated once, backward hooks start
copies that step() uses only while the gradient's fingerprint is unchanged, folds of any size, the host
shard's layout, and the chaos context's own contract.
"""

import contextvars
import copy
import threading
import time
from contextlib import nullcontext

import pytest
import torch
from support import HYPER, SHAPES, drive, grad_sequence, make_params, snapshot

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.device_model import Chaos, Delays, current_chaos
from zenflow_kernels.host import ALIGN, HostShard, out_sizes
from zenflow_kernels.link import AsyncLink, CpuLink, host_alloc, make_engine, make_link
from zenflow_kernels.rules import AdamW
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


def zenflow_threads():
    return [t for t in threading.enumerate() if t.name.startswith("zenflow")]


def new_link(params, *, overlap, host_threads=1, cores=None, timeout=10, chaos=None):
    """A link for CPU ``params`` (one group) as the optimizer builds it: engine, host shard (double-buffered
    accumulation with overlap), link."""
    engine = make_engine(torch.device("cpu"), chaos=chaos, timeout=timeout)
    host = HostShard(params, [0] * len(params), rule=AdamW(), num_acc=2 if overlap else 1, **host_alloc(engine),
                     landing=engine is not None)
    return make_link(host, engine, overlap=overlap, host_threads=host_threads, cores=cores, timeout=timeout)


def tick_link_clocks(monkeypatch):
    """A clock ticking 1 s per read, in the link package's modules only (those that time the training thread)."""
    import types

    from zenflow_kernels.link import asynchronous, base, cpu

    ticks = iter(range(1000))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)), sleep=time.sleep)
    for module in (base, cpu, asynchronous):
        monkeypatch.setattr(module, "time", clock)


CONFIGS = {
    "overlap": dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=3, overlap_step=True),
    "sync-warmup": dict(topk_ratio=0.2, select_strategy="step", select_interval=6, update_interval=2,
                        full_warm_up_rounds=3),
    "auto-offload": dict(topk_ratio=0.25, select_strategy="step", select_interval=9, update_interval="auto",
                         overlap_step=True, offload=True, max_update_interval=4, auto_ratio=0.5),
    "every-step": dict(topk_ratio=0.3, select_strategy="step", select_interval=5, update_interval=1,
                       overlap_step=True),
    "topk0": dict(topk_ratio=0.0, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True),
}


@pytest.mark.parametrize("clip", [None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chaos_is_bit_identical_to_the_synchronous_link(name, dtype, clip):
    """The asynchronous link with random delays must give the synchronous link's bits at every step,
    with some gradients missing now and then (counts that differ between parameters)."""
    grads = grad_sequence(26)
    for t, step in enumerate(grads):
        if t % 5 == 2:
            step[2] = None  # a matrix without a gradient in some intervals
        if t % 7 == 3:
            step[3] = None  # a vector too
    runs, links = [], []
    for seed in (None, 0, 1, 2):
        zp = make_params(dtype)
        if seed is None:
            opt = ZenFlowAdamW(zp, **HYPER, zenflow=CONFIGS[name], max_grad_norm=clip)
        else:
            with chaos(seed=seed):
                opt = ZenFlowAdamW(zp, **HYPER, zenflow=CONFIGS[name], max_grad_norm=clip)
        with opt:
            history = drive(opt, zp, grads)
            opt.flush()
            history.append(snapshot(zp))
            state = opt.state_dict()
            links.append(opt.stats()["link"])
        runs.append((history, state))
    assert links == ["cpu", "cpu-async", "cpu-async", "cpu-async"]
    (base, base_state), others = runs[0], runs[1:]
    for seed, (history, state) in enumerate(others):
        for t, (a, b) in enumerate(zip(base, history, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"seed {seed}: step {t} param {i} differs from the synchronous link"
        for idx, st in base_state["state"].items():
            for key, value in st.items():
                other = state["state"][idx][key]
                same = torch.equal(value, other) if torch.is_tensor(value) else value == other
                assert same, f"seed {seed}: state {idx}.{key}"


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float32, torch.bfloat16)])
def test_the_landing_area_is_allocated_once_in_the_gradients_dtypes(dtypes):
    """One landing buffer per parameter dtype, laid out like the copy-out buffers (each parameter padded to the
    alignment), allocated with the shard and reused for the whole run (allocating per step would cost a pinned
    allocation each time on a GPU); ``host_bytes()["landing"]`` reports it. The synchronous link has none."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtypes[n % len(dtypes)]))
              for n, s in enumerate(SHAPES)]
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True,
                   full_warm_up_rounds=2)
    with chaos(seed=0):
        opt = ZenFlowAdamW(params, **HYPER, zenflow=zenflow)
    with opt:
        drive(opt, params, grad_sequence(12))
        link = opt.link
        assert isinstance(link, AsyncLink)
        sizes = out_sizes(link.host.slots)
        assert {dt: t.numel() for dt, t in link.host.landing.items()} == sizes
        want = sum(n * dt.itemsize for dt, n in sizes.items())
        assert link.landing_bytes == want == opt.host_bytes()["landing"]
        ids = {dt: t.data_ptr() for dt, t in link.host.landing.items()}
        drive(opt, params, grad_sequence(6))
        assert {dt: t.data_ptr() for dt, t in link.host.landing.items()} == ids
    with ZenFlowAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], **HYPER, zenflow=zenflow) as sync:
        drive(sync, sync._params, grad_sequence(2))
        assert sync.host_bytes()["landing"] == 0 and sync.host_shard.landing == {}


@pytest.mark.parametrize("fold_bytes", [64, 1000, 1 << 26])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folds_of_any_size_give_the_synchronous_bits(monkeypatch, fold_bytes, dtype):
    """Fold jobs of any size (one parameter each up to one for the whole step), a loop whose steps have one
    backward or two, undeclared and alternating (the short last step of an epoch), and in-place clipping on
    every third step, under chaos: the synchronous link's bits at every step, no warning, no restart; the
    hand-over stays on (the rewrites are not steps in a row)."""
    monkeypatch.setattr(AsyncLink, "FOLD_CHUNK_BYTES", fold_bytes)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6)).to(dtype)
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(8, 12, generator=g).to(dtype), torch.randn(8, 6, generator=g).to(dtype))
                for _ in range(2)] for _ in range(12)]
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, overlap_step=True,
                   full_warm_up_rounds=1)
    runs = []
    for seed in (None, 0, 1):
        model = copy.deepcopy(base)
        if seed is None:
            opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
        else:
            with chaos(seed=seed):
                opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
        with opt:
            history = [_train(model, opt, batches[t : t + 1], micro=1 + t % 2, clip=t % 3 == 0)[0]
                       for t in range(len(batches))]
            stats = opt.stats()
        assert stats["handover"] == ("on" if seed is not None else "off")
        runs.append(history)
    for run in runs[1:]:
        for t, (a, b) in enumerate(zip(runs[0], run, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"step {t} param {i}"


def _train(model, opt, batches, micro, clip):
    history = []
    for batch in batches:
        opt.zero_grad()
        for x, y in batch[:micro]:  # gradient accumulation: several backward passes per step
            torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # changes the gradients in place
        opt.step()
        history.append(snapshot(model.parameters()))
    return history


@pytest.mark.parametrize("micro, clip", [(1, False), (2, False), (2, True)])
def test_backward_hooks_start_copies_that_step_uses_only_if_unchanged(micro, clip):
    """On an asynchronous link each gradient's copy starts from its post-accumulate-grad hook. A gradient changed
    after its hook (another micro-batch accumulated into it, clipping) is copied again by step(): results stay
    bit-identical to the synchronous link, and the copies are counted. Undeclared micro-batches are learned:
    after the first step with hooks, only the last backward's hooks copy. Clipped at every step, the hooks'
    copies are wasted three steps in a row: hand-over turns off and step() copies alone."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6))
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)) for _ in range(2)]
               for _ in range(14)]
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, overlap_step=True,
                   full_warm_up_rounds=1)
    runs, copied, stats = [], None, None
    for seed in (None, 3):
        model = copy.deepcopy(base)
        if seed is None:
            opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
        else:
            with chaos(seed=seed):
                opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
        with opt:
            runs.append(_train(model, opt, batches, micro, clip))
            copied, stats = opt.link.d2h_bytes, opt.stats()
    for t, (a, b) in enumerate(zip(*runs, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {t} param {i}"
    # the first step builds the optimizer after its backward: step() copies all 4 tensors (warm-up, 462
    # elements). Then the 2 matrices (288 + 144 elements) a step: from the hooks, once a step, but in step 1 once
    # per backward (the count is learned from it); clipped, step() copies them again, and from step 4 alone
    steps = len(batches) - 1
    if not clip:
        assert copied == 4 * (462 + 432 * (steps + micro - 1))
        assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == 4 * 432 * (micro - 1)
    else:
        assert copied == 4 * (462 + 432 * (micro + 1) + 432 * 2 * 2 + 432 * (steps - 3))
        assert stats["handover"] == "off" and "step 3: gradients changed between backward" in stats["handover_why"]


def test_device_accumulation_in_memory_crosses_behind_the_next_steps_compute():
    """The boundary's crossing of the device sums (``device_accumulation``, state in memory) does not hold the
    boundary step (the device's next forward and backward overlap it); the next write into the sums waits for it.
    Here the D2H copy thread is held by a gate past the boundary: that step returns, the next step's ``step()``
    blocks until the gate opens, and the weights are those of the synchronous link."""
    zenflow = dict(topk_ratio=0.2, select_strategy="step", select_interval=100, update_interval=2, overlap_step=True,
                   device_accumulation=True)
    grads = grad_sequence(6)
    want = make_params()
    with ZenFlowAdamW(want, **HYPER, zenflow=zenflow) as opt:
        drive(opt, want, grads)
        opt.flush()
    got = make_params()
    with chaos(seed=0, max_delay=0.0):
        opt = ZenFlowAdamW(got, **HYPER, zenflow=zenflow)
    with opt:
        drive(opt, got, grads[:1])
        gate = threading.Event()
        opt.link.engine._d2h.submit(gate.wait)  # a copy engine busy for as long as the test likes

        def step(t):  # on a thread of its own, with this one's kernel backend (a context variable)
            return threading.Thread(target=contextvars.copy_context().run, args=(drive, opt, got, grads[t : t + 1]),
                                    daemon=True)

        try:
            boundary = step(1)
            boundary.start()
            boundary.join(10)
            assert not boundary.is_alive(), "the boundary step waited for the sums' crossing"
            assert opt.host_updates == 1 and opt.link._sums_zeroed is not None
            nxt = step(2)
            nxt.start()
            nxt.join(0.5)
            assert nxt.is_alive(), "the next step added into sums the crossing had not yet read"
        finally:
            gate.set()  # (a failure above must not leave the threads waiting for host_timeout)
        nxt.join(10)
        assert not nxt.is_alive() and opt.link._sums_zeroed is None
        drive(opt, got, grads[3:])
        opt.flush()
    for i, (x, y) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(x, y), i


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_accumulation_is_bit_identical_and_moves_less(overlap, dtype):
    """``device_accumulation`` sums the interval on the device and uploads it once per update: the same
    bits as accumulating every step on the host, on every link, with update_interval times fewer
    gradient copies (fp32 sums: half the saving in bytes for bf16 gradients)."""
    base = dict(topk_ratio=0.2, select_strategy="step", select_interval=8, update_interval=4, overlap_step=overlap,
                full_warm_up_rounds=1)
    grads = grad_sequence(21)
    for t, step in enumerate(grads):
        if t % 5 == 2:
            step[2] = None
    runs, moved = [], []
    for device_acc, seed in ((False, None), (True, None), (True, 0), (True, 1)):
        zp = make_params(dtype)
        zenflow = dict(base, device_accumulation=device_acc)
        if seed is None:
            opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
        else:
            with chaos(seed=seed):
                opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
        with opt:
            history = drive(opt, zp, grads[:10])
            saved = opt.state_dict()  # mid-interval: the partial sums live on the device
            history += drive(opt, zp, grads[10:])
            opt.flush()
            history.append(snapshot(zp))
            moved.append(opt.stats()["d2h_bytes"])
        runs.append(history)
        if device_acc:
            assert saved["state"][0]["acc"].abs().sum() > 0 and saved["state"][0]["acc_count"] == 1
    for r, other in enumerate(runs[1:], 1):
        for t, (a, b) in enumerate(zip(runs[0], other, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"run {r} step {t} param {i}"
    size = torch.empty(0, dtype=dtype).element_size()
    everything = sum(torch.Size(s).numel() for s in SHAPES) * size
    matrices = [torch.Size(s).numel() for s in SHAPES if len(s) == 2]
    # steps 1..20: every matrix gradient but the 4 missing ones; with device sums one fp32 copy per
    # update of every matrix that had a gradient (5 updates), and warm-up's gradients summed there too (fp32)
    per_step = (sum(matrices) * 20 - matrices[1] * 4) * size
    assert moved[0] == everything + per_step
    assert moved[1:] == [everything // size * 4 + 5 * sum(matrices) * 4] * 3


def test_zeroing_gradients_in_place_waits_for_their_copies(monkeypatch):
    """``zero_grad(set_to_none=False)`` writes into the gradients a D2H copy may still be reading: it must
    wait for the copies first. Copies slowed to 50 ms make the race certain without the wait."""
    from zenflow_kernels.link import ThreadEngine, _submit

    def slow_d2h(self, copies):
        pairs = list(copies)

        def late():
            time.sleep(0.05)
            for dst, src in pairs:
                dst.copy_(src)

        self._last_d2h = _submit(self._d2h, late, None)

    monkeypatch.setattr(ThreadEngine, "d2h", slow_d2h)
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2)
    grads = grad_sequence(8)
    runs = []
    for seed in (None, 0):
        zp = make_params()
        if seed is None:
            opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
        else:
            with chaos(seed=seed, max_delay=0):
                opt = ZenFlowAdamW(zp, **HYPER, zenflow=zenflow)
        history = []
        with opt:
            for step_grads in grads:
                for p, g in zip(zp, step_grads, strict=True):
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)  # gradients written in place, as backward accumulates into them
                opt.step()
                opt.zero_grad(set_to_none=False)
                history.append(snapshot(zp))
        runs.append(history)
    for t, (a, b) in enumerate(zip(*runs, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {t} param {i}"


def test_cpu_link_times_the_host_work_it_does_on_the_training_thread(monkeypatch):
    """accumulate() and upload() add their own duration to ``accumulate_s`` (a clock ticking 1 s per read)."""
    tick_link_clocks(monkeypatch)
    params = make_params()
    link = new_link(params, overlap=False)
    assert isinstance(link, CpuLink)
    grads = [(i, torch.ones_like(p)) for i, p in enumerate(params)]
    link.accumulate(grads, 0)
    link.accumulate(grads, 0)
    assert link.accumulate_s == 2.0
    sums = [(0, torch.full_like(params[0], 3.0))]
    link.upload(sums, 0)
    assert link.accumulate_s == 3.0
    assert torch.equal(link.host.view(link.host.acc[0], 0), torch.full_like(params[0], 3.0))
    assert not sums[0][1].any()  # zeroed for the next interval
    assert torch.equal(link.host.view(link.host.acc[0], 1), torch.full_like(params[1], 2.0))
    link.close()


def test_chaos_delays_every_kind_of_asynchronous_job(monkeypatch):
    """Under chaos every asynchronous completion gets its draw of delays: the gradient copies and their
    marker, the accumulation, the host update and the write-back (a kind left out would let its ordering
    bugs pass unseen)."""
    wrapped = []
    real_wrap = Delays.wrap
    monkeypatch.setattr(Delays, "wrap", lambda self, fn: wrapped.append(fn.__name__) or real_wrap(self, fn))
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, overlap_step=True)
    with chaos(seed=0):
        opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
    with opt:
        drive(opt, opt._params, grad_sequence(5))
    # per step: the copies (their completion is the fold's marker), the fold; per update: the host update, the
    # write-back
    assert {"copy", "fold", "job", "run"} <= set(wrapped), sorted(set(wrapped))
    # one fold job per step (the whole step fits in one chunk; no hook copied: drive() sets the gradients)
    assert wrapped.count("fold") == 5 and wrapped.count("job") == 2


def test_skipped_steps_and_batches_while_folds_are_still_queued_keep_the_synchronous_bits(monkeypatch):
    """Folds slowed to 20 ms each (fold jobs of 512 bytes: several a step), so that the next step's backward
    runs while they are queued: its hooks wait for the places they write (a fold still reads them), and a step
    skipped for a NaN, or a batch dropped with ``zero_grad()``, discards its own copies without touching the
    queued folds of the step before. The synchronous link's bits, the hand-over on."""
    monkeypatch.setattr(AsyncLink, "FOLD_CHUNK_BYTES", 512)
    real = HostShard.fold

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        real(self, *args, **kwargs)

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)) for _ in range(10)]
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, overlap_step=True,
                   full_warm_up_rounds=1)
    runs, stats = [], None
    for seed in (None, 0):
        if seed is not None:
            monkeypatch.setattr(HostShard, "fold", slow)
        model = copy.deepcopy(base)
        with chaos(seed=seed, max_delay=0) if seed is not None else nullcontext():
            opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow)
        history = []
        with opt:
            for t, (x, y) in enumerate(data):
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss * float("nan") if t in (3, 7) else loss).backward()
                if t != 5:
                    opt.step()
                opt.zero_grad()  # (at t = 5: the batch is dropped)
                history.append(snapshot(model.parameters()))
            stats = opt.stats()
        runs.append(history)
    for t, (a, b) in enumerate(zip(*runs, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {t} param {i}"
    assert stats["handover"] == "on" and stats["skipped_steps"] == 2
    # the hooks did wait for queued folds (a lower bound: the folds sleep; nothing here times speed)
    assert stats["worker_wait_s"] >= 0.1, stats["worker_wait_s"]


def test_fold_merges_neighbours_in_the_layout(monkeypatch):
    """A fold adds the landing area into the sums in runs: parameters next to each other in the layout (and so in
    the landing buffer of their dtype) are one range, added as one tensor; a parameter not folded, or of another
    dtype, ends a run. The sums are the landed gradients times the scale, whatever the grouping."""
    import zenflow_kernels.host as host_module

    params = [torch.zeros(s) for s in [(4, 8), (2, 8), (3, 3)]] + [torch.zeros(5, dtype=torch.bfloat16),
                                                                   torch.zeros(6)]
    # flat order: matrices 0, 1, 2, then vectors 3, 4
    host = HostShard(params, [0] * 5, rule=AdamW(), num_acc=1, landing=True)
    calls = []
    real = host_module.accumulate_unchecked
    monkeypatch.setattr(host_module, "accumulate_unchecked",
                        lambda accs, srcs, scale: calls.append([a.numel() for a in accs]) or real(accs, srcs,
                                                                                                  scale=scale))
    for i, p in enumerate(params):
        host.landing_view(i).copy_(torch.arange(1, p.numel() + 1).reshape(p.shape))
    host.fold(0, [4, 1, 0, 3], scale=0.5)  # 0 and 1 adjacent (32 + 16, aligned); 2 left out; 3 bf16; 4 after 3
    assert calls == [[48, 5, 6]]
    for i, p in enumerate(params):
        want = torch.arange(1, p.numel() + 1, dtype=torch.float32).reshape(p.shape) * 0.5 if i != 2 else 0 * p
        assert torch.equal(host.view(host.acc[0], i), want), i
    host.fold(0, [2], scale=1.0)
    assert torch.equal(host.view(host.acc[0], 2), torch.arange(1, 10, dtype=torch.float32).reshape(3, 3))


@pytest.mark.parametrize("stuck", ["d2h", "h2d", "accumulate"])
def test_a_stuck_copy_times_out_with_host_timeout(monkeypatch, stuck):
    """Every thread of the asynchronous link obeys host_timeout: a copy or an accumulation that never
    completes ends the step with an error within seconds, not a hang."""
    from zenflow_kernels.link import ThreadEngine, _submit
    from zenflow_kernels.link.worker import HostWorkerError

    release = threading.Event()

    def stuck_copy(self, work, *_):  # the copy job hangs in its thread (the training thread goes on)
        worker = self._d2h if stuck == "d2h" else self._h2d
        handle = _submit(worker, lambda: release.wait(20), None)
        if stuck == "d2h":
            self._last_d2h = handle
        else:
            self._device_waits.append(handle)
            return handle

    if stuck == "accumulate":
        monkeypatch.setattr(HostShard, "fold", lambda *args: release.wait(20))
    else:
        monkeypatch.setattr(ThreadEngine, stuck, stuck_copy)
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=1)
    with chaos(seed=0, max_delay=0):
        opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow, host_timeout=0.5)
    t0 = time.perf_counter()
    with pytest.raises(HostWorkerError, match="host_timeout=0.5"):
        drive(opt, opt._params, grad_sequence(4))
    assert time.perf_counter() - t0 < 10
    release.set()
    opt.close()


def test_in_place_zeroing_before_any_copy_is_fine():
    """A first step skipped for a NaN stages nothing: zeroing gradients in place then has no copy to wait for."""
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2)
    with chaos(seed=0):
        opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
    with opt:
        grads = grad_sequence(3)
        grads[0][0][0, 0] = float("nan")
        drive(opt, opt._params, grads[:1])
        assert opt.skipped_steps == 1
        opt.zero_grad(set_to_none=False)
        assert opt.state_dict()["zenflow"]["t"] == 0  # nothing accumulated yet: nothing to wait for
        drive(opt, opt._params, grads[1:])
        assert opt.t == 2


def test_the_training_thread_waits_are_timed(monkeypatch):
    """Every wait of the training thread on asynchronous work adds its duration to ``waited_s`` (a clock
    ticking 1 s per read, in the link package only)."""
    tick_link_clocks(monkeypatch)
    params = make_params()
    link = new_link(params, overlap=True, chaos=Chaos(seed=0, max_delay=0))
    assert isinstance(link, AsyncLink)
    done = link.submit_update(lambda: 7)
    assert link.wait(done) == 7 and link.waited_s == 1.0
    assert link.wait(link.submit_update(lambda: 8)) == 8 and link.waited_s == 2.0  # added up, not replaced
    link.write_back([(params[1], link.host.out_view(1), None)])
    link.join()
    assert link.waited_s == 3.0
    link.join()
    assert link.waited_s == 4.0
    link.close()


def test_every_thread_of_the_asynchronous_link_gets_its_share(host_workers_made):
    """The accumulation worker runs with the host worker's threads and cores; the copy threads run no numba."""
    made = host_workers_made
    params = make_params()
    link = new_link(params, overlap=True, host_threads=3, cores=[0], timeout=7, chaos=Chaos())
    try:
        by_name = {m.get("name", "zenflow-host"): m for m in made}
        assert sorted(by_name) == ["zenflow-accumulate", "zenflow-d2h", "zenflow-fetch", "zenflow-h2d", "zenflow-host"]
        for name in ("zenflow-host", "zenflow-accumulate"):
            assert (by_name[name]["num_threads"], by_name[name]["cores"], by_name[name]["timeout"]) == (3, [0], 7)
        for name in ("zenflow-d2h", "zenflow-h2d", "zenflow-fetch"):  # the copy engines
            assert by_name[name].get("num_threads") is None and by_name[name]["timeout"] == 7
        assert len(link.workers) == 5
        assert len(link.host.acc) == 2  # overlap: double-buffered accumulation
    finally:
        link.close()  # (a failure above must not leave threads behind for later tests)
    sync = new_link(params, overlap=False, timeout=7)
    assert len(sync.host.acc) == 1 and sync.workers == []
    sync.close()


def test_asynchronous_link_threads_stop_at_close():
    zenflow = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, update_interval=2, overlap_step=True)
    with chaos(seed=0):
        opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
    drive(opt, opt._params, grad_sequence(5))
    names = sorted(t.name for t in zenflow_threads())
    opt.close()
    assert names == ["zenflow-accumulate", "zenflow-d2h", "zenflow-fetch", "zenflow-h2d", "zenflow-host"]
    assert not zenflow_threads()


def test_links_are_chosen_by_device_and_chaos():
    zenflow = dict(select_strategy="step", select_interval=4, update_interval=2)
    with ZenFlowAdamW(make_params(), zenflow=zenflow) as opt:
        drive(opt, opt._params, grad_sequence(1))
        assert isinstance(opt.link, CpuLink) and opt.stats()["link"] == "cpu"
    with chaos(seed=1, max_delay=0):
        assert current_chaos().seed == 1
        opt = ZenFlowAdamW(make_params(), zenflow=zenflow)
    assert current_chaos() is None
    with opt:  # created inside the block: keeps the asynchronous link after it
        drive(opt, opt._params, grad_sequence(1))
        assert isinstance(opt.link, AsyncLink) and opt.stats()["link"] == "cpu-async"


def test_engines_and_links_are_chosen_by_device_and_chaos():
    """make_engine: CPU without chaos -> no engine; with chaos -> a ThreadEngine carrying its delays (none at
    max_delay 0). make_link: no engine -> CpuLink; a ThreadEngine -> the asynchronous CPU link with its delays.
    host_alloc: the engine's allocator, or HostShard's default."""
    from zenflow_kernels.link import ThreadEngine

    cpu = torch.device("cpu")
    assert make_engine(cpu, chaos=None, timeout=5) is None and host_alloc(None) == {}
    params = make_params()
    for max_delay in (0.0, 0.001):
        engine = make_engine(cpu, chaos=Chaos(seed=3, max_delay=max_delay), timeout=5)
        assert isinstance(engine, ThreadEngine) and host_alloc(engine) == {"alloc": engine.alloc}
        assert (engine.delays is None) == (max_delay == 0)
        host = HostShard(params, [0] * len(params), rule=AdamW(), num_acc=1, **host_alloc(engine), landing=True)
        link = make_link(host, engine, overlap=False, host_threads=1, cores=None, timeout=5)
        try:
            assert isinstance(link, AsyncLink) and link.kind == "cpu-async" and link.host is host
            assert link.engine is engine and link._delays is engine.delays
        finally:
            link.close()
    host = HostShard(params, [0] * len(params), rule=AdamW(), num_acc=1)
    link = make_link(host, None, overlap=False, host_threads=1, cores=None, timeout=5)
    assert isinstance(link, CpuLink) and link.kind == "cpu" and link.host is host
    link.close()


def test_bytes_moved_are_counted():
    """Gradients of the matrices (and, in warm-up, of every parameter) go to the host at each step;
    weights come back at each host update."""
    zenflow = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=3, overlap_step=False,
                   full_warm_up_rounds=1)
    sizes = [torch.Size(s).numel() * 4 for s in SHAPES]
    matrices = sum(n for n, s in zip(sizes, SHAPES, strict=True) if len(s) == 2)
    for seed in (None, 0):
        if seed is None:
            opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
        else:
            with chaos(seed=seed):
                opt = ZenFlowAdamW(make_params(), **HYPER, zenflow=zenflow)
        with opt:
            drive(opt, opt._params, grad_sequence(7))
            s = opt.stats()
        # step 0: warm-up, everything both ways; steps 1-6: matrices down, two host updates bring them back
        assert s["d2h_bytes"] == sum(sizes) + 6 * matrices
        assert s["h2d_bytes"] == sum(sizes) + 2 * matrices
        assert s["d2h_bytes_per_step"] == pytest.approx(s["d2h_bytes"] / 7)
        assert s["h2d_bytes_per_step"] == pytest.approx(s["h2d_bytes"] / 7)


def test_host_shard_layout_is_aligned_and_disjoint():
    """Every parameter starts on a 64-byte boundary of each flat fp32 buffer; ranges never overlap;
    within a group the matrices come first (one numba call per run of parameters)."""
    shapes = [(3, 5), (7,), (1, 1), (13, 3), (2,), (17,), (5, 9)]
    params = [torch.zeros(s) for s in shapes]
    groups = [0, 0, 0, 1, 1, 0, 1]
    host = HostShard(params, groups, rule=AdamW(), num_acc=2)
    spans = sorted((s.offset, s.offset + s.numel) for s in host.slots.values())
    for (_, hi), (next_lo, _) in zip(spans, spans[1:], strict=False):
        assert hi <= next_lo
    assert spans[-1][1] <= host.numel
    for i, slot in host.slots.items():
        assert slot.offset % ALIGN == 0, (i, slot.offset)
        for flat in (host.master, host.exp_avg, host.exp_avg_sq, *host.acc):
            assert host.view(flat, i).data_ptr() % 64 == 0, (i, slot.offset)
        assert host.view(host.master, i).shape == params[i].shape
    order = [(s.group, len(s.shape) != 2) for s in host.order]
    assert order == sorted(order)


def test_chaos_delays_follow_the_seed():
    def draws(seed):
        delays = Delays(Chaos(seed=seed, max_delay=0.01))
        return [delays.draw() for _ in range(50)]

    assert draws(4) == draws(4) and draws(4) != draws(5)
    assert all(min(before, after) >= 0 and before + after <= 0.01 + 1e-12 for before, after in draws(4))
    assert max(b + a for b, a in draws(4)) > 0.005  # the range is used, not only its bottom


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seed=1.5), TypeError, "seed=1.5"),
        (dict(seed=True), TypeError, "seed=True"),
        (dict(max_delay=-1), ValueError, "max_delay=-1"),
        (dict(max_delay=float("inf")), ValueError, "max_delay=inf"),
        (dict(max_delay="1"), ValueError, "max_delay='1'"),
    ],
)
def test_chaos_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match), chaos(**kwargs):
        pass
    assert current_chaos() is None
