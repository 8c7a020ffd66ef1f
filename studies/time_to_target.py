"""Is ZenFlow faster to my loss than offload? Time to target on a modeled machine (issue 56, item 2).

    python -m studies.time_to_target [--results DIR] [--out DIR]

Time to a target = steps to it (the tuned comparison's ``tuned_{workload}.json``, as a ratio to AdamW's; **assumed
to carry over from our small workloads to the modeled models**, unchecked) x time per step: the planner's model
(``zenflow_kernels.planner.predict``) on ``PROFILE``, an H200 (fast path and selection scaled from the kernels
measured on one, ``shared/measurements/h200-2026-11-30/kernels_gpu.json``; an *assumed* 400 TFLOP/s), PCIe Gen5 at an
*assumed* 50 GB/s, a 32-core host with 16 threads for the host worker (``bench/results/plan_cpu.json``'s one-thread
probe scaled linearly, capped by an *assumed* 200 GB/s). Device AdamW is listed where its 16 bytes a parameter fit
85% of the H200's 141 GB. Where a seed misses the target, the ratio is a lower bound (``at_least``); beside it the
same at AdamW's loss at half the steps (``half_time_vs_*``). Results: ``time_to_target.json`` in studies/results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.harness import OneLineParser, output_dir, write_result
from studies.tuned_comparison import BASE_ZENFLOW, RESULTS, VARIANTS

REPO = Path(__file__).resolve().parents[1]
_LAYER = 4 * 4096**2 + 3 * 4096 * 11008  # one layer of a 4096-wide model with an 11008-wide MLP
PROFILE = dict(
    device="NVIDIA H200 (fast path measured 2026-11-30)", device_tflops=400.0, hbm_bytes_per_s=4.8e12,
    device_memory_bytes=141e9, pcie_bytes_per_s=50e9, host_cores=32, pt_reserved_cores_perc=0.5,
    host_memory_bytes_per_s=200e9, tokens_per_step=32768, adamw_device_bytes_per_param=28,
    host_update_bytes_per_param=30, host_fold_bytes_per_param=10,
    # H200, 2026-11-30: multi_selective_adamw at topk 0.1 over 8 layers, 4.65 ms; the selection over 32, 13.2 ms
    fast_path_s_per_param_at_topk_0_1=4.649e-3 / (8 * _LAYER), selection_s_per_param=13.164e-3 / (32 * _LAYER),
)
MODELS = {"1.5B": 1_500_000_000, "7B": 7_000_000_000}
ASSUMPTION = ("steps to the target, as a ratio to AdamW's, carry over from the tuned comparison's small workloads "
              "to these models; the device's 400 TFLOP/s, the link's 50 GB/s and the host's 200 GB/s are assumed, "
              "the host's passes are one thread of this VM's scaled linearly to 16 threads")
# ZenFlow's variants of AdamW (AdamW and synchronous offload are timed apart)
ZENFLOW_ADAM = [n for n, v in VARIANTS.items() if v.family == "adam" and n not in ("adamw", "offload")]


def host_probe(profile: dict):
    """The committed probe of this host, scaled to the profile's host threads and capped by its memory bandwidth."""
    from zenflow_kernels.planner import HostProbe

    probe = json.loads((REPO / "bench" / "results" / "plan_cpu.json").read_text())["probes"]["default"]
    threads = int(profile["host_cores"] * (1 - profile["pt_reserved_cores_perc"]))
    speed = threads / probe["threads"]
    mem = profile["host_memory_bytes_per_s"]
    update, fold = profile["host_update_bytes_per_param"] / mem, profile["host_fold_bytes_per_param"] / mem

    def scaled(key, floor):
        return max(probe[key] / speed, floor)

    return HostProbe(update_s_per_param=scaled("update_s_per_param", update),
                     accumulate_s_per_param=scaled("accumulate_s_per_param", fold), step_work_s_per_param=0.0,
                     update_alone_s_per_param=scaled("update_alone_s_per_param", update),
                     threads=threads, params=probe["params"], grad_dtype=probe["grad_dtype"])


def _plan(params: int, profile: dict, probe, **knobs):
    """The device's compute per step and the planner's prediction for ``knobs``."""
    from zenflow_kernels.planner import predict

    compute = 6.0 * params * profile["tokens_per_step"] / (profile["device_tflops"] * 1e12)
    return compute, predict(matrix_params=params, device_step_s=compute, d2h_bytes_per_s=profile["pcie_bytes_per_s"],
                            probe=probe, **knobs)


