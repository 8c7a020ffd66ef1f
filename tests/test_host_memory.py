"""The optimizer's host memory (docs/design.md section 9): what ``host_bytes()`` reports, the budget per
parameter, and that nothing else model-sized is allocated (the process's RSS growth agrees).

Budget per parameter (the optimizer's host buffers, not the parameters, their gradients or the fast
path's state): fp32 master 4, moments 8, accumulation 4 (a second 4 while an overlapped update reads the
first, with host accumulation), a copy-out in the parameter's own dtype, and on an asynchronous link with host
accumulation a landing area in the gradient's dtype (docs/design.md section 5.1). bf16 parameters: 22 bytes
with overlap and host accumulation, 18 otherwise, 2 more for the landing area; fp32: 24 and 20, 4 more.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.host import ALIGN
from zenflow_kernels.testing import chaos

REPO = Path(__file__).resolve().parents[1]


pytestmark = [pytest.mark.subprocess, pytest.mark.usefixtures("numba_backend")]  # (conftest.py)


def _params(matrix_dtype, vector_dtype, d=64, layers=2, seed=0):
    """A transformer-shaped list: per layer qkv, out, up, down matrices and two norm vectors."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(layers):
        for shape in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)]:
            dt = matrix_dtype if len(shape) == 2 else vector_dtype
            params.append(torch.nn.Parameter(torch.randn(shape, generator=g).to(dt)))
    return params


def _run(params, link, zenflow, steps=5):
    zen = dict(topk_ratio=0.1, select_strategy="step", select_interval=4, update_interval=2) | zenflow
    if link == "cpu":
        opt = ZenFlowAdamW(params, zenflow=zen)
    else:
        with chaos(seed=0, max_delay=0.001):
            opt = ZenFlowAdamW(params, zenflow=zen)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return opt


def _padded(n):
    return math.ceil(n / ALIGN) * ALIGN


CASES = {  # name: (matrix dtype, vector dtype, zenflow, accumulation buffers)
    "bf16-overlap": (torch.bfloat16, torch.bfloat16, dict(overlap_step=True), 2),
    "fp32-overlap": (torch.float32, torch.float32, dict(overlap_step=True), 2),
    "mixed-overlap": (torch.bfloat16, torch.float32, dict(overlap_step=True), 2),
    "bf16-sync": (torch.bfloat16, torch.bfloat16, dict(overlap_step=False), 1),
    "mixed-devacc": (torch.bfloat16, torch.float32, dict(overlap_step=True, device_accumulation=True), 1),
    "fp32-devacc-sync": (torch.float32, torch.float32, dict(overlap_step=False, device_accumulation=True), 1),
}


