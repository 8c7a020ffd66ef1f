"""The NVMe tier (issue 25) measured: its storage pass against this disk's roofline, and whole optimizer runs
with the host state on disk beside the same runs with it in memory.

    python -m bench.nvme [--out DIR] [--quick] [--dir PATH] [--sizes 16 64 256] [--repeats 2]
                        [--run-sizes 768x6 1024x12 ...] [--configs overlap sync devacc] [--intervals 4 8 16]
                        [--stall-size 1024x12] [--attempts 2] [--headroom-gib 4]

**Storage pass.** For each size (millions of parameters; the state file holds 12 bytes per parameter: fp32
master and both moments) and each way of opening the file (``buffered``: the page cache between the process
and the disk; ``direct``: ``O_DIRECT``), two passes over the same bytes with the same block size and the same
system calls:

* ``roofline``: a plain sequential pass, read a block then write it back, one thread, nothing computed;
* ``streamed``: ``streamed_host_step_``, the host update (here AdamW's) over the file (read ahead, the numba kernel,
  write behind; the in-memory host's bits, tests/test_state_files.py).

Reported per pass: seconds, GB/s of disk traffic (read + write), the streamed pass over the roofline (goal
of issue 25: >= 0.7), and how much the page cache (``/proc/meminfo`` Cached) grew during the pass. Before
each pass the file's pages are written out and dropped from the cache (``fdatasync`` +
``POSIX_FADV_DONTNEED``), so a buffered read comes from the disk.

**Optimizer runs.** ``ZenFlowAdamW`` alone on bench.scale's transformer-shaped parameters (bf16 matrices,
fp32 norms, gradients drawn once and kept in ``.grad``), ``topk_ratio=0.1``, one selection, stepped back to
back, each (size, config, update_interval, where the state lives) in a fresh process (bench.scale's pattern:
a warm-up run first, glibc told to return freed memory, other processes' CPU share recorded and a run that
saw more than ``MAX_OTHER_LOAD`` run again, up to ``--attempts``, the quietest kept). ``offload_device``
``nvme`` (the state file under ``--dir``, ``O_DIRECT``: ``ZenFlowAdamW.NVME_DIRECT``) and ``cpu`` (in memory)
run one after the other with the same parameters, gradients and config. Sizes whose predicted memory (or
state file) does not fit what the machine has free are skipped and listed, before anything starts.

* memory (configs ``overlap``, ``sync``, ``devacc`` as in bench.scale, ``update_interval`` 4, every run
  size): the process's RSS growth over the run (after the parameters and gradients exist, to after the
  last host update; its peak beside it) per parameter, and its slope across the sizes (least squares:
  what a parameter more costs, without the process's constant part, e.g. the update's three 12 MiB block
  buffers and, for ``devacc`` on disk, the three 4 MiB blocks it fetches the device's sums into). On this
  CPU-only machine the "device" is process memory too: the fast path's state and ``device_accumulation``'s
  sums (``host_bytes()`` ``fast_state`` and ``device_sums``, as bench.scale and tests/test_host_memory.py
  count them) are taken off the RSS to give the host side, which is what the issue's goals (10.5, 6.5 and
  2.5 bytes per parameter on disk) are compared with, beside the host buffers ``host_bytes()`` reports
  (``total``; ``disk`` apart);
* page cache: ``/proc/meminfo`` Cached before the optimizer is built, its largest value after any step,
  and after the last host update (the whole machine's: other processes' files count too);
* stall (config ``overlap`` at ``--stall-size``, ``update_interval`` in ``--intervals``): ``step()`` wall
  time per step, the cold first step apart, at update boundaries and between them (mean and median), and
  the training thread's waits for the worker (``stats()["worker_wait_s"]``), disk against memory;
* the host update: ``stats()["host_update_s"]`` (the last one runs alone, during ``flush()``) against a
  plain read+write pass (the storage roofline above) over a file of the same size, measured in the same
  process right after the run;
* the final weights' SHA-256: the disk run and the memory run of one config must agree bit for bit.

Sizes up to 1 B parameters by default (2048x20: 1.007 B; two update intervals at sizes from
``LONG_RUN_PARAMS`` on, three below). Results: ``nvme_cpu.json`` and ``nvme_cpu.png`` in ``bench/results``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import (
    OneLineParser,
    int_at_least,
    machine_info_light,
    meminfo_bytes,
    output_dir,
    parse_width_layers,
    peak_rss_bytes,
    plt,
    rss_bytes,
    run_child,
    write_json_light,
)

SIZES_M = [16, 64, 256]
QUICK_SIZES_M = [1]
BLOCK_NUMEL = 1 << 20
MODES = ("buffered", "direct")
GOAL = 0.7

# optimizer runs: (d, layers) as bench.scale's; ~42M, 151M, 472M and 1.007B parameters
RUN_SIZES = [(768, 6), (1024, 12), (1280, 24), (2048, 20)]
QUICK_RUN_SIZES = [(64, 2)]  # one size: a child process costs seconds (torch, numba), the test stays short
STALL_SIZE = (1024, 12)
QUICK_STALL_SIZE = (64, 2)
STALL_INTERVALS = [4, 8, 16]
QUICK_STALL_INTERVALS = [4]
MEMORY_INTERVAL = 4  # the memory runs' update_interval (bench.scale's)
OFFLOADS = ("nvme", "cpu")  # disk first: a run that does not fit is the in-memory one
LONG_RUN_PARAMS = 5 * 10**8  # from here on two update intervals a run (a handful of steps at 1 B), three below
LR = 1e-4
MAX_OTHER_LOAD = 0.15
# issue 25's goals for the host side of each config with the state on disk, bytes per parameter
GOAL_BYTES_PER_PARAM = {"overlap": 10.5, "sync": 6.5, "devacc": 2.5}
STREAM_BUFFERS_BOUND = 3 * BLOCK_NUMEL * 12  # the update's pipeline: three blocks of master + moments


# -- the storage pass -----------------------------------------------------------------------------------------


def file_descriptor(files) -> int:
    """A descriptor of this benchmark's own on the state file (``files.path``; the caller closes it): syncing and
    dropping act on the file's data and its pages in the cache, whichever descriptor names the file."""
    return os.open(files.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


def drop_from_cache(fd: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def plain_pass(files) -> None:
    bufs = files.new_block()
    for j in range(files.blocks):
        files.read_block(j, bufs)
        files.write_block(j, bufs)


def timed_passes(files, fn, repeats: int, flush: bool) -> dict:
    """``fn()`` ``repeats`` times, each from a cold cache: seconds, the best as GB/s of traffic, cache growth."""
    seconds, grew = [], []
    fd = file_descriptor(files)
    try:
        for _ in range(repeats):
            drop_from_cache(fd)
            before = meminfo_bytes("Cached")
            t0 = time.perf_counter()
            fn()
            if flush:
                os.fdatasync(fd)  # the written bytes reached the disk: part of the pass
            seconds.append(time.perf_counter() - t0)
            after = meminfo_bytes("Cached")
            grew.append(None if before is None else after - before)
    finally:
        os.close(fd)
    best = min(seconds)
    return dict(seconds=seconds, best_s=best, gb_per_s=2 * files.nbytes / best / 1e9, cache_growth_bytes=grew)


def measure(size_m: int, mode: str, where: str, repeats: int) -> dict:
    import torch

    from zenflow_kernels.rules import AdamW
    from zenflow_kernels.state_files import StateFileError, StateFiles
    from zenflow_kernels.streamed_host import RangeStep, streamed_host_step_

    numel, rule = size_m * (1 << 20), AdamW()
    try:
        files = StateFiles(where, numel, fields=("master", *rule.state_names), block_numel=min(BLOCK_NUMEL, numel),
                           direct=mode == "direct")
    except (StateFileError, ValueError) as exc:
        return dict(size_m=size_m, mode=mode, skipped=str(exc))
    try:
        acc = torch.ones(numel)
        run = RangeStep(0, numel, None, dict(step=1, grad_scale=1.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                       weight_decay=0.01))
        plain_pass(files)  # every block written once (allocated space reads as zeros but may be unwritten)
        small = RangeStep(0, min(numel, 1024), None, run.step_args)
        # the numba kernel compiled (or loaded) before anything is timed
        streamed_host_step_(files, acc, [small], rule=rule)
        out = dict(size_m=size_m, mode=mode, file_bytes=files.nbytes, traffic_bytes=2 * files.nbytes)
        for name, fn in (("roofline", lambda: plain_pass(files)),
                         ("streamed", lambda: streamed_host_step_(files, acc, [run], rule=rule))):
            out[name] = timed_passes(files, fn, repeats, flush=mode == "buffered")
        out["streamed_over_roofline"] = out["roofline"]["best_s"] / out["streamed"]["best_s"]
        return out
    finally:
        files.close()


def disk_roofline(where: str, numel: int, block_numel: int, direct: bool, repeats: int) -> dict:
    """The plain read+write pass over a state file of ``numel`` elements a field, opened as the optimizer
    opens its own (block size, ``O_DIRECT``): the roofline of a host update's disk pass."""
    from zenflow_kernels.rules import AdamW
    from zenflow_kernels.state_files import StateFiles

    files = StateFiles(where, numel, fields=("master", *AdamW.state_names), block_numel=block_numel, direct=direct)
    try:
        plain_pass(files)  # every block written once, as the optimizer's first step writes its file
        return dict(file_bytes=files.nbytes, **timed_passes(files, lambda: plain_pass(files), repeats,
                                                            flush=not direct))
    finally:
        files.close()


# -- one optimizer run (a fresh process) ----------------------------------------------------------------------


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _median(xs):
    return statistics.median(xs) if xs else None


def zenflow_config(spec: dict) -> dict:
    from bench.scale import BASE_ZENFLOW, CONFIGS

    zen = dict(BASE_ZENFLOW, **CONFIGS[spec["config"]], update_interval=spec["update_interval"],
               pt_reserved_cores_perc=1.0)  # training and the worker share the cores (bench.scale's CPU setting)
    if spec["offload"] == "nvme":
        zen.update(offload_device="nvme", nvme_path=spec["dir"])
    return zen


def padded_numel(params) -> int:
    """Elements a field of the host shard holds: each parameter padded to the host's alignment."""
    from zenflow_kernels.host import ALIGN

    return sum(math.ceil(p.numel() / ALIGN) * ALIGN for p in params)


def weights_sha256(params) -> str:
    """The parameters' bytes, in order: equal digests are bit-identical weights."""
    import torch

    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def warm_up(zen: dict) -> None:
    """What any first run loads once (numba's kernels, torch's ops, the worker's first call), on a tiny model."""
    from bench.scale import build_params
    from zenflow_kernels import ZenFlowAdamW

    with ZenFlowAdamW(build_params(16, 1, "cpu", seed=1), lr=LR, zenflow=zen) as warm:
        for _ in range(2 * zen["update_interval"]):
            warm.step()
    del warm
    gc.collect()


def step_times(opt, steps: int) -> tuple[list[float], list[bool], int | None]:
    """``steps`` back-to-back ``step()`` calls: their wall times, which were update boundaries, and the page
    cache's largest size after any of them."""
    times, boundary, cached = [], [], []
    for _ in range(steps):
        before = opt.host_updates
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        boundary.append(opt.host_updates > before)
        cached.append(meminfo_bytes("Cached"))
    return times, boundary, max(cached) if None not in cached else None


def step_summary(times: list[float], boundary: list[bool], flush_s: float) -> dict:
    """The cold first step apart; the rest split into update boundaries and the steps between them."""
    measured = list(zip(times[1:], boundary[1:], strict=True))
    at_boundary = [t for t, b in measured if b]
    between = [t for t, b in measured if not b]
    return dict(step_s=times, boundary=boundary, cold_first_step_s=times[0], flush_s=flush_s,
                mean_step_s=_mean([t for t, _ in measured]), boundary_mean_s=_mean(at_boundary),
                boundary_median_s=_median(at_boundary), between_mean_s=_mean(between),
                between_median_s=_median(between))


def run_one(spec: dict) -> dict:
    """One (size, config, update_interval, offload) in this process: build, step, flush, measure."""
    from bench.harness import OtherLoad
    from bench.scale import build_params
    from zenflow_kernels import ZenFlowAdamW

    zen = zenflow_config(spec)
    warm_up(zen)
    rss_base = rss_bytes()
    params = build_params(spec["d"], spec["layers"], "cpu")
    rss_params = rss_bytes()
    n = sum(p.numel() for p in params)
    cache_before = meminfo_bytes("Cached")
    opt = ZenFlowAdamW(params, lr=LR, zenflow=zen)
    load = OtherLoad()
    times, boundary, cache_max = step_times(opt, spec["steps"])
    t0 = time.perf_counter()
    opt.flush()
    flush_s = time.perf_counter() - t0
    other_load = load.fraction()
    rss_end, cache_end = rss_bytes(), meminfo_bytes("Cached")
    stats, hb = opt.stats(), opt.host_bytes()
    block, direct = opt.NVME_BLOCK_NUMEL, opt.NVME_DIRECT
    opt.close()
    peak = max(peak_rss_bytes(), rss_end)
    sha = weights_sha256(params)
    device_side = hb["fast_state"] + hb["device_sums"]
    growth = rss_end - rss_params
    out = dict(
        size=f"{spec['d']}x{spec['layers']}", d=spec["d"], layers=spec["layers"], config=spec["config"],
        offload=spec["offload"], update_interval=spec["update_interval"], steps=spec["steps"], zenflow=zen,
        params=n, padded_numel=padded_numel(params), block_numel=block, direct=direct,
        other_processes_cpu_fraction=other_load, weights_sha256=sha,
        host_bytes=hb, bytes_per_param={k: v / n for k, v in hb.items() if k != "per_parameter"},
        rss=dict(before_params=rss_base, after_params_and_grads=rss_params, end=rss_end, peak=peak,
                 growth_over_run=growth, peak_over_params=peak - rss_params, device_side=device_side,
                 host_side_growth=growth - device_side, growth_per_param=growth / n,
                 host_side_growth_per_param=(growth - device_side) / n),
        page_cache=dict(before=cache_before, max=cache_max, end=cache_end,
                        growth_max=None if cache_before is None else cache_max - cache_before,
                        growth_end=None if cache_before is None else cache_end - cache_before),
        times=step_summary(times, boundary, flush_s),
        host_update=dict(seconds=stats["host_update_s"], last_s=stats["host_update_s"][-1],
                         mean_s=_mean(stats["host_update_s"]), count=len(stats["host_update_s"])),
        stats={k: stats[k] for k in ("steps", "host_updates", "selections", "stall_s", "accumulate_s",
                                     "worker_wait_s", "step_s_mean", "link")},
    )
    del opt, params
    gc.collect()
    if spec["offload"] == "nvme":
        roof = disk_roofline(spec["dir"], out["padded_numel"], block, direct, spec["roof_repeats"])
        hu = out["host_update"]
        hu.update(disk_roofline=roof, disk_traffic_bytes=2 * roof["file_bytes"],
                  roofline_over_last=roof["best_s"] / hu["last_s"], roofline_over_mean=roof["best_s"] / hu["mean_s"])
    return out


# -- the driver: which runs, which fit, the quietest of a few attempts ----------------------------------------


def size_params(d: int, layers: int) -> int:
    return layers * (12 * d * d + 2 * d)


def planned_runs(sizes, configs, stall_size, intervals, quick: bool) -> list[dict]:
    """Every memory run (each size and config at MEMORY_INTERVAL) and stall run (overlap at the stall size,
    each interval), once, by size; each on disk then in memory, one after the other."""
    keys = [(d, layers, c, MEMORY_INTERVAL) for d, layers in sizes for c in configs]
    keys += [(*stall_size, "overlap", s) for s in intervals]
    order = {c: i for i, c in enumerate(GOAL_BYTES_PER_PARAM)}
    keys = sorted(set(keys), key=lambda k: (size_params(k[0], k[1]), order[k[2]], k[3]))
    specs = []
    for d, layers, config, interval in keys:
        count = 2 if quick or size_params(d, layers) >= LONG_RUN_PARAMS else 3
        for offload in OFFLOADS:
            specs.append(dict(d=d, layers=layers, config=config, update_interval=interval, offload=offload,
                              steps=count * interval))
    return specs


def predicted_memory_bytes(spec: dict) -> int:
    """A generous estimate of one run's peak RSS (bench.scale.predicted_bytes's, less the master and moments
    on disk): bf16 parameters and gradients 4, accumulation 4 a buffer, copy-out 2, the fast path's state,
    devacc's sums, 1.5 GiB of interpreter, torch and numba."""
    from bench.scale import predicted_bytes

    n = size_params(spec["d"], spec["layers"])
    on_disk = 12 * n if spec["offload"] == "nvme" else 0
    return predicted_bytes(spec["d"], spec["layers"], spec["config"]) - int(on_disk * 1.05)


def predicted_disk_bytes(spec: dict) -> int:
    """The state file (master and moments, whole blocks), 0 in memory; the roofline's file after it is as big."""
    if spec["offload"] != "nvme":
        return 0
    padded = size_params(spec["d"], spec["layers"]) + 16 * 6 * spec["layers"]  # at most 16 elements a tensor
    return 12 * math.ceil(padded / BLOCK_NUMEL) * BLOCK_NUMEL


def why_not_fitting(spec: dict, where: str, headroom_gib: float) -> str | None:
    need, free = predicted_memory_bytes(spec), meminfo_bytes("MemAvailable")
    if free is not None and need > free - headroom_gib * 2**30:
        return f"predicted {need / 2**30:.1f} GiB > available {free / 2**30:.1f} GiB less {headroom_gib} GiB headroom"
    disk = predicted_disk_bytes(spec)
    stat = os.statvfs(where)
    free_disk = stat.f_bavail * stat.f_frsize
    if disk > 0.8 * free_disk:
        return f"state file {disk / 2**30:.1f} GiB > 80% of the {free_disk / 2**30:.1f} GiB free in {where}"
    return None


def _child(spec: dict) -> dict:
    from bench.scale import MALLOC_ENV

    return run_child("bench.nvme", ["--worker", "--spec", json.dumps(spec)], timeout=3600,
                     what=f"the run {spec}", env_extra=MALLOC_ENV)


def run_quietest(spec: dict, attempts: int, label: str) -> dict:
    """The run, again (after waiting for quiet) while other processes took more than MAX_OTHER_LOAD of the
    CPUs, up to ``attempts`` runs; the quietest is kept."""
    from bench.harness import quietest

    return quietest(lambda: _child(spec), lambda r: r["other_processes_cpu_fraction"], attempts, MAX_OTHER_LOAD, label)


def describe(run: dict) -> str:
    tm, hu = run["times"], run["host_update"]
    text = (f"{run['size']} ({run['params'] / 1e6:.0f}M) {run['config']} S={run['update_interval']} "
            f"{run['offload']}: RSS +{run['rss']['growth_per_param']:.2f} B/param (host side "
            f"{run['rss']['host_side_growth_per_param']:.2f}), step {tm['mean_step_s'] * 1e3:.0f} ms "
            f"(boundary {tm['boundary_mean_s'] * 1e3:.0f}, between {tm['between_mean_s'] * 1e3:.0f}), "
            f"host update {hu['last_s']:.2f} s")
    if "disk_roofline" in hu:
        text += f" = {hu['roofline_over_last']:.2f}x of the plain pass ({hu['disk_roofline']['best_s']:.2f} s)"
    growth = run["page_cache"]["growth_max"]
    return text + ("" if growth is None else f", page cache +{growth / 2**20:.0f} MiB at most")


# -- summaries --------------------------------------------------------------------------------------------------


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares dy/dx (None below two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def memory_summary(runs: list[dict]) -> dict:
    """Per config and offload (the MEMORY_INTERVAL runs): bytes per parameter at each size and their slopes
    across the sizes; with the state on disk, the goal and whether the host side's slope meets it."""
    out: dict = {}
    for config in GOAL_BYTES_PER_PARAM:
        for offload in OFFLOADS:
            rs = sorted((r for r in runs if r["config"] == config and r["offload"] == offload
                         and r["update_interval"] == MEMORY_INTERVAL), key=lambda r: r["params"])
            if not rs:
                continue
            entry = dict(sizes=[dict(size=r["size"], params=r["params"],
                                     rss_growth=r["rss"]["growth_per_param"],
                                     host_side_rss_growth=r["rss"]["host_side_growth_per_param"],
                                     host_buffers_reported=r["bytes_per_param"]["total"],
                                     device_side_reported=r["rss"]["device_side"] / r["params"],
                                     peak_over_params=r["rss"]["peak_over_params"] / r["params"],
                                     disk=r["bytes_per_param"].get("disk", 0.0),
                                     peak_unreported_bytes=r["rss"]["peak_over_params"] - r["host_bytes"]["total"]
                                     - r["rss"]["device_side"]) for r in rs])
            for key, get in (("rss_growth", lambda r: r["rss"]["growth_over_run"]),
                             ("host_side_rss_growth", lambda r: r["rss"]["host_side_growth"]),
                             ("peak_over_params", lambda r: r["rss"]["peak_over_params"]),
                             ("host_buffers_reported", lambda r: r["host_bytes"]["total"])):
                entry[f"{key}_slope"] = slope([(r["params"], get(r)) for r in rs])
            if offload == "nvme":
                goal = GOAL_BYTES_PER_PARAM[config]
                measured = entry["host_side_rss_growth_slope"]
                entry.update(goal=goal, goal_met=None if measured is None else measured <= goal,
                             largest_reported_meets_goal=entry["sizes"][-1]["host_buffers_reported"] <= goal)
            out[f"{config} {offload}"] = entry
    return out


def _pair(runs: list[dict], size: str, config: str, interval: int) -> dict:
    return {r["offload"]: r for r in runs if (r["size"], r["config"], r["update_interval"]) == (size, config, interval)}


def stall_summary(runs: list[dict], stall_size: tuple[int, int], intervals: list[int]) -> list[dict]:
    """Per update_interval at the stall size (overlap): step() time per step, disk beside memory."""
    size = f"{stall_size[0]}x{stall_size[1]}"
    rows = []
    for interval in intervals:
        pair = _pair(runs, size, "overlap", interval)
        row = dict(update_interval=interval, size=size)
        for offload, r in pair.items():
            tm, hu = r["times"], r["host_update"]
            row[offload] = dict(mean_step_s=tm["mean_step_s"], boundary_mean_s=tm["boundary_mean_s"],
                                between_mean_s=tm["between_mean_s"],
                                worker_wait_per_step_s=r["stats"]["worker_wait_s"] / r["steps"],
                                host_update_last_s=hu["last_s"], host_update_mean_s=hu["mean_s"],
                                disk_roofline_s=hu.get("disk_roofline", {}).get("best_s"),
                                roofline_over_last=hu.get("roofline_over_last"))
        if len(pair) == 2:
            row["extra_per_step_s"] = row["nvme"]["mean_step_s"] - row["cpu"]["mean_step_s"]
            row["disk_over_memory"] = row["nvme"]["mean_step_s"] / row["cpu"]["mean_step_s"]
        rows.append(row)
    return rows


def weights_agree(runs: list[dict]) -> list[dict]:
    """Each config run both ways: whether the final weights are the same bits on disk and in memory."""
    rows = []
    for key in sorted({(r["size"], r["config"], r["update_interval"]) for r in runs}):
        pair = _pair(runs, *key)
        if len(pair) == 2:
            rows.append(dict(size=key[0], config=key[1], update_interval=key[2],
                             identical=pair["nvme"]["weights_sha256"] == pair["cpu"]["weights_sha256"]))
    return rows


def page_cache_summary(runs: list[dict]) -> list[dict]:
    return [dict(size=r["size"], config=r["config"], update_interval=r["update_interval"], offload=r["offload"],
                 state_file_bytes=r["host_bytes"].get("disk", 0), growth_max=r["page_cache"]["growth_max"],
                 growth_end=r["page_cache"]["growth_end"]) for r in runs]


def largest_runs(runs: list[dict], at_least: int = 10**9) -> list[dict]:
    """The runs of 1 B parameters or more: what the issue asks to see recorded."""
    return [dict(size=r["size"], params=r["params"], config=r["config"], offload=r["offload"],
                 update_interval=r["update_interval"], steps=r["steps"], mean_step_s=r["times"]["mean_step_s"],
                 cold_first_step_s=r["times"]["cold_first_step_s"], host_update_s=r["host_update"]["seconds"],
                 roofline_over_last=r["host_update"].get("roofline_over_last"), rss_peak=r["rss"]["peak"],
                 rss_growth_per_param=r["rss"]["growth_per_param"], disk_bytes=r["host_bytes"].get("disk", 0),
                 page_cache_growth_max=r["page_cache"]["growth_max"]) for r in runs if r["params"] >= at_least]


# -- plot -------------------------------------------------------------------------------------------------------


def _plot_storage(ax1, ax2, results: list[dict]) -> None:
    done = [r for r in results if "skipped" not in r]
    for mode, marker in zip(MODES, "os", strict=True):
        rows = [r for r in done if r["mode"] == mode]
        sizes = [r["size_m"] for r in rows]
        for name, style in (("roofline", "--"), ("streamed", "-")):
            ax1.plot(sizes, [r[name]["gb_per_s"] for r in rows], style, marker=marker, label=f"{mode} {name}")
            ax2.plot(sizes, [max(0, r[name]["cache_growth_bytes"][-1] or 0) / 2**20 for r in rows], style,
                     marker=marker, label=f"{mode} {name}")
    for ax, label in ((ax1, "disk traffic GB/s (read + write)"), (ax2, "page cache growth per pass (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    ax1.set_title("storage pass: streamed AdamW against a plain read+write")
    ax2.set_title("storage pass: page cache")


def _plot_memory(ax, memory: dict) -> None:
    configs = [c for c in GOAL_BYTES_PER_PARAM if any(k.startswith(c + " ") for k in memory)]
    x = range(len(configs))
    for i, (offload, hatch) in enumerate(zip(OFFLOADS, ("", "//"), strict=True)):
        host = [memory.get(f"{c} {offload}", {}).get("host_side_rss_growth_slope") or 0 for c in configs]
        total = [memory.get(f"{c} {offload}", {}).get("rss_growth_slope") or 0 for c in configs]
        xs = [j + (i - 0.5) * 0.4 for j in x]
        ax.bar(xs, host, 0.4, color="C0" if offload == "nvme" else "C1", hatch=hatch,
               label=f"{offload}: host side (RSS slope less device-side buffers)")
        ax.bar(xs, [t - h for t, h in zip(total, host, strict=True)], 0.4, bottom=host, color="0.8", hatch=hatch,
               label="device side (fast state, devacc sums)" if i == 0 else None)
    for j, c in enumerate(configs):
        ax.plot([j - 0.45, j + 0.05], [GOAL_BYTES_PER_PARAM[c]] * 2, "k-", lw=2,
                label="goal on disk (issue 25)" if j == 0 else None)
    ax.set_xticks(list(x), configs)
    ax.set_ylabel("bytes per parameter (slope across sizes)")
    ax.set_title("RSS per parameter, state on disk (left) and in memory (right)")
    ax.legend(fontsize=7)


def _plot_stall(ax, stall: list[dict]) -> None:
    for offload, color in zip(OFFLOADS, ("C0", "C1"), strict=True):
        rows = [r for r in stall if offload in r]
        xs = [r["update_interval"] for r in rows]
        ax.plot(xs, [r[offload]["mean_step_s"] * 1e3 for r in rows], "-o", color=color,
                label=f"{offload}: mean step()")
        ax.plot(xs, [(r[offload]["boundary_mean_s"] or 0) * 1e3 for r in rows], ":s", color=color,
                label=f"{offload}: at boundaries")
        ax.plot(xs, [(r[offload]["between_mean_s"] or 0) * 1e3 for r in rows], "--", color=color, alpha=0.6,
                label=f"{offload}: between boundaries")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("update_interval")
    ax.set_ylabel("ms")
    ax.set_title(f"step() with overlap at {stall[0]['size'] if stall else '?'}: disk vs memory")
    ax.legend(fontsize=7)


def _plot_update(ax, runs: list[dict]) -> None:
    """Per config (the memory runs): the last host update (alone, in flush()) and the plain pass over a file of
    its size, each labelled with their ratio (the goal: >= GOAL)."""
    rs = sorted((r for r in runs if "disk_roofline" in r["host_update"]), key=lambda r: r["params"])
    for config, color in zip(GOAL_BYTES_PER_PARAM, ("C0", "C1", "C2"), strict=True):
        mine = [r for r in rs if r["config"] == config and r["update_interval"] == MEMORY_INTERVAL]
        xs = [r["params"] for r in mine]
        ax.plot(xs, [r["host_update"]["last_s"] for r in mine], "-o", color=color, label=f"{config}: host update")
        ax.plot(xs, [r["host_update"]["disk_roofline"]["best_s"] for r in mine], ":x", color=color,
                label=f"{config}: plain read+write of its file")
        for r in mine:
            ax.annotate(f"{r['host_update']['roofline_over_last']:.2f}x", (r["params"], r["host_update"]["last_s"]),
                        fontsize=7, color=color, textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds")
    ax.set_title(f"host update on disk (last, alone) vs plain pass (labels: ratio, goal >= {GOAL})")
    ax.legend(fontsize=7)


def _plot_cache(ax, runs: list[dict]) -> None:
    for offload, color in zip(OFFLOADS, ("C0", "C1"), strict=True):
        rs = sorted((r for r in runs if r["offload"] == offload and r["page_cache"]["growth_max"] is not None),
                    key=lambda r: r["params"])
        ax.plot([r["params"] for r in rs], [r["page_cache"]["growth_max"] / 2**20 for r in rs], "o", color=color,
                label=f"{offload}: largest growth during the run")
    rs = sorted((r for r in runs if r["offload"] == "nvme"), key=lambda r: r["params"])
    ax.plot([r["params"] for r in rs], [r["host_bytes"]["disk"] / 2**20 for r in rs], "k:", label="state file size")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("parameters")
    ax.set_ylabel("MiB")
    ax.set_title("page cache growth (Cached, whole machine) per run")
    ax.legend(fontsize=7)


def plot(payload: dict, path) -> None:
    pyplot = plt()
    fig, axes = pyplot.subplots(2, 3, figsize=(18, 10))
    _plot_storage(axes[0, 0], axes[0, 1], payload["results"])
    _plot_memory(axes[0, 2], payload["memory"])
    _plot_stall(axes[1, 0], payload["stall"])
    _plot_update(axes[1, 1], payload["runs"])
    _plot_cache(axes[1, 2], payload["runs"])
    fig.suptitle("ZenFlowAdamW host state on disk (offload_device='nvme', O_DIRECT) against memory")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot.close(fig)


# -- main -------------------------------------------------------------------------------------------------------


def storage_passes(sizes: list[int], where: str, repeats: int) -> list[dict]:
    free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
    results = []
    for size_m in sizes:
        for mode in MODES:
            if size_m * (1 << 20) * 12 > free * 0.8:
                results.append(dict(size_m=size_m, mode=mode, skipped=f"needs {size_m * 12} MiB, {free} bytes free"))
                continue
            r = measure(size_m, mode, where, repeats)
            results.append(r)
            if "skipped" in r:
                print(f"{size_m:>6} M {mode:>8}: skipped ({r['skipped']})", flush=True)
            else:
                print(f"{size_m:>6} M {mode:>8}: roofline {r['roofline']['gb_per_s']:.2f} GB/s, streamed "
                      f"{r['streamed']['gb_per_s']:.2f} GB/s ({r['streamed_over_roofline']:.2f}x), page cache "
                      f"+{(r['streamed']['cache_growth_bytes'][-1] or 0) / 2**20:.0f} MiB", flush=True)
    return results


def optimizer_runs(specs: list[dict], where: str, repeats: int, attempts: int,
                   headroom_gib: float) -> tuple[list[dict], list[dict]]:
    """Every spec that fits, each in a fresh process; the ones that do not, with the reason. What fits is
    decided before anything starts (what one run leaves in the page cache must not decide the next)."""
    runs, skipped, todo = [], [], []
    for spec in specs:
        reason = why_not_fitting(spec, where, headroom_gib)
        if reason:
            skipped.append(dict(spec, predicted_memory_bytes=predicted_memory_bytes(spec),
                                predicted_disk_bytes=predicted_disk_bytes(spec), reason=reason))
            print(f"{spec['d']}x{spec['layers']} {spec['config']} S={spec['update_interval']} {spec['offload']}: "
                  f"skipped, {reason}", flush=True)
        else:
            todo.append(spec)
    for spec in todo:
        t0 = time.perf_counter()
        label = f"{spec['d']}x{spec['layers']} {spec['config']} S={spec['update_interval']} {spec['offload']}"
        run = run_quietest(dict(spec, dir=where, roof_repeats=repeats), attempts, label)
        run["wall_s"] = time.perf_counter() - t0
        runs.append(run)
        print(describe(run) + f" ({run['wall_s']:.0f}s)", flush=True)
    return runs, skipped


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m bench.nvme", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    parser.add_argument("--quick", action="store_true",
                        help="1 M parameters in the storage pass, tiny optimizer runs, one repeat (the test suite's)")
    parser.add_argument("--sizes", type=int_at_least(1), nargs="+", default=None,
                        help="storage pass: millions of parameters (default 16 64 256)")
    parser.add_argument("--dir", default=None, help="where the state files go (default: a temporary folder)")
    parser.add_argument("--repeats", type=int_at_least(1), default=2, help="passes per plain/streamed pass")
    parser.add_argument("--run-sizes", nargs="+", type=parse_width_layers, default=None, metavar="DxL",
                        help="optimizer runs: d x layers (default 768x6 1024x12 1280x24 2048x20)")
    parser.add_argument("--configs", nargs="+", choices=list(GOAL_BYTES_PER_PARAM), default=None)
    parser.add_argument("--intervals", type=int_at_least(1), nargs="+", default=None,
                        help="update_interval of the stall runs (default 4 8 16)")
    parser.add_argument("--stall-size", type=parse_width_layers, default=None, metavar="DxL",
                        help="size of the stall runs (default 1024x12)")
    parser.add_argument("--attempts", type=int_at_least(1), default=None,
                        help="runs of one measurement while other processes take more than 15%% of the CPUs "
                             "(default 2, --quick 1)")
    parser.add_argument("--headroom-gib", type=float, default=4.0,
                        help="leave this much of MemAvailable free when deciding what fits (default 4)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(run_one(json.loads(args.spec))))
        return 0

    started = time.time()
    sizes = args.sizes or (QUICK_SIZES_M if args.quick else SIZES_M)
    repeats = 1 if args.quick else args.repeats
    run_sizes = args.run_sizes or (QUICK_RUN_SIZES if args.quick else RUN_SIZES)
    configs = args.configs or list(GOAL_BYTES_PER_PARAM)
    intervals = args.intervals or (QUICK_STALL_INTERVALS if args.quick else STALL_INTERVALS)
    stall_size = args.stall_size or (QUICK_STALL_SIZE if args.quick else STALL_SIZE)
    attempts = args.attempts or (1 if args.quick else 2)
    where = args.dir or tempfile.gettempdir()
    free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
    out = output_dir(args.out)

    results = storage_passes(sizes, where, repeats)
    specs = planned_runs(run_sizes, configs, stall_size, intervals, args.quick)
    runs, skipped = optimizer_runs(specs, where, repeats, attempts, args.headroom_gib)
    payload = dict(
        bench="nvme", command="python -m bench.nvme " + " ".join(sys.argv[1:] if argv is None else argv),
        quick=args.quick, sizes_m=sizes, block_numel=BLOCK_NUMEL, goal_streamed_over_roofline=GOAL,
        directory=where, free_bytes=free, results=results,
        run_config=dict(run_sizes=[f"{d}x{layers}" for d, layers in run_sizes], configs=configs,
                        memory_interval=MEMORY_INTERVAL, stall_size=f"{stall_size[0]}x{stall_size[1]}",
                        stall_intervals=intervals, lr=LR, attempts=attempts, max_other_load=MAX_OTHER_LOAD,
                        headroom_gib=args.headroom_gib, long_run_params=LONG_RUN_PARAMS,
                        goal_bytes_per_param=GOAL_BYTES_PER_PARAM, stream_buffers_bound=STREAM_BUFFERS_BOUND),
        runs=runs, skipped_runs=skipped, memory=memory_summary(runs), stall=stall_summary(runs, stall_size, intervals),
        weights_identical=weights_agree(runs), page_cache=page_cache_summary(runs), billion=largest_runs(runs),
        machine=machine_info_light(), total_s=time.time() - started)
    write_json_light(out / "nvme_cpu.json", payload)
    plot(payload, out / "nvme_cpu.png")
    print(f"wrote {out / 'nvme_cpu.json'} and {out / 'nvme_cpu.png'} ({payload['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
