"""The tables of measured results in README.md and docs/*.md, each rendered from the JSON it names
(``python -m tools.docs_results`` writes them between their markers; ``--check`` compares)."""

from __future__ import annotations

from tools.docs_results import REPO, link, load, source, table, where  # noqa: F401

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


def seam() -> str:
    names = ("seam_speed_vs_89d3e24.json", "seam_speed_fused_rules.json", "seam_speed.json")
    keys = {"cpu_adam_ms_at_2^20": "host AdamW, 2^20", "cpu_adam_ms_at_2^24": "host AdamW, 2^24",
            "step_vs_foreach_at_150": "`step()` over foreach AdamW, 150 tensors",
            "step_vs_foreach_at_600": "`step()` over foreach AdamW, 600 tensors"}
    runs = {n: load(n) for n in names}
    return "\n".join([*(f"- {source(n)} Base {runs[n]['base']}, {runs[n]['rounds']} rounds." for n in names), "",
                      table(["head over base"] + [f"`{n}`" for n in names],
                            [[label] + [f"{runs[n]['summary'][k]['head_over_base']:.2f}x" for n in names]
                             for k, label in keys.items()])])


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

def e2e() -> str:
    return _old('e2e')


def zero() -> str:
    return _old('zero')


def overlap() -> str:
    return _old('overlap')


def fsdp2() -> str:
    return _old('fsdp2')


def nvme_timeline() -> str:
    return _old('nvme_timeline')


# -- docs/benchmarks.md: scale; quality (tuned comparison, concentration); docs/nvme.md -------------------------------

def scale() -> str:
    return _old('scale')


def tuned() -> str:
    return _old('tuned')


def concentration() -> str:
    return _old('concentration')


def nvme() -> str:
    return _old('nvme')


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


def _old(name: str) -> str:
    """The section as bench.readme_results wrote it (until this module renders it)."""
    from bench.readme_results import section
    return section(name).split("\n", 1)[1].rsplit("\n", 1)[0]


BENCHMARKS = DOCS / "benchmarks.md"
SECTIONS = {"readme": (README, readme), "kernels_gpu": (BENCHMARKS, kernels_gpu),
            "step_overhead": (BENCHMARKS, step_overhead), "rules_step": (BENCHMARKS, rules_step),
            "seam": (BENCHMARKS, seam), "cpu_adam": (BENCHMARKS, cpu_adam), "kernels_cpu": (BENCHMARKS, kernels_cpu),
            "cpu_rules": (BENCHMARKS, cpu_rules), "stochastic_rounding": (BENCHMARKS, stochastic_rounding),
            "e2e": (BENCHMARKS, e2e), "zero": (BENCHMARKS, zero), "overlap": (BENCHMARKS, overlap),
            "fsdp2": (BENCHMARKS, fsdp2), "nvme_timeline": (BENCHMARKS, nvme_timeline), "scale": (BENCHMARKS, scale),
            "tuned": (BENCHMARKS, tuned), "concentration": (BENCHMARKS, concentration),
            "nvme": (DOCS / "nvme.md", nvme), "deepspeed_choices": (DOCS / "deepspeed.md", deepspeed_choices),
            "deepspeed_rounding": (DOCS / "deepspeed.md", deepspeed_rounding)}
