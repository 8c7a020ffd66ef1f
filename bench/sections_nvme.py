"""docs/nvme.md's measured section, written from ``nvme_cpu.json`` (``python -m bench.nvme``) and the second full run
``nvme_cpu_repeat.json`` (``--attempts 3``): the storage pass, the host memory per parameter of whole runs, the
1 B-parameter runs, the stall against ``update_interval`` and the rule for picking it."""

from __future__ import annotations

import statistics

from bench.results_text import load, span, where

RUN, REPEAT = "nvme_cpu.json", "nvme_cpu_repeat.json"
CONFIGS = ("overlap", "sync", "devacc")


def _link(name: str) -> str:
    return f"[`{name}`](../bench/results/{name})"


def _size_text(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.0f} M"


def _storage(results: list[dict]) -> str:
    direct = [r for r in results if r["mode"] == "direct"]
    buffered = [r for r in results if r["mode"] == "buffered"]
    gbps = [r["streamed"]["gb_per_s"] for r in direct]
    direct_growth = max(g for r in direct for g in r["streamed"]["cache_growth_bytes"])
    largest = max(buffered, key=lambda r: r["size_m"])
    sizes = sorted({r["size_m"] for r in results})
    return (f"The storage pass alone ({', '.join(map(str, sizes))} M parameters, both runs): with `O_DIRECT` the "
            f"streamed AdamW pass at {span([r['streamed_over_roofline'] for r in direct], 2)} of a plain read+write "
            f"pass over the same bytes ({min(gbps):.1f}-{max(gbps):.1f} GB/s of traffic), the page cache growing by "
            f"at most {max(direct_growth, 0) / 2**20:.1f} MiB; buffered "
            f"{span([r['streamed_over_roofline'] for r in buffered], 2)}, which leaves the whole file in the page "
            f"cache after each pass ({max(largest['streamed']['cache_growth_bytes']) / 2**30:.1f} GiB at "
            f"{largest['size_m']} M). The optimizer opens its file with `O_DIRECT`.")


def _memory_table(result: dict) -> list[str]:
    memory, goals = result["memory"], result["run_config"]["goal_bytes_per_param"]
    sizes = memory["overlap nvme"]["sizes"]
    rows = [f"| bytes per parameter (RSS slope, {_size_text(sizes[0]['params'])} to "
            f"{_size_text(sizes[-1]['params'])}) | host side on disk | goal | met | host side in memory | "
            "whole RSS on disk |", "|---|---|---|---|---|---|"]
    for config in CONFIGS:
        disk, mem = memory[f"{config} nvme"], memory[f"{config} cpu"]
        rows.append(f"| {config} | {disk['host_side_rss_growth_slope']:.2f} | <= {goals[config]} | "
                    f"{'yes' if disk['goal_met'] else 'no'} | {mem['host_side_rss_growth_slope']:.2f} | "
                    f"{disk['rss_growth_slope']:.2f} |")
    return rows


def _memory_notes(result: dict) -> str:
    memory = result["memory"]
    disk_sizes = [s for config in CONFIGS for s in memory[f"{config} nvme"]["sizes"]]
    gap = max(abs(s["host_side_rss_growth"] - s["host_buffers_reported"]) for s in disk_sizes)
    smallest = min(s["params"] for s in disk_sizes)
    unreported = [s["peak_unreported_bytes"] / 2**20 for s in disk_sizes if s["params"] > smallest]
    fast = statistics.median(s["device_side_reported"] for s in memory["overlap nvme"]["sizes"])
    cache = [p for p in result["page_cache"] if p["offload"] == "nvme"]
    files = [p["state_file_bytes"] / 1e9 for p in cache]
    second = min(s["params"] for s in disk_sizes if s["params"] > smallest)
    return (f"The host side is the RSS less what a GPU run keeps on the device and this CPU run keeps in process "
            f"memory (the fast path's state, {fast:.1f}, and `device_accumulation`'s sums: `host_bytes()` "
            "`fast_state` and `device_sums`, as bench.scale counts them); it is within "
            f"{gap:.2f} bytes per parameter of `host_bytes()[\"total\"]` in every disk run. Beyond the reported "
            f"buffers the peak RSS holds {min(unreported):.0f}-{max(unreported):.0f} MiB from "
            f"{_size_text(second)} on (the update's three 12 MiB state blocks and a few MiB, not attributed). Page "
            f"cache during the disk runs: Cached grew by at most {max(p['growth_max'] for p in cache) / 2**20:.0f} "
            f"MiB, with state files of {min(files):.1f} to {max(files):.1f} GB.")


