"""HostWorker (the background thread every asynchronous job runs on) and HostShard's buffers, directly."""

import threading
import time

import pytest
import torch

from zenflow_kernels.host import HostShard, HostWorker, HostWorkerError


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


def test_submit_after_close_is_a_clear_error():
    w = HostWorker(timeout=5)
    w.close()
    w.close()  # idempotent
    with pytest.raises(HostWorkerError, match=r"^zenflow host worker is not running \(it was closed or it died\)$"):
        w.submit(lambda: None)


def test_host_shard_buffers_have_their_dtypes():
    params = [torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2, 2, dtype=torch.float16)]
    host = HostShard(params, [0, 0, 0], num_acc=2)
    for flat in (host.master, host.exp_avg, host.exp_avg_sq, *host.acc):
        assert flat.dtype == torch.float32 and flat.numel() == host.numel and not flat.any()
    assert sorted(host.out, key=str) == sorted([torch.bfloat16, torch.float32, torch.float16], key=str)
    for dtype, flat in host.out.items():
        assert flat.dtype == dtype and flat.numel() == host.numel
    assert host.out_view(0).dtype == torch.bfloat16 and host.out_view(1).dtype == torch.float32
    assert torch.equal(host.view(host.master, 0), params[0].float())


def test_a_worker_that_stopped_with_jobs_queued_says_so_without_a_traceback():
    from zenflow_kernels.host import _STOP, _Job

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
    host = HostShard(params, [0], num_acc=1)
    hyper = [dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)]
    with pytest.raises(ValueError, match=r"^HostShard.update: last= cannot be combined with max_grad_norm"):
        host.update(0, {0: 1}, hyper, 1.0, last={0: torch.ones(4, 4)})
    assert not host.master.any() and host.host_step == [0]  # nothing changed


def test_update_merges_flat_neighbours_that_share_group_step_and_count():
    """One AdamW call per run of flat neighbours with the same group, dtype, step and gradient count; a
    fused last gradient takes its own pass. The result says how the work was split, and how long it took."""
    params = [torch.zeros(4, 4), torch.zeros(2, 8), torch.zeros(3, 3), torch.zeros(5)]
    host = HostShard(params, [0, 0, 0, 0], num_acc=1)
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
