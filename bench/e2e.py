"""End-to-end benchmark and the ``make demo`` engine: fine-tune a small GPT on Python's own source.

``python -m bench.e2e --demo`` (``make demo``) pre-trains a byte-level GPT (``bench.model``) on a seeded selection of
the standard library's top-level modules (``bench.data``), or loads it from the cache (``data/e2e/``), then
fine-tunes it on package sources three times on the same batches: ``torch.optim.AdamW`` (``fused=True`` where the
device supports it), synchronous ZeRO-Offload (host AdamW on the fp32 master every step while training waits, then
the whole model copied back) and ``ZenFlowAdamW`` (top-k columns every step, the rest on the host every
``update_interval`` steps, overlapped), all with the same AdamW hyper-parameters (lr 3e-4, or with ``--demo`` the
tuned comparison's pick ``DEMO_TUNED``; linear warm-up over 10% of the steps, weight decay 0.01, no clipping;
without ``--demo`` ZenFlow re-selects once per epoch of the fine-tuning data). It prints a table (steps/s, stall,
host updates, final train and held-out loss; the time to AdamW's loss at 75% of its steps, here and modeled for a
7B model on an H200 profile: ``bench.e2e_target``) and writes ``e2e.json`` (every figure, the curves, the machine)
and ``e2e.png``.

Timing: the clock runs over the training steps only (data, forward, backward, optimizer step, the final
``flush()``); held-out evaluation runs after each run, on snapshots of the weights taken during it (as training used
them: ZenFlow's non-selected columns up to one interval stale). Stall: the time the training thread waited for the
host (``stats()["stall_s"]``), as a share of the wall time. ``--repeats R`` interleaves the runs (A, B, C, A, ...)
and reports the median steps/s, the curves from the repeat with the median wall time. The notebooks use
``prepare(cfg)`` and ``train_run(spec, prep)`` (``bench.e2e_core``, shared with ``bench.gpu_e2e``, re-exported here).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from bench import e2e_core, e2e_target, gpu_e2e, harness
from bench.e2e_core import *  # noqa: F403 - re-exported: the notebooks use the core's names as e2e.prepare and so on
from bench.e2e_core import E2EConfig, RunSpec, offload_block, zenflow_block
from bench.model import SIZES, num_params
from zenflow_kernels.concentration import PREMISE_TOP10, concentration_report

# ``--demo``: the learning rate and ZenFlow setting the tuned comparison picks on the byte-GPT fine-tune
# (studies/results/tuned_gpt_finetune.json, tiny model): AdamW's best rate, 2e-3, is also the best of topk_ratio 0.05
# with update_interval 2 (no overlap, columns re-selected every 4 steps: the study's variant as it ran), the one
# setting that beat ZenFlow's defaults on all four workloads (studies/findings.py); tests/test_studies.py checks these
# against the committed study. The demo's model is the small preset: the rate is carried over from the tiny one.
DEMO_TUNED = dict(lr=2e-3, topk_ratio=0.05, update_interval=2, overlap=False, select_interval=4)


def default_specs(cfg: E2EConfig, n_epoch: int, cores_percs: Sequence[float] | None = None,
                  variants: Sequence[tuple[str, dict]] = (), baseline_threads: Sequence[int] = ()) -> list[RunSpec]:
    """AdamW, synchronous offload, and ZenFlow (one ZenFlow run per ``pt_reserved_cores_perc``), then one
    more ZenFlow run per ``(name, overrides)`` variant (overrides: ZenFlow config fields), and one more
    AdamW run per entry of ``baseline_threads`` (AdamW at that many torch threads)."""
    specs = [RunSpec("adamw", "adamw", label="torch AdamW"),
             RunSpec("offload", "offload", offload_block(cfg), label="sync offload")]
    for n in baseline_threads:
        specs.append(RunSpec(f"adamw_t{n}", "adamw", label=f"torch AdamW, {n} thread{'s' if n > 1 else ''}",
                             threads=n))
    percs = [cfg.cores_perc() if p is None else p for p in (cores_percs or [None])]
    for perc in percs:
        name = "zenflow" if len(percs) == 1 else f"zenflow_pt{perc:g}"
        label = "ZenFlowAdamW" if len(percs) == 1 else f"ZenFlowAdamW (pt_reserved {perc:g})"
        specs.append(RunSpec(name, "zenflow", zenflow_block(cfg, n_epoch, pt_reserved_cores_perc=perc), label))
    for name, overrides in variants:
        label = "ZenFlowAdamW " + ", ".join(f"{k}={v}" for k, v in overrides.items())
        specs.append(RunSpec(f"zenflow_{name}", "zenflow", zenflow_block(cfg, n_epoch, **overrides), label))
    return specs


def _smooth(xs: list[float], k: int) -> list[float]:
    """The running mean of the last ``k`` values (fewer at the start)."""
    sums = [0.0, *itertools.accumulate(xs)]
    return [(sums[i + 1] - sums[max(0, i + 1 - k)]) / min(i + 1, k) for i in range(len(xs))]


def plot(result: dict, path: Path) -> Path:
    """Loss against wall time and against step: smoothed train loss (thin) and held-out loss (markers); and the
    gradient's concentration at each selection of the ZenFlow runs (ZenFlow's premise)."""
    fig, axes = harness.figure(3, size=(17, 4.5))
    colors = harness.plt().rcParams["axes.prop_cycle"].by_key()["color"]
    for j, r in enumerate(result["runs"]):
        c = colors[j % len(colors)]
        smooth = _smooth(r["train_loss"], max(1, r["steps"] // 20))
        axes[0].plot(r["wall_at_step"], smooth, color=c, lw=0.8, alpha=0.6)
        axes[1].plot(list(range(1, r["steps"] + 1)), smooth, color=c, lw=0.8, alpha=0.6)
        ev = r["evals"]
        axes[0].plot([e["wall_s"] for e in ev], [e["heldout_loss"] for e in ev], "o-", color=c, lw=1.8,
                     label=f"{r['label']} ({r['steps_per_s_median']:.2f} steps/s)")
        axes[1].plot([e["step"] for e in ev], [e["heldout_loss"] for e in ev], "o-", color=c, lw=1.8, label=r["label"])
        conc = r.get("concentration")
        if conc and conc["top10"]:
            at = r["selection_steps"]
            axes[2].plot(at, conc["top10"], "o-", color=c, lw=1.2, label=f"{r['label']}: top 10% of columns")
            axes[2].plot(at, conc["top1"], "^--", color=c, lw=0.9, label="top 1%")
            axes[2].plot(at, conc["selected"], "s:", color=c, lw=0.9, label="selected")
        along = r.get("concentration_at_evals")
        if along:
            axes[2].plot([a["step"] for a in along], [a["top10"] for a in along], "-", color=c, lw=2, alpha=0.5,
                         label=f"{r['label']}: top 10%, the step's gradient along the run")
    m, cfg = result["machine"], result["config"]
    where = m.get("gpu") or f"{m.get('cpu')}, {cfg['threads']} threads"
    harness.style(axes[0], "wall time (s, training steps only)", "loss (nats/byte)", "loss against wall time", legend=8)
    harness.style(axes[1], "step", "loss (nats/byte)", "loss against step", legend=8)
    axes[2].axhline(PREMISE_TOP10, color="grey", lw=0.8, ls="--")
    axes[2].set_ylim(0, 1.02)
    harness.style(axes[2], "step (markers: selections)", "share of the gradient's energy",
                  f"gradient concentration (premise: top 10% >= {PREMISE_TOP10:.0%})", legend=8)
    fig.suptitle(f"fine-tuning a {cfg['model']} byte GPT ({result['model']['params']['total'] / 1e6:.2f} M params) on "
                 f"stdlib packages; markers: held-out, lines: train (smoothed); {where}", fontsize=9)
    harness.save(fig, path)
    return path


def table(result: dict) -> str:
    """The run table: one row per run, the figures the README cites."""
    cmp = result["comparison"]["per_run"]
    head = (f"{'run':<34}{'steps/s':>9}{'vs AdamW':>10}{'stall %':>9}{'host upd':>10}"
            f"{'train loss':>12}{'held-out':>10}")
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        ratio = cmp[r["name"]].get("steps_per_s_vs_adamw", float("nan"))
        lines.append(f"{r['label']:<34}{r['steps_per_s_median']:>9.2f}{ratio:>9.2f}x{r['stall_pct_median']:>9.1f}"
                     f"{r['host_updates']:>10d}{r['final_train_loss']:>12.4f}{r['final_heldout_loss']:>10.4f}")
    for name, row in cmp.items():
        if name.startswith("zenflow") and "heldout_gap_vs_offload_equal_wall" in row:
            lines.append(f"{name}: at equal wall time ({row['equal_wall_time_s']:.1f} s) held-out"
                         f" {row['heldout_at_equal_wall']:.4f} vs sync offload"
                         f" {row['offload_heldout_at_equal_wall']:.4f}; at equal steps"
                         f" {row['heldout_gap_vs_adamw_equal_steps']:+.4f} vs AdamW")
    zen = next((r for r in result["runs"] if r.get("concentration", {}).get("top10")), None)
    if zen is not None:
        lines.append(f"{zen['name']}: " + concentration_report({"concentration": zen["concentration"]}))
    return "\n".join(lines + e2e_target.lines(result))


_positive_int = harness.int_at_least(1)


def _float(ok, what: str):
    """An argparse ``type=``: a number for which ``ok(value)`` holds, with a one-line message otherwise."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return v

    return parse


