"""The tables of measured results in README.md and docs/*.md, each rendered from the JSON it names
(``python -m tools.docs_results`` writes them between their markers; ``--check`` compares), and the lookups of the
committed results that the tables and the prose figures' check share."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT_DIRS = [REPO / "bench" / "results", REPO / "studies" / "results"]


def path_of(name: str) -> Path:
    """A committed result by its path under bench/results/ or studies/results/."""
    for folder in RESULT_DIRS:
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(f"no result {name!r} under {', '.join(str(d) for d in RESULT_DIRS)}")


def load(name: str) -> dict:
    return json.loads(path_of(name).read_text())


def link(name: str, up: str = "../") -> str:
    """A markdown link to a result, from docs/ (``up="../"``) or from README.md (``up=""``)."""
    return f"[`{Path(name).name}`]({up}{path_of(name).relative_to(REPO).as_posix()})"


def where(result: dict) -> str:
    """The run's machine and commit, from its record (or, for a result made before records, its machine entry)."""
    record = result.get("record")
    machine = (record or result)["machine"]
    commit = record["commit"][:7] if record else f"{result['machine'].get('git_commit')}, no record"
    cpu = machine["cpu"].replace("(R)", "").replace(" Processor", "").strip()
    detail = machine.get("cpu_detail")
    if detail:  # records from before cpu_detail name the model only
        l3 = detail["caches"].get("L3")
        simd = "AVX-512" if "avx512f" in detail["flags"] else "AVX2" if "avx2" in detail["flags"] else "no AVX2"
        cpu += " (" + ", ".join([f"{detail['mhz']} MHz"] + ([f"L3 {l3}"] if l3 else []) + [simd]) + ")"
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    return f"{cpu}, {machine['logical_cores']} cores{gpu}; {commit}"


