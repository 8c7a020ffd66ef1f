"""Scale benchmark: the optimizer alone on synthetic gradients, from ~10M parameters to what fits.

    python -m bench.scale [--out DIR] [--quick] [--sizes 512x4 1024x24 ...] [--configs overlap sync devacc]

Transformer-shaped parameters (per layer: qkv [3d, d], out [d, d], up [4d, d], down [d, 4d] in bf16, two norm
vectors [d] in fp32, like tests/test_host_memory.py), gradients drawn once and kept in ``.grad`` (no forward),
``ZenFlowAdamW`` stepped back to back. Each (size, config) runs in a fresh process after a warm-up run, so peak RSS
and first-step costs do not mix; sizes whose predicted memory exceeds ``MemAvailable`` less ``--headroom-gib`` are
skipped and listed. Configs: ``overlap`` (host accumulation), ``sync`` (no overlap) and ``devacc`` (overlap with
``device_accumulation``), all ``topk_ratio=0.1, update_interval=4``, one selection (at the first step), on CPU
``pt_reserved_cores_perc=1.0`` (the host worker takes what torch leaves of the cores, one thread on 2 cores).

Per run:

* host bytes per parameter by buffer (``opt.host_bytes()``), the fast path's state beside them, and the process's
  RSS after the parameters and gradients exist, after the run and at its peak (``getrusage``); glibc is told to
  return freed memory (``MALLOC_ENV``, as the test does), so RSS follows what is live.
* ``step()`` wall time: the first (cold) and the later ones, split into update boundaries and the steps between
  them. The last step is a boundary and ``flush()`` follows, so the last host update runs with nothing beside it.
* the host update (``stats()["host_update_s"]``) against the memory roofline: numba loops with exactly the update's
  memory traffic (``UPDATE_BYTES``; a synchronous update folds the last gradient in: ``FUSED_UPDATE_BYTES``) and
  trivial arithmetic, at the update's thread count (the worker: what torch leaves free; synchronous: the training
  thread's numba threads), measured in each run's process right after it, best of ``ROOF_REPEATS``; the roofline is
  the best any run measured (a run measured while other processes held the cores sees less than the machine
  attains). The accumulation between boundaries is compared with ``acc += g`` (``ACC_BYTES``) at torch's threads.
  This machine is shared: a run that saw other processes take more than ``MAX_OTHER_LOAD`` of the CPUs is run again
  after waiting for quiet, up to ``--attempts`` runs, and the quietest is kept.
* on a GPU (the same command, parameters on ``cuda:0``): the device's peak allocated/reserved memory.

Per-tensor cost of ``step()`` (docs: the issue's item 9): tiny tensors (compute vanishes) at 150 and 300 tensors,
through the synchronous CPU link and the asynchronous one (``testing.chaos(seed=0, max_delay=0)``: the CUDA
protocol's threads, no sleeps), against ``torch.optim.AdamW(foreach=True)``, interleaved step by step, medians over
``--tensor-rounds`` steps; per-tensor cost = the slope between the two counts. DeepSpeed's host bytes per parameter
are cited, not measured (``DEEPSPEED_REFERENCE``).

Results: ``scale_cpu.json`` (``scale_cuda.json`` on a GPU) and a PNG drawn from it, in ``bench/results``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from bench import harness
from bench.harness import OneLineParser, int_at_least, meminfo_bytes, parse_width_layers, rss_bytes, style

# (d, layers): ~12.6M, 42M, 151M, 472M parameters; 6 tensors a layer
SIZES = [(512, 4), (768, 6), (1024, 12), (1280, 24)]
QUICK_SIZES = [(32, 2), (64, 2)]
BASE_ZENFLOW = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=10**6)
CONFIGS = {"overlap": dict(overlap_step=True), "sync": dict(overlap_step=False),
           "devacc": dict(overlap_step=True, device_accumulation=True)}
LR = 1e-4
ROOF_NUMEL = 1 << 25
QUICK_ROOF_NUMEL = 1 << 16
ROOF_REPEATS = 7
MAX_OTHER_LOAD = 0.15
UPDATE_BYTES = 34  # overlapped host update: read master, acc, m, v (fp32); write master, m, v, acc, out (bf16)
FUSED_UPDATE_BYTES = 36  # synchronous: the same plus the last bf16 gradient read
ACC_BYTES = 10  # acc (fp32) += g (bf16): read 4 + 2, write 4
# the budget of docs/design.md section 9 for bf16 parameters: master 4, moments 8, accumulation 4 per
# buffer, copy-out 2
BUDGET = {"master": 4, "exp_avg": 4, "exp_avg_sq": 4, "copy_out": 2}
NUM_ACC = {"overlap": 2, "sync": 1, "devacc": 1}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}

DEEPSPEED_REFERENCE = {
    "zero_offload": {
        "bytes_per_param": 16,
        "what": "fp32 master 4 + Adam moments 8 + fp32 gradient 4 (the ZeRO-Offload figure the issue cites)",
        "counted_in_deepspeed_0.19.8": {
            "file": "deepspeed/runtime/zero/stage_1_and_2.py",
            "buffers": {"fp32 master partition (single_partition_of_fp32_groups)": 4,
                        "fp32 gradient partition (initialize_optimizer_states: .grad)": 4,
                        "exp_avg, exp_avg_sq (DeepSpeedCPUAdam state, fp32)": 8,
                        "bit16 copy of the partition for the H2D copy "
                        "(param_buffer_of_bit16_for_cpu_offload_groups)": 2},
            "total_bf16_params": 18,
        },
    },
    "zenflow_overlap": {
        "bytes_per_param": 32,
        "what": "DeepSpeed ZenFlow with overlap_step (the figure the issue cites)",
        "counted_in_deepspeed_0.19.8": {
            "file": "deepspeed/runtime/zenflow/zenflow_stage_1_and_2.py (ZenFlowZeroOptimizerParallel) and "
                    "zenflow_utils.py (zenflow_optimizer_process)",
            "buffers": {"fp32 master partition": 4,
                        "overlap_grad: two fp32 gradient buffers [buffer, buffer.clone()]": 8,
                        "stale_param: fp32 snapshot of the master the worker writes and the GPU copy reads": 4,
                        "exp_avg0/1 and exp_avg_sq0/1: two fp32 copies of each moment, one per overlap_grad "
                        "state, allocated in the optimizer process": 16,
                        "bit16 copy of the partition (the base ZeRO optimizer's, allocated with cpu_offload)": 2},
            "total_bf16_params": 34,
            "not_counted": "the selective optimizer's state of the selected columns lives on the GPU (host "
                           "memory only with offload_selective_optimizer); temp_grad_buffer_for_cpu_offload is "
                           "one largest-parameter buffer",
        },
    },
}


# -- helpers bench.nvme and bench.step_overhead share ---------------------------------------------------------


def median_or_none(xs):
    return statistics.median(xs) if xs else None


def mean_or_none(xs):
    return statistics.fmean(xs) if xs else None


def slope(points) -> float | None:
    """Least-squares dy/dx of ``(x, y)`` points (None below two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def size_params(d: int, layers: int) -> int:
    return layers * (12 * d * d + 2 * d)


def build_params(d: int, layers: int, device, seed: int = 0):
    """Transformer-shaped parameters with gradients set once: bf16 matrices, fp32 norm vectors."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    params = []
    for _ in range(layers):
        for shape in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)]:
            dtype = torch.bfloat16 if len(shape) == 2 else torch.float32
            p = torch.empty(shape, dtype=dtype).uniform_(-0.02, 0.02, generator=g)
            p = torch.nn.Parameter(p.to(device))
            p.grad = torch.empty(shape, dtype=dtype).uniform_(-1e-3, 1e-3, generator=g).to(device)
            params.append(p)
    return params


def tiny_tensors(count: int, seed: int = 0):
    """Parameters and gradients so small that compute nearly vanishes: alternating fp32 [64, 64] and [64]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params, grads = [], []
    for i in range(count):
        shape = (64, 64) if i % 2 == 0 else (64,)
        params.append(torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02))
        grads.append(torch.randn(shape, generator=g) * 1e-3)
    return params, grads


