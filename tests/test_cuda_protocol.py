"""What the CUDA-only code asks of CUDA and of torch.distributed, checked on CPU.

No GPU here: the CUDA engine's calls go to a recording stand-in for ``torch.cuda`` (streams, events,
``set_device``, device guards), so the choices the code makes are asserted where CI runs:

* events the workers wait on are created with ``blocking=True`` (a default event's ``synchronize()``
  spins a core the host AdamW needs);
* every worker thread that waits on CUDA work sets the parameters' device first (a new thread's device
  is 0: its first CUDA call would create a context on GPU 0), on the asynchronous CPU link too;
* NCCL collectives are waited on without a timeout (``Work.wait(timeout)`` polls a CPU core), gloo ones
  with the collective timeout.

tests/test_gpu_link.py runs the real thing on a GPU (bench/gpu_suite.sh).
"""

from __future__ import annotations

import datetime
import mmap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from worker_clock import accumulate_worker_times  # noqa: E402

from zenflow_kernels import ZenFlowAdamW, link
from zenflow_kernels.link.worker import HostWorkerError
from zenflow_kernels.sharding import zero_context
from zenflow_kernels.testing import chaos

ZEN = dict(overlap_step=True, update_interval=1, select_strategy="step", select_interval=4)


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


class _FakeEvent:
    made: list[_FakeEvent] = []

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.blocking = blocking
        self.recorded_on = None
        _FakeEvent.made.append(self)

    def record(self, stream=None):
        self.recorded_on = stream

    def synchronize(self):
        self.synchronized_on = threading.current_thread().name

    def query(self):
        return self.complete

    complete = False


class _FakeStream:
    def __init__(self, device=None):
        self.device = device
        self.waited_for: list[_FakeStream] = []

    def wait_stream(self, other):
        self.waited_for.append(other)

    def wait_event(self, event):
        self.waited_for.append(event)

    def synchronize(self):
        self.synchronized = True


class _FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        del self.registered[ptr]
        return 0


class _FakeCuda:
    """The parts of ``torch.cuda`` the CUDA engine calls, recording what they were given."""

    def __init__(self):
        self.current = _FakeStream("current")
        self.set_devices: list[tuple[str, torch.device]] = []
        self.guards: list[torch.device] = []
        self.cudart = _FakeCudart()

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
        monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: _Nothing())
        monkeypatch.setattr(torch.cuda, "set_device",
                            lambda d: self.set_devices.append((threading.current_thread().name, d)))
        fake = self

        class _Guard(_Nothing):
            def __init__(self, device):
                fake.guards.append(device)

        monkeypatch.setattr(torch.cuda, "device", _Guard)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self.cudart)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cuda_engine_events_block_and_pinning_runs_on_the_engines_device(monkeypatch):
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    _FakeEvent.made.clear()
    device = torch.device("cuda", 3)
    engine = link.CudaEngine(device)
    buf = engine.alloc(10, torch.float32)
    assert buf.shape == (10,) and cuda.guards == [device]
    # page-locked where it is: the whole pages of a mapping of its own (torch's caching host allocator would
    # round 40 B up to a power of two and keep the block after it is freed)
    page = mmap.PAGESIZE
    assert buf.data_ptr() % page == 0 and cuda.cudart.calls == [("register", buf.data_ptr(), page, 1)]
    assert engine.pinned_bytes() == {"pinned_requested": page, "pinned_reserved": page}
    engine.d2h([(torch.zeros(2), torch.ones(2))])
    marker = engine.d2h_marker()
    guard = engine.h2d(lambda: None)
    # the events a thread waits on block; a D2H job records none (its sources are record_stream'ed)
    assert len(_FakeEvent.made) == 2 and marker.event.blocking and guard.event.blocking
    assert marker.event.recorded_on is engine._d2h and guard.event.recorded_on is engine._h2d
    engine.thread_setup()
    assert cuda.set_devices == [(threading.current_thread().name, device)]
    engine.close()  # after the copy streams are done, every buffer is unregistered (and stays usable)
    assert engine._d2h.synchronized and engine._h2d.synchronized
    assert cuda.cudart.registered == {} and engine.pinned_bytes()["pinned_requested"] == 0
    buf.add_(1)