@pytest.mark.parametrize("link", ["cpu", "chaos"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_host_bytes_by_buffer_meet_the_budget(case, link):
    matrix_dtype, vector_dtype, zenflow, num_acc = CASES[case]
    params = _params(matrix_dtype, vector_dtype)
    with _run(params, link, zenflow) as opt:
        hb = opt.host_bytes()
        assert opt.stats()["host_bytes"] == hb
    padded = sum(_padded(p.numel()) for p in params)
    assert hb["master"] == hb["exp_avg"] == hb["exp_avg_sq"] == 4 * padded
    assert hb["accumulation"] == 4 * padded * num_acc
    # one copy-out per dtype, holding only that dtype's parameters
    assert hb["copy_out"] == sum(_padded(p.numel()) * p.element_size() for p in params)
    # the landing area: an asynchronous link's, where gradients cross every step (not summed on the device), laid
    # out like the copy-out, in the gradients' dtype
    landing = link != "cpu" and not zenflow.get("device_accumulation")
    assert hb["landing"] == (hb["copy_out"] if landing else 0)
    assert hb["total"] == sum(hb[k] for k in ("master", "exp_avg", "exp_avg_sq", "accumulation", "copy_out", "landing"))
    n = sum(p.numel() for p in params)
    assert hb["per_parameter"] == pytest.approx(hb["total"] / n)
    # the budget: 12 + 4 per accumulation buffer + the copy-out's dtype (+ the landing area's, the same)
    budget = sum(p.numel() * (12 + 4 * num_acc + p.element_size() * (1 + landing)) for p in params)
    assert hb["total"] <= budget * 1.01  # the alignment padding of 16 elements a parameter
    if matrix_dtype == vector_dtype:
        size = {torch.bfloat16: 2, torch.float32: 4}[matrix_dtype]
        goal = {torch.bfloat16: 22, torch.float32: 24}[matrix_dtype] - (4 if num_acc == 1 else 0) + size * landing
        assert hb["total"] / n <= goal * 1.01
    # the fast path's state lives in host memory on a CPU run: reported beside the budget
    assert hb["fast_state"] > 0
    assert hb["device_sums"] == (4 * padded if zenflow.get("device_accumulation") else 0)
    assert "pinned_requested" not in hb  # nothing is page-locked on CPU


def test_host_bytes_before_the_first_step_is_empty():
    opt = ZenFlowAdamW(_params(torch.float32, torch.float32), zenflow=dict(select_strategy="step", select_interval=4))
    assert opt.host_bytes() == {} and opt.stats()["host_bytes"] == {}


def test_a_reload_frees_the_old_buffers_before_building_new_ones(monkeypatch):
    """load_state_dict builds a new link: the old one's host buffers are gone by then (never two links'
    host memory at once)."""
    from zenflow_kernels import host as host_module

    params = _params(torch.bfloat16, torch.float32)
    opt = _run(params, "chaos", dict(overlap_step=True))
    saved = opt.state_dict()
    shard = opt.host_shard
    old = [weakref.ref(t) for t in (shard.master, shard.exp_avg, *shard.acc, *shard.out.values(),
                                    *shard.landing.values())]
    del shard  # (the test's own reference must not keep the old buffers alive)
    alive_at_build = []
    real_init = host_module.HostShard.__init__

    def init(self, *args, **kwargs):
        alive_at_build.append(sum(r() is not None for r in old))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(host_module.HostShard, "__init__", init)
    opt.load_state_dict(saved)
    assert alive_at_build == [0]
    opt.close()


RSS_SCRIPT = textwrap.dedent(
    r"""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_host_memory import _params, _run
    from zenflow_kernels.ops import use_backend

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    link, zenflow, d, layers = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    with use_backend("numba"):
        # what any first run loads once (numba's kernels, torch's ops): not the optimizer's memory
        _run(_params(torch.bfloat16, torch.float32, d=32, layers=1), link, zenflow, steps=6).close()
        params = _params(torch.bfloat16, torch.float32, d=d, layers=layers)
        for p in params:
            p.grad = torch.zeros_like(p)
        before = rss()
        opt = _run(params, link, zenflow, steps=6)
        opt.link.synchronize()
        after = rss()
        hb = opt.host_bytes()
        opt.close()
    n = sum(p.numel() for p in params)
    print(json.dumps(dict(params=n, growth=after - before, host_bytes=hb)))
    """
)


@pytest.mark.parametrize("link, zenflow", [
    ("chaos", dict(overlap_step=True)),
    ("chaos", dict(overlap_step=True, device_accumulation=True)),
    ("cpu", dict(overlap_step=False)),
])
def test_rss_growth_is_what_host_bytes_reports(link, zenflow):
    """A fresh process, a 12.6M-parameter transformer-shaped list (bf16 matrices, fp32 vectors): its RSS
    grows by the reported host buffers plus the fast path's state (and device_accumulation's sums, host
    memory here) within 1.5 bytes per parameter, so nothing else model-sized is allocated. glibc keeps
    freed memory of up to 32 MiB blocks for reuse (its dynamic mmap threshold); fixed thresholds make RSS
    follow what is live."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(REPO / "tests"), link, json.dumps(zenflow), "512", "4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    n, hb = result["params"], result["host_bytes"]
    reported = hb["total"] + hb["fast_state"] + hb["device_sums"]
    assert n == 12_587_008
    assert abs(result["growth"] - reported) / n <= 1.5, (result["growth"] / n, reported / n, hb)


RSS_GLIBC_SCRIPT = textwrap.dedent(
    r"""
    import ctypes, gc, json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_host_memory import _params, _run
    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.ops import use_backend
    from zenflow_kernels.testing import chaos

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    cases, results = json.loads(sys.argv[2]), []
    with use_backend("numba"):
        for link, zenflow in cases:
            _run(_params(torch.bfloat16, torch.float32, d=32, layers=1), link, zenflow, steps=6).close()
        # a training loop's activations raise glibc's mmap threshold to its ceiling (32 MiB): from then on
        # every smaller temporary comes from the heap, which keeps what is freed
        torch.empty((32 << 20) // 4 - 1024)
        for link, zenflow in cases:
            zen = dict(topk_ratio=0.1, select_strategy="step", select_interval=4, update_interval=2) | zenflow
            params = _params(torch.bfloat16, torch.float32, d=512, layers=4)
            for p in params:
                p.grad = torch.zeros_like(p)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # the baseline is what is live; the run is never trimmed
            before = rss()
            if link == "cpu":
                opt = ZenFlowAdamW(params, zenflow=zen)
            else:
                with chaos(seed=0, max_delay=0):
                    opt = ZenFlowAdamW(params, zenflow=zen)
            g = torch.Generator().manual_seed(1)
            for _ in range(9):  # three selections, four host updates and their write-backs
                for p in params:
                    p.grad.normal_(generator=g)  # in place: the loop itself allocates nothing
                opt.step()
            opt.link.synchronize()
            after = rss()
            n = sum(p.numel() for p in params)
            results.append(dict(params=n, growth=after - before, host_bytes=opt.host_bytes()))
            opt.close()
            del opt, params
    print(json.dumps(results))
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc behaviour")
def test_rss_growth_is_what_host_bytes_reports_with_glibc_defaults():
    """The same check with glibc's own malloc settings (no fixed thresholds), after its mmap threshold has
    risen: RSS grows by the reported buffers within 0.5 bytes per parameter without trimming, through
    re-selections, host updates and write-backs, on the synchronous and the asynchronous link and with
    device accumulation (one process, each run from a trimmed baseline). Model-sized temporaries go back to
    the system at once (zenflow_kernels._memory) and a re-selection rewrites the fast path's state in place;
    before, the heap kept 1.5-5.5 bytes per parameter here."""
    cases = [("cpu", dict(overlap_step=True)), ("chaos", dict(overlap_step=True)),
             ("chaos", dict(overlap_step=True, device_accumulation=True))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", RSS_GLIBC_SCRIPT, str(REPO / "tests"), json.dumps(cases)],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    excess = {}
    for (link, zenflow), result in zip(cases, results, strict=True):
        n, hb = result["params"], result["host_bytes"]
        assert n == 12_587_008
        reported = hb["total"] + hb["fast_state"] + hb["device_sums"]
        excess[f"{link} {zenflow}"] = (result["growth"] - reported) / n
    assert all(abs(e) <= 0.5 for e in excess.values()), excess