def warm_up(zen: dict, device="cpu") -> None:
    """What any first run loads once (numba's kernels, torch's ops, the worker's first call), on a tiny model."""
    from zenflow_kernels import ZenFlowAdamW

    with ZenFlowAdamW(build_params(16, 1, device, seed=1), lr=LR, zenflow=zen) as warm:
        for _ in range(2 * zen["update_interval"]):
            warm.step()
    del warm
    gc.collect()


def timed_steps(opt, steps: int, sync=lambda: None, sample=lambda: None) -> tuple:
    """``steps`` back-to-back ``step()`` calls, then ``flush()``: the steps' wall times (to ``sync()``), which were
    update boundaries, ``sample()`` after each, the flush's time and other processes' share of the CPUs meanwhile."""
    load = harness.OtherLoad()
    times, boundary, samples = [], [], []
    for _ in range(steps):
        before = opt.host_updates
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        boundary.append(opt.host_updates > before)
        samples.append(sample())
    t0 = time.perf_counter()
    opt.flush()
    sync()
    return times, boundary, samples, time.perf_counter() - t0, load.fraction()


def split_steps(times: list[float], boundary: list[bool]) -> tuple[list[float], list[float], list[float]]:
    """The steps after the cold first one: all, those at update boundaries and those between them."""
    measured = list(zip(times[1:], boundary[1:], strict=True))
    return [t for t, _ in measured], [t for t, b in measured if b], [t for t, b in measured if not b]


