"""How much of a step's gradient transfer backward hides, on the modeled device (docs/testing.md).

    python -m bench.overlap [--out DIR] [--quick] [--sizes 1 4 16 64] [--steps 8] [--batch 256]

On CPU a device-to-host copy is a memcpy, so the asynchronous test link (``testing.chaos``) models one: each copy
job takes ``bytes / bandwidth`` on its copy thread. Gradients land in the host's landing area from backward's hooks
and are folded into the sums after ``step()``, in fold jobs of 4 MiB (``AsyncLink.FOLD_CHUNK_BYTES`` shrunk, so that
a CPU-sized model is many fold jobs as a 7 B model is many of the default 64 MiB): the next backward's hooks wait
for the job holding their gradient's place. The model: fp32 MLPs of ``d = 512`` layers (1 MiB of gradient each),
1x to 64x a fold job, each size in a fresh process. Bandwidths: ``pcie`` (25 GB/s) and ``slow`` (the transfer takes
40% of backward, measured first: at 25 GB/s this machine's backward hides almost anything). Variants: ``handover``
(gradients cross from backward's hooks) and ``at_step`` (``orderings.changed(early_handover=False)`` around every
call into its optimizer: every gradient crosses at ``step()``). Each runs with the bandwidth model and without it,
the four runs interleaved step by step; the "device" is the CPU that also runs the host's work, so each variant is
compared with itself: the added stall is the median over steps of the modeled step's wall time minus the same
variant's unmodeled step taken just before it. Also: backward, ``step()``, the training thread's waits on the link,
the share of the transfer that ran during backward (the timeline's d2h lane), the folds' time per step and the
waits for them. Goal (issue 23): with backward longer than the transfer, the added stall <= 10% of the transfer at
every size. Writes ``overlap_cpu.json`` and ``overlap_cpu.png`` (against model size; one step's timeline per
variant at the largest size).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from unittest import mock

from bench import harness

FOLD_BYTES = 4 << 20  # the modeled fold job
D = 512
SIZES = [1, 4, 16, 64]
QUICK_SIZES = [1, 12]  # d = 128, fold jobs of 64 KiB: structure only, per-job overheads dominate
PCIE = 25e9
SLOW_SHARE = 0.4  # "slow": the transfer takes this share of the measured backward
VARIANTS = ("handover", "at_step")
ZENFLOW = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, full_warm_up_rounds=0,
               select_strategy="step", select_interval=1000)
GOAL_SHARE = 0.10


def build_model(layers: int, d: int, seed: int = 0):
    """``layers`` Linear(d, d) with ReLUs between, initialised to keep the gradient's scale through the depth
    (He-normal weights, zero biases). With torch's default init each layer shrinks the gradient by about 0.4, so
    at 256 layers it passes through the subnormal range, where x86 arithmetic is ~100x slower: backward stalls for
    seconds on a dozen layers and then hands over the rest in a burst (measured here: 2.5 s of backward at 256
    layers against 0.36 s with subnormals flushed), which is a property of that init, not of the link."""
    import torch

    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        linear = torch.nn.Linear(d, d)
        torch.nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        torch.nn.init.zeros_(linear.bias)
        mods += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _run(base, bytes_per_s: float | None, early: bool) -> dict:
    """A copy of the model and its optimizer on the asynchronous link (modeled at ``bytes_per_s``, or with
    plain memcpys), with its own timeline."""
    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.testing import Timeline, chaos

    model, timeline = copy.deepcopy(base), Timeline()
    with chaos(seed=0, max_delay=0, d2h_bytes_per_s=bytes_per_s, h2d_bytes_per_s=bytes_per_s, timeline=timeline):
        opt = ZenFlowAdamW(model.parameters(), lr=1e-4, zenflow=ZENFLOW)
    return dict(model=model, opt=opt, timeline=timeline, steps=[], early=early)


def _switches(run: dict):
    """The run's ablation switch (``early_handover``: read at the optimizer's first ``step()``), set around every
    call into its optimizer: the runs are interleaved step by step, each with its own setting."""
    from zenflow_kernels.orderings import orderings

    return orderings.changed(early_handover=run["early"])


def _close(run: dict) -> None:
    with _switches(run):
        run["opt"].close()


def measure_size(spec: dict) -> dict:
    """One model size: every bandwidth, every variant, interleaved; in this process."""
    import torch

    from zenflow_kernels.link import AsyncLink
    from zenflow_kernels.ops import use_backend

    d, fold = spec["d"], spec["fold_bytes"]
    layers = max(1, math.ceil(spec["size"] * fold / (d * d * 4)))
    base = build_model(layers, d)
    matrix_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.dim() == 2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(spec["batch"], d, generator=g), torch.randn(spec["batch"], d, generator=g)
    # numba: the backward "slow" is sized from are training steps as the runs take them
    with mock.patch.object(AsyncLink, "FOLD_CHUNK_BYTES", fold), use_backend("numba"):
        probe = _run(base, None, True)
        for t in range(5):
            _step(probe, x, y, measured=t >= 2)
        _close(probe)
        backward_s = statistics.median(s["backward"] for s in probe["steps"])
        share = spec.get("slow_share", SLOW_SHARE)
        bandwidths = {name: rate for name, rate in (("pcie", PCIE), ("slow", matrix_bytes / (share * backward_s)))
                      if name in spec.get("bandwidths", ("pcie", "slow"))}
        out = dict(size=spec["size"], layers=layers, d=d, params=sum(p.numel() for p in base.parameters()),
                   grad_bytes=sum(p.numel() * p.element_size() for p in base.parameters()),
                   matrix_grad_bytes=matrix_bytes, fold_bytes=fold, times_fold=matrix_bytes / fold,
                   backward_s_alone=backward_s, batch=spec["batch"], rows=[], timelines={})
        for bw_name, bw in bandwidths.items():
            # each variant with the modeled bandwidth ("bw") and without it ("free", copies are memcpys)
            runs = {(variant, link): _run(base, bw if link == "bw" else None, variant == "handover")
                    for variant in VARIANTS for link in ("free", "bw")}
            for t in range(spec["warmup"] + spec["steps"]):
                for run in runs.values():
                    _step(run, x, y, measured=t >= spec["warmup"])
            for variant in VARIANTS:
                run = runs[variant, "bw"]
                out["rows"].append(_row(spec, bw_name, bw, variant, run, runs[variant, "free"], matrix_bytes))
                if bw_name == "slow":  # one step's lanes, for the picture
                    s = run["steps"][len(run["steps"]) // 2]
                    out["timelines"][variant] = [
                        (lane, label, a - s["start"], b - s["start"], n)
                        for lane, label, a, b, n in run["timeline"].between(s["start"], s["end"] + 0.3 * s["wall"])]
            for run in runs.values():
                _close(run)
    return out


def _row(spec: dict, bw_name: str, bw: float, variant: str, run: dict, free: dict, matrix_bytes: int) -> dict:
    """A variant's figures at one bandwidth: its modeled run against its unmodeled twin (``free``)."""
    steps, timeline, transfer_s = run["steps"], run["timeline"], matrix_bytes / bw
    # the d2h lane inside each step's backward, over the transfer the step needs
    hidden = [timeline.busy("d2h", s["backward_start"], s["backward_end"]) for s in steps]
    # the folds of each step's gradients (they run from its step() into the next forward), and the training
    # thread's waits for a fold (a hook whose gradient's place was still being read)
    folds = [timeline.busy("accumulate", s["step_start"], s["end"] + s["wall"]) for s in steps]
    fold_waits = [sum(b - a for lane, label, a, b, _ in timeline.between(s["start"], s["end"])
                      if lane == "wait" and label == "fold") for s in steps]
    stats = run["opt"].stats()

    def median(key: str, of=steps) -> float:
        return statistics.median(s[key] for s in of)

    row = dict(size=spec["size"], bandwidth=bw_name, bytes_per_s=bw, variant=variant, transfer_s=transfer_s,
               wall_s=median("wall"), free_wall_s=median("wall", free["steps"]), backward_s=median("backward"),
               step_s=median("step"), waited_s=median("waited"),
               # each step against the same variant's step without the bandwidth model, taken just before it:
               # what the transfer adds, with the machine's drift cancelled
               added_stall_s=statistics.median(s["wall"] - f["wall"] for s, f in zip(steps, free["steps"],
                                                                                      strict=True)),
               # the same for the training thread's waits on the link: copies are sleeps on other threads, so
               # waits are the only way the transfer reaches the training thread
               added_waits_s=statistics.median(s["waited"] - f["waited"] for s, f in zip(steps, free["steps"],
                                                                                          strict=True)),
               hidden_share=statistics.median(hidden) / transfer_s,
               fold_s=statistics.median(folds), fold_wait_s=statistics.median(fold_waits),
               handover=stats["handover"], d2h_bytes_in_backward=stats["d2h_bytes_in_backward"],
               d2h_bytes=stats["d2h_bytes"])
    # the share of backward the transfer took in this run (the bandwidth was sized from the probe)
    row["transfer_share_of_backward"] = transfer_s / median("backward", free["steps"])
    for key in ("added_stall", "waited", "added_waits"):
        row[f"{key}_share"] = row[f"{key}_s"] / transfer_s
    return row


