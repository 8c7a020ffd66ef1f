"""HostWorker (the background thread every asynchronous job runs on) and HostShard's buffers, directly."""

import threading
import time

import pytest
import torch

from zenflow_kernels.host import HostShard, layout
from zenflow_kernels.link.worker import HostWorker, HostWorkerError, _Job
from zenflow_kernels.rules import AdamW


def test_jobs_run_in_order_and_return_their_results():
    w = HostWorker(timeout=5)
    seen = []
    jobs = [w.submit(lambda i=i: seen.append(i) or i * i) for i in range(20)]
    assert [w.wait(j) for j in reversed(jobs)] == [i * i for i in reversed(range(20))]
    assert seen == list(range(20))
    w.close()


def test_a_failed_job_fails_every_later_wait_and_check_with_its_traceback():
    w = HostWorker(timeout=5)

    def broken():
        raise ValueError("injected")

    first = w.submit(broken)  # nobody waits for it
    later = w.submit(lambda: 42)
    with pytest.raises(HostWorkerError, match=r"(?s)^zenflow host update failed earlier in the background worker:\n"
                                              r".*in broken") as info:
        w.wait(later)  # it ran, but after a failure: not to be trusted
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(HostWorkerError, match=r"(?s)^zenflow host update failed in the background worker:\n"
                                              r".*ValueError: injected"):
        w.wait(first)
    with pytest.raises(HostWorkerError, match="failed earlier"):
        w.check()
    with pytest.raises(HostWorkerError, match="failed earlier"):
        w.submit(lambda: None)
    w.close()


def test_a_dead_worker_is_detected_and_stays_failed():
    w = HostWorker(timeout=5, poll=0.01)

    def dies():
        raise SystemExit("the thread ends here")

    job = w.submit(dies)
    with pytest.raises(HostWorkerError, match=r"(?s)^zenflow host worker thread died before finishing a host update; "
                                              r"the optimizer cannot continue:\n.*SystemExit: the thread ends"):
        w.wait(job)
    with pytest.raises(HostWorkerError, match="failed earlier"):
        w.check()


def test_a_stuck_job_times_out():
    w = HostWorker(timeout=0.2, poll=0.01)
    release = threading.Event()
    job = w.submit(lambda: release.wait(10))
    t0 = time.perf_counter()
    with pytest.raises(HostWorkerError, match=r"^zenflow host update did not finish within host_timeout=0.2 s; "
                                              r"the worker is stuck$"):
        w.wait(job)
    assert time.perf_counter() - t0 < 2
    release.set()
    assert w.wait(job) is True  # it did finish later; a timeout is not a failure
    w.close()


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_a_failed_thread_setup_fails_the_first_submit_however_late_it_fails(delay):
    """The setup failure is recorded before the first submit returns, so a caller that never waits for its job
    (an overlapped update) still hears of it at once; and no job runs on the failed thread."""
    def no_device():
        time.sleep(delay)
        raise RuntimeError("CUDA error: invalid device ordinal")

    w = HostWorker(timeout=5, poll=0.01, setup=no_device)
    ran = []
    with pytest.raises(HostWorkerError, match=r"(?s)failed earlier.*in no_device.*invalid device ordinal"):
        w.submit(ran.append, 1)
    late = _Job(ran.append, (2,))
    w._jobs.put(late)  # a job queued past submit()'s check (a race no caller can win now) is failed, not run
    assert late.done.wait(5)
    assert ran == [] and isinstance(late.error, RuntimeError)
    w.close()


def test_a_hung_thread_setup_times_out_at_submit():
    release = threading.Event()
    w = HostWorker(timeout=0.2, poll=0.01, setup=lambda: release.wait(10))
    t0 = time.perf_counter()
    with pytest.raises(HostWorkerError, match=r"^zenflow host worker's thread setup did not finish within "
                                              r"host_timeout=0.2 s$"):
        w.submit(lambda: None)
    assert time.perf_counter() - t0 < 2
    release.set()
    assert w.wait(w.submit(lambda: 7)) == 7  # it finished later: the worker runs jobs
    w.close()


def test_submit_after_close_is_a_clear_error():
    w = HostWorker(timeout=5)
    w.close()
    w.close()  # idempotent
    with pytest.raises(HostWorkerError, match=r"^zenflow host worker is not running \(it was closed or it died\)$"):
        w.submit(lambda: None)