_fraction = _float(lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
_positive_float = _float(lambda v: v > 0 and math.isfinite(v), "a positive number")


def _interval(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _variant(text: str) -> tuple[str, dict]:
    """NAME:field=value,field=value -> (NAME, {field: value}); values are JSON (true, 0.5, "auto") or text."""
    name, sep, body = text.partition(":")
    if not sep or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:field=value[,field=value...]")
    from zenflow_kernels import ZenFlowConfig

    overrides = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ZenFlowConfig.field_names():
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not field=value with a ZenFlow config field")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:  # the values, checked now rather than after the pre-training
        ZenFlowConfig.from_dict(zenflow_block(E2EConfig(), 10**6, **overrides))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return name, overrides


def parser() -> argparse.ArgumentParser:
    d, tuned = E2EConfig(), DEMO_TUNED
    p = harness.OneLineParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--demo", action="store_true", help="the make-demo preset (the defaults below, progress bar on)")
    p.add_argument("--preset", choices=["gpu"], default=None,
                   help="gpu: the GPU benchmark (bench.gpu_e2e: 152 M model, AdamW / sync offload / ZenFlowAdamW / "
                        "DeepSpeed, e2e_gpu.json); needs CUDA unless --device cpu")
    p.add_argument("--model", choices=sorted(SIZES), default=None,
                   help=f"model size preset (default {d.model}; gpt152m with --preset gpu)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help=f"fine-tuning steps per run (default {d.steps}; 40 timed steps with --preset gpu)")
    p.add_argument("--pretrain-steps", type=harness.int_at_least(0), default=d.pretrain_steps,
                   help="pre-training steps (cached)")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help=f"fine-tuning learning rate (default {d.lr}; {tuned['lr']} with --demo)")
    p.add_argument("--topk-ratio", type=_fraction, default=None,
                   help=f"ZenFlow topk_ratio (default {d.topk_ratio}; {tuned['topk_ratio']} with --demo)")
    p.add_argument("--update-interval", type=_interval, default=None,
                   help=f"ZenFlow update_interval (default {d.update_interval}; {tuned['update_interval']} with "
                        "--demo)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="ZenFlow without overlap_step (the default with --demo)")
    p.add_argument("--select-interval", type=_positive_int, default=None,
                   help="re-select columns every N steps (default: once per epoch of the fine-tuning data; 4 with "
                        "--demo)")
    p.add_argument("--pt-reserved-cores-perc", type=_fraction, nargs="+", default=[d.pt_reserved_cores_perc],
                   help="ZenFlow pt_reserved_cores_perc, default 1.0 on CPU (training and host share the cores), "
                        "0.5 on CUDA; several values: one ZenFlow run each")
    p.add_argument("--variant", type=_variant, action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                   help="one more ZenFlow run with these config fields changed, e.g. sync:overlap_step=false")
    p.add_argument("--baseline-threads", type=_positive_int, nargs="+", default=[], metavar="N",
                   help="one more AdamW run per value, at that many torch threads")
    p.add_argument("--runs", default="adamw,offload,zenflow", help="comma-separated subset of adamw, offload, zenflow")
    p.add_argument("--repeats", type=_positive_int, default=d.repeats, help="interleaved repeats of every run")
    p.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the preset's)")
    p.add_argument("--context", type=_positive_int, default=None, help="context length (default: the preset's)")
    p.add_argument("--eval-points", type=_positive_int, default=d.eval_points, help="held-out evaluations per run")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", default=None, help="output folder (default: bench/results)")
    p.add_argument("--name", default="e2e", help="output file stem: NAME.json, NAME.png")
    p.add_argument("--cache", default=str(e2e_core.cache_dir()), help="pre-trained model cache folder ('' disables it)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _check_device(text: str) -> str:
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"error: --device {text!r} is invalid: allowed auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {text!r} asked for CUDA, but torch sees no CUDA device here")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    kinds = [k.strip() for k in args.runs.split(",") if k.strip()]
    if not kinds or any(k not in ("adamw", "offload", "zenflow") for k in kinds):
        raise SystemExit(f"error: --runs {args.runs!r} is invalid: allowed a comma-separated subset of "
                         "adamw, offload, zenflow")
    if not all(c.isalnum() or c in "-_." for c in args.name):
        raise SystemExit(f"error: --name {args.name!r} is invalid: allowed letters, digits, '-', '_' and '.'")
    d = E2EConfig()
    for key, value in (DEMO_TUNED if args.demo else dict(lr=d.lr, topk_ratio=d.topk_ratio, overlap=d.overlap,
                                                          update_interval=d.update_interval)).items():
        if getattr(args, key) is None:  # (what is not given: the demo's tuned pick, else E2EConfig's default)
            setattr(args, key, value)
    if args.preset == "gpu":
        if args.device != "auto":
            _check_device(args.device)
        return gpu_e2e.main(args)
    device = _check_device(args.device)
    out = harness.output_dir(args.out)
    cfg = E2EConfig(
        model=args.model or d.model, steps=args.steps or d.steps, pretrain_steps=args.pretrain_steps, lr=args.lr,
        topk_ratio=args.topk_ratio, update_interval=args.update_interval, overlap=args.overlap,
        pt_reserved_cores_perc=args.pt_reserved_cores_perc[0], select_interval=args.select_interval, seed=args.seed,
        eval_points=args.eval_points, device=device, threads=args.threads, repeats=args.repeats,
        batch=args.batch, context=args.context)
    size = cfg.size()
    if size.d_model % size.n_head:
        raise SystemExit("error: the model's width is not a multiple of its heads")
    progress = not args.quiet
    t_start = time.perf_counter()
    try:
        prep = e2e_core.prepare(cfg, cache_dir=args.cache or None, progress=progress)
    except RuntimeError as exc:
        if "standard-library" in str(exc):
            raise SystemExit(f"error: {exc}") from None
        raise
    specs = default_specs(cfg, prep.n_epoch, args.pt_reserved_cores_perc, args.variant, args.baseline_threads)
    runs = e2e_core.run_all([s for s in specs if s.kind in kinds], prep, repeats=cfg.repeats, progress=progress)
    result = {
        "benchmark": "e2e",
        "command": "python -m bench.e2e " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {**asdict(cfg), "threads": prep.threads, "device": str(prep.device), "size": size.as_dict(),
                   "epoch_steps": prep.n_epoch, "fused_adamw": e2e_core.fused_supported(prep.device),
                   "pt_reserved_cores_perc_resolved": cfg.cores_perc(),
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "model": {"params": num_params(e2e_core.make_model(prep))},
        "corpus": prep.corpus.describe(), "pretrain": prep.pretrain, "runs": runs,
        "comparison": e2e_core.compare(runs), "to_target": e2e_target.to_target(runs),
        "machine": harness.machine_info(),
    }
    result["machine"]["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    result["total_s"] = time.perf_counter() - t_start
    json_path = harness.write_result(out / f"{args.name}.json", result)
    png_path = plot(result, out / f"{args.name}.png") if args.plot else None
    print(table(result))
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else "") + f" ({result['total_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