def step_times(params: int, profile: dict, probe, variants=None) -> dict:
    """Seconds per step of AdamW on the device, synchronous offload and each ZenFlow variant of the Adam family
    (``variants``: their names, default ``ZENFLOW_ADAM``)."""
    compute, sync = _plan(params, profile, probe, state_bytes=8, topk_ratio=0.0, update_interval=1, overlap_step=False)
    fits = 16 * params <= 0.85 * profile["device_memory_bytes"]
    device = compute + profile["adamw_device_bytes_per_param"] * params / profile["hbm_bytes_per_s"]
    out = {"adamw": dict(step_s=device if fits else None, compute_s=compute, fits=fits),
           "offload": dict(step_s=compute + sync.sync_offload_stall_s, stall_s=sync.sync_offload_stall_s)}
    for name in ZENFLOW_ADAM if variants is None else variants:
        out[name] = zenflow_step_time(params, profile, probe, dict(BASE_ZENFLOW, **VARIANTS[name].zenflow),
                                      state_bytes=8 if VARIANTS[name].state == "fp32" else 4)
    return out


def zenflow_step_time(params: int, profile: dict, probe, zen: dict, state_bytes: int = 8) -> dict:
    """Seconds per step of ZenFlow with config ``zen`` (its ``topk_ratio``, integer ``update_interval``,
    ``overlap_step``, and ``select_interval`` in steps, or in epochs of ``steps_per_epoch`` steps): the device's
    compute, the fast path and the selection scaled from the H200's, the planner's stall. ``state_bytes``: the host
    state per parameter (8: AdamW's fp32 moments; 4 in bf16; the host pass is timed by the fp32 probe either way)."""
    compute, plan = _plan(params, profile, probe, state_bytes=state_bytes, topk_ratio=zen["topk_ratio"],
                          update_interval=zen["update_interval"], overlap_step=zen["overlap_step"])
    select = zen["select_interval"] * (zen["steps_per_epoch"] if zen.get("select_strategy") == "epoch" else 1)
    fast = profile["fast_path_s_per_param_at_topk_0_1"] * params * zen["topk_ratio"] / 0.1
    selection = profile["selection_s_per_param"] * params / select
    return dict(step_s=compute + fast + selection + plan.zenflow_stall_s, stall_s=plan.zenflow_stall_s,
                fast_path_s=fast, selection_s=selection, limit=plan.limit)


def _times(a, b):
    return None if a is None or b is None else a * b


def table(summaries: dict, profile: dict = PROFILE) -> dict:
    """Per workload and model: each variant's steps to the target over AdamW's, its step time, and its time to the
    target over AdamW's on the device (or, where AdamW does not fit, over synchronous offload's)."""
    probe = host_probe(profile)
    out = {}
    for model, params in MODELS.items():
        steps = step_times(params, profile, probe)
        for workload, summary in summaries.items():
            rows = {}
            for name, timing in steps.items():
                if (v := summary["variants"].get(name)) is None:
                    continue
                exact = v["steps_over_adamw"]["mean"]  # None where a seed never reached the target: then the
                ratio = exact if exact is not None else v["steps_over_adamw_at_least"]  # lower bound, or None
                half, step = v["half_steps_over_adamw"]["mean"], timing["step_s"]
                rows[name] = dict(steps_ratio=ratio, at_least=exact is None, half_target_steps_ratio=half,
                                  step_s=step, time_per_adamw_step_s=_times(ratio, step),
                                  half_time_per_adamw_step_s=_times(half, step),
                                  **{k: x for k, x in timing.items() if k != "step_s"})
            base = "adamw" if rows["adamw"]["step_s"] is not None else "offload"
            for r in rows.values():
                for key, of in (("time_vs_", "time_per_adamw_step_s"), ("half_time_vs_", "half_time_per_adamw_step_s")):
                    t, b = r[of], rows[base][of]
                    r[key + base] = None if t is None or b is None else t / b
            out[f"{workload}/{model}"] = dict(workload=workload, model=model, params=params, base=base, rows=rows)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m studies.time_to_target", description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS), help="where the tuned_*.json are (default studies/results)")
    ap.add_argument("--out", default=None, help="output directory (default: --results)")
    args = ap.parse_args(argv)
    results = Path(args.results)
    summaries = {s["workload"]: s for s in (json.loads(p.read_text())["summary"]
                                            for p in sorted(results.glob("tuned_*.json")))}
    if not summaries:
        ap.error(f"argument --results: no tuned_*.json in {str(results)!r}: run python -m studies.tuned_comparison")
    got = table(summaries)
    out = output_dir(args.out or results)
    payload = dict(command=" ".join(["python -m studies.time_to_target", *argv]), description=__doc__,
                   profile=PROFILE, models=MODELS, assumption=ASSUMPTION, tables=got,
                   sources={w: f"tuned_{w}.json" for w in summaries})
    path = write_result(out / "time_to_target.json", payload)
    for key, t in got.items():
        cells = [f"{n} {'>=' if r['at_least'] else ''}{r['time_vs_' + t['base']]:.2f}" for n, r in t["rows"].items()
                 if r["time_vs_" + t["base"]] is not None]
        print(f"{key} (time to target over {t['base']}'s): " + ", ".join(cells))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