def source(name: str, up: str = "../", command: str | None = None) -> str:
    """The line above a table: which result, made by which command, on which machine and commit."""
    from bench.refresh import MOVED  # (bench/refresh.py's map of the modules moved since a record was made)

    result = load(name)
    command = command or (result.get("record") or result).get("command", "")
    command = re.sub(r" --out \S+", "", command).strip()  # where the run wrote is not how to make it
    for old, new in MOVED.items():  # a record made before its module moved names where it was then
        command = re.sub(rf"-m {re.escape(old)}\b", f"-m {new}", command)
    return f"{link(name, up)}" + (f", `{command}`" if command else "") + f"; {where(result)}."


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; a float cell is written to 2 decimals unless it is already text."""
    cell = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


README = REPO / "README.md"
DOCS = REPO / "docs"


# -- README.md -----------------------------------------------------------------------------------------------------

KERNELS_GPU = "h200-2026-11-30/kernels_gpu.json"


def span(values, digits: int = 1, unit: str = "x") -> str:
    """``lo-hi`` of ``values`` (one figure where both round alike)."""
    lo, hi = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def adamw_vs_deepspeed(rows: list[dict]) -> dict:
    """Per selective-AdamW case (shape, dtype) of a kernels JSON: DeepSpeed's gather / AdamW / scatter path's time
    over ours, per path (``foreach``, ``fused``) the run had."""
    ms = {(r["shape"], r["dtype"], r["impl"]): r["ms"] for r in rows if r["op"] == "selective_adamw"}
    ours = {(s, d): v for (s, d, impl), v in ms.items() if impl in ("triton", "numba")}
    return {case: {impl.split("(")[1].split()[0]: v / ours[case] for (s, d, impl), v in ms.items()
                   if (s, d) == case and impl.startswith("deepspeed path")} for case in ours}


def readme() -> str:
    gpu, adam, demo, scale = (load(n) for n in (KERNELS_GPU, "cpu_adam.json", "e2e.json", "scale_cpu.json"))
    ratio = adamw_vs_deepspeed(gpu["rows"])
    selection = next(r for r in gpu["rows"] if r["op"] == "selection" and r["impl"] == "triton multi")
    goals, runs = adam["goals"], demo["to_target"]["runs"]
    stall = {n: demo["comparison"]["per_run"][n]["stall_pct"] for n in ("zenflow", "offload")}
    per_param = sorted({round(r["bytes_per_param"]["total"], 1) for r in scale["runs"] if r["config"] == "overlap"})
    rss = max(abs(r["rss"]["growth_over_run"] - r["rss"]["reported"]) / r["params"] for r in scale["runs"])
    at = lambda key, d: " / ".join(f"{runs[n][key]:.{d}f}" for n in ("zenflow", "offload", "adamw"))  # noqa: E731
    data = lambda name: f"{link(name, '')}; {where(load(name))}"  # noqa: E731
    return table(["result", "figure", "against", "data"], [
        [f"selective AdamW kernel, H200, `topk_ratio={gpu['topk_ratio']}`, {len(ratio)} cases",
         f"{span([r['foreach'] for r in ratio.values()])} / {span([r['fused'] for r in ratio.values()])}",
         "DeepSpeed's gather / AdamW / scatter with `foreach` / `fused` AdamW", data(KERNELS_GPU)],
        ["column scores, H200: share of the copy bandwidth measured beside them",
         span([100 * r["copy_fraction"] for r in gpu["rows"] if r["op"] == "column_scores" and r["impl"] == "triton"],
              0, "%"), f"goal: {gpu['goals']['column_scores']}", data(KERNELS_GPU)],
        [f"whole-model column selection, H200, {selection['matrices']} matrices",
         f"{selection['speedup_vs_torch']:.1f}x", "a torch loop", data(KERNELS_GPU)],
        [f"host Adam, 2^{goals['size'].bit_length() - 1} fp32 parameters, {goals['threads']} threads",
         " / ".join(f"{goals[k]['measured']:.2f}x" for k in ("adam_vs_roofline", "adam_vs_deepspeed",
                                                             "adam_vs_deepspeed_zenflow_native",
                                                             "adam_out_fp32_vs_deepspeed_zenflow_native")),
         "memory roofline / DeepSpeed's CPU Adam / DeepSpeed's ZenFlow Adam / the same, at its 36 bytes a parameter",
         data("cpu_adam.json")],
        ["`make demo`: stall, % of wall time (one run)", f"{stall['zenflow']:.1f} / {stall['offload']:.1f}",
         "ZenFlow / sync offload", data("e2e.json")],
        [f"`make demo`: seconds to AdamW's loss at {demo['to_target']['target_at']:.0%} of its steps",
         at("cpu_s", 1), "ZenFlow / sync offload / AdamW, this CPU", data("e2e.json")],
        [f"the same, **modeled** for a {demo['to_target']['model']} model on an H200", at("modeled_s", 0),
         "ZenFlow / sync offload / AdamW", data("e2e.json")],
        ["host bytes per bf16 parameter, with overlap", "/".join(f"{b:g}" for b in per_param),
         f"about {scale['deepspeed_reference']['zenflow_overlap']['bytes_per_param']} for DeepSpeed's ZenFlow",
         data("scale_cpu.json")],
        [f"RSS growth beyond `opt.host_bytes()`, {len(scale['runs'])} runs", f"at most {rss:.2f} B/parameter", "",
         data("scale_cpu.json")]])


# -- docs/benchmarks.md: kernels and host passes ------------------------------------------------------------------

def kernels_gpu() -> str:
    result = load(KERNELS_GPU)
    rows, ratio = result["rows"], adamw_vs_deepspeed(result["rows"])
    scores = {(r["shape"], r["dtype"]): r for r in rows if r["op"] == "column_scores" and r["impl"] == "triton"}
    selection = next(r for r in rows if r["op"] == "selection" and r["impl"] == "triton multi")
    goals = "; ".join(f"{k} {v}" for k, v in result["goals"].items())
    return "\n".join([
        source(KERNELS_GPU, command="bash bench/gpu_suite.sh") + f" Goals: {goals}.",
        "", table(["shape", "dtype", "selective AdamW vs `foreach` path", "vs `fused` path",
                   "column scores vs torch", "column scores, share of copy bandwidth"],
                  [[s, d, f"{ratio[s, d]['foreach']:.1f}x", f"{ratio[s, d]['fused']:.1f}x",
                    f"{scores[s, d]['speedup_vs_torch']:.2f}x", f"{scores[s, d]['copy_fraction']:.1%}"]
                   for s, d in sorted(ratio)]),
        "", table(["whole-model selection", "launches", "vs a torch loop"],
                  [[f"{selection['matrices']} matrices", selection["launches"],
                    f"{selection['speedup_vs_torch']:.1f}x"]])])


def _vs_foreach(result: dict, candidates: dict, sizes=(150, 600)) -> list[list]:
    """step_overhead rows: each candidate's CPU time over torch's foreach AdamW's, side by side, at ``sizes``."""
    cpu = {name: c["cpu"] for name, c in result["summary"].items() if name != "goal"}
    return [[label] + [f"{cpu[name][f'vs_torch_adamw_foreach_at_{n}']:.2f}x" for n in sizes]
            for name, label in candidates.items() if name in cpu]


def step_overhead() -> str:
    result = load("step_overhead_cpu.json")
    goal = result["summary"]["goal"]
    limits = " and ".join(f"{v}x at {k}" for k, v in goal["limits"].items())
    multi = load("host_multi_cpu.json")["rows"]
    kinds = {("grad_norm", "bfloat16"): "gradient norm, bf16", ("grad_norm", "float32"): "gradient norm, fp32",
             ("accumulate", "bfloat16"): "fp32 accumulation of bf16 gradients",
             ("accumulate", "float32"): "fp32 accumulation of fp32 gradients"}
    return "\n".join([
        source("step_overhead_cpu.json") + f" Goal: {limits}, **{'met' if goal['met'] else 'missed'}**.", "",
        table(["`step()`, training-thread CPU time over torch's `AdamW(foreach=True)`", "150 tensors", "600 tensors"],
              _vs_foreach(result, {"zenflow_async_link": "asynchronous link, gradients set by hand",
                                   "zenflow_async_link_hooks": "asynchronous link, gradients from backward's hooks",
                                   "zenflow_cpu_link": "synchronous CPU link",
                                   "torch_adamw_fused": "torch `AdamW(fused=True)`"})),
        "", source("host_multi_cpu.json"), "",
        table(["multi-tensor pass", "elements", "ours (unchecked) vs torch's foreach ops"],
              [[label, span([r["elements"] / 1e6 for r in multi if (r["op"], r["dtype"]) == k], 1, " M"),
                span([r["speedup_unchecked"] for r in multi if (r["op"], r["dtype"]) == k])]
               for k, label in kinds.items()])])


