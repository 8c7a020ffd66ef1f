"""The CUDA engine run through a faithful stand-in for ``torch.cuda`` (tests/fake_cuda.py): deferred copies on
the side streams, per-thread current streams, and the caching allocator's view of what deferred work reads.

The optimizer runs here with the real ``CudaEngine`` (streams, events, page-locked buffers, record_stream) over
CPU tensors; its copies run late, when something waits for them. So an ordering bug a GPU would expose gives a
wrong number or a recorded violation here: the hand-over (hooks, fingerprints, folds), ``device_accumulation`` in
memory (the sums zeroed behind their crossing) and on disk (the update's reader fetching the sums), against the
synchronous link bit for bit; gradient memory released when ``zero_grad(set_to_none=True)`` returns, as on the
synchronous link. Then the stand-in's own power: the bugs it exists to catch, put back one at a time, are caught.
And each fix of the CUDA-path review (issue 32) with the test that fails without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from fake_cuda import PAGE, FakeCuda

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels import link as link_module
from zenflow_kernels.host import HostShard
from zenflow_kernels.optim import sums as sums_module
from zenflow_kernels.optim.interval import HostInterval
from zenflow_kernels.rules import AdamW

REAL_MAKE_ENGINE = link_module.make_engine  # (the cuda fixture replaces the package's)
HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1,
           overlap_step=True)


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


@pytest.fixture
def cuda(monkeypatch):
    """The stand-in installed, and every ZenFlowAdamW built in the test on the CUDA engine over it (its H2D stream
    eager: the write-back's column gathers are not deferred, see fake_cuda): ``zenflow_kernels.link.make_engine``,
    where the optimizer asks for its engine, answers the CPU parameters with a CUDA engine; the host shard (on the
    engine's page-locked buffers, with a landing area) and ``make_link``'s AsyncLink(kind="cuda") follow from it."""
    fake = FakeCuda().install(monkeypatch)
    fake.engines = []

    def make_engine(device, *, chaos, timeout):
        engine = link_module.CudaEngine(torch.device("cuda", 0))
        engine._h2d.eager = True
        fake.engines.append(engine)
        return engine

    monkeypatch.setattr(link_module, "make_engine", make_engine)
    # device_accumulation's adds into the device sums: a default-stream kernel (the stand-in checks what it touches)
    monkeypatch.setattr(sums_module, "accumulate_unchecked", fake.kernel(sums_module.accumulate_unchecked,
                                                                          "an add into the device sums"))
    return fake


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8))


def batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 24, generator=g), torch.randn(6, 8, generator=g)) for _ in range(steps)]


def train(model, opt, data, *, cuda=None, in_place=(), nan_at=(), rewrite_at=(), held=None):
    """One backward a step; a NaN loss at ``nan_at``; a ``.data`` rewrite of a gradient before step() at
    ``rewrite_at``; zeroing in place at ``in_place``, else set to None, after which (``cuda`` given) the sources of
    the step's copies the program still holds go into ``held``."""
    history = []
    for t, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        (loss * float("nan") if t in nan_at else loss).backward()
        if t in rewrite_at:
            model[2].weight.grad.data.mul_(0.5)
        opt.step()
        handles = cuda.handles([p.grad for p in model.parameters()]) if cuda is not None else []
        opt.zero_grad(set_to_none=t not in in_place)
        if cuda is not None and held is not None and t not in in_place:
            held.extend(cuda.held_by_program(handles))
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def run(zenflow, data, *, fake=None, model=None, max_grad_norm=None, **kw):
    model = copy.deepcopy(model if model is not None else mlp())
    opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow, max_grad_norm=max_grad_norm)
    held: list = []
    with opt:
        history = train(model, opt, data, cuda=fake, held=held, **kw)
        opt.flush()
        history.append([p.detach().clone() for p in model.parameters()])
        stats = opt.stats()
    return history, stats, held


def same(a, b) -> bool:
    return all(torch.equal(x, y) for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True))


