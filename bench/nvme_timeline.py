"""Where the interval's gradient sums cross with ``device_accumulation``, on the modeled device: one copy at the
boundary (state in memory) against block pieces fetched inside the streamed update (state on disk), each in
today's order and the former one, side by side in one run.

    python -m bench.nvme_timeline [--out DIR] [--quick] [--size DxL] [--interval S] [--intervals N]

The device is modeled (docs/testing.md): ``testing.chaos(max_delay=0)`` runs the CUDA link's protocol on CPU,
every copy taking at least ``bytes / bandwidth`` on its copy thread (``pcie``: 25 GB/s, PCIe 4 x16; ``slow``:
the sums' crossing takes ``SLOW_SHARE`` of the host update on disk, where it shows). The device's forward and
backward are a sleep of ``compute_s`` a step: a GPU computes beside the host without taking its cores.
Gradients are fixed (bench.scale's transformer-shaped parameters, bf16 matrices, set once), so the host's only
work is the optimizer's. One model on one device whatever the host: ``compute_s = ratio * U / S`` for every
variant, ``U`` the host update on disk taken alone first (a probe run per offload, no compute, no modeled
copies), ``ratio`` in ``RATIOS``: below 1 the disk's update outlasts the interval and the boundary that drains
it waits; above 1 the interval hides it.

Variants (``VARIANTS``): ``memory`` (the sums zeroed behind their copies; only the next write into them waits:
``AsyncLink.sums_ready``), ``memory eager`` (``orderings.changed(sums_wait_at_boundary=True)``: the boundary step
waits for the crossing, the former order), ``disk`` (the reader starts a block's fetches, reads the block, then
waits) and ``disk serial`` (``orderings.changed(fetch_beside_read=False)``: read, then fetch, the former order); both
switches from ``zenflow_kernels.orderings``, set around the whole run of each variant's optimizer.

Lanes (a :class:`~zenflow_kernels.testing.Timeline`): ``compute`` and ``step`` (marked here), ``wait`` (the
training thread blocked: ``join`` the write-back of the weights the next forward needs, ``sums`` the crossing
before the next write into the sums, unlabelled the drain of the last update), ``d2h``/``h2d`` (copies),
``fetch`` (the sums' pieces the update's reader fetches), ``update`` (the host update job), ``read``/``write``
(the state file's blocks, wrapped here). Reported per interval: the waits by cause against predictions (drain:
``max(0, u - S * (compute_s + step_s))`` from the run's own update ``u`` and median ``step()`` between boundaries;
sums: the whole crossing when eager, else what the boundary's write-back wait and the next step's compute do not
cover), the crossing per update and its share inside the update job. Results: ``nvme_timeline_cpu.json`` and
``.png`` (the waits, and one interval's lanes per variant at the lowest ratio and the slow bandwidth).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from bench.harness import OneLineParser, draw_lanes, int_at_least, machine_info_light, output_dir, plt, write_json_light

PCIE = 25e9
SLOW_SHARE = 0.25  # "slow": the sums' crossing takes this share of the host update on disk (its probe)
RATIOS = (0.5, 1.5)  # S * compute_s over the host update on disk
# name: (offload_device, the sums' crossing waited for at the boundary: orderings.sums_wait_at_boundary, a block's
# fetch started before its read: orderings.fetch_beside_read); "eager" and "serial" are the former orders
VARIANTS = {"memory": ("cpu", False, True), "memory eager": ("cpu", True, True), "disk": ("nvme", False, True),
            "disk serial": ("nvme", False, False)}
SIZE = (1024, 4)  # d x layers: 50 M parameters
PIPELINE_NUMEL = 1 << 24  # the streamed pass alone: 16 M elements, 192 MiB of state read and written a pass
QUICK_SIZE = (128, 2)
ZENFLOW = dict(topk_ratio=0.1, overlap_step=True, device_accumulation=True, full_warm_up_rounds=0,
               select_strategy="step", select_interval=10**6, pt_reserved_cores_perc=1.0)
LANES = ("compute", "step", "wait", "d2h", "fetch", "update", "read", "write", "h2d")
COLORS = dict(compute="#3182bd", step="#6baed6", wait="#e6550d", d2h="#31a354", fetch="#74c476",
              update="#bcbddc", read="#fdae6b", write="#fd8d3c", h2d="#a1d99b")


def _optimizer(params, offload: str, interval: int, folder: str, bandwidth: float | None, timeline):
    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.device_model import recorded
    from zenflow_kernels.testing import chaos

    zen = dict(ZENFLOW, update_interval=interval)
    if offload == "nvme":
        zen.update(offload_device="nvme", nvme_path=folder)
    with chaos(seed=0, max_delay=0, d2h_bytes_per_s=bandwidth, h2d_bytes_per_s=bandwidth, timeline=timeline):
        opt = ZenFlowAdamW(params, lr=1e-4, zenflow=zen)
    opt.step()  # builds the link and the host shard (the first step: not measured)
    files = opt.host_shard.disk
    if files is not None and timeline is not None:  # the state file's blocks as lanes of their own
        files.read_block = recorded(files.read_block, timeline, "read")
        files.write_block = recorded(files.write_block, timeline, "write")
    return opt


def _train(opt, steps: int, compute_s: float, timeline) -> list[dict]:
    """``steps`` steps of a modeled device computing ``compute_s`` each, then ``step()``."""
    out = []
    for _ in range(steps):
        before, waited = opt.host_updates, opt.stats()["worker_wait_s"]
        t0 = time.perf_counter()
        with timeline.span("compute"):
            time.sleep(compute_s)
        t1 = time.perf_counter()
        with timeline.span("step"):
            opt.step()
        t2 = time.perf_counter()
        out.append(dict(start=t0, step_start=t1, end=t2, step_s=t2 - t1, boundary=opt.host_updates > before,
                        waited_s=opt.stats()["worker_wait_s"] - waited))
    return out


def _spans(timeline, lane: str) -> list[tuple[float, float]]:
    """``lane``'s spans, ``(start, end)``."""
    return [(s, e) for ln, _, s, e, _ in timeline.spans if ln == lane]