def rules_step() -> str:
    result = load("step_overhead_rules_cpu.json")
    names = {"": "AdamW", "_lion": "Lion", "_sgd": "SGD (momentum 0.9)", "_adam": "Adam"}
    rules = {f"zenflow_async_link{k}": f"{v}, fused kernel" for k, v in names.items()}
    rules |= {f"zenflow_async_link{k}_torch": f"{v}, plain-torch device step" for k, v in names.items() if k}
    rules |= {"zenflow_async_link_rmsprop_compiled": "RMSprop of one's own, compiled",
              "zenflow_async_link_rmsprop_eager": "RMSprop of one's own, eager (`compile=False`)",
              "zenflow_async_link_ademamix_compiled": "AdEMAMix of one's own, compiled",
              "zenflow_async_link_from_torch_rmsprop": "`rules.from_torch(torch.optim.RMSprop)`"}
    return "\n".join([source("step_overhead_rules_cpu.json"), "",
                      table(["rule (asynchronous link)", "150 tensors", "600 tensors"], _vs_foreach(result, rules))])


CPU_ADAM = {"adam_vs_roofline": "AdamW pass vs the memory roofline", "adam_vs_deepspeed": "vs DeepSpeed's CPU Adam",
            "adam_vs_torch_fused": "vs torch's fused CPU AdamW",
            "adam_vs_deepspeed_zenflow_native": "vs DeepSpeed's native ZenFlow Adam (36 bytes a parameter, ours 28)",
            "adam_out_fp32_vs_deepspeed_zenflow_native": "the same, ours also writing the fp32 snapshot (36 bytes)",
            "fused_pipeline_vs_separate_zenflow_kernels": "fused boundary pipeline vs our kernels as separate passes",
            "fused_pipeline_vs_separate_deepspeed": "fused boundary pipeline vs DeepSpeed's separate passes",
            "fused_pipeline_vs_separate_torch_fused": "fused boundary pipeline vs torch's separate passes",
            "fused_zero_acc_vs_separate_zenflow_zero_acc": "the same, zeroing the sums, vs our separate passes",
            "fused_zero_acc_vs_separate_deepspeed_zero_acc": "the same, zeroing the sums, vs DeepSpeed's"}


def cpu_adam() -> str:
    goals = load("cpu_adam.json")["goals"]
    rows = [[CPU_ADAM.get(k, k), f"{g['measured']:.2f}x", f"{g['goal']}x" if "goal" in g else "",
             f"{g['memory_bound_limit']:.2f}x" if "memory_bound_limit" in g else ""]
            for k, g in goals.items() if isinstance(g, dict)]
    return "\n".join([source("cpu_adam.json") + f" At 2^{goals['size'].bit_length() - 1} fp32 parameters, "
                      f"{goals['threads']} threads:", "",
                      table(["ratio", "measured", "goal", "memory-bound limit"], rows)])


def kernels_cpu() -> str:
    result = load("kernels_cpu.json")
    rows = result["rows"]
    ratio = adamw_vs_deepspeed(rows)
    multi = next(r for r in rows if r["op"] == "multi_selective_adamw" and r["impl"] == "numba multi")
    selection = next(r for r in rows if r["op"] == "selection" and r["impl"] != "torch loop")
    cases = [[s, d, f"{v:.1f}x"] for (s, d), r in sorted(ratio.items()) for v in r.values()]
    return "\n".join([source("kernels_cpu.json") + f" `topk_ratio={result['topk_ratio']}`.", "",
                      table(["numba selective AdamW", "dtype", "vs DeepSpeed's path, torch's default CPU AdamW"],
                            cases + [[f"multi-tensor, {multi['matrices']} matrices", "",
                                      f"{multi['speedup_vs_deepspeed']:.1f}x"]]),
                      "", table(["whole-model selection", "vs a torch loop"],
                                [[f"`{selection['impl']}` (CPU: torch ops)",
                                  f"{selection['speedup_vs_torch']:.1f}x"]])])


def cpu_rules() -> str:
    result = load("cpu_rules.json")
    rows = [r for r in result["rows"] if "fraction_of_roofline" in r]
    sizes, threads = sorted({r["size"] for r in rows}), sorted({r["threads"] for r in rows})
    frac = {(r["candidate"], r["size"], r["threads"]): r["fraction_of_roofline"] for r in rows}
    rules = [c for c in dict.fromkeys(r["candidate"] for r in rows)]
    cols = [(n, t) for n in sizes[-2:] for t in threads]
    return "\n".join([source("cpu_rules.json"), "", table(
        ["host pass, fraction of its roofline"] + [f"2^{n.bit_length() - 1}, {t} thread(s)" for n, t in cols],
        [[c] + [f"{frac[c, n, t]:.2f}" if (c, n, t) in frac else "" for n, t in cols] for c in rules])])


def stochastic_rounding() -> str:
    result = load("stochastic_rounding.json")
    rows = {(r["size"], r["threads"], r["candidate"]): r for r in result["rows"]}
    size = max(n for n, _, _ in rows)
    threads = sorted({t for n, t, _ in rows if n == size})
    return "\n".join([source("stochastic_rounding.json") + f" At 2^{size.bit_length() - 1} parameters:", "",
                      table(["host Adam pass, time over bf16 rounded to nearest"] + [f"{t} thread(s)" for t in threads],
                            [[c] + [f"{rows[size, t, c]['vs_bf16_nearest']:.2f}x" for t in threads]
                             for c in ("fp32", "bf16_stochastic")])])