CASES = {
    "hand-over": dict(zenflow=ZEN, kw=dict(in_place={3, 7}, nan_at={5}, rewrite_at={2, 6})),
    "clipping": dict(zenflow=ZEN, kw=dict(max_grad_norm=0.5, rewrite_at={4})),
    "device sums": dict(zenflow=dict(ZEN, device_accumulation=True), kw=dict(in_place={3}, nan_at={5})),
    "device sums on disk": dict(zenflow=dict(ZEN, device_accumulation=True, offload_device="nvme"),
                                kw=dict(max_grad_norm=0.5, nan_at={5})),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cuda_engine_on_the_stand_in_gives_the_synchronous_bits(cuda, tmp_path, name):
    """The hand-over (hooks, fingerprints, a .data rewrite after backward, a NaN skip, zeroing in place), clipping,
    ``device_accumulation`` in memory (the sums zeroed behind their crossing) and on disk (the update's reader
    fetching the sums block by block): the CUDA engine's copies run late, yet every step's weights are the
    synchronous link's; no deferred read of freed memory; after ``zero_grad(set_to_none=True)`` the program holds
    none of the gradients it copied."""
    case = CASES[name]
    zenflow = dict(case["zenflow"])
    if zenflow.get("offload_device") == "nvme":
        zenflow["nvme_path"] = str(tmp_path)
    data = batches(12)
    kw = dict(case["kw"])
    max_grad_norm = kw.pop("max_grad_norm", None)
    with pytest.MonkeyPatch.context() as mp:  # the reference: the synchronous CPU link (no stream of the stand-in)
        mp.setattr(link_module, "make_engine", REAL_MAKE_ENGINE)
        want, _, _ = run(zenflow, data, max_grad_norm=max_grad_norm, **kw)
    got, stats, held = run(zenflow, data, fake=cuda, max_grad_norm=max_grad_norm, **kw)
    assert stats["link"] == "cuda" and cuda.engines
    assert same(got, want)
    assert cuda.violations == [] and held == []
    if not zenflow.get("device_accumulation"):
        assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0
    assert any(op[0] == "copy" for op in cuda.log)  # (the copies did go through the stand-in's streams)


def test_gradient_memory_is_released_when_zero_grad_returns(cuda):
    """The sources of every D2H copy are released by the time ``zero_grad(set_to_none=True)`` returns, as on the
    synchronous link: the engine keeps no reference (the caching allocator's ``record_stream`` keeps the memory from
    new work until the copy stream is past it). The engine of before held each batch's sources until its next copy:
    the last batch of a step (the embedding's gradient, last in backward) through the next forward."""
    model, data = mlp(), batches(6)
    _, _, held = run(ZEN, data, fake=cuda, model=model)
    assert held == [] and cuda.violations == []
    recorded = [entry for entry in cuda.log if entry[0] == "record_stream"]
    assert recorded and all(entry[2] is cuda.engines[0]._d2h for entry in recorded)


# -- the stand-in's power: each kind of bug it exists for, put back ----------------------------------------------


def test_put_back_an_early_read_and_the_numbers_change(cuda, monkeypatch):
    """A fold that does not wait for the copies into the landing area reads it before they ran (stale bytes): the
    stand-in runs the copies late, so the weights leave the synchronous link's."""
    data = batches(8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(link_module, "make_engine", REAL_MAKE_ENGINE)
        want, _, _ = run(ZEN, data)
    monkeypatch.setattr(link_module.Event, "wait", lambda self: None)  # the fold's wait for its copies, gone
    got, _, _ = run(ZEN, data, fake=cuda)
    assert not same(got, want)


def test_put_back_a_cross_stream_reuse_and_it_is_flagged(cuda, monkeypatch):
    """Without ``record_stream`` (and without holding the sources), a gradient freed by ``zero_grad`` while its copy is
    queued would go back to the allocator with the copy still to read it: the stand-in records each such read."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)
    run(ZEN, batches(6), fake=cuda, model=mlp())
    assert cuda.violations and "record_stream" in cuda.violations[0]


def test_put_back_a_missing_wait_and_the_numbers_change(cuda, monkeypatch):
    """``device_accumulation``: if the next step's add into the device sums did not wait for their zeroing (queued
    behind the crossing on the D2H stream), the zeroing would run after it and wipe that step's gradient."""
    zenflow = dict(ZEN, device_accumulation=True)
    data = batches(10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(link_module, "make_engine", REAL_MAKE_ENGINE)
        want, _, _ = run(zenflow, data)
    monkeypatch.setattr(link_module.AsyncLink, "sums_ready", lambda self: None)
    got, _, _ = run(zenflow, data, fake=cuda)
    assert not same(got, want)


# -- the review's fixes, each with what fails without it ---------------------------------------------------------


def test_receive_spans_of_the_zero_write_back_are_the_links_pinned_buffers_reused(monkeypatch):
    """ZeRO: the other ranks' copy-out spans this rank receives for the write-back come from the link's allocator
    (page-locked on a GPU: a host-to-device copy from pageable memory blocks the training thread until the GPU's
    queue drains), one buffer per rank and dtype, the same at every exchange."""
    from zenflow_kernels.sharding import zero_context

    params = [torch.zeros(8, 4), torch.zeros(4), torch.zeros(6, 6, dtype=torch.bfloat16), torch.zeros(3)]
    groups = [0] * 4
    ctx = object.__new__(zero_context.ZeroContext)
    ctx.rank, ctx.world = 0, 2
    ctx.owner = zero_context.owners(params, groups, 2)
    order = zero_context.layout(params, groups)[0]
    ctx.layouts = [zero_context.layout(params, groups, [i for i in order if ctx.owner[i] == r])[1] for r in range(2)]
    ctx._host, ctx._receive = object(), {}
    ctx.start = lambda *args, **kwargs: ("handle",)
    monkeypatch.setattr(zero_context.dist, "get_global_rank", lambda group, r: r)
    made = []

    def alloc(numel, dtype):
        made.append(torch.zeros(numel, dtype=dtype))
        return made[-1]

    ctx.use_host_memory(alloc)
    host = HostShard(params, groups, rule=AdamW(), num_acc=1, indices=[i for i in order if ctx.owner[i] == 0])
    theirs = [i for i in range(4) if ctx.owner[i] == 1]
    spans = []
    for _ in range(3):
        exchange = ctx.start_exchange(host, list(range(4)), {i: p.dtype for i, p in enumerate(params)})
        spans.append({i: t.data_ptr() for i, t in exchange.received.items()})
    assert sorted(spans[0]) == theirs and spans[0] == spans[1] == spans[2]
    buffers = {(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in made}
    assert len(made) == len({params[i].dtype for i in theirs})  # one per dtype of the other rank, made once
    assert all(any(lo <= ptr < hi for lo, hi in buffers) for ptr in spans[0].values())
    assert ctx.receive_bytes == sum(t.untyped_storage().nbytes() for t in made)


def test_device_sums_fetches_start_before_the_write_back(cuda, tmp_path, monkeypatch):
    """``device_accumulation`` on disk with overlap: the event the update's fetches wait for is recorded before the
    write-back of the same boundary makes the compute stream wait for the H2D stream, so the fetches (D2H) need
    not wait for the write-back's copies (H2D) and both directions of PCIe work at once."""
    real = HostInterval.boundary
    monkeypatch.setattr(HostInterval, "boundary",
                        lambda self, *a, **kw: cuda.log.append(("host_update",)) or real(self, *a, **kw))
    zenflow = dict(ZEN, device_accumulation=True, offload_device="nvme", nvme_path=str(tmp_path))
    run(zenflow, batches(9), fake=cuda)
    engine = cuda.engines[0]
    default = cuda.default_stream(None)
    ready = {id(e[2]) for e in cuda.log if e[0] == "wait_event" and e[1] is engine._fetch}
    boundaries, current = [], None
    for n, entry in enumerate(cuda.log):
        if entry[0] == "host_update":
            current = dict(ready=None, wait=None)
            boundaries.append(current)
        elif current is not None and entry[0] == "record" and id(entry[1]) in ready and current["ready"] is None:
            current["ready"] = n
        elif current is not None and entry[:3] == ("wait_stream", default, engine._h2d) and current["wait"] is None:
            current["wait"] = n
    # (a boundary right after a re-selection's flush has nothing pending to write back)
    checked = [b for b in boundaries if b["ready"] is not None and b["wait"] is not None]
    assert len(checked) >= 2, boundaries
    assert all(b["ready"] < b["wait"] for b in checked), checked


def test_close_lets_the_fetch_stream_finish_before_unregistering(cuda):
    """A fetch still queued (an update that failed or timed out left it) writes into a page-locked sums block:
    ``close()`` synchronizes the fetch stream before it unregisters any buffer."""
    engine = link_module.CudaEngine(torch.device("cuda", 0))
    block = engine.alloc(8, torch.float32)
    flat = torch.arange(16.0)
    fetch = engine.fetcher(flat)
    fetch(block, 4, 12)  # queued, never waited for
    assert not block.any()
    engine.close()
    assert block.tolist() == list(range(4, 12))
    kinds = [e[0] for e in cuda.log]
    synced = [n for n, e in enumerate(cuda.log) if e == ("stream_synchronize", engine._fetch)]
    assert synced and kinds.index("unregister") > synced[-1]


def test_sums_ready_waits_on_every_access_until_the_zeroing_ran(cuda):
    """The device sums' zeroing (behind their crossing) is waited for by the stream current at each access until it
    is known to have run: a first access under a side stream (``state_dict()`` inside ``torch.cuda.stream(s)``) must
    not leave the default stream's next add racing it."""
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    host = HostShard(params, [0], rule=AdamW(), num_acc=1)
    engine = link_module.CudaEngine(torch.device("cuda", 0))
    link = link_module.AsyncLink(host, engine, kind="cuda", overlap=False, host_threads=1, cores=None, timeout=10)
    try:
        sums = torch.ones(16)
        link._sums_zeroed = engine.behind_d2h(lambda: torch._foreach_zero_([sums]))
        zeroing = link._sums_zeroed
        side = cuda.Stream()
        with torch.cuda.stream(side):
            link.sums_ready()
        assert ("wait_event", side, zeroing) in cuda.log
        assert link._sums_zeroed is zeroing  # not known to have run when asked: kept
        link.sums_ready()  # the default stream's access
        assert ("wait_event", cuda.default_stream(None), zeroing) in cuda.log
        assert not sums.any() and link._sums_zeroed is None  # the default stream waited: it ran, and is dropped
    finally:
        link.close()


def first_step(model, opt):
    """One step (the hooks are on from the next backward); returns the batch."""
    x, y = batches(1)[0]
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return x, y


def test_a_backward_under_cuda_graph_capture_is_a_clear_error(cuda):
    model = mlp()
    opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZEN)
    with opt:
        x, y = first_step(model, opt)
        cuda.capturing = True
        with pytest.raises(RuntimeError, match="captured in a CUDA graph is not supported"):
            F.mse_loss(model(x), y).backward()
        cuda.capturing = False


def test_a_backward_under_compiled_autograd_is_a_clear_error():
    """Compiled autograd traces backward's hooks into a graph, which cannot hold the hooks' host work: the hook
    says so (on the asynchronous CPU link, whose hooks are the CUDA link's)."""
    from zenflow_kernels.testing import chaos

    model = mlp()
    with chaos(seed=0, max_delay=0):
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZEN)
    with opt:
        x, y = first_step(model, opt)
        # (config.patch, not monkeypatch.setattr: undoing a setattr on dynamo's config leaves the flag unreadable,
        # and every later torch.compile in the process fails; torch.compile reads the flag when it wraps)
        with torch._dynamo.config.patch(compiled_autograd=True):

            @torch.compile(backend="eager")
            def step(x, y):
                F.mse_loss(model(x), y).backward()

            with pytest.raises(Exception, match="traced by compiled autograd .* is not supported"):
                step(x, y)


def test_pinned_buffers_are_whole_pages_of_their_own_and_failures_are_named(cuda):
    """A buffer is page-locked as whole pages at a page-aligned address no other allocation shares (the stand-in's
    cudaHostRegister refuses anything else, as a registration overlapping another would fail on a GPU): sizes that
    are not a page's multiple included. A failed registration raises naming the CUDA error, and clears the runtime's
    last error (torch's next kernel launch check would otherwise report it as its own); a failed unregistration at
    close() is raised after the others were tried."""
    engine = link_module.CudaEngine(torch.device("cuda", 0))
    buffers = [engine.alloc(n, dtype) for n, dtype in ((10, torch.float32), (PAGE // 2, torch.bfloat16),
                                                       (1, torch.uint8))]
    assert all(b.data_ptr() % PAGE == 0 and not b.any() for b in buffers)
    assert [c[2] for c in cuda.cudart.calls] == [PAGE, PAGE, PAGE]
    assert engine.pinned_bytes() == {"pinned_requested": 3 * PAGE, "pinned_reserved": 3 * PAGE}
    cuda.cudart.fail_register = True
    with pytest.raises(RuntimeError, match=rf"page-locking {PAGE} bytes of host memory failed: out of memory "
                                           r"\(cudaError 2\)"):
        engine.alloc(7, torch.float32)
    assert cuda.cudart.last_error == 0  # cleared
    cuda.cudart.fail_unregister = True
    with pytest.raises(RuntimeError, match="unlocking page-locked host memory failed for .*not correspond to a "
                                           "registered memory region"):
        engine.close()
    assert [c[0] for c in cuda.cudart.calls].count("unregister") == 3 and cuda.cudart.last_error == 0
    buffers[0].add_(1)  # still valid, pageable memory


def test_the_stand_in_runs_deferred_work_only_when_waited_for(cuda):
    """The stand-in itself: a copy on a side stream has not run until an event after it is synchronized; a query
    runs it but answers False that once; the default stream's wait is a barrier honoured by the next default-stream
    op on memory the queued work touches; such an op with no wait before it is a missing wait."""
    side = cuda.Stream()
    src, dst = torch.ones(3), torch.zeros(3)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(side)
    src.fill_(2)  # (fill_ is not one the stand-in watches) written before the copy ran: the late copy reads it
    assert not dst.any()
    assert event.query() is False and dst.tolist() == [2, 2, 2] and event.query() is True
    device = torch.full((3,), 5.0)
    with torch.cuda.stream(side):
        torch._foreach_copy_([dst], [device], non_blocking=True)
    cuda.default_stream(None).wait_stream(side)
    assert dst.tolist() == [2, 2, 2]  # a wait does not run the work on the host's clock ...
    device.add_(1)  # ... the default stream's next op on its memory does, first
    assert dst.tolist() == [5, 5, 5] and cuda.violations == []
    with torch.cuda.stream(side):
        torch._foreach_zero_([device])
    device.mul_(2)  # no wait orders it after the queued zeroing
    assert cuda.violations and cuda.violations[0].startswith("missing wait: a multiply")