# -- roofline ------------------------------------------------------------------------------------------------


def _roof_kernels():
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True, nogil=True, cache=True)
    def update(p, acc, m, v, out16):
        """The overlapped host update's traffic: read p, acc, m, v; write p, m, v, acc (zeroed), out16."""
        for i in prange(p.size):
            a = acc[i]
            m[i] = m[i] + a
            v[i] = v[i] + a
            p[i] = p[i] + a
            acc[i] = np.float32(0.0)
            out16[i] = np.uint16(a)

    @njit(parallel=True, nogil=True, cache=True)
    def fused(p, acc, g16, m, v, out16):
        """The synchronous update's traffic: update's plus the last bf16 gradient read."""
        for i in prange(p.size):
            a = acc[i] + np.float32(g16[i])
            m[i] = m[i] + a
            v[i] = v[i] + a
            p[i] = p[i] + a
            acc[i] = np.float32(0.0)
            out16[i] = g16[i]

    @njit(parallel=True, nogil=True, cache=True)
    def accumulate(acc, g16):
        """acc (fp32) += g (16-bit): read 6 bytes, write 4."""
        for i in prange(acc.size):
            acc[i] = acc[i] + np.float32(g16[i])

    return update, fused, accumulate


def measure_bandwidth(numel: int, threads: list[int], repeats: int, names=None) -> list[dict]:
    """Effective GB/s of the traffic patterns (``names``, default all three) at each thread count: the
    best of ``repeats`` (``gbps``) and their median (``gbps_median``), patterns interleaved."""
    import numba
    import numpy as np

    update, fused, accumulate = _roof_kernels()
    p, acc, m, v = (np.full(numel, 0.5, dtype=np.float32) for _ in range(4))
    g16 = np.full(numel, 0x3F00, dtype=np.uint16)
    out16 = np.zeros(numel, dtype=np.uint16)
    patterns = {
        "host_update": (UPDATE_BYTES, lambda: update(p, acc, m, v, out16)),
        "fused_host_update": (FUSED_UPDATE_BYTES, lambda: fused(p, acc, g16, m, v, out16)),
        "accumulate": (ACC_BYTES, lambda: accumulate(acc, g16)),
    }
    patterns = {k: v for k, v in patterns.items() if names is None or k in names}
    rows = []
    saved = numba.get_num_threads()
    try:
        for k in threads:
            numba.set_num_threads(k)
            for _, fn in patterns.values():
                fn()  # compile or load, and touch every page
            samples = {name: [] for name in patterns}
            for _ in range(repeats):  # patterns interleaved round by round
                for name, (_, fn) in patterns.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
            for name, (nbytes, _) in patterns.items():
                med, best = statistics.median(samples[name]), min(samples[name])
                rows.append(dict(pattern=name, threads=k, bytes_per_element=nbytes, numel=numel, median_s=med,
                                 min_s=best, gbps=nbytes * numel / best / 1e9, gbps_median=nbytes * numel / med / 1e9))
    finally:
        numba.set_num_threads(saved)
    return rows


# -- one run (a fresh process) --------------------------------------------------------------------------------