# -- docs/benchmarks.md: whole runs (e2e, ZeRO, overlap, FSDP2, the sums' crossing) --------------------------------

def _goals(c: dict) -> str:
    """bench.e2e's three goals for a ZenFlow run, from its comparison row: stall, speed, loss at equal wall time."""
    met = [c["stall_pct"] < 5, c["steps_per_s_vs_adamw"] >= 0.9, c["heldout_gap_vs_offload_equal_wall"] <= 0]
    return ", ".join("met" if ok else "missed" for ok in met)


def _e2e_rows(name: str) -> list[list]:
    """One row per run of an e2e JSON: speed and stall (medians over repeats), held-out loss, goals."""
    r = load(name)
    cfg, per, start = r["config"], r["comparison"]["per_run"], r["pretrain"]["heldout_loss"]
    gain = start - next(x for x in r["runs"] if x["name"] == "adamw")["final_heldout_loss"]
    labels = {"adamw": "AdamW (fused)", "adamw_t1": "AdamW, 1 thread", "offload": "sync offload",
              "zenflow": f"ZenFlow, {'overlap' if cfg['overlap'] else 'no overlap'}",
              "zenflow_pt1": "ZenFlow, overlap, `pt_reserved_cores_perc` 1.0",
              "zenflow_pt0.5": "ZenFlow, overlap, `pt_reserved_cores_perc` 0.5",
              "zenflow_nooverlap": "ZenFlow, no overlap"}
    setting = f"{name.removesuffix('.json')}: {cfg['lr']:g}, {cfg['topk_ratio']:g}, {cfg['update_interval']}"
    return [[setting, labels[x["name"]], f"{c['steps_per_s_vs_adamw']:.2f}x", f"{c['stall_pct']:.1f}",
             x["host_updates"], f"{x['final_heldout_loss']:.4f}", f"{(start - x['final_heldout_loss']) / gain:.0%}",
             f"{c['heldout_gap_vs_offload_equal_wall']:+.4f}", _goals(c) if x["name"].startswith("zenflow") else ""]
            for x in r["runs"] for c in [per[x["name"]]]]


_E2E = ["result: lr, `topk_ratio`, `update_interval`", "run", "steps/s vs AdamW", "stall, % of wall time",
        "host updates", "held-out loss at the end", "its gain on the start, share of AdamW's",
        "held-out loss minus sync offload's at equal wall time",
        "goals: stall < 5%, steps/s >= 0.9x AdamW's, loss <= sync offload's"]


def e2e() -> str:
    demo = load("e2e.json")
    to = demo["to_target"]
    rows = [row + [f"{t['cpu_s']:.1f}" if t["steps"] is not None else "not reached", f"{t['modeled_s']:.0f}"]
            for row, x in zip(_e2e_rows("e2e.json"), demo["runs"], strict=True) for t in [to["runs"][x["name"]]]]
    others = ("e2e_variants.json", "e2e_lr1e-3.json", "e2e_base_batch2.json")
    head = [*_E2E, f"to AdamW's loss at {to['target_at']:.0%} of its steps, s",
            f"the same, modeled for {to['model']} on the H200 profile, s"]
    return "\n\n".join([source("e2e.json"), table(head, rows),
                        "\n".join(f"- {source(n)}" for n in others),
                        table(_E2E, [row for n in others for row in _e2e_rows(n)])])


def zero() -> str:
    r = load("zero_cpu.json")
    runs, steps = r["summary"], r["config"]["warmup"] + r["config"]["steps"]
    ranks = [[w, i, s["torch_threads_per_rank"], f"{s['steps_per_s_median']:.2f}",
              f"{s['steps_per_s_vs_first_world']:.2f}x", f"{s['host_state_bytes_per_rank'][i] / 1e6:.1f}",
              *(f"{held[k]:,}" for k in ("grad", "own", "in_flight"))]
             for w, s in runs.items() for i, held in enumerate(s["gradient_elements_held_per_rank"])]
    moved = runs[max(runs)]["collective_bytes_per_step"]
    kinds = [[k, f"{b:,.0f}", f"{b * steps:,.0f}"] for k, b in sorted(moved.items(), key=lambda kb: -kb[1])]
    return "\n\n".join([source("zero_cpu.json"), table(
        ["ranks", "rank", "torch threads", "steps/s", "vs 1 rank", "host state, MB",
         "gradient elements held after backward: `.grad`", "own range's sums", "another rank's bucket in flight"],
        ranks), table([f"collective at {max(runs)} ranks (rank 0)", f"bytes a step (the run's total / {steps})",
                       "bytes over the run"], kinds)])