def test_host_shard_buffers_have_their_dtypes():
    params = [torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2, 2, dtype=torch.float16)]
    host = HostShard(params, [0, 0, 0], rule=AdamW(), num_acc=2)
    for flat in (host.master, host.exp_avg, host.exp_avg_sq, *host.acc):
        assert flat.dtype == torch.float32 and flat.numel() == host.numel and not flat.any()
    assert sorted(host.out, key=str) == sorted([torch.bfloat16, torch.float32, torch.float16], key=str)
    # each copy-out buffer holds only its dtype's parameters (each padded to ALIGN = 16 elements)
    assert {dt: flat.numel() for dt, flat in host.out.items()} == {torch.bfloat16: 16, torch.float32: 16,
                                                                    torch.float16: 16}
    assert host.numel == 48
    for dtype, flat in host.out.items():
        assert flat.dtype == dtype
    assert host.out_view(0).dtype == torch.bfloat16 and host.out_view(1).dtype == torch.float32
    assert torch.equal(host.view(host.master, 0), params[0].float())


def test_copy_out_buffers_are_sized_by_their_dtype_and_views_do_not_overlap():
    """A bf16 model with fp32 vectors: the fp32 copy-out holds the vectors only; two parameters of one
    dtype in one run are neighbours in the copy-out buffer as in the fp32 buffers."""
    shapes = [(40, 8), (8,), (8, 40), (40,), (33,)]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    params = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
    host = HostShard(params, [0] * 5, rule=AdamW(), num_acc=1)
    assert host.out[torch.bfloat16].numel() == 640 and host.out[torch.float32].numel() == 16 + 48 + 48
    for dtype, flat in host.out.items():
        seen = torch.zeros(flat.numel(), dtype=torch.int32)
        for i, slot in host.slots.items():
            if slot.dtype == dtype:
                view = host.out_view(i)
                assert view.shape == params[i].shape
                start = (view.data_ptr() - flat.data_ptr()) // flat.element_size()
                seen[start : start + view.numel()] += 1
        assert seen.max() == 1
    # the two bf16 matrices are flat neighbours (matrices first): adjacent in both buffers
    m0, m2 = host.slots[0], host.slots[2]
    assert m2.offset - m0.offset == m2.out_offset - m0.out_offset == 320


def test_a_worker_that_stopped_with_jobs_queued_says_so_without_a_traceback():
    from zenflow_kernels.link.worker import _STOP, _Job

    w = HostWorker(timeout=5, poll=0.01)
    w._jobs.put(_STOP)
    job = _Job(lambda: 1, ())
    w._jobs.put(job)  # queued behind the stop, as a submit racing close() would be
    with pytest.raises(HostWorkerError) as info:
        w.wait(job)
    assert str(info.value) == ("zenflow host worker thread died before finishing a host update; the optimizer "
                               "cannot continue")


def test_worker_threads_are_daemons_pinned_to_their_cores():
    import os

    cores = sorted(os.sched_getaffinity(0))[:1] if hasattr(os, "sched_getaffinity") else None
    w = HostWorker(timeout=5, cores=cores)
    assert w._thread.daemon  # an optimizer never closed must not keep the interpreter from exiting
    if cores is not None:
        assert w.wait(w.submit(lambda: sorted(os.sched_getaffinity(0)))) == cores
    w.close()
    bad = HostWorker(timeout=5, cores=[10**6])  # an affinity the OS refuses is ignored, not fatal
    assert bad.wait(bad.submit(lambda: 5)) == 5
    bad.close()



def test_close_returns_within_its_timeout_even_with_a_stuck_job():
    w = HostWorker(timeout=5)
    release = threading.Event()
    w.submit(lambda: release.wait(30))
    t0 = time.perf_counter()
    w.close(timeout=0.2)
    assert time.perf_counter() - t0 < 2
    release.set()


def test_a_fused_last_gradient_and_clipping_do_not_mix():
    params = [torch.zeros(4, 4)]
    host = HostShard(params, [0], rule=AdamW(), num_acc=1)
    hyper = [dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)]
    with pytest.raises(ValueError, match=r"^HostShard.update: last= cannot be combined with max_grad_norm"):
        host.update(0, {0: 1}, hyper, 1.0, last={0: torch.ones(4, 4)})
    assert not host.master.any() and host.host_step == [0]  # nothing changed


def test_update_merges_flat_neighbours_that_share_group_step_and_count():
    """One AdamW call per run of flat neighbours with the same group, dtype, step and gradient count; a
    fused last gradient takes its own pass. The result says how the work was split, and how long it took."""
    params = [torch.zeros(4, 4), torch.zeros(2, 8), torch.zeros(3, 3), torch.zeros(5)]
    host = HostShard(params, [0, 0, 0, 0], rule=AdamW(), num_acc=1)
    hyper = [dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)]
    t0 = time.perf_counter()
    out = host.update(0, {0: 1, 1: 1, 2: 2, 3: 1}, hyper, None)
    assert time.perf_counter() - t0 >= out["seconds"] > 0
    # 0 and 1 merge; 2 has another count; 3 (a vector, after the matrices) has 2 between it and 1
    assert {k: out[k] for k in ("params", "runs", "fused")} == {"params": 4, "runs": 3, "fused": 0}
    assert host.host_step == [1, 1, 1, 1]
    out = host.update(0, {0: 1, 1: 1, 2: 1}, hyper, None, last={1: torch.ones(2, 8)})
    assert {k: out[k] for k in ("params", "runs", "fused")} == {"params": 3, "runs": 2, "fused": 1}
    assert host.host_step == [2, 2, 2, 1]