def test_cuda_engine_issues_a_jobs_copies_in_one_call_and_marks_each_source_allocation_once(monkeypatch):
    """One ``torch._foreach_copy_(..., non_blocking=True)`` per D2H job on the D2H stream (not a Python copy_ per
    piece); the engine keeps no source: each source's allocation is marked used by the D2H stream
    (``record_stream``) once, however many of the job's sources view it (a ZeRO bucket, a reduce-scatter's
    output), so the caching allocator keeps it from new work until the copies ran."""
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    calls, marked = [], []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s, non_blocking=False: calls.append(
        (len(d), non_blocking)) or real(d, s))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marked.append((t.untyped_storage().data_ptr(), s)))
    engine = link.CudaEngine(torch.device("cuda", 0))
    bucket = torch.arange(12.0)
    own = [torch.full((3,), float(k)) for k in range(2)]
    srcs = [bucket[0:3], bucket[3:6], bucket[6:12], *own]
    dsts = [torch.zeros(s.numel()) for s in srcs]
    engine.d2h(list(zip(dsts, srcs, strict=True)))
    assert calls == [(5, True)] and [d.tolist() for d in dsts] == [s.tolist() for s in srcs]
    assert cuda.current in engine._d2h.waited_for  # behind the device work that made the sources
    expected = [(bucket.untyped_storage().data_ptr(), engine._d2h)]
    expected += [(t.untyped_storage().data_ptr(), engine._d2h) for t in own]
    assert marked == expected
    assert not hasattr(engine, "_reading")  # nothing holds a source: zero_grad(set_to_none=True) frees it
    engine.d2h([])  # nothing to copy: no call, no mark
    assert len(calls) == 1 and len(marked) == 3
    engine.close()


def test_cuda_engine_fetches_device_sums_behind_the_device_work_and_sleeps_until_copied(monkeypatch):
    """``device_accumulation`` with the state on disk: a host update's reader thread fetches the device sums on
    a stream of the engine's that waits for an event recorded when the sums were handed over (not for later
    device work), under the engine's device guard; the fetch returns without waiting (the reader reads the state
    file meanwhile) a wait that sleeps on a blocking event until the copy is done."""
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    _FakeEvent.made.clear()
    device = torch.device("cuda", 2)
    engine = link.CudaEngine(device)
    fetch = engine.fetcher(torch.arange(10.0))
    [ready] = _FakeEvent.made
    assert ready.recorded_on is cuda.current and not ready.blocking
    dst, waits = torch.zeros(4), []
    reader = threading.Thread(target=lambda: waits.append(fetch(dst, 3, 7)), name="zenflow-state-read")
    reader.start()
    reader.join()
    assert dst.tolist() == [3.0, 4.0, 5.0, 6.0]
    done = _FakeEvent.made[-1]
    assert engine._fetch.waited_for == [ready] and done.recorded_on is engine._fetch
    assert done.blocking and not hasattr(done, "synchronized_on") and cuda.guards == [device]
    assert waits == [done.synchronize]
    reader = threading.Thread(target=waits[0], name="zenflow-state-read")
    reader.start()
    reader.join()
    assert done.synchronized_on == "zenflow-state-read"
    stream = engine._fetch
    engine.fetcher(torch.zeros(3))  # a later update's fetches: the same stream, their own hand-over event
    assert engine._fetch is stream and _FakeEvent.made[-1].recorded_on is cuda.current
    engine.close()


def test_cuda_engine_zeroes_the_uploaded_sums_behind_the_copies_without_holding_the_compute_stream(monkeypatch):
    """``device_accumulation`` in memory: the sums are zeroed on the D2H stream behind their copies, under the
    engine's device guard, and the compute stream waits for that (an event, no host wait) only when asked, before
    the next write into the sums; until then the next forward runs beside the crossing."""
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    active: list = []

    class _On(_Nothing):
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            active.append(self.stream)
            return self

        def __exit__(self, *exc):
            active.pop()
            return False

    monkeypatch.setattr(torch.cuda, "stream", _On)
    _FakeEvent.made.clear()
    device = torch.device("cuda", 1)
    engine = link.CudaEngine(device)
    ran_on = []
    done = engine.behind_d2h(lambda: ran_on.append(active[-1]))
    assert ran_on == [engine._d2h] and cuda.guards == [device]
    assert _FakeEvent.made == [done] and done.recorded_on is engine._d2h and not done.blocking
    assert cuda.current.waited_for == []  # the compute stream goes on
    engine.device_waits_for(done)
    assert cuda.current.waited_for == [done]
    engine.close()