def _step(run: dict, x, y, *, measured: bool) -> None:
    """One training step of a run, its spans marked on its timeline."""
    import torch.nn.functional as F

    model, opt, timeline = run["model"], run["opt"], run["timeline"]
    with _switches(run):
        waited = opt.stats()["worker_wait_s"] if opt.built else 0.0
        t0 = time.perf_counter()
        with timeline.span("forward"):
            loss = F.mse_loss(model(x), y)
        t1 = time.perf_counter()
        with timeline.span("backward"):
            loss.backward()
        t2 = time.perf_counter()
        with timeline.span("step"):
            opt.step()
            opt.zero_grad()
        t3 = time.perf_counter()
        if measured:
            run["steps"].append(dict(start=t0, backward_start=t1, backward_end=t2, step_start=t2, end=t3,
                                     wall=t3 - t0, backward=t2 - t1, step=t3 - t2,
                                     waited=opt.stats()["worker_wait_s"] - waited))


def main(argv: list[str] | None = None) -> int:
    at_least = harness.int_at_least
    ap = harness.OneLineParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="two small sizes, a few steps (the test suite's run)")
    ap.add_argument("--sizes", type=at_least(1), nargs="+", default=None,
                    help=f"model sizes in multiples of a fold job (default {' '.join(map(str, SIZES))})")
    ap.add_argument("--steps", type=at_least(2), default=None, help="measured steps per variant (default 8)")
    ap.add_argument("--batch", type=at_least(1), default=None, help="rows per batch (default 256)")
    ap.add_argument("--worker-spec", dest="spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", dest="worker_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.spec is not None:
        with open(args.worker_out, "w") as f:
            json.dump(measure_size(json.loads(args.spec)), f)
        return 0
    out_dir = harness.output_dir(args.out)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    d = 128 if args.quick else D
    fold_bytes = (64 << 10) if args.quick else FOLD_BYTES
    steps, warmup = args.steps or (2 if args.quick else 8), 1 if args.quick else 2
    batch = args.batch or (64 if args.quick else 256)
    started = time.perf_counter()
    results = [harness.run_child("bench.overlap", ["--worker-spec", json.dumps(dict(
        size=size, d=d, fold_bytes=fold_bytes, batch=batch, steps=steps, warmup=warmup))], timeout=1800,
        what=f"the size {size}x process") for size in sizes]
    rows = [r for res in results for r in res["rows"]]
    summary = {}
    for bw in ("pcie", "slow"):
        for variant in VARIANTS:
            sel = [r for r in rows if r["bandwidth"] == bw and r["variant"] == variant]
            fits = [r for r in sel if r["transfer_share_of_backward"] < 1]  # backward longer than the transfer
            summary[f"{bw}/{variant}"] = dict(
                worst_added_stall_share=max(r["added_stall_share"] for r in sel),
                worst_added_waits_share=max(r["added_waits_share"] for r in sel),
                goal_met_wall=all(r["added_stall_share"] <= GOAL_SHARE for r in fits),
                goal_met_waits=all(r["added_waits_share"] <= GOAL_SHARE for r in fits),
                sizes_where_backward_is_longer=[r["size"] for r in fits])
    payload = dict(config=dict(sizes=sizes, d=d, fold_bytes=fold_bytes, batch=batch, steps=steps,
                               warmup=warmup, quick=args.quick, zenflow=ZENFLOW, pcie_bytes_per_s=PCIE,
                               slow_share_of_backward=SLOW_SHARE, goal_share=GOAL_SHARE, dtype="float32"),
                   sizes=[{k: v for k, v in res.items() if k not in ("rows", "timelines")} for res in results],
                   rows=rows, summary=summary, timelines=results[-1]["timelines"],
                   total_s=time.perf_counter() - started, machine=harness.machine_info())
    path = harness.write_result(out_dir / "overlap_cpu.json", payload)
    plot(payload, out_dir / "overlap_cpu.png")
    print(f"{'size':>5} {'x fold':>7} {'bandwidth':>9} {'variant':>9} {'transfer ms':>12} {'backward ms':>12} "
          f"{'added ms':>9} {'added/xfer':>10} {'+waits/xfer':>11} {'hidden':>7} {'fold ms':>8} {'fold wait':>9}")
    by_size = {res["size"]: res for res in results}
    for r in rows:
        print(f"{r['size']:>5} {by_size[r['size']]['times_fold']:>7.1f} {r['bandwidth']:>9} {r['variant']:>9} "
              f"{1e3 * r['transfer_s']:>12.1f} {1e3 * r['backward_s']:>12.1f} {1e3 * r['added_stall_s']:>9.1f} "
              f"{r['added_stall_share']:>10.2f} {r['added_waits_share']:>11.2f} {r['hidden_share']:>7.2f} "
              f"{1e3 * r['fold_s']:>8.1f} {1e3 * r['fold_wait_s']:>9.2f}")
    for key, s in summary.items():
        print(f"{key}: worst added stall {s['worst_added_stall_share']:.2f} of the transfer (wall), "
              f"{s['worst_added_waits_share']:.2f} (waits); goal (<= {GOAL_SHARE:.2f} where backward is longer, "
              f"sizes {s['sizes_where_backward_is_longer']}): wall {'met' if s['goal_met_wall'] else 'not met'}, "
              f"waits {'met' if s['goal_met_waits'] else 'not met'}")
    print(f"wrote {path}")
    return 0


LANES = ("forward", "backward", "step", "wait", "d2h", "accumulate", "update", "h2d")
COLORS = dict(forward="#9ecae1", backward="#3182bd", step="#6baed6", wait="#e6550d", d2h="#31a354",
              accumulate="#756bb1", update="#bcbddc", h2d="#a1d99b")


def plot(payload: dict, path) -> None:
    fig = harness.plt().figure(figsize=(15, 8.5))
    grid = fig.add_gridspec(2, 6)
    top = [fig.add_subplot(grid[0, 2 * k : 2 * k + 2]) for k in range(3)]
    bottom = [fig.add_subplot(grid[1, 3 * k : 3 * k + 3]) for k in range(2)]
    rows = payload["rows"]
    times_fold = {s["size"]: s["times_fold"] for s in payload["sizes"]}
    for ax, key, title, bandwidths in (
            (top[0], "added_stall_share", "added wall time per step / transfer (slow)", ("slow",)),
            (top[1], "added_waits_share", "added training-thread waits / transfer", ("slow", "pcie")),
            (top[2], "hidden_share", "transfer during backward / transfer", ("slow", "pcie"))):
        for bw in bandwidths:
            for variant, marker in (("handover", "o"), ("at_step", "s")):
                sel = sorted((r for r in rows if r["bandwidth"] == bw and r["variant"] == variant),
                             key=lambda r: r["size"])
                ax.plot([times_fold[r["size"]] for r in sel], [r[key] for r in sel], "-" if bw == "slow" else ":",
                        marker=marker, label=f"{variant}, {bw}")
        if key != "hidden_share":
            ax.axhline(payload["config"]["goal_share"], color="grey", lw=0.8, ls="--", label="goal")
            ax.set_ylim(-0.3, 1.3)
        harness.style(ax, "model gradient / fold job", logx=10, grid=None).set_title(title, fontsize=10)
    for ax, variant in zip(bottom, ("handover", "at_step"), strict=True):
        # (waits under 50 us: checks of finished jobs, recorded before the link filtered them)
        spans = [s for s in payload["timelines"].get(variant, []) if s[0] != "wait" or s[3] - s[2] > 5e-5]
        harness.draw_lanes(ax, spans, LANES, COLORS, scale=1e3)
        ax.set_xlabel("ms from the step's forward")
        ax.set_title(f"one step, {variant} (largest size, slow bandwidth)", fontsize=10)
    fig.suptitle("bench.overlap: gradient transfer on the modeled device (CPU, " +
                 f"fold jobs of {payload['config']['fold_bytes'] >> 10} KiB)")
    harness.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