def _inside(spans: list[tuple[float, float]], timeline, spans_lane: str) -> float:
    """Seconds of ``spans`` that ran inside a span of ``spans_lane`` (its spans do not overlap one another)."""
    outer = _spans(timeline, spans_lane)
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans for a, b in outer)


def _lane_s(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def measure(spec: dict) -> dict:
    """Every variant, bandwidth and ratio at one size, in this process."""
    from bench.scale import build_params
    from zenflow_kernels.ops import use_backend
    from zenflow_kernels.orderings import orderings
    from zenflow_kernels.testing import Timeline

    d, layers, interval, intervals = spec["d"], spec["layers"], spec["interval"], spec["intervals"]
    params = build_params(d, layers, "cpu")
    n = sum(p.numel() for p in params)
    sums_bytes = 4 * sum(p.numel() for p in params if p.dim() == 2)  # fp32 sums of the matrices
    out = dict(d=d, layers=layers, params=n, sums_bytes=sums_bytes, interval=interval, intervals=intervals,
               probes={}, rows=[], timelines={})
    with use_backend("numba"), tempfile.TemporaryDirectory(prefix="zenflow-nvme-timeline-") as folder:
        for offload in ("cpu", "nvme"):  # the host update alone: no compute, no modeled copies
            timeline = Timeline()
            opt = _optimizer(build_params(d, layers, "cpu"), offload, interval, folder, None, timeline)
            _train(opt, (intervals + 1) * interval, 0.0, timeline)
            opt.flush()
            out["probes"][offload] = dict(update_s=statistics.median(opt.stats()["host_update_s"][1:]),
                                          updates=len(opt.stats()["host_update_s"]))
            opt.close()
        disk_s = out["probes"]["nvme"]["update_s"]  # one model, one device: the compute is sized from the disk's
        bandwidths = {"pcie": PCIE, "slow": sums_bytes / (SLOW_SHARE * disk_s)}
        for bw_name, bw in bandwidths.items():
            for ratio in spec["ratios"]:
                compute_s = ratio * disk_s / interval
                for variant, (offload, eager, beside) in VARIANTS.items():
                    timeline = Timeline()
                    with orderings.changed(sums_wait_at_boundary=eager, fetch_beside_read=beside):
                        opt = _optimizer(build_params(d, layers, "cpu"), offload, interval, folder, bw, timeline)
                        _train(opt, interval - 1, compute_s, timeline)  # to the first boundary (not measured)
                        steps = _train(opt, intervals * interval, compute_s, timeline)
                        opt.flush()  # every update done: each crossed all the sums
                        stats = opt.stats()
                        opt.close()
                    out["rows"].append(_row(spec, variant, offload, bw_name, bw, ratio, compute_s,
                                            out["probes"][offload]["update_s"], sums_bytes, steps, stats, timeline))
                    if bw_name == "slow" and ratio == min(spec["ratios"]):
                        out["timelines"][variant] = _one_interval(steps, timeline, interval)
        # the streamed pass alone over at most PIPELINE_NUMEL elements: at the runs' slow bandwidth, and at one where
        # the fetches take as long as the pass without them (where fetching beside the reads could halve the pass)
        numel = min(n, PIPELINE_NUMEL)
        alone = reader_pipeline(numel, "no fetch", None, 3, folder)["median_s"]["no fetch"]
        out["reader_pipeline"] = [reader_pipeline(numel, name, bw, spec["repeats"], folder) for name, bw in (
            ("slow", bandwidths["slow"]), ("disk rate", 4 * numel / alone))]
    return out


def reader_pipeline(numel: int, bw_name: str, bandwidth: float | None, repeats: int, folder: str) -> dict:
    """The streamed pass alone, over a state file of ``numel`` elements, interleaved round by round (a disk's
    speed drifts between whole runs by more than the fetch costs): the sums in host memory (``no fetch``: the
    disk's own time), fetched beside each block's read, and fetched after it (``serial``), the fetches on the
    modeled device's copy thread at ``bandwidth`` (None: ``no fetch`` only)."""
    import torch

    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.link import ThreadEngine
    from zenflow_kernels.orderings import orderings
    from zenflow_kernels.rules import AdamW
    from zenflow_kernels.state_files import StateFiles
    from zenflow_kernels.streamed_host import DeviceSums, RangeStep, streamed_host_step_

    block, rule = ZenFlowAdamW.NVME_BLOCK_NUMEL, AdamW()
    files = StateFiles(folder, numel, fields=("master", *rule.state_names), block_numel=block,
                       direct=ZenFlowAdamW.NVME_DIRECT)
    engine = ThreadEngine(timeout=600.0, delays=None, d2h_bytes_per_s=bandwidth)
    flat = torch.full((numel,), 1e-3)  # the device's sums (left as they are: the update only reads them)
    acc = torch.empty(numel)
    sums = DeviceSums(engine.fetcher(flat), [torch.empty(min(block, numel)) for _ in range(3)])
    runs = [RangeStep(0, numel, None, dict(step=1, grad_scale=1.0, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                     weight_decay=0.0))]
    times: dict[str, list[float]] = {"no fetch": []} if bandwidth is None else {"no fetch": [], "beside": [],
                                                                                  "serial": []}
    try:
        for _ in range(repeats):
            for name in times:
                acc.fill_(1e-3)  # (zeroed by the in-memory pass)
                with orderings.changed(fetch_beside_read=name != "serial"):
                    t0 = time.perf_counter()
                    if name == "no fetch":
                        streamed_host_step_(files, acc, runs, rule=rule)
                    else:
                        streamed_host_step_(files, None, runs, rule=rule, sums=sums)
                    times[name].append(time.perf_counter() - t0)
    finally:
        engine.close()
        files.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    if bandwidth is None:
        return dict(numel=numel, seconds=times, median_s=med)
    fetch_s = 4 * numel / bandwidth
    return dict(bandwidth=bw_name, bytes_per_s=bandwidth, numel=numel, repeats=repeats, seconds=times,
                median_s=med, fetch_model_s=fetch_s, serial_over_beside=med["serial"] / med["beside"],
                # the reader's path per block: read + fetch when serial, the longer of the two beside each other
                predicted_serial_s=med["no fetch"] + fetch_s, predicted_beside_s=max(med["no fetch"], fetch_s))


def _row(spec, variant, offload, bw_name, bw, ratio, compute_s, update_s, sums_bytes, steps, stats, timeline) -> dict:
    interval, intervals = spec["interval"], spec["intervals"]
    t0, t1 = steps[0]["start"], steps[-1]["end"]
    between = [s for s in steps if not s["boundary"]]
    step_s = statistics.median(s["step_s"] for s in between) if between else 0.0
    updates = stats["host_update_s"][1:]  # (the first ran beside the unmeasured steps)
    # the sums' crossing: on disk every fetch; in memory the boundary's one D2H job of all the sums (the
    # per-step copies of the vectors' gradients share the lane)
    lane = "fetch" if offload == "nvme" else "d2h"
    crossing = [(a, b, nb) for ln, _, a, b, nb in timeline.spans
                if ln == lane and (offload == "nvme" or nb == sums_bytes)]
    crossing_s = sum(b - a for a, b, _ in crossing)
    per_crossing_s = crossing_s / stats["host_updates"]
    # the training thread's waits in the measured steps, per interval, by cause: "" the drain of the last update,
    # "join" the write-back of its weights (H2D), "sums" the device sums' crossing (memory)
    waits: dict[str, float] = {}
    for ln, label, a, b, _ in timeline.spans:
        if ln == "wait" and a >= t0 and b <= t1:
            waits[label or "drain"] = waits.get(label or "drain", 0.0) + (b - a) / intervals
    spans = [(a, b) for a, b, _ in crossing]
    return dict(
        variant=variant, offload=offload, eager=VARIANTS[variant][1], fetch_beside_read=VARIANTS[variant][2],
        bandwidth=bw_name, bytes_per_s=bw, ratio=ratio,
        compute_s=compute_s, probe_update_s=update_s, update_s=statistics.median(updates) if updates else None,
        step_s_between=step_s, waits_per_interval_s=waits,
        # from this run's own update (the probe's, taken alone, sized the compute; disks drift between runs)
        predicted_drain_s=max(0.0, statistics.median(updates) - interval * (compute_s + step_s)) if updates else None,
        # memory: the next write into the sums follows the boundary's write-back wait and the next step's compute
        # (eager: the crossing whole)
        predicted_sums_wait_s=0.0 if offload == "nvme" else per_crossing_s if VARIANTS[variant][1] else max(
            0.0, per_crossing_s - waits.get("join", 0.0) - compute_s),
        waited_between_boundaries_s=sum(s["waited_s"] for s in between) / intervals,
        crossing_lane=lane, crossing_s=crossing_s, per_crossing_s=per_crossing_s,
        per_crossing_model_s=sums_bytes / bw, crossing_bytes=sum(nb for _, _, nb in crossing),
        host_updates=stats["host_updates"],
        crossing_inside_update_share=_inside(spans, timeline, "update") / crossing_s if crossing_s else None,
        crossing_inside_wait_share=_inside(spans, timeline, "wait") / crossing_s if crossing_s else None,
        disk_read_s=_lane_s(_spans(timeline, "read")), disk_write_s=_lane_s(_spans(timeline, "write")),
        wall_per_step_s=(t1 - t0) / len(steps), steps=len(steps), d2h_bytes=stats["d2h_bytes"])


def _one_interval(steps: list[dict], timeline, interval: int) -> dict:
    """The lanes from the second measured boundary step to the end of the interval after it, from its start."""
    boundaries = [k for k, s in enumerate(steps) if s["boundary"]]
    first = boundaries[1] if len(boundaries) > 1 else boundaries[0]
    last = min(len(steps) - 1, first + interval)
    t0, t1 = steps[first]["start"], steps[last]["end"]
    spans = [(ln, lb, max(a, t0) - t0, min(b, t1) - t0, nb) for ln, lb, a, b, nb in timeline.between(t0, t1)]
    return dict(spans=spans, boundary_steps=[steps[k]["step_start"] - t0 for k in boundaries if first <= k <= last])


def _size(text: str) -> tuple[int, int]:
    d, _, layers = text.partition("x")
    if not (d.isdigit() and layers.isdigit() and int(d) >= 1 and int(layers) >= 1):
        raise ValueError(f"--size: {text!r} is invalid: allowed DxL with integers >= 1 (e.g. 1024x4)")
    return int(d), int(layers)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.nvme_timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="a small size, one ratio (the test suite's run)")
    ap.add_argument("--size", type=_size, default=None, metavar="DxL", help="model size (default 1024x4)")
    ap.add_argument("--interval", type=int_at_least(2), default=None, help="update_interval (default 4)")
    ap.add_argument("--intervals", type=int_at_least(2), default=None, help="measured intervals per run (default 4)")
    args = ap.parse_args(argv)
    out_dir = output_dir(args.out)
    d, layers = args.size or (QUICK_SIZE if args.quick else SIZE)
    spec = dict(d=d, layers=layers, interval=args.interval or (2 if args.quick else 4),
                intervals=args.intervals or (2 if args.quick else 4), ratios=[0.5] if args.quick else list(RATIOS),
                repeats=2 if args.quick else 9)
    started = time.perf_counter()
    result = measure(spec)  # one process: timings only (no memory figures a fresh process would be needed for)
    from zenflow_kernels import ZenFlowAdamW

    payload = dict(config=dict(spec, quick=args.quick, zenflow=ZENFLOW, pcie_bytes_per_s=PCIE, slow_share=SLOW_SHARE,
                               block_numel=ZenFlowAdamW.NVME_BLOCK_NUMEL, direct=ZenFlowAdamW.NVME_DIRECT),
                   **result, total_s=time.perf_counter() - started, machine=machine_info_light())
    path = write_json_light(out_dir / "nvme_timeline_cpu.json", payload)
    plot(payload, out_dir / "nvme_timeline_cpu.png")
    print(f"{result['params'] / 1e6:.1f} M params, sums {result['sums_bytes'] / 2**20:.0f} MiB, "
          f"update_interval {spec['interval']}; host update alone: "
          + ", ".join(f"{k} {v['update_s']:.3f} s" for k, v in result["probes"].items()))
    print("waits per interval (s), measured / predicted; crossing: seconds per update, share inside the update job")
    print(f"{'variant':>12} {'bw':>4} {'ratio':>5} {'compute':>7} {'update':>6} {'drain':>11} {'sums':>11} "
          f"{'join':>5} {'between':>7} {'crossing':>8} {'in upd':>6}")
    for r in result["rows"]:
        w = r["waits_per_interval_s"]
        print(f"{r['variant']:>12} {r['bandwidth']:>4} {r['ratio']:>5} {r['compute_s']:>7.3f} {r['update_s']:>6.3f} "
              f"{w.get('drain', 0):>5.3f}/{r['predicted_drain_s']:<5.3f} {w.get('sums', 0):>5.3f}/"
              f"{r['predicted_sums_wait_s']:<5.3f} {w.get('join', 0):>5.3f} {r['waited_between_boundaries_s']:>7.3f} "
              f"{r['per_crossing_s']:>8.3f} {r['crossing_inside_update_share'] or 0:>6.2f}")
    print("the streamed pass alone, interleaved: medians (s) and the prediction beside each")
    for r in result["reader_pipeline"]:
        m = r["median_s"]
        print(f"  {r['bandwidth']:>4}: no fetch {m['no fetch']:.3f}, beside {m['beside']:.3f} "
              f"(predicted {r['predicted_beside_s']:.3f}), serial {m['serial']:.3f} (predicted "
              f"{r['predicted_serial_s']:.3f}); serial / beside {r['serial_over_beside']:.2f}")
    print(f"wrote {path}")
    return 0