def test_pinned_sizes_count_whole_pages():
    page = mmap.PAGESIZE
    sizes = link.pinned_sizes([(0, 1), (page - 1, 2), (3 * page, 2 * page)])  # 1 page, 2 (a boundary), 2
    assert sizes == {"pinned_requested": 1 + 2 + 2 * page, "pinned_reserved": page + 2 * page + 2 * page}


def test_cuda_engine_orders_later_device_work_after_the_gradient_copies(monkeypatch):
    """Item 6 of the GPU review on the CUDA engine: after a step's copies are issued, the current stream
    waits for the D2H stream (no host wait), so a later in-place write of a gradient cannot race them."""
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    engine = link.CudaEngine(torch.device("cuda", 0))
    engine.d2h([(torch.zeros(2), torch.ones(2))])
    assert cuda.current.waited_for == []
    engine.device_orders_after_d2h()
    assert cuda.current.waited_for == [engine._d2h]


def test_every_worker_thread_that_waits_on_the_engine_runs_its_setup_first(monkeypatch):
    """On the asynchronous CPU link (the CUDA protocol) the update and accumulate workers call the
    engine's ``thread_setup`` (CUDA: ``set_device``) on their own thread before any job."""
    ran: list[str] = []
    monkeypatch.setattr(link.ThreadEngine, "thread_setup", lambda self: ran.append(threading.current_thread().name))
    model = torch.nn.Linear(8, 4)
    with chaos(seed=0, max_delay=0.0):
        opt = ZenFlowAdamW(model.parameters(), zenflow=ZEN)
    with opt:
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        threads = {w._thread.name for w in opt.link.workers}
    assert sorted(ran) == ["zenflow-accumulate", "zenflow-host"], ran
    assert {"zenflow-accumulate", "zenflow-host"} <= threads


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("thread", ["zenflow-host", "zenflow-accumulate"])
def test_a_failing_thread_setup_fails_the_step_with_its_traceback(monkeypatch, thread, late):
    """Either worker's setup failing fails the first step, even when it fails after that step has queued its
    overlapped update (the race a loaded CI machine once lost: the step returned and nobody waited)."""
    def no_device(self):
        if late:
            time.sleep(0.3)
        if threading.current_thread().name == thread:
            raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(link.ThreadEngine, "thread_setup", no_device)
    model = torch.nn.Linear(8, 4)
    with chaos(seed=0, max_delay=0.0):
        opt = ZenFlowAdamW(model.parameters(), zenflow=ZEN)
    model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(HostWorkerError, match="invalid device ordinal"):
        opt.step()
    opt.close()  # a failed link: close() lands nothing and stops the threads


class _FakeWork:
    def __init__(self):
        self.waits: list = []

    def wait(self, *args):
        self.waits.append(args)
        return True


@pytest.mark.parametrize("backend,bounded", [("nccl", False), ("gloo", True)])
def test_collectives_wait_without_polling_on_nccl_and_bounded_on_gloo(monkeypatch, backend, bounded):
    ctx = object.__new__(zero_context.ZeroContext)
    ctx.timeout, ctx._delays, ctx.bytes, ctx.failed = 7.0, None, {}, False
    ctx._train, ctx._host = object(), object()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend if group is ctx._train else "gloo")
    work = _FakeWork()
    ctx.finish(ctx.start("gradients", "all_reduce", torch.zeros(4), lambda: work))
    assert work.waits == ([(datetime.timedelta(seconds=7.0),)] if bounded else [()])
    host_work = _FakeWork()  # the host worker's group is gloo whatever the training group is
    ctx.finish(ctx.start("write-back", "broadcast", torch.zeros(4), lambda: host_work, host=True))
    assert host_work.waits == [(datetime.timedelta(seconds=7.0),)]


def test_the_accumulate_worker_sleeps_while_it_waits(monkeypatch):
    """The accumulate worker waits for each step's copies; its CPU time over 20 steps stays well below
    its wall time (it blocks, it does not spin). On CPU the copies are delayed by chaos; the GPU suite
    runs the same measurement on CUDA events (tests/test_gpu_link.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with chaos(seed=1, max_delay=0.01):
        opt = ZenFlowAdamW(model.parameters(), zenflow=dict(ZEN, update_interval=2, topk_ratio=0.1))
    def train_step():
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()

    with opt:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        cpu, wall = accumulate_worker_times(opt, train_step)
    assert cpu < 0.5 * wall, (cpu, wall)