def _devacc(result: dict) -> str:
    disk, mem = result["memory"]["devacc nvme"], result["memory"]["devacc cpu"]
    sizes = disk["sizes"]
    host = ", ".join(f"{s['host_side_rss_growth']:.2f}" for s in sizes)
    at = ", ".join(_size_text(s["params"]) for s in sizes)
    reported = [s["host_buffers_reported"] for s in sizes]
    return (f"`device_accumulation` on disk (overlap, the sums fetched from the device block by block as the update "
            f"streams the file): host side {host} bytes per parameter at {at}, slope "
            f"{disk['host_side_rss_growth_slope']:.2f} (`host_bytes()[\"total\"]` reports {reported[0]:.2f} to "
            f"{reported[-1]:.2f}, the three 4 MiB blocks the sums are fetched into included); the device side "
            f"{sizes[-1]['device_side_reported']:.2f} at the largest (the fast path's state and two fp32 buffers of "
            f"sums); in memory {mem['host_side_rss_growth_slope']:.2f} host side. The whole RSS slope is "
            f"{disk['rss_growth_slope']:.2f}: on this CPU-only machine the device's buffers are process memory too.")


def _billion(result: dict) -> str:
    runs = {r["config"]: r for r in result["billion"]}
    if not runs:
        return "No 1 B-parameter run in this result."
    size = next(iter(runs.values()))

    def one(config: str) -> str:
        r = runs[config]
        updates = " and ".join(f"{s:.1f}" for s in r["host_update_s"])
        return (f"{config} {r['mean_step_s']:.2f} s a step after a cold first step of {r['cold_first_step_s']:.0f} s, "
                f"host updates {updates} s (the last {r['roofline_over_last']:.2f}x the plain pass over its file), "
                f"peak RSS {r['rss_peak'] / 2**30:.1f} GiB")

    skipped = [s["predicted_memory_bytes"] / 2**30 for s in result["skipped_runs"] if s["offload"] == "cpu"]
    growth = max(r["page_cache_growth_max"] for r in runs.values()) / 2**20
    return (f"The {size['params'] / 1e9:.3f} B-parameter runs ({size['size']}, {size['steps']} steps at "
            f"`update_interval` {size['update_interval']}, the state file {size['disk_bytes'] / 1e9:.1f} GB): "
            + "; ".join(one(c) for c in CONFIGS if c in runs)
            + f"; the page cache grew by at most {max(growth, 0):.0f} MiB. "
            + (f"In memory 1 B does not fit this machine (predicted {min(skipped):.1f}-{max(skipped):.1f} GiB: "
               "skipped and listed)." if skipped else ""))


def _stall_table(result: dict, repeat: dict) -> list[str]:
    size = result["run_config"]["stall_size"]
    runs = {(r["config"], r["offload"], r["update_interval"]): r for r in result["runs"] if r["size"] == size}
    second = {s["update_interval"]: s["disk_over_memory"] for s in repeat["stall"]}
    params = next(r["params"] for r in result["runs"] if r["size"] == size)
    rows = [f"| `update_interval` ({size}, {_size_text(params)}, overlap) | disk: mean `step()` | at boundaries | "
            "between | memory: mean `step()` | disk over memory | host updates on disk | other processes' CPU "
            "share, disk / memory run | second full run: disk over memory |", "|---|---|---|---|---|---|---|---|---|"]
    for s in result["stall"]:
        k = s["update_interval"]
        disk, mem = s["nvme"], s["cpu"]
        updates = ", ".join(f"{x:.1f}" for x in runs[("overlap", "nvme", k)]["host_update"]["seconds"])
        load_disk = runs[("overlap", "nvme", k)]["other_processes_cpu_fraction"]
        load_mem = runs[("overlap", "cpu", k)]["other_processes_cpu_fraction"]
        rows.append(f"| {k} | {1e3 * disk['mean_step_s']:.0f} ms | {1e3 * disk['boundary_mean_s']:.0f} ms | "
                    f"{1e3 * disk['between_mean_s']:.0f} ms | {1e3 * mem['mean_step_s']:.0f} ms | "
                    f"{s['disk_over_memory']:.2f}x (+{1e3 * s['extra_per_step_s']:.0f} ms) | {updates} s | "
                    f"{load_disk:.0%} / {load_mem:.0%} | "
                    + (f"{second[k]:.2f}x |" if k in second else "not run |"))
    return rows