def test_the_usual_intervals_runs_are_kept_and_are_the_general_merges():
    """Every parameter, one count, one step: the layout's runs (group, dtype) merged once and kept; the same runs and
    bits as the general merge (forced here on a second shard), through groups, dtypes and a non-uniform interval."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 4), (2, 8), (3, 3), (6, 2), (5,), (7,)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    groups = [0, 0, 1, 1, 0, 1]
    params = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    hyper = [dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0),
             dict(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)]
    kept, general = (HostShard(params, groups, rule=AdamW(), num_acc=1) for _ in range(2))
    general._indices = frozenset()  # (never the usual interval: the general merge every time)
    for counts in ({i: 2 for i in range(6)}, {i: 1 + (i == 3) for i in range(6)}, {i: 1 for i in range(6)}):
        grads = [torch.randn(s, generator=g) for s in shapes]
        outs = []
        for host in (kept, general):
            for i, grad in enumerate(grads):
                host.view(host.acc[0], i).copy_(grad)
            outs.append(host.update(0, counts, hyper, None)["runs"])
        assert outs[0] == outs[1]
        assert torch.equal(kept.master, general.master) and kept.host_step == general.host_step
        assert all(torch.equal(kept.out[d], general.out[d]) for d in kept.out)
    # flat order 0 1 4 | 2 3 5 (group 0 | group 1, matrices first): 0 and 1 merge; 4 and 2 share a dtype, not a group
    assert [[s.index for s in run] for run in kept._layout_runs] == [[0, 1], [4], [2], [3, 5]]
    assert general._layout_runs is None


def test_a_shard_of_some_parameters_lays_out_only_those():
    """ZeRO: each rank's shard holds its own run of parameters, laid out as a single-rank shard of them."""
    params = [torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2, 20), torch.zeros(7)]
    order, slots, numel = layout(params, [0, 0, 0, 0])
    assert order == [0, 2, 1, 3] and numel == 16 + 48 + 16 + 16  # matrices first, 16-element aligned
    shards = [HostShard(params, [0] * 4, rule=AdamW(), num_acc=1, indices=part) for part in ([0, 2], [1, 3])]
    assert [sorted(s.slots) for s in shards] == [[0, 2], [1, 3]]
    assert [s.numel for s in shards] == [16 + 48, 16 + 16] and sum(s.numel for s in shards) == numel
    assert [s.order[0].offset for s in shards] == [0, 0]  # each shard starts its own buffers
    assert sorted(shards[0].out, key=str) == sorted([torch.bfloat16, torch.float32], key=str)
    assert list(shards[1].out) == [torch.float32]  # only its parameters' dtypes
    with pytest.raises(KeyError):
        shards[1].view(shards[1].master, 0)  # another rank's parameter


def test_update_clips_by_the_norm_summed_over_the_ranks():
    """The clipping norm is the model's: each shard's sum of squares goes through sum_over_ranks."""
    hyper = [dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)]
    results = []
    for factor in (1.0, 4.0):  # as if three more ranks held the same sum of squares
        host = HostShard([torch.zeros(4, 4)], [0], rule=AdamW(), num_acc=1)
        host.acc[0][:16] = 3.0  # norm 12 on this shard
        seen = []
        host.update(0, {0: 1}, hyper, 6.0, sum_over_ranks=lambda x, f=factor, seen=seen: seen.append(x) or f * x)
        assert seen == [144.0]
        results.append(host.exp_avg[:16].clone())
    # Adam's first step moves every weight by about lr whatever the clipping: the moments show the scale
    for factor, got in zip((1.0, 4.0), results, strict=True):
        manual = HostShard([torch.zeros(4, 4)], [0], rule=AdamW(), num_acc=1)
        manual.acc[0][:16] = 3.0
        manual.acc[0][:16] *= min(1.0, 6.0 / (12.0 * factor**0.5 + 1e-6))
        manual.update(0, {0: 1}, hyper, None)
        assert torch.allclose(got, manual.exp_avg[:16], rtol=1e-6)
    assert not torch.allclose(results[0], results[1])