def overlap() -> str:
    r = load("overlap_cpu.json")
    sizes = {s["size"]: s for s in r["sizes"]}
    row = {(x["size"], x["variant"]): x for x in r["rows"] if x["bandwidth"] == "slow"}
    hand = [row[(n, "handover")] for n in sizes]
    goal = r["config"]["goal_share"]
    lines = [("parameters, M", [f"{s['params'] / 1e6:.1f}" for s in sizes.values()]),
             ("transfer at `slow`, ms", [f"{1e3 * x['transfer_s']:.1f}" for x in hand]),
             ("transfer / backward", [x["transfer_share_of_backward"] for x in hand]),
             ("hand-over from hooks: added wall time / transfer", [x["added_stall_share"] for x in hand]),
             ("hand-over from hooks: added training-thread waits / transfer", [x["added_waits_share"] for x in hand]),
             ("crossing at `step()` (`orderings.early_handover=False`): added wall time / transfer",
              [row[(n, "at_step")]["added_stall_share"] for n in sizes]),
             (f"goal: hand-over's added wall time <= {goal:g} of the transfer where backward is longer",
              ["met" if x["added_stall_share"] <= goal else "missed" if x["transfer_share_of_backward"] < 1 else ""
               for x in hand]),
             ("folds into the sums, ms a step (`fold_s`)", [f"{1e3 * x['fold_s']:.1f}" for x in hand]),
             ("hooks' waits for the folds, ms a step (`fold_wait_s`)", [f"{1e3 * x['fold_wait_s']:.1f}" for x in hand])]
    return source("overlap_cpu.json") + "\n\n" + table(["model / fold job", *(f"{n}x" for n in sizes)],
                                                       [[label, *cells] for label, cells in lines])


def fsdp2() -> str:
    r = load("fsdp2_cpu.json")
    summary, comp, steps = r["summary"], r["comparisons"], r["config"]["warmup"] + r["config"]["steps"]
    labels = {"one_zenflow": "one process, ZenFlowAdamW", "one_adamw": "one process, `torch.optim.AdamW(fused=True)`",
              "fsdp2_zenflow": "FSDP2, ZenFlowAdamW", "fsdp2_adamw": "FSDP2, AdamW",
              "fsdp2_offload_adamw": "FSDP2 + `CPUOffloadPolicy(pin_memory=False)`, AdamW"}
    rows = []
    for name, label in labels.items():
        s, c = summary[name], comp.get(name)
        inside = sum(k["ms_per_step_calm"] for k in s["fsdp2_collectives"].values())
        rows.append([label, f"{s['calm_repeats']} of {len(s['step_ms_per_repeat'])}", f"{s['steps_per_s_calm']:.1f}",
                     f"{c['steps_per_s_ratio_calm']:.2f}x" if c else "", f"{s['step_call_ms_calm']:.1f}",
                     f"{s['optimizer_state_bytes_per_rank'][0] / 1e6:.2f}", f"{s['final_loss']:.4f}",
                     f"{c['max_abs_loss_diff']:.1e}" if c else "", f"{inside:.0f}" if c else "",
                     f"{s['step_ms_calm'] - summary[c['twin']]['step_ms_calm']:.0f}" if c else ""])
    zen = summary["fsdp2_zenflow"]
    kinds = [[f"FSDP2 {k}", f"{v['calls_per_step']:.0f}", f"{v['bytes_per_step']:,.0f}",
              f"{v['bytes_per_step'] * steps:,.0f}"] for k, v in zen["fsdp2_collectives"].items()]
    kinds += [[f"ZenFlow {k}", "", f"{b / steps:,.0f}", f"{b:,}"]
              for k, b in zen["zenflow"]["collective_bytes_total"].items()]
    return "\n\n".join([source("fsdp2_cpu.json"), table(
        ["run", "calm repeats", "steps/s", "vs one process, same optimizer", "`step()` + `zero_grad()`, ms",
         "optimizer state per rank, MB", f"loss, mean of steps {steps - 3}-{steps}",
         "largest loss difference to one process, any step", "ms a step inside FSDP2's collectives",
         "ms a step longer than one process"], rows),
        table(["collective (rank 0, FSDP2 with ZenFlowAdamW)", "calls a step", f"bytes a step (over {steps} steps)",
               "bytes over the run"], kinds)])


# -- docs/benchmarks.md: scale; quality (tuned comparison, concentration); docs/nvme.md -------------------------------

def _grid(header: list[str], cols: list, rows: list[tuple[str, object]]) -> str:
    """A table with one column per ``cols`` entry: each row a label and a function of the column's item."""
    return table(header, [[label] + [f(c) for c in cols] for label, f in rows])