def _update_vs_plain(result: dict, repeat: dict) -> str:
    goal = result["goal_streamed_over_roofline"]

    def ratios(r: dict) -> list[float]:
        return [x["host_update"]["roofline_over_last"] for x in r["runs"]
                if x["offload"] == "nvme" and x["host_update"].get("roofline_over_last") is not None]

    first, again = ratios(result), ratios(repeat)
    met = lambda xs: sum(x >= goal for x in xs)  # noqa: E731
    bytes_moved = max(abs(a["host_side_rss_growth_slope"] - b["host_side_rss_growth_slope"])
                      for key, a in result["memory"].items() for k2, b in repeat["memory"].items() if key == k2)
    same = [w["identical"] for w in repeat["weights_identical"]]
    return (f"The host update against a plain read+write pass over a file of its size, measured in the same process "
            f"right after the run: {span(first, 2)} (goal >= {goal}: met in {met(first)} of {len(first)} disk runs); "
            f"in the second full run {span(again, 2)} ({met(again)} of {len(again)}). One update against one plain "
            "pass minutes apart measures this disk's swings as much as the update (above 1 where the disk gave the "
            "plain pass, one thread reading then writing, less than the update's pipeline of reads ahead and writes "
            "behind), so the goal is neither shown met here nor clearly missed; the storage pass above (the update's "
            "pass and the plain one over the same file, back to back) is the steadier figure. The host side bytes "
            f"per parameter of the second run agree with the first within {bytes_moved:.2f}, and its final weights "
            f"are bit-identical on disk and in memory in {sum(same)} of {len(same)} pairs.")


def _picking(result: dict) -> str:
    size = result["run_config"]["stall_size"]
    disk_runs = [r for r in result["runs"] if r["size"] == size and r["offload"] == "nvme" and
                 r["config"] == "overlap"]
    params = disk_runs[0]["params"]
    rates = [r["host_update"]["disk_traffic_bytes"] / s / 1e9 for r in disk_runs for s in r["host_update"]["seconds"]]
    rate = statistics.median(rates)
    between = [s["nvme"]["between_mean_s"] for s in result["stall"]]
    step = statistics.median(between)
    ratio = {s["update_interval"]: s["disk_over_memory"] for s in result["stall"]}
    smallest = 24 * params / (rate * 1e9 * step)
    return ("Picking `update_interval`: a host update on disk takes about `24 * N / B` seconds (N parameters, B the "
            "disk's read+write rate through the update's pipeline; `python -m bench.nvme` measures yours) and is "
            f"hidden while the `S - 1` steps after a boundary take longer. Here, at {_size_text(params)} (B "
            f"{rate:.2f} GB/s, the median of those updates) and optimizer-only steps of "
            f"{1e3 * min(between):.0f}-{1e3 * max(between):.0f} ms between boundaries, the mean `step()` on disk is "
            + ", ".join(f"{ratio[k]:.2f}x at S = {k}" for k in sorted(ratio, reverse=True))
            + " the in-memory host's; the rule `S >= 24 * N / (B * step_time)` with the median step between "
            f"boundaries ({1e3 * step:.0f} ms) gives S >= {smallest:.1f}. Steps with a forward and backward are "
            "longer, so the same model needs a smaller S; a model that needs S beyond what its convergence allows "
            "wants a faster disk or its state in memory.")


def nvme_section() -> str:
    """docs/nvme.md's measured section."""
    result, repeat = load(RUN), load(REPEAT)
    head = (f"**Measured** ({_link(RUN)} and `nvme_cpu.png`, `python -m bench.nvme`, {where(result)}; a second full "
            f"run, {_link(REPEAT)}, `--attempts 3`, {where(repeat)}). This machine's disk is virtual and shared with "
            "other jobs: each run records the CPU share other processes took, and one that saw more than "
            f"{result['run_config']['max_other_load']:.0%} ran again (up to {result['run_config']['attempts']} "
            "attempts), the quietest kept.")
    identical = [w["identical"] for w in result["weights_identical"]]
    runs = ("Whole runs (`ZenFlowAdamW` alone on bench.scale's transformer-shaped bf16 parameters, `topk_ratio=0.1`, "
            "each run a fresh process, the state file with `O_DIRECT`; every config also run with the state in "
            f"memory where it fits: the final weights are bit-identical in {sum(identical)} of {len(identical)} "
            "pairs):")
    return "\n".join([head, "", _storage(result["results"] + repeat["results"]), "", runs, "",
                      *_memory_table(result), "", _memory_notes(result), "", _devacc(result), "", _billion(result),
                      "", *_stall_table(result, repeat), "", _update_vs_plain(result, repeat), "", _picking(result)])
