"""The NVMe tier (issue 25) measured: its storage pass against this disk's roofline, and whole optimizer runs
with the host state on disk beside the same runs with it in memory.

    python -m bench.nvme [--out DIR] [--quick] [--dir PATH] [--sizes 16 64 256] [--repeats 2]
                        [--run-sizes 768x6 1024x12 ...] [--configs overlap sync devacc] [--intervals 4 8 16]
                        [--stall-size 1024x12] [--attempts 2] [--headroom-gib 4]

**Storage pass.** For each size (millions of parameters; the state file holds 12 bytes per parameter: fp32
master and both moments) and each way of opening the file (``buffered``: through the page cache; ``direct``:
``O_DIRECT``), two passes over the same bytes with the same block size and system calls: ``roofline``, a plain
sequential read-a-block-write-it-back on one thread, and ``streamed``, ``streamed_host_step_`` (AdamW's host update
over the file: read ahead, the numba kernel, write behind). Reported per pass: seconds, GB/s of disk traffic (read
+ write), streamed over roofline (issue 25's goal: >= 0.7) and the page cache's (``/proc/meminfo`` Cached) growth.
Before each pass the file's pages are written out and dropped from the cache (``fdatasync`` +
``POSIX_FADV_DONTNEED``), so a buffered read comes from the disk.

**Optimizer runs.** ``ZenFlowAdamW`` alone on bench.scale's transformer-shaped parameters, ``topk_ratio=0.1``, one
selection, stepped back to back, each (size, config, update_interval, where the state lives) in a fresh process
(bench.scale's pattern: a warm-up run first, glibc told to return freed memory, a run that saw other processes
take more than ``MAX_OTHER_LOAD`` of the CPUs run again, up to ``--attempts``, the quietest kept).
``offload_device`` ``nvme`` (the state file under ``--dir``, ``O_DIRECT``: ``ZenFlowAdamW.NVME_DIRECT``) and
``cpu`` (in memory) run one after the other with the same parameters, gradients and config. Runs whose predicted
memory (or state file) does not fit what the machine has free are skipped and listed, before anything starts.

* memory (configs ``overlap``, ``sync``, ``devacc`` at ``update_interval`` 4, every run size): the process's RSS
  growth over the run per parameter (its peak beside it) and its least-squares slope across the sizes (what a
  parameter more costs, without the process's constant part such as the update's block buffers). On this CPU-only
  machine the "device" is process memory too: the fast path's state and ``device_accumulation``'s sums
  (``host_bytes()`` ``fast_state`` and ``device_sums``) are taken off the RSS to give the host side, which is
  compared with the issue's goals on disk (``GOAL_BYTES_PER_PARAM``), beside the host buffers ``host_bytes()``
  reports;
* page cache: Cached before the optimizer is built, its largest value after any step, and after the last host
  update (the whole machine's: other processes' files count too);
* stall (config ``overlap`` at ``--stall-size``, ``update_interval`` in ``--intervals``): ``step()`` wall time,
  the cold first step apart, at update boundaries and between them, and the training thread's waits for the worker
  (``stats()["worker_wait_s"]``), disk against memory;
* the host update (``stats()["host_update_s"]``; the last runs alone, during ``flush()``) against the plain
  read+write pass over a file of the same size, measured in the same process right after the run;
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
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import OneLineParser, int_at_least, meminfo_bytes, parse_width_layers, style
from bench.scale import mean_or_none, median_or_none, size_params, slope

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


def plain_pass(files) -> None:
    bufs = files.new_block()
    for j in range(files.blocks):
        files.read_block(j, bufs)
        files.write_block(j, bufs)


def timed_passes(files, fn, repeats: int, flush: bool) -> dict:
    """``fn()`` ``repeats`` times, each from a cold cache: seconds, the best as GB/s of traffic, cache growth."""
    seconds, grew = [], []
    # a descriptor of our own on the state file: syncing and dropping act on the file's data and its pages in the
    # cache, whichever descriptor names the file
    fd = os.open(files.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for _ in range(repeats):
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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


def run_one(spec: dict) -> dict:
    """One (size, config, update_interval, offload) in this process: build, step, flush, measure."""
    from bench.scale import BASE_ZENFLOW, CONFIGS, build_params, split_steps, timed_steps, warm_up
    from zenflow_kernels import ZenFlowAdamW

    zen = dict(BASE_ZENFLOW, **CONFIGS[spec["config"]], update_interval=spec["update_interval"],
               pt_reserved_cores_perc=1.0)  # training and the worker share the cores (bench.scale's CPU setting)
    if spec["offload"] == "nvme":
        zen.update(offload_device="nvme", nvme_path=spec["dir"])
    warm_up(zen)
    rss_base = harness.rss_bytes()
    params = build_params(spec["d"], spec["layers"], "cpu")
    rss_params = harness.rss_bytes()
    n = sum(p.numel() for p in params)
    cache_before = meminfo_bytes("Cached")
    opt = ZenFlowAdamW(params, lr=LR, zenflow=zen)
    times, boundary, cached, flush_s, other_load = timed_steps(opt, spec["steps"],
                                                               sample=lambda: meminfo_bytes("Cached"))
    cache_max = max(cached) if None not in cached else None
    rss_end, cache_end = harness.rss_bytes(), meminfo_bytes("Cached")
    stats, hb = opt.stats(), opt.host_bytes()
    block, direct = opt.NVME_BLOCK_NUMEL, opt.NVME_DIRECT
    opt.close()
    peak = max(harness.peak_rss_bytes(), rss_end)
    device_side = hb["fast_state"] + hb["device_sums"]
    growth = rss_end - rss_params
    measured, at_boundary, between = split_steps(times, boundary)
    updates = stats["host_update_s"]
    out = dict(
        size=f"{spec['d']}x{spec['layers']}", d=spec["d"], layers=spec["layers"], config=spec["config"],
        offload=spec["offload"], update_interval=spec["update_interval"], steps=spec["steps"], zenflow=zen,
        params=n, padded_numel=padded_numel(params), block_numel=block, direct=direct,
        other_processes_cpu_fraction=other_load, weights_sha256=weights_sha256(params),
        host_bytes=hb, bytes_per_param={k: v / n for k, v in hb.items() if k != "per_parameter"},
        rss=dict(before_params=rss_base, after_params_and_grads=rss_params, end=rss_end, peak=peak,
                 growth_over_run=growth, peak_over_params=peak - rss_params, device_side=device_side,
                 host_side_growth=growth - device_side, growth_per_param=growth / n,
                 host_side_growth_per_param=(growth - device_side) / n),
        page_cache=dict(before=cache_before, max=cache_max, end=cache_end,
                        growth_max=None if cache_before is None else cache_max - cache_before,
                        growth_end=None if cache_before is None else cache_end - cache_before),
        # the cold first step apart; the rest split into update boundaries and the steps between them
        times=dict(step_s=times, boundary=boundary, cold_first_step_s=times[0], flush_s=flush_s,
                   mean_step_s=mean_or_none(measured), boundary_mean_s=mean_or_none(at_boundary),
                   boundary_median_s=median_or_none(at_boundary), between_mean_s=mean_or_none(between),
                   between_median_s=median_or_none(between)),
        host_update=dict(seconds=updates, last_s=updates[-1], mean_s=mean_or_none(updates), count=len(updates)),
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
    """A generous estimate of one run's peak RSS: bench.scale.predicted_bytes's, less the master and moments
    on disk."""
    from bench.scale import predicted_bytes

    on_disk = 12 * size_params(spec["d"], spec["layers"]) if spec["offload"] == "nvme" else 0
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


def run_quietest(spec: dict, attempts: int, label: str) -> dict:
    """The run in a fresh process, again (after waiting for quiet) while other processes took more than
    MAX_OTHER_LOAD of the CPUs, up to ``attempts`` runs; the quietest is kept."""
    from bench.scale import MALLOC_ENV

    def run():
        return harness.run_child("bench.nvme", ["--worker", "--spec", json.dumps(spec)], timeout=3600,
                                 what=f"the run {spec}", env_extra=MALLOC_ENV)

    return harness.quietest(run, lambda r: r["other_processes_cpu_fraction"], attempts, MAX_OTHER_LOAD, label)


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


def plot(payload: dict, path) -> None:
    fig, axes = harness.figure(3, 2, size=(18, 10))
    runs, colors = payload["runs"], dict(zip(OFFLOADS, ("C0", "C1"), strict=True))

    # the storage pass: rates and the page cache's growth
    done = [r for r in payload["results"] if "skipped" not in r]
    for mode, marker in zip(MODES, "os", strict=True):
        rows = [r for r in done if r["mode"] == mode]
        for name, fmt in (("roofline", "--"), ("streamed", "-")):
            sizes = [r["size_m"] for r in rows]
            axes[0, 0].plot(sizes, [r[name]["gb_per_s"] for r in rows], fmt, marker=marker, label=f"{mode} {name}")
            axes[0, 1].plot(sizes, [max(0, r[name]["cache_growth_bytes"][-1] or 0) / 2**20 for r in rows], fmt,
                            marker=marker, label=f"{mode} {name}")
    style(axes[0, 0], "parameters (millions)", "disk traffic GB/s (read + write)",
          "storage pass: streamed AdamW against a plain read+write", logx=10, grid=None)
    style(axes[0, 1], "parameters (millions)", "page cache growth per pass (MiB)", "storage pass: page cache",
          logx=10, grid=None)

    # RSS per parameter: the host side against the goal, the device side on top
    ax, memory = axes[0, 2], payload["memory"]
    configs = [c for c in GOAL_BYTES_PER_PARAM if any(k.startswith(c + " ") for k in memory)]
    for i, (offload, hatch) in enumerate(zip(OFFLOADS, ("", "//"), strict=True)):
        host = [memory.get(f"{c} {offload}", {}).get("host_side_rss_growth_slope") or 0 for c in configs]
        total = [memory.get(f"{c} {offload}", {}).get("rss_growth_slope") or 0 for c in configs]
        xs = [j + (i - 0.5) * 0.4 for j in range(len(configs))]
        ax.bar(xs, host, 0.4, color=colors[offload], hatch=hatch,
               label=f"{offload}: host side (RSS slope less device-side buffers)")
        ax.bar(xs, [t - h for t, h in zip(total, host, strict=True)], 0.4, bottom=host, color="0.8", hatch=hatch,
               label="device side (fast state, devacc sums)" if i == 0 else None)
    for j, c in enumerate(configs):
        ax.plot([j - 0.45, j + 0.05], [GOAL_BYTES_PER_PARAM[c]] * 2, "k-", lw=2,
                label="goal on disk (issue 25)" if j == 0 else None)
    ax.set_xticks(range(len(configs)), configs)
    style(ax, None, "bytes per parameter (slope across sizes)",
          "RSS per parameter, state on disk (left) and in memory (right)", grid=None)

    # the stall: step() against update_interval, disk and memory
    stall = payload["stall"]
    for offload, color in colors.items():
        rows = [r for r in stall if offload in r]
        xs = [r["update_interval"] for r in rows]
        for key, fmt, what in (("mean_step_s", "-o", "mean step()"), ("boundary_mean_s", ":s", "at boundaries"),
                               ("between_mean_s", "--", "between boundaries")):
            axes[1, 0].plot(xs, [(r[offload][key] or 0) * 1e3 for r in rows], fmt, color=color,
                            label=f"{offload}: {what}")
    style(axes[1, 0], "update_interval", "ms", f"step() with overlap at {stall[0]['size'] if stall else '?'}: "
          "disk vs memory", logx=2, logy=10, grid=None)

    # per config (the memory runs): the last host update (alone, in flush()) and the plain pass over a file of its
    # size, each labelled with their ratio
    ax = axes[1, 1]
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
    style(ax, "parameters", "seconds", f"host update on disk (last, alone) vs plain pass (labels: ratio, goal >= "
          f"{GOAL})", logx=10, logy=10, grid=None)

    # the page cache's growth per run against the state file's size
    ax = axes[1, 2]
    for offload, color in colors.items():
        rs = sorted((r for r in runs if r["offload"] == offload and r["page_cache"]["growth_max"] is not None),
                    key=lambda r: r["params"])
        ax.plot([r["params"] for r in rs], [r["page_cache"]["growth_max"] / 2**20 for r in rs], "o", color=color,
                label=f"{offload}: largest growth during the run")
    rs = sorted((r for r in runs if r["offload"] == "nvme"), key=lambda r: r["params"])
    ax.plot([r["params"] for r in rs], [r["host_bytes"]["disk"] / 2**20 for r in rs], "k:", label="state file size")
    ax.set_yscale("symlog", linthresh=10)
    style(ax, "parameters", "MiB", "page cache growth (Cached, whole machine) per run", logx=10, grid=None)
    fig.suptitle("ZenFlowAdamW host state on disk (offload_device='nvme', O_DIRECT) against memory")
    harness.save(fig, path, dpi=100)


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
        label = f"{spec['d']}x{spec['layers']} {spec['config']} S={spec['update_interval']} {spec['offload']}"
        reason = why_not_fitting(spec, where, headroom_gib)
        if reason:
            skipped.append(dict(spec, predicted_memory_bytes=predicted_memory_bytes(spec),
                                predicted_disk_bytes=predicted_disk_bytes(spec), reason=reason))
            print(f"{label}: skipped, {reason}", flush=True)
        else:
            todo.append((spec, label))
    for spec, label in todo:
        t0 = time.perf_counter()
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
    out = harness.output_dir(args.out)

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
        machine=harness.machine_info(), total_s=time.time() - started)
    harness.write_result(out / "nvme_cpu.json", payload)
    plot(payload, out / "nvme_cpu.png")
    print(f"wrote {out / 'nvme_cpu.json'} and {out / 'nvme_cpu.png'} ({payload['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