def scale() -> str:
    r = load("scale_cpu.json")
    top = max(x["params"] for x in r["runs"])
    at = [next(x for x in r["runs"] if x["params"] == top and x["config"] == c) for c in ("overlap", "sync", "devacc")]
    g, pt = r["growth"], r["per_tensor"]["summary"]
    mem = (r.get("record") or r)["machine"]["memory_gib"] * 2**30
    stale = r["record"]["started_utc"] < "2026-12-04T19:02:50Z"  # 1f58ea0 changed what a step reads
    return "\n\n".join([source("scale_cpu.json"), _grid(
        [f"{top / 1e6:.0f} M parameters ({at[0]['size']}, {at[0]['tensors']} tensors)", "overlap", "no overlap",
         "`device_accumulation`"], at, [
            ("host buffers (`host_bytes()`), bytes per parameter", lambda x: f"{x['bytes_per_param']['total']:.1f}"
             + (f" + {x['bytes_per_param']['device_sums']:.1f} device-side sums" if x["host_bytes"]["device_sums"]
                else "")),
            ("fast path's state, bytes per parameter", lambda x: f"{x['bytes_per_param']['fast_state']:.1f}"),
            ("RSS growth over the run / peak RSS, bytes per parameter",
             lambda x: f"{x['rss']['growth_per_param']:.1f} / {x['rss']['peak_per_param']:.1f}"),
            (f"parameters its {mem / 2**30:g} GiB would hold (peak RSS over the process's base)",
             lambda x: f"{mem / x['rss']['peak_over_base_per_param'] / 1e6:.0f} M"),
            ("first `step()` (cold)", lambda x: f"{x['times']['cold_first_step_s']:.1f} s"),
            ("`step()` between update boundaries / at one; fast path alone",
             lambda x: f"{x['times']['between_boundaries_median_s']:.2f} / {x['times']['boundary_median_s']:.2f}; "
                       f"{x['fast_path_median_s']:.2f} s"),
            ("host update alone (threads), fraction of the roofline",
             lambda x: f"{x['host_update']['last_s']:.2f} s ({x['host_threads']}"
                       f"{', fused' if x['host_update']['pattern'].startswith('fused') else ''}), "
                       f"{x['host_update']['fraction_of_roofline_last']:.2f}"),
            ("mean `step()` over all sizes: ns per parameter (exponent)",
             lambda x: "{ns_per_param:.2f} ({exponent:.2f})".format(**g[x["config"]]["mean_step"])),
            ("other processes' CPU share, most over the sizes", lambda x: "{:.0%}".format(max(
                y["other_processes_cpu_fraction"] for y in r["runs"] if y["config"] == x["config"]))),
        ]), table(["`step()` per tensor" + (" (recorded before 1f58ea0; not this version's)" if stale else ""),
                   "ms at 150 tensors", "ms at 300", "us per added tensor"],
                  [[f"`{n}`", pt[n]["ms_at_150"], pt[n]["ms_at_300"], f"{pt[n]['us_per_tensor']:.0f}"]
                   for n in ("torch_adamw_foreach", "zenflow_cpu_link", "zenflow_async_link")])])


def tuned() -> str:
    from studies import findings

    res = findings.load_results()
    s = {w: x["summary"] for w, x in res.items()}
    v = lambda w, n: s[w]["variants"].get(n)  # noqa: E731
    base = lambda n: "-" if v(next(iter(s)), n)["family"] != "adam" or n == "zenflow" else (  # noqa: E731
        "yes" if findings.wins_everywhere(s, n) else "no")

    def cell(w: str, n: str) -> str:
        if v(w, n) is None:
            return "-"
        steps, bound = findings.steps_ratio(s[w], n), v(w, n)["steps_over_adamw_at_least"]
        reach = f"{steps:.2f}" if steps is not None else f">={bound:.2f}" if bound is not None else "-"
        star = "*" if findings.beats_adamw(s[w], n) else ""
        lr = v(w, n)["lr_over_adamw"]
        return f"{findings.final_ratio(s[w], n)['mean']:.2f}{star} / {reach} / {lr:.2g}x".replace(
            f"{lr:.2g}x", f"{lr:.2g}x" if lr < 10 else f"{lr:.0f}x")

    def best(w: str) -> str:
        n = min((n for n in s[w]["variants"] if v(w, n)["family"] == "adam" and n not in ("adamw", "offload")),
                key=lambda n: findings.final_ratio(s[w], n)["mean"])
        return f"`{n}`"
    z = lambda w: findings.final_ratio(s[w], "zenflow")  # noqa: E731
    head = [["ZenFlow's top-10% share", *(v(w, "zenflow")["top10_share"] for w in s)],
            ["AdamW's best rate; its held-out gain", *(f"{s[w]['adamw_best_lr']:.2g}; "
             f"{1 - v(w, 'adamw')['final']['mean'] / s[w]['initial_heldout']:.1%}" for w in s)],
            ["runs", *(len(res[w]["runs"]) for w in s)],
            ["`zenflow`'s final over AdamW's, seeds' range", *(f"{z(w)['min']:.2f}-{z(w)['max']:.2f}" for w in s)],
            ["lowest final among ZenFlow's AdamW variants", *(best(w) for w in s)]]
    names = ["zenflow", "overlap", "deepspeed", "host_step_count", "reselect_state", "lr_times_interval",
             "topk0.05_ui2", "topk0.05_ui8", "topk0.25_ui2", "bf16_nearest", "bf16_stochastic", "lion",
             "zenflow_lion", "sgd", "zenflow_sgd"]
    tt = load("time_to_target.json")["tables"]
    shown = ("offload", "zenflow", "overlap", "deepspeed", "lr_times_interval", "topk0.25_ui2")
    ttc = lambda t, n: "-" if t["rows"].get(n, {}).get("time_vs_" + t["base"]) is None else (  # noqa: E731
        f"{'>=' if t['rows'][n]['at_least'] else ''}{t['rows'][n]['time_vs_' + t['base']]:.2f}")
    resumed = any("--resume" in x["record"]["command"] for x in res.values())
    return "\n\n".join([
        (", ".join(link(f"tuned_{w}.json") for w in s) + ", `python -m studies.tuned_comparison --workload W"
              + (" --resume`, the summaries written from the runs' log (the runs came from earlier commits)"
                 if resumed else "`") + "; " + "; ".join(sorted({where(x) for x in res.values()})) + "."),
        table(["", *s, "beats `zenflow` on every workload"],
              [h + [""] for h in head] + [[f"`{n}`", *(cell(w, n) for w in s), base(n)] for n in names]),
        (source("time_to_target.json") + f" Assumed: {load('time_to_target.json')['assumption']}."),
        table(["time to target over AdamW's", *(f"`{n}`" for n in shown)],
              [[k, *(ttc(t, n) for n in shown)] for k, t in tt.items()])])