def run_one(spec: dict) -> dict:
    """One (size, config) in this process: build, step, flush, measure."""
    import numba
    import torch

    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.cpu_ops import split_cores

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    zen = dict(BASE_ZENFLOW, **CONFIGS[spec["config"]], pt_reserved_cores_perc=1.0 if not cuda else 0.5)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    warm_up(zen, device)
    warmup_s = time.perf_counter() - t0

    rss_base = rss_bytes()
    t0 = time.perf_counter()
    params = build_params(spec["d"], spec["layers"], device)
    build_s = time.perf_counter() - t0
    rss_params = rss_bytes()
    n = sum(p.numel() for p in params)
    n_matrix = sum(p.numel() for p in params if p.dim() == 2)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    opt = ZenFlowAdamW(params, lr=LR, zenflow=zen)
    times, boundary, _, flush_s, other_load = timed_steps(opt, spec["steps"], sync)
    rss_end = rss_bytes()
    stats, hb = opt.stats(), opt.host_bytes()
    device_memory = None
    if cuda:
        device_memory = dict(max_allocated=torch.cuda.max_memory_allocated(device),
                             max_reserved=torch.cuda.max_memory_reserved(device),
                             params_and_grads=sum(p.numel() * p.element_size() * 2 for p in params))
    opt.close()
    # getrusage's high-water mark, or a sample above it (the kernel's per-thread RSS counters lag by a
    # few dozen pages)
    peak = max(harness.peak_rss_bytes(), rss_start, rss_base, rss_params, rss_end)
    n_tensors = len(params)
    del opt, params
    gc.collect()

    measured, at_boundary, between = split_steps(times, boundary)
    overlap = zen["overlap_step"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # the update's threads, by the rule optim/build.py documents: the worker gets what torch leaves free of
    # the shared cores (CPU, pt_reserved_cores_perc=1.0); a synchronous update runs on the training
    # thread with its numba threads
    if overlap:
        host_threads = max(1, cores - torch.get_num_threads()) if not cuda else len(split_cores(0.5)[1])
    else:
        host_threads = numba.get_num_threads()
    updates = stats["host_update_s"]
    pattern = "host_update" if overlap else "fused_host_update"
    t0 = time.perf_counter()
    bandwidth = measure_bandwidth(spec["roof_numel"], sorted({host_threads, torch.get_num_threads()}),
                                  ROOF_REPEATS, names=(pattern, "accumulate"))
    roof_s = time.perf_counter() - t0
    return dict(
        size=f"{spec['d']}x{spec['layers']}", d=spec["d"], layers=spec["layers"], config=spec["config"],
        zenflow=zen, device=str(device), params=n, matrix_params=n_matrix, tensors=n_tensors,
        steps=spec["steps"], torch_threads=torch.get_num_threads(), host_threads=host_threads,
        other_processes_cpu_fraction=other_load,
        host_bytes=hb, bytes_per_param={k: v / n for k, v in hb.items() if k != "per_parameter"},
        rss=dict(start=rss_start, before_params=rss_base, after_params_and_grads=rss_params, end=rss_end,
                 peak=peak, params_and_grads=rss_params - rss_base, growth_over_run=rss_end - rss_params,
                 reported=hb["total"] + hb["fast_state"] + hb["device_sums"],
                 peak_per_param=peak / n, peak_over_base_per_param=(peak - rss_base) / n,
                 growth_per_param=(rss_end - rss_params) / n),
        device_memory=device_memory,
        times=dict(warmup_process_s=warmup_s, build_params_s=build_s, cold_first_step_s=times[0], step_s=times,
                   boundary=boundary, flush_s=flush_s, between_boundaries_median_s=median_or_none(between),
                   boundary_median_s=median_or_none(at_boundary), mean_step_s=mean_or_none(measured)),
        host_update=dict(seconds=updates, last_s=updates[-1] if updates else None, count=len(updates),
                         bytes_per_element=UPDATE_BYTES if overlap else FUSED_UPDATE_BYTES, pattern=pattern),
        bandwidth=bandwidth, bandwidth_s=roof_s,
        stats={k: stats[k] for k in ("steps", "host_updates", "selections", "stall_s", "accumulate_s",
                                     "worker_wait_s", "fast_path_s_mean", "step_s_mean", "link")},
        fast_path_median_s=median_or_none(stats["fast_path_s"][1:]),
    )


# -- per-tensor cost -----------------------------------------------------------------------------------------


def run_tensors(spec: dict) -> dict:
    """step() of ZenFlowAdamW (sync CPU link, asynchronous test link) and torch AdamW(foreach) on the same
    tiny tensors, one step of each in turn."""
    import torch

    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.testing import chaos

    def tiny(count):
        params, grads = tiny_tensors(count)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return params

    zen = dict(BASE_ZENFLOW, overlap_step=True, pt_reserved_cores_perc=1.0)
    rows = []
    for count in spec["counts"]:
        opts = {"zenflow_cpu_link": ZenFlowAdamW(tiny(count), lr=LR, zenflow=zen)}
        with chaos(seed=0, max_delay=0):
            opts["zenflow_async_link"] = ZenFlowAdamW(tiny(count), lr=LR, zenflow=zen)
        opts["torch_adamw_foreach"] = torch.optim.AdamW(tiny(count), lr=LR, foreach=True)
        for opt in opts.values():
            for _ in range(2 * BASE_ZENFLOW["update_interval"]):
                opt.step()
        samples = {name: [] for name in opts}
        flags = {name: [] for name in opts}
        load = harness.OtherLoad()
        for _ in range(spec["rounds"]):
            for name, opt in opts.items():
                before = getattr(opt, "host_updates", 0)
                t0 = time.perf_counter()
                opt.step()
                samples[name].append(time.perf_counter() - t0)
                flags[name].append(getattr(opt, "host_updates", 0) > before)
        other_load = load.fraction()
        for name, opt in opts.items():
            s, f = samples[name], flags[name]
            between = median_or_none([t for t, b in zip(s, f, strict=True) if not b])
            rows.append(dict(tensors=count, candidate=name, median_s=statistics.median(s), mean_s=statistics.fmean(s),
                             between_boundaries_median_s=between,
                             boundary_median_s=median_or_none([t for t, b in zip(s, f, strict=True) if b]),
                             steps=len(s), other_processes_cpu_fraction=other_load))
            if hasattr(opt, "close"):
                opt.close()
    return dict(rows=rows, torch_threads=torch.get_num_threads(), config=zen,
                shapes="alternating [64, 64] matrices and [64] vectors, fp32")


def per_tensor_summary(result: dict) -> dict:
    rows = result["rows"]
    counts = sorted({r["tensors"] for r in rows})
    by = {(r["candidate"], r["tensors"]): r for r in rows}
    out = {}
    for cand in sorted({r["candidate"] for r in rows}):
        lo, hi = by[cand, counts[0]], by[cand, counts[-1]]
        entry = {f"ms_at_{c}": by[cand, c]["median_s"] * 1e3 for c in counts}
        if len(counts) > 1:
            entry["us_per_tensor"] = (hi["median_s"] - lo["median_s"]) / (counts[-1] - counts[0]) * 1e6
        if cand != "torch_adamw_foreach":
            for c in counts:
                entry[f"vs_torch_adamw_at_{c}"] = by[cand, c]["median_s"] / by["torch_adamw_foreach", c]["median_s"]
        out[cand] = entry
    return out


# -- driver ---------------------------------------------------------------------------------------------------


def predicted_bytes(d: int, layers: int, config: str) -> int:
    """A generous estimate of one run's peak RSS: bf16 parameters and gradients 4, the host budget,
    the fast path's state (10% of the columns: fp32 master and moments), devacc's sums, 1.5 GiB of
    interpreter, torch and numba."""
    per = 4 + 14 + 4 * NUM_ACC[config] + 1.2 + (4 if config == "devacc" else 0)
    return int(size_params(d, layers) * per * 1.05 + 1.5 * 2**30)


def _child(kind: str, spec: dict, timeout: float) -> dict:
    return harness.run_child("bench.scale", ["--worker", kind, "--spec", json.dumps(spec)], timeout=timeout,
                             what=f"the {kind} process {spec}", env_extra=MALLOC_ENV)


def best_bandwidth(runs: list[dict]) -> list[dict]:
    """The roofline: per (pattern, threads), the best rate any run of this benchmark measured (the
    attainable bandwidth is the machine's; a run measured while other processes took the cores sees less)."""
    best: dict[tuple[str, int], dict] = {}
    for run in runs:
        for row in run["bandwidth"]:
            key = (row["pattern"], row["threads"])
            if key not in best or row["gbps"] > best[key]["gbps"]:
                best[key] = dict(row, run=f"{run['size']} {run['config']}")
    return sorted(best.values(), key=lambda r: (r["pattern"], r["threads"]))


def add_roofline(run: dict, bandwidth: list[dict]) -> None:
    """Roofline times of this run's host update and accumulation (``bandwidth``: best_bandwidth's), and
    the achieved fractions."""

    def gbps(pattern, threads):
        row = next((r for r in bandwidth if r["pattern"] == pattern and r["threads"] == threads), None)
        return row["gbps"] if row else None

    hu = run["host_update"]
    bw = gbps(hu["pattern"], run["host_threads"])
    if bw and hu["last_s"]:
        hu["roofline_s"] = hu["bytes_per_element"] * run["matrix_params"] / (bw * 1e9)
        hu["fraction_of_roofline_last"] = hu["roofline_s"] / hu["last_s"]
        hu["fraction_of_roofline_median"] = hu["roofline_s"] / statistics.median(hu["seconds"])
        hu["bandwidth_gbps"] = bw
        hu["achieved_gbps_last"] = hu["bytes_per_element"] * run["matrix_params"] / hu["last_s"] / 1e9
    acc_bw = gbps("accumulate", run["torch_threads"])
    between = run["times"]["between_boundaries_median_s"]
    if acc_bw and between and run["config"] != "devacc":
        roof = ACC_BYTES * run["matrix_params"] / (acc_bw * 1e9)
        run["accumulation"] = dict(roofline_s=roof, per_step_s=run["stats"]["accumulate_s"] / run["steps"],
                                   step_between_boundaries_vs_roofline=roof / between)


def growth(runs: list[dict]) -> dict:
    """Per config: ns per parameter of the time per step and the host update (least squares through the
    sizes), the exponent of time ~ params^a between the smallest and the largest size."""
    out = {}
    for config in sorted({r["config"] for r in runs}):
        rs = sorted((r for r in runs if r["config"] == config), key=lambda r: r["params"])
        if len(rs) < 2:
            continue
        entry = {}
        for key, get in (("mean_step", lambda r: r["times"]["mean_step_s"]),
                         ("between_boundaries", lambda r: r["times"]["between_boundaries_median_s"]),
                         ("host_update_last", lambda r: r["host_update"]["last_s"]),
                         ("cold_first_step", lambda r: r["times"]["cold_first_step_s"])):
            pts = [(r["params"], get(r)) for r in rs if get(r)]
            if len(pts) < 2:
                continue
            (x0, y0), (x1, y1), s = pts[0], pts[-1], slope(pts)
            intercept = statistics.fmean(y for _, y in pts) - s * statistics.fmean(x for x, _ in pts)
            entry[key] = dict(ns_per_param=s * 1e9, intercept_ms=intercept * 1e3,
                              exponent=math.log(y1 / y0) / math.log(x1 / x0))
        out[config] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few steps (the test suite's run)")
    ap.add_argument("--sizes", nargs="+", type=parse_width_layers, default=None, metavar="DxL",
                    help="d x layers, e.g. 1024x24 (default: 512x4 768x6 1024x12 1280x24)")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=None)
    ap.add_argument("--steps", type=int_at_least(5), default=None,
                    help="steps per run, the first is the cold one (default 8: two update intervals)")
    ap.add_argument("--tensors", type=int_at_least(2), nargs="+", default=None,
                    help="tensor counts of the per-tensor measurement (default 150 300)")
    ap.add_argument("--tensor-rounds", type=int_at_least(1), default=None, help="steps per candidate (default 300)")
    ap.add_argument("--headroom-gib", type=float, default=4.0,
                    help="leave this much of MemAvailable free when deciding what fits (default 4)")
    ap.add_argument("--attempts", type=int_at_least(1), default=None,
                    help="runs of a measurement while other processes take more than 15%% of the CPUs; the "
                         "quietest is kept (default 2, --quick 1)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--worker", choices=("run", "tensors"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.spec)
        result = run_one(spec) if args.worker == "run" else run_tensors(spec)
        Path(args.worker_out).write_text(json.dumps(result))
        return 0

    import torch

    started = time.time()
    out_dir = harness.output_dir(args.out)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        ap.error(f"argument --device: {device!r} is not cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("argument --device: cuda needs a CUDA GPU; this machine has none")
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    configs = args.configs or list(CONFIGS)
    steps = args.steps or 8
    counts = args.tensors or ([12, 24] if args.quick else [150, 300])
    rounds = args.tensor_rounds or (20 if args.quick else 300)
    attempts = args.attempts or (1 if args.quick else 2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    roof_numel = QUICK_ROOF_NUMEL if args.quick else ROOF_NUMEL

    t0 = time.perf_counter()
    tensors = harness.quietest(lambda: _child("tensors", dict(counts=counts, rounds=rounds), timeout=1800),
                               lambda r: max(row["other_processes_cpu_fraction"] for row in r["rows"]), attempts,
                               MAX_OTHER_LOAD, "per-tensor")
    tensors["summary"] = per_tensor_summary(tensors)
    summary = "; ".join(f"{c}: " + ", ".join(f"{k} {v:.2f}" for k, v in e.items())
                        for c, e in tensors["summary"].items())
    print(f"per-tensor step() ({time.perf_counter() - t0:.0f}s): {summary}", flush=True)

    runs, skipped = [], []
    for d, layers in sorted(sizes, key=lambda s: s[1] * s[0] ** 2):
        for config in configs:
            need, free = predicted_bytes(d, layers, config), meminfo_bytes("MemAvailable")
            if free is not None and need > free - args.headroom_gib * 2**30:
                skipped.append(dict(size=f"{d}x{layers}", config=config, predicted_bytes=need, available_bytes=free,
                                    reason=f"predicted {need / 2**30:.1f} GiB > available {free / 2**30:.1f} GiB "
                                           f"less {args.headroom_gib} GiB headroom"))
                print(f"{d}x{layers} {config}: skipped, {skipped[-1]['reason']}", flush=True)
                continue
            t0 = time.perf_counter()
            spec = dict(d=d, layers=layers, config=config, steps=steps, device=device, roof_numel=roof_numel)
            run = harness.quietest(lambda spec=spec: _child("run", spec, timeout=3600),
                                   lambda r: r["other_processes_cpu_fraction"], attempts, MAX_OTHER_LOAD,
                                   f"{d}x{layers} {config}")
            runs.append(run)
            bpp, tm, hu = run["bytes_per_param"], run["times"], run["host_update"]
            own = next(b["gbps"] for b in run["bandwidth"] if b["pattern"] == hu["pattern"]
                       and b["threads"] == run["host_threads"])
            achieved = hu["bytes_per_element"] * run["matrix_params"] / hu["last_s"] / 1e9
            print(f"{run['size']} ({run['params'] / 1e6:.1f}M, {run['tensors']} tensors) {config}: host "
                  f"{bpp['total']:.2f} B/param (+ fast state {bpp['fast_state']:.2f}), peak RSS "
                  f"{run['rss']['peak_per_param']:.1f} B/param; cold {tm['cold_first_step_s']:.2f}s, step "
                  f"{tm['between_boundaries_median_s'] * 1e3:.1f} ms, boundary {tm['boundary_median_s'] * 1e3:.1f} ms, "
                  f"host update {hu['last_s'] * 1e3:.1f} ms ({achieved:.1f} GB/s at {run['host_threads']} thr; "
                  f"measured after it: {own:.1f}) ({time.perf_counter() - t0:.0f}s)", flush=True)
    bandwidth = best_bandwidth(runs)
    for run in runs:
        add_roofline(run, bandwidth)
    print("host update, fraction of the roofline: " + ", ".join(
        f"{r['size']} {r['config']} {r['host_update'].get('fraction_of_roofline_last', float('nan')):.2f}"
        for r in runs), flush=True)

    kind = "cuda" if device == "cuda" else "cpu"
    payload = dict(
        benchmark="scale", command="python -m bench.scale " + " ".join(sys.argv[1:] if argv is None else argv),
        description=__doc__,
        config=dict(sizes=[f"{d}x{layers}" for d, layers in sizes], configs={c: CONFIGS[c] for c in configs},
                    zenflow=BASE_ZENFLOW, lr=LR, steps=steps, device=device, cores=cores,
                    headroom_gib=args.headroom_gib, malloc_env=MALLOC_ENV, budget_bytes_per_param=BUDGET,
                    tensor_counts=counts, tensor_rounds=rounds, quick=args.quick, roof_numel=roof_numel,
                    roof_repeats=ROOF_REPEATS, max_other_load=MAX_OTHER_LOAD, attempts=attempts),
        roofline_bandwidth=bandwidth, per_tensor=tensors, runs=runs, skipped=skipped, growth=growth(runs),
        deepspeed_reference=DEEPSPEED_REFERENCE, machine=harness.machine_info(), total_s=time.time() - started,
    )
    path = harness.write_result(out_dir / f"scale_{kind}.json", payload)
    plot(payload, out_dir / f"scale_{kind}.png")
    print(f"wrote {path} and {out_dir / f'scale_{kind}.png'} ({payload['total_s']:.0f}s)")
    return 0


# -- plot -----------------------------------------------------------------------------------------------------

_COLORS = {"overlap": "C0", "sync": "C1", "devacc": "C2"}
_BUFFERS = ["master", "exp_avg", "exp_avg_sq", "accumulation", "copy_out", "landing", "fast_state", "device_sums"]


def plot(payload: dict, path) -> None:
    from matplotlib.ticker import NullFormatter

    runs, ds = payload["runs"], payload["deepspeed_reference"]
    fig, axes = harness.figure(3, 2, size=(18, 10))
    configs = [c for c in _COLORS if any(r["config"] == c for r in runs)]

    def curves(ax, c, *lines):
        """Per line (getter, format, label): this config's values against the parameters."""
        rs = sorted((r for r in runs if r["config"] == c), key=lambda r: r["params"])
        for get, fmt, label in lines:
            ax.plot([r["params"] for r in rs], [get(r) for r in rs], fmt, color=_COLORS[c], ms=3, label=f"{c}: {label}")

    def deepspeed(ax):
        ax.axhline(ds["zero_offload"]["bytes_per_param"], color="k", ls=":", lw=1, label="DeepSpeed ZeRO-Offload 16")
        ax.axhline(ds["zenflow_overlap"]["bytes_per_param"], color="k", ls="--", lw=1,
                   label="DeepSpeed ZenFlow overlap ~32")

    ax = axes[0, 0]
    largest = {c: max((r for r in runs if r["config"] == c), key=lambda r: r["params"]) for c in configs}
    bottom = [0.0] * len(configs)
    for i, buf in enumerate(_BUFFERS):
        vals = [largest[c]["bytes_per_param"].get(buf, 0.0) for c in configs]
        if any(vals):
            ax.bar(configs, vals, bottom=bottom, label=buf, color=f"C{i}", hatch="//" if i >= 6 else None)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    deepspeed(ax)
    style(ax, None, "host bytes per parameter", "host buffers by kind at the largest size run" + (
        f" ({largest[configs[0]]['params'] / 1e6:.0f}M)" if configs else ""), grid=None)
    nan = float("nan")
    for c in configs:
        curves(axes[0, 1], c, (lambda r: r["bytes_per_param"]["total"], "-o", "host buffers"),
               (lambda r: r["rss"]["peak_over_base_per_param"], ":s",
                "peak RSS over the process's base (params + grads + all)"))
        curves(axes[0, 2], c, (lambda r: r["times"]["mean_step_s"] * 1e3, "-o", "mean step()"),
               (lambda r: r["times"]["between_boundaries_median_s"] * 1e3, ":", "between boundaries"),
               (lambda r: r["times"]["cold_first_step_s"] * 1e3, "--", "first (cold)"))
        curves(axes[1, 0], c, (lambda r: r["host_update"]["last_s"] * 1e3, "-o",
                               f"host update ({'1 worker' if c != 'sync' else 'training'} thread(s))"),
               (lambda r: r["host_update"].get("roofline_s", nan) * 1e3, ":", "memory roofline"))
        accumulation = (lambda r: r.get("accumulation", {}).get("step_between_boundaries_vs_roofline", nan), ":s",
                        "step between boundaries vs acc += g roofline")
        curves(axes[1, 2], c, (lambda r: r["host_update"].get("fraction_of_roofline_last", nan), "-o", "host update"),
               *([] if c == "devacc" else [accumulation]))
    deepspeed(axes[0, 1])
    axes[1, 2].axhline(1.0, color="k", lw=0.8)
    for ax, ylabel, title, logy in (
            (axes[0, 1], "bytes per parameter", "bytes per parameter against model size", None),
            (axes[0, 2], "ms", "step() time against model size (optimizer alone)", 10),
            (axes[1, 0], "ms", "host update (the last, alone) against the memory roofline", 10),
            (axes[1, 2], "roofline time / measured time",
             "fraction of the memory roofline (the best bandwidth any run measured)", None)):
        style(ax, "parameters", ylabel, title, logx=10, logy=logy)
        ax.xaxis.set_minor_formatter(NullFormatter())
    rows = payload["per_tensor"]["rows"]
    for i, cand in enumerate(sorted({r["candidate"] for r in rows})):
        pts = sorted((r["tensors"], r["median_s"] * 1e3) for r in rows if r["candidate"] == cand)
        axes[1, 1].plot(*zip(*pts, strict=True), "-o", color=f"C{i + 3}", label=cand)
    style(axes[1, 1], "tensors (tiny: compute vanishes)", "step() ms, median", "per-tensor cost of step()")
    harness.save(fig, path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