def plot(payload: dict, path) -> None:
    p = plt()
    timelines = payload["timelines"]
    fig = p.figure(figsize=(14, 3.4 + 2.6 * len(timelines)))
    grid = fig.add_gridspec(1 + len(timelines), 4)
    ax = fig.add_subplot(grid[0, :3])
    axes = [ax] + [fig.add_subplot(grid[k + 1, :]) for k in range(len(timelines))]
    pipe = fig.add_subplot(grid[0, 3])
    names = ("no fetch", "beside", "serial")
    for k, r in enumerate(payload["reader_pipeline"]):
        pipe.bar([k * 4 + i for i in range(3)], [r["median_s"][n] for n in names], color=["#bdbdbd", "#74c476",
                                                                                          "#fd8d3c"])
        pipe.plot([k * 4 + 1, k * 4 + 2], [r["predicted_beside_s"], r["predicted_serial_s"]], "kx")
    pipe.set_xticks([k * 4 + i for k in range(len(payload["reader_pipeline"])) for i in range(3)],
                    [f"{n}\n{r['bandwidth']}" for r in payload["reader_pipeline"] for n in names], fontsize=7)
    pipe.set_ylabel("s per streamed pass (median)")
    pipe.set_title("the disk pass alone, interleaved (x: predicted)", fontsize=10)
    rows = payload["rows"]
    labels = [f"{r['variant']}\n{r['bandwidth']}, {r['ratio']}" for r in rows]
    bottom = [0.0] * len(rows)
    for cause, color in (("drain", "#bcbddc"), ("join", "#a1d99b"), ("sums", "#e6550d")):
        heights = [r["waits_per_interval_s"].get(cause, 0.0) for r in rows]
        ax.bar(range(len(rows)), heights, bottom=bottom, color=color, label=f"wait: {cause}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.plot(range(len(rows)), [r["predicted_drain_s"] + r["predicted_sums_wait_s"] for r in rows], "kx",
            label="predicted drain + sums")
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=30)
    ax.set_ylabel("training-thread wait per interval (s)")
    ax.set_title("waits by cause (variant, bandwidth, S x compute / disk update)", fontsize=10)
    ax.legend(fontsize=7)
    for ax, (variant, tl) in zip(axes[1:], timelines.items(), strict=True):
        draw_lanes(ax, tl["spans"], LANES, COLORS)
        for t in tl["boundary_steps"]:
            ax.axvline(t, color="k", lw=0.6, ls="--")
        ax.set_xlabel("s from the boundary step's compute (dashed: boundary step() calls)")
        ax.set_title(f"one interval: {variant} (slow bandwidth, lowest ratio)", fontsize=10)
    fig.suptitle(f"bench.nvme_timeline: device_accumulation's sums crossing on the modeled device "
                 f"({payload['params'] / 1e6:.1f} M params, S = {payload['interval']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    p.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