def concentration() -> str:
    r = load("concentration_study.json")
    c, z = r["config"], r["config"]["zenflow"]
    rec = lambda x, k: f"{x[k]:.3f} ({x[k + '_range'][0]:.3f}-{x[k + '_range'][1]:.3f})"  # noqa: E731
    return "\n\n".join([
        source("concentration_study.json"),
        table(["steps", "lr", "`topk_ratio`", "`update_interval`", "`select_interval`", "seeds"],
              [[c["steps"], f"{c['lr']:g}", str(z["topk_ratio"]), z["update_interval"], z["select_interval"],
                len(c["seeds"])]]),
        table(["exponent", "top 1%", "top 10%", "selected", "recovered, overlap (seeds)",
               "recovered, no overlap (seeds)", "AdamW's final over its half-way loss"],
              [[f"{x['alpha']:g}" + (" (flat)" if x["alpha"] == 0 else ""), x["top1_share"], x["top10_share"],
                x["selected_share"], rec(x, "zenflow_overlap_recovered"), rec(x, "zenflow_sync_recovered"),
                x["adamw_end_over_half"]]
               for x in r["summary"]])])


def nvme() -> str:
    one, two = load("nvme_cpu.json"), load("nvme_cpu_repeat.json")
    cfgs, goal, size = one["run_config"]["configs"], one["goal_streamed_over_roofline"], one["run_config"]["stall_size"]
    m = lambda p: f"{p / 1e9:.2f} B" if p >= 1e9 else f"{p / 1e6:.0f} M"  # noqa: E731
    both = lambda f, xs: " / ".join(f(x) for x in xs)  # noqa: E731 (the first run / the second)
    each = lambda f, xs: ", ".join(f(x) for x in xs)  # noqa: E731
    store = {(r["mode"], r["size_m"]): [] for r in one["results"]}
    for r in one["results"] + two["results"]:
        store[r["mode"], r["size_m"]].append(r)
    disk, inmem = (lambda c: one["memory"][c + " nvme"]), (lambda c: one["memory"][c + " cpu"])
    ups = lambda res, c: [x["host_update"]["roofline_over_last"] for x in res["runs"]  # noqa: E731
                          if x["config"] == c and x["offload"] == "nvme" and x["host_update"].get("roofline_over_last")]
    plain = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}x, {sum(x >= goal for x in xs)} of {len(xs)} met"  # noqa: E731
    same = lambda res, c: "{} of {}".format(*(f([w["identical"] for w in res["weights_identical"]  # noqa: E731
                                                 if w["config"] == c]) for f in (sum, len)))
    cache = lambda c: max(p["growth_max"] for p in one["page_cache"]  # noqa: E731
                          if p["config"] == c and p["offload"] == "nvme") / 2**20
    big = {r["config"]: r for r in one["billion"]}
    b = big[cfgs[0]]
    skip = {s["config"]: s["predicted_memory_bytes"] / 2**30 for s in one["skipped_runs"] if s["offload"] == "cpu"}
    run = {(r["config"], r["offload"], r["update_interval"]): r for r in one["runs"] if r["size"] == size}
    again = {s["update_interval"]: s["disk_over_memory"] for s in two["stall"]}
    rate = lambda r: statistics.median(r["host_update"]["disk_traffic_bytes"] / s  # noqa: E731
                                       for s in r["host_update"]["seconds"]) / 1e9
    stall = [(s, run["overlap", "nvme", s["update_interval"]], run["overlap", "cpu", s["update_interval"]])
             for s in one["stall"]]
    return "\n\n".join([
        (source("nvme_cpu.json") + " Repeated: "
              + source("nvme_cpu_repeat.json", command="python -m bench.nvme --attempts 3")),
        table(["storage pass (first run / second)", "streamed over plain pass", "streamed GB/s",
               "page cache growth, most (MiB)"],
              [[f"{n} M, {mode}", both(lambda r: f"{r['streamed_over_roofline']:.2f}x", rs),
                both(lambda r: f"{r['streamed']['gb_per_s']:.1f}", rs),
                both(lambda r: f"{max(r['streamed']['cache_growth_bytes'] + [0]) / 2**20:.0f}", rs)]
               for (mode, n), rs in sorted(store.items())]),
        table([f"bytes per parameter ({each(lambda s: m(s['params']), disk('overlap')['sizes'])})",
               "host side on disk, slope", "goal", "met", "host side at each size", "`host_bytes()` at each size",
               "device side, largest", "peak RSS beyond the reported buffers, MiB", "host side in memory, slope",
               "whole RSS on disk, slope", "second run: host side on disk"],
              [[c, disk(c)["host_side_rss_growth_slope"], f"<= {one['run_config']['goal_bytes_per_param'][c]}",
                "met" if disk(c)["goal_met"] else "missed",
                each(lambda s: f"{s['host_side_rss_growth']:.2f}", disk(c)["sizes"]),
                each(lambda s: f"{s['host_buffers_reported']:.2f}", disk(c)["sizes"]),
                disk(c)["sizes"][-1]["device_side_reported"],
                each(lambda s: f"{s['peak_unreported_bytes'] / 2**20:.0f}", disk(c)["sizes"]),
                inmem(c)["host_side_rss_growth_slope"], disk(c)["rss_growth_slope"],
                two["memory"][c + " nvme"]["host_side_rss_growth_slope"]] for c in cfgs]),
        table([f"{m(b['params'])} ({b['size']}, {b['steps']} steps, `update_interval` {b['update_interval']}, file "
               f"{b['disk_bytes'] / 1e9:.1f} GB), on disk", "mean `step()`", "cold first step", "host updates",
               "last over plain pass", "peak RSS", "in memory", "page cache growth, most over its disk runs (MiB)",
               f"every disk run: update over plain pass (goal >= {goal}), first run / second",
               "weights identical on disk and in memory, first / second"],
              [[c, f"{big[c]['mean_step_s']:.2f} s", f"{big[c]['cold_first_step_s']:.0f} s",
                each(lambda x: f"{x:.1f}", big[c]["host_update_s"]) + " s", f"{big[c]['roofline_over_last']:.2f}x",
                f"{big[c]['rss_peak'] / 2**30:.1f} GiB", f"skipped (predicted {skip[c]:.1f} GiB)" if c in skip
                else "run", f"{cache(c):.0f}", both(plain, [ups(one, c), ups(two, c)]),
                f"{same(one, c)} / {same(two, c)}"] for c in cfgs]),
        table([f"`update_interval` S ({size}, {m(stall[0][1]['params'])}, overlap)", "disk: mean `step()`",
               "at boundaries", "between", "memory: mean `step()`", "disk over memory", "second run: disk over memory",
               "B, GB/s (median update)", "rule: S >= 24 N / (B step)", "other processes' CPU, disk / memory run"],
              [[s["update_interval"], *(f"{1e3 * s['nvme'][x]:.0f} ms" for x in ("mean_step_s", "boundary_mean_s",
                                                                               "between_mean_s")),
                f"{1e3 * s['cpu']['mean_step_s']:.0f} ms", f"{s['disk_over_memory']:.2f}x",
                f"{again[s['update_interval']]:.2f}x" if s["update_interval"] in again else "not run",
                rate(d), f"{24 * d['params'] / (rate(d) * 1e9 * s['nvme']['between_mean_s']):.1f}",
                both(lambda r: f"{r['other_processes_cpu_fraction']:.0%}", [d, c])] for s, d, c in stall])])


