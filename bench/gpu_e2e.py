"""The GPU end-to-end benchmark: ``python -m bench.e2e --preset gpu`` (``bench/gpu_suite.sh`` runs it).

One process, the same batches for every run: the 152 M-parameter byte GPT of ``bench.model`` (``gpt152m``), fp32
parameters, forward and backward under bf16 autocast, randomly initialised (the runs compare speed, and loss at
equal steps), a constant learning rate; untimed warm-up steps first, then ``--steps`` timed steps, each ended by a
device sync. Runs: ``adamw`` (``torch.optim.AdamW(fused=True)`` on the GPU: the speed to reach), ``offload``
(synchronous ZeRO-Offload through ``ZenFlowAdamW``), ``zenflow`` (``topk_ratio=0.1``, ``update_interval=4``,
overlapped), ``zenflow_devacc`` (the same with ``device_accumulation=True``: one gradient upload per interval), and
when ``deepspeed`` imports (optional, never the library's dependency) ``ds_zero2_offload`` (ZeRO-2, CPU offload)
and ``ds_zenflow`` (DeepSpeed's ZenFlow at the same settings).

Per run: ms/step (median and mean: every fourth step differs), stall (the training thread waiting for, or doing,
host work, as a share of wall time), bytes crossing PCIe per step each way, peak device memory, final train and
held-out loss. Writes ``e2e_gpu.json`` and ``e2e_gpu.png``; prints a table and the GPU issue's goals (ZenFlow step
<= 1.25x AdamW's, >= 4x sync offload's speed, stall < 5%, faster than DeepSpeed ZenFlow, ``step()`` <= 2 ms).
Without CUDA it says so and exits; ``--device cpu`` with a small ``--model`` runs the same code on CPU (the tests).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from bench import e2e_core, harness
from bench.e2e_core import E2EConfig, RunSpec
from bench.model import num_params

DEFAULT_MODEL = "gpt152m"
DEFAULT_STEPS = 40


def deepspeed_unavailable() -> str | None:
    """None when deepspeed imports here, else why not (one line)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or its own start-up failing (no compiler, no CUDA toolkit)
        return f"deepspeed does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def ds_config(*, batch: int, lr: float, weight_decay: float, zenflow: dict | None) -> dict:
    """ZeRO-2, optimizer state on the CPU (pinned), fp32 parameters (the forward runs under torch's bf16 autocast,
    as for every other run), AdamW with the benchmark's numbers, no clipping; ``zenflow``: DeepSpeed's
    ``zero_optimization.zenflow`` block, or None for plain ZeRO-Offload."""
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True}
    if zenflow is not None:
        zero["zenflow"] = dict(zenflow)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": weight_decay}},
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def specs(cfg: E2EConfig, n_epoch: int) -> tuple[list[RunSpec], str | None]:
    """The runs, and why the DeepSpeed ones are left out (None when they are in)."""
    zen = dict(topk_ratio=cfg.topk_ratio, update_interval=cfg.update_interval, overlap_step=cfg.overlap,
               pt_reserved_cores_perc=cfg.cores_perc(), full_warm_up_rounds=0, select_strategy="step",
               select_interval=max(cfg.steps * 4, 4))  # one selection per run (the runs are short)
    out = [RunSpec("adamw", "adamw", label="torch AdamW (fused)"),
           RunSpec("offload", "offload", e2e_core.offload_block(cfg), label="sync offload"),
           RunSpec("zenflow", "zenflow", zen, label="ZenFlowAdamW"),
           RunSpec("zenflow_devacc", "zenflow", dict(zen, device_accumulation=True),
                   label="ZenFlowAdamW, device accumulation")]
    why_not = deepspeed_unavailable()
    if why_not is None:
        common = dict(batch=cfg.size().batch, lr=cfg.lr, weight_decay=cfg.weight_decay)
        ds_zen = {k: zen[k] for k in ("topk_ratio", "update_interval", "overlap_step", "full_warm_up_rounds",
                                      "select_strategy", "select_interval", "pt_reserved_cores_perc")}
        out += [RunSpec("ds_zero2_offload", "deepspeed", ds_config(**common, zenflow=None),
                        label="DeepSpeed ZeRO-2 offload"),
                RunSpec("ds_zenflow", "deepspeed", ds_config(**common, zenflow=ds_zen), label="DeepSpeed ZenFlow")]
    return out, why_not


def summarize(run: dict) -> dict:
    """The per-run figures the issue asks for."""
    ms = run["step_ms"]
    return {"label": run["label"], "ms_per_step_median": statistics.median(ms),
            "ms_per_step_mean": statistics.fmean(ms), "stall_pct": run["stall_pct"],
            "d2h_bytes_per_step": run["d2h_bytes_per_step"], "h2d_bytes_per_step": run["h2d_bytes_per_step"],
            "peak_device_bytes": run["peak_device_bytes"],
            "optimizer_step_call_ms_mean": 1e3 * run["optimizer_step_call_s_mean"],
            "final_train_loss": run["final_train_loss"], "final_heldout_loss": run["final_heldout_loss"]}


def goals(rows: dict) -> dict:
    """The GPU issue's goals, from figures measured in this run (None where a baseline is missing)."""
    zen, adamw, offload, ds = rows.get("zenflow"), rows.get("adamw"), rows.get("offload"), rows.get("ds_zenflow")
    if zen is None:
        return {}
    mean = zen["ms_per_step_mean"]
    return {
        "step_le_1p25x_adamw": None if adamw is None else mean <= 1.25 * adamw["ms_per_step_mean"],
        "speed_ge_4x_sync_offload": None if offload is None else offload["ms_per_step_mean"] >= 4 * mean,
        "stall_lt_5pct": zen["stall_pct"] < 5.0,
        "faster_than_deepspeed_zenflow": None if ds is None else mean < ds["ms_per_step_mean"],
        "step_call_le_2ms": zen["optimizer_step_call_ms_mean"] <= 2.0,
    }