# -- docs/deepspeed.md ----------------------------------------------------------------------------------------------

def _sci(x: float) -> str:
    """5.6e-7 rather than 5.6e-07."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _semantics() -> tuple[dict, dict, dict]:
    result = load("deepspeed_semantics.json")
    cell = {(r["variant"], r["mode"], r["setting"]): r["max"] for r in result["rows"]}
    return result, cell, result["config"]["settings"]


def deepspeed_choices() -> str:
    """Each of DeepSpeed's six choices turned back to ours: the largest weight difference from DeepSpeed's run."""
    _, cell, settings = _semantics()
    choices = {"deepspeed": "none (`semantics=\"deepspeed\"`)", "all_ours": "all six (our defaults)"} | {
        f"{n}_ours": f"`{n}`" for n in ("gradient_scale", "host_step_count", "reselect_state", "vector_state",
                                        "importance", "select_anchor")}
    order = ["deepspeed", *[k for k in choices if k not in ("deepspeed", "all_ours")], "all_ours"]
    return table(["turned back to ours"] + [f"ui {ui}, si {si}, W {w}" for ui, si, w in settings.values()],
                 [[choices[v]] + [_sci(cell[(v, "sync", s)]) for s in settings] for v in order])


def deepspeed_rounding() -> str:
    """``semantics="deepspeed"`` on our kernels (both links: the sync and chaos runs asserted equal) and in the
    reference, against DeepSpeed's own run."""
    result, cell, settings = _semantics()
    for s in settings:
        assert cell[("deepspeed", "sync", s)] == cell[("deepspeed", "chaos", s)], s  # both links, the same bits
    return "\n".join([source("deepspeed_semantics.json"), "", table(
        ["setting", "ours, `semantics=\"deepspeed\"` (both links)", "`ReferenceZenFlow`"],
        [[f"ui {ui}, si {si}, W {w}" + (" (an interval cut short)" if s == "ui3_si4_w0" else ""),
          _sci(cell[("deepspeed", "sync", s)]), _sci(cell[("deepspeed", "reference", s)])]
         for s, (ui, si, w) in settings.items()])])


BENCHMARKS = DOCS / "benchmarks.md"
SECTIONS = {"readme": (README, readme), "kernels_gpu": (BENCHMARKS, kernels_gpu),
            "step_overhead": (BENCHMARKS, step_overhead), "rules_step": (BENCHMARKS, rules_step),
            "cpu_adam": (BENCHMARKS, cpu_adam), "kernels_cpu": (BENCHMARKS, kernels_cpu),
            "cpu_rules": (BENCHMARKS, cpu_rules), "stochastic_rounding": (BENCHMARKS, stochastic_rounding),
            "e2e": (BENCHMARKS, e2e), "zero": (BENCHMARKS, zero), "overlap": (BENCHMARKS, overlap),
            "fsdp2": (BENCHMARKS, fsdp2), "scale": (BENCHMARKS, scale),
            "tuned": (BENCHMARKS, tuned), "concentration": (BENCHMARKS, concentration),
            "nvme": (DOCS / "nvme.md", nvme), "deepspeed_choices": (DOCS / "deepspeed.md", deepspeed_choices),
            "deepspeed_rounding": (DOCS / "deepspeed.md", deepspeed_rounding)}