def plot(result: dict, path) -> None:
    rows = result["summary"]
    names = list(rows)
    x = range(len(names))
    fig, axes = harness.figure(3, size=(15, 4.5))
    axes[0].bar([i - 0.2 for i in x], [rows[n]["ms_per_step_median"] for n in names], width=0.4, label="median")
    axes[0].bar([i + 0.2 for i in x], [rows[n]["ms_per_step_mean"] for n in names], width=0.4, label="mean")
    axes[1].bar(x, [rows[n]["d2h_bytes_per_step"] / 2**20 for n in names], width=0.4, label="device -> host")
    axes[1].bar([i + 0.4 for i in x], [rows[n]["h2d_bytes_per_step"] / 2**20 for n in names], width=0.4,
                label="host -> device")
    for r in result["runs"]:
        axes[2].plot(r["wall_at_step"], r["train_loss"], lw=1, label=r["label"])
    for ax in axes[:2]:
        ax.set_xticks(list(x), [rows[n]["label"] for n in names], rotation=30, ha="right", fontsize=7)
    harness.style(axes[0], None, "ms per step", "step time")
    harness.style(axes[1], None, "MiB per step", "bytes crossing PCIe")
    harness.style(axes[2], "wall time (s)", "train loss (nats/byte)", "loss against wall time")
    fig.suptitle(f"{result['config']['model']} byte GPT ({result['model']['params']['total'] / 1e6:.0f} M params), "
                 f"bf16 autocast; {result['machine'].get('gpu') or result['config']['device']}", fontsize=9)
    harness.save(fig, path)


def table(result: dict) -> str:
    head = f"{'run':<36}{'ms/step med':>12}{'mean':>9}{'stall %':>9}{'D2H MiB':>9}{'H2D MiB':>9}{'peak GiB':>9}" \
           f"{'step() ms':>10}{'loss':>8}"
    lines = [head, "-" * len(head)]
    for row in result["summary"].values():
        lines.append(
            f"{row['label']:<36}{row['ms_per_step_median']:>12.1f}{row['ms_per_step_mean']:>9.1f}"
            f"{row['stall_pct']:>9.1f}{row['d2h_bytes_per_step'] / 2**20:>9.1f}"
            f"{row['h2d_bytes_per_step'] / 2**20:>9.1f}{(row['peak_device_bytes'] or 0) / 2**30:>9.2f}"
            f"{row['optimizer_step_call_ms_mean']:>10.2f}{row['final_train_loss']:>8.3f}")
    if result.get("deepspeed_skipped"):
        lines.append(f"DeepSpeed runs left out: {result['deepspeed_skipped']}")
    lines.append("goals: " + ", ".join(f"{k}={v}" for k, v in result["goals"].items()))
    return "\n".join(lines)


def main(args) -> int:
    """Run the preset from ``bench.e2e``'s parsed arguments (``--model``, ``--steps``, ``--device``, ...)."""
    device = args.device if args.device != "auto" else "cuda"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: bench.e2e --preset gpu needs a CUDA GPU and torch sees none on this machine; run it "
                         "where one is (bench/gpu_suite.sh does), or pass --device cpu with a small --model to try "
                         "the code path")
    out = harness.output_dir(args.out)
    cfg = E2EConfig(model=args.model or DEFAULT_MODEL, steps=args.steps or DEFAULT_STEPS, pretrain_steps=0,
                    lr=args.lr, warmup_frac=0.0, topk_ratio=args.topk_ratio, update_interval=args.update_interval,
                    overlap=args.overlap, pt_reserved_cores_perc=args.pt_reserved_cores_perc[0], seed=args.seed,
                    eval_points=1, device=device, threads=args.threads, repeats=1, batch=args.batch,
                    context=args.context, autocast="bf16")
    t0 = time.perf_counter()
    prep = e2e_core.prepare(cfg, cache_dir=None, progress=not args.quiet)
    runs_specs, ds_skipped = specs(cfg, prep.n_epoch)
    runs = e2e_core.run_all(runs_specs, prep, repeats=1, progress=not args.quiet)
    summary = {r["name"]: summarize(r) for r in runs}
    result = {
        "benchmark": "e2e_gpu",
        "command": "python -m bench.e2e " + " ".join(sys.argv[1:]),
        "config": {**cfg.__dict__, "threads": prep.threads, "device": str(prep.device), "size": cfg.size().as_dict(),
                   "fused_adamw": e2e_core.fused_supported(prep.device),
                   "warmup_steps_untimed": e2e_core.WARMUP_STEPS,
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "model": {"params": num_params(e2e_core.make_model(prep))}, "runs": runs, "summary": summary,
        "comparison": e2e_core.compare(runs), "goals": goals(summary), "deepspeed_skipped": ds_skipped,
        "machine": harness.machine_info(),
    }
    result["total_s"] = time.perf_counter() - t0
    name = args.name if args.name != "e2e" else "e2e_gpu"
    json_path = harness.write_result(out / f"{name}.json", result)
    if args.plot:
        plot(result, out / f"{name}.png")
    print(table(result))
    print(f"wrote {json_path} ({result['total_s']:.0f} s in all)")
    return 0
