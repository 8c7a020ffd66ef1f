"""The results sections of README.md, docs/benchmarks.md and docs/deepspeed.md, written from the committed JSONs:
every figure there is computed from the key it names (the README's and DeepSpeed's here, benchmarks.md's in
``bench/sections_runs.py``, ``bench/sections_speed.py`` and ``bench/sections_quality.py``, nvme.md's in
``bench/sections_nvme.py``), so none can drift from its result. ``python -m
bench.readme_results`` rewrites each section between its markers (after ``bench.refresh`` made results again);
``--check`` exits 1 when one differs (``tests/test_readme.py`` asserts none does)."""

from __future__ import annotations

import re
import sys

from bench.harness import REPO, OneLineParser
from bench.results_text import link, load, load_study, lr_text, sci, span, where
from bench.sections_nvme import nvme_section
from bench.sections_quality import concentration_section, tuned_section
from bench.sections_runs import (
    e2e_section,
    fsdp2_section,
    nvme_timeline_section,
    overlap_section,
    zero_section,
)
from bench.sections_speed import (
    cpu_adam_section,
    cpu_rules_section,
    kernels_cpu_section,
    rules_step_section,
    scale_section,
    seam_section,
    step_overhead_section,
    stochastic_rounding_section,
)

README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"


def begin(name: str) -> str:
    return (f"<!-- results:{name}: written by `python -m bench.readme_results` from bench/results/; edit that module, "
            "not this -->")


def end(name: str) -> str:
    return f"<!-- /results:{name} -->"


KERNELS_GPU = "h200-2026-11-30/kernels_gpu.json"


def selective_adamw_ratios(rows: list[dict]) -> tuple[list[tuple[str, str]], dict]:
    """The H200 run's (shape, dtype) cases of the selective AdamW and, per (case, "foreach" | "fused"), DeepSpeed's
    gather / AdamW / scatter path's time over the Triton kernel's."""
    ms = {(r["shape"], r["dtype"], r["impl"]): r["ms"] for r in rows if r["op"] == "selective_adamw"}
    cases = sorted({(shape, dtype) for shape, dtype, _ in ms})
    return cases, {(c, path): ms[c + (f"deepspeed path ({path} AdamW)",)] / ms[c + ("triton",)] for c in cases
                   for path in ("foreach", "fused")}


def kernels_gpu() -> str:
    name = KERNELS_GPU
    rows = load(name)["rows"]
    cases, ratio = selective_adamw_ratios(rows)
    vs_foreach = [ratio[(c, "foreach")] for c in cases]
    vs_fused = [ratio[(c, "fused")] for c in cases]
    selection = next(r for r in rows if r["op"] == "selection" and r["impl"] == "triton multi")
    return (f"- **Kernels, H200** ({link(name)}; Triton kernels of `6d4eb75`, changed since: "
            f"[README](bench/results/h200-2026-11-30/README.md)): the fused selective AdamW at `topk_ratio="
            f"{load(name)['topk_ratio']}` is {span(vs_foreach)} DeepSpeed's gather / AdamW / scatter path with its "
            f"`foreach` AdamW and {span(vs_fused)} with its `fused` AdamW ({len(cases)} cases: "
            f"{', '.join(sorted({s for s, _ in cases}))}, fp32 and bf16); the whole model's column selection "
            f"({selection['matrices']} matrices) {selection['speedup_vs_torch']:.1f}x a torch loop.")


def kernels_gpu_doc() -> str:
    """docs/benchmarks.md's paragraph on the H200 kernel run: each ratio from ``kernels_gpu.json``."""
    result = load(KERNELS_GPU)
    rows = result["rows"]
    cases, ratio = selective_adamw_ratios(rows)
    fused_worst = min(cases, key=lambda c: ratio[(c, "fused")])
    goal = sorted({shape for (shape, _), path in ratio if path == "foreach" and all(
        ratio[((shape, d), "foreach")] >= 3 for d in ("float32", "bfloat16"))})
    selection = next(r for r in rows if r["op"] == "selection" and r["impl"] == "triton multi")
    scores = {(r["shape"], r["dtype"]): r["speedup_vs_torch"] for r in rows
              if r["op"] == "column_scores" and r["impl"] == "triton"}
    slowest = min(scores, key=scores.get)
    # the column-score goal is a share of the copy bandwidth measured in the same run: say how often it is met
    share = float(re.search(r">= (\d+)%", result["goals"]["column_scores"]).group(1)) / 100
    copy = [r["copy_fraction"] for r in rows if r["op"] == "column_scores" and r["impl"] == "triton"]
    met = lambda path: sum(ratio[(c, path)] >= 3 for c in cases)  # noqa: E731
    return (f"**Measured on a GPU so far** (an H200, 16 cores; [`bench/results/h200-2026-11-30/`]"
            f"(../bench/results/h200-2026-11-30), `kernels_gpu.json`; the Triton kernels of `6d4eb75`, changed "
            f"since): the kernels only. Selective AdamW at `topk_ratio={result['topk_ratio']}` "
            f"({', '.join(sorted({s for s, _ in cases}))}; fp32 and bf16) against DeepSpeed's path (gather the "
            "selected columns, AdamW, scatter back), both in the same run: "
            f"{span([ratio[(c, 'foreach')] for c in cases])} with its `foreach` AdamW, "
            f"{span([ratio[(c, 'fused')] for c in cases])} with its `fused` AdamW (the lowest, "
            f"{'bf16' if fused_worst[1] == 'bfloat16' else 'fp32'} {fused_worst[0]}: "
            f"{ratio[(fused_worst, 'fused')]:.1f}x); the goal of 3x is met in {met('foreach')} of {len(cases)} cases "
            f"against `foreach` (" + (f"{', '.join(goal)} in both dtypes" if goal else "no shape in both dtypes")
            + f") and {met('fused')} of {len(cases)} against `fused`. Whole-model selection "
            f"({selection['matrices']} matrices) {selection['speedup_vs_torch']:.1f}x a "
            f"torch loop in {selection['launches']} launches; column scores "
            f"{span([v for (_, d), v in scores.items() if d == 'bfloat16'])} torch for bf16 gradients, "
            f"{scores[slowest]:.2f}x at {'fp32' if slowest[1] == 'float32' else 'bf16'} {slowest[0]}; their goal, "
            f"{share:.0%} of the copy bandwidth measured beside them, is met in {sum(c >= share for c in copy)} of "
            f"{len(copy)} cases ({min(copy):.1%}-{max(copy):.1%} of it).")


def host_adam() -> str:
    name = "cpu_adam.json"
    result = load(name)
    goals = result["goals"]
    size = goals["size"]
    return (f"- **Host Adam, CPU** ({link(name)}; {where(result)}): at 2^{size.bit_length() - 1} fp32 parameters and "
            f"{goals['threads']} threads, {goals['adam_vs_roofline']['measured']:.2f}x the memory roofline and "
            f"{goals['adam_vs_deepspeed']['measured']:.2f}x DeepSpeed's CPU Adam; "
            f"{goals['adam_vs_deepspeed_zenflow_native']['measured']:.2f}x DeepSpeed's native ZenFlow Adam, which also "
            f"writes a fp32 snapshot (36 bytes a parameter against 28): at equal bytes "
            f"{goals['adam_out_fp32_vs_deepspeed_zenflow_native']['measured']:.2f}x.")


def end_to_end() -> str:
    demo = load("e2e.json")
    per_run = demo["comparison"]["per_run"]
    cfg, runs = demo["config"], demo["to_target"]["runs"]
    reach = lambda n, key, fmt: "not within the run" if runs[n][key] is None else fmt.format(runs[n][key])  # noqa: E731
    return (f"- **End to end, CPU** ({link('e2e.json')}, `make demo`; {where(demo)}): the byte GPT fine-tuned for "
            f"{cfg['steps']} steps at the tuned comparison's pick (lr {lr_text(cfg['lr'])}; ZenFlow `topk_ratio` "
            f"{cfg['topk_ratio']:g}, `update_interval` {cfg['update_interval']}"
            f"{'' if cfg['overlap'] else ', no overlap'}). ZenFlow's stall {per_run['zenflow']['stall_pct']:.1f}% of "
            f"wall time against sync offload's {per_run['offload']['stall_pct']:.1f}% (one run). To AdamW's loss at "
            "75% of its steps: ZenFlow "
            f"{reach('zenflow', 'cpu_s', '{:.1f} s')}, sync offload {reach('offload', 'cpu_s', '{:.1f} s')}, AdamW "
            f"{reach('adamw', 'cpu_s', '{:.1f} s')} here; **modeled** for a 7B model on an H200 "
            f"([docs/benchmarks.md](docs/benchmarks.md)): {reach('zenflow', 'modeled_s', '{:.0f}')}, "
            f"{reach('offload', 'modeled_s', '{:.0f}')} and {reach('adamw', 'modeled_s', '{:.0f}')} s. On a CPU the "
            "\"device\" is the host, so the stall ZenFlow removes is small.")


def host_memory() -> str:
    name = "scale_cpu.json"
    result = load(name)
    runs = [r for r in result["runs"] if r["config"] == "overlap"]
    per_param = sorted({round(r["bytes_per_param"]["total"], 1) for r in runs})
    gaps = [abs(r["rss"]["growth_over_run"] - r["rss"]["reported"]) / r["params"] for r in result["runs"]]
    ds = result["deepspeed_reference"]["zenflow_overlap"]["bytes_per_param"]
    return (f"- **Host memory** ({link(name)}; {where(result)}; [docs/design.md](docs/design.md) section 9): "
            f"{'/'.join(f'{b:g}' for b in per_param)} bytes per bf16 parameter with overlap (+2 on a GPU for the "
            f"landing area), against about {ds} for DeepSpeed's ZenFlow with overlap; the process's RSS grew within "
            f"{max(gaps):.2f} bytes per parameter of `opt.host_bytes()` in each of its {len(gaps)} runs.")


def render() -> str:
    """The README's section's text between the markers."""
    gpu_e2e = ("- **End to end, GPU**: not measured for this version. `bench/gpu_suite.sh` (the optimizer tests on "
               "CUDA, the CUDA path's checklist, the 152 M GPT against AdamW and DeepSpeed, PCIe overlap) has not yet "
               "run whole on a GPU.")
    head = ("Each figure below is computed from the JSON it links by `bench/readme_results.py` (machine and commit "
            "from the result's record); the method and the caveats in [docs/benchmarks.md](docs/benchmarks.md).")
    return "\n".join([head, "", kernels_gpu(), host_adam(), end_to_end(), gpu_e2e, host_memory()])


def deepspeed_tables(result: dict) -> tuple[list[str], list[str]]:
    """docs/deepspeed.md's two tables from ``deepspeed_semantics.json``: each choice turned back to ours, and
    ``semantics="deepspeed"`` on our kernels (both links: the sync row, the chaos row asserted equal) and in the
    reference, per setting."""
    cell = {(r["variant"], r["mode"], r["setting"]): r["max"] for r in result["rows"]}
    settings = list(result["config"]["settings"])
    head = "| " + " | ".join(f"ui {ui}, si {si}, W {w}" for ui, si, w in result["config"]["settings"].values()) + " |"
    choices = [("deepspeed", "none (`semantics=\"deepspeed\"`)")] + [
        (f"{name}_ours", f"`{name}`") for name in ("gradient_scale", "host_step_count", "reselect_state",
                                                   "vector_state", "importance", "select_anchor")] + [
        ("all_ours", "all six (our defaults)")]
    first = ["| turned back to ours " + head, "|---|" + "---|" * len(settings)]
    first += [f"| {label} | " + " | ".join(f"{sci(cell[(v, 'sync', s)])}" for s in settings) + " |"
              for v, label in choices]
    names = {"ui3_si4_w0": " (an interval cut short)"}
    second = ["| setting | ours, `semantics=\"deepspeed\"` (both links) | `ReferenceZenFlow` |", "|---|---|---|"]
    for s, (ui, si, w) in result["config"]["settings"].items():
        assert cell[("deepspeed", "sync", s)] == cell[("deepspeed", "chaos", s)], s  # both links, the same bits
        second.append(f"| ui {ui}, si {si}, W {w}{names.get(s, '')} | {sci(cell[('deepspeed', 'sync', s)])} | "
                      f"{sci(cell[('deepspeed', 'reference', s)])} |")
    return first, second


def deepspeed_choices() -> str:
    return "\n".join(deepspeed_tables(load_study("deepspeed_semantics.json"))[0])


def deepspeed_rounding() -> str:
    result = load_study("deepspeed_semantics.json")
    worst = {mode: max(r["max"] for r in result["rows"] if r["variant"] == "deepspeed" and r["mode"] == mode)
             for mode in ("sync", "reference")}
    return "\n".join(deepspeed_tables(result)[1] + [
        "", f"Each cell is the largest difference in any weight over the 16 steps, on the machine of "
        f"[`deepspeed_semantics.json`](../studies/results/deepspeed_semantics.json) ({where(result)}): at most "
        f"{sci(worst['sync'])} on our kernels and {sci(worst['reference'])} in the reference."])


SECTIONS = {"readme": (README, render), "e2e": (BENCHMARKS, e2e_section), "zero": (BENCHMARKS, zero_section),
            "tuned": (BENCHMARKS, tuned_section),
            "concentration": (BENCHMARKS, concentration_section),
            "kernels_gpu": (BENCHMARKS, kernels_gpu_doc),
            "nvme_timeline": (BENCHMARKS, nvme_timeline_section),
            "scale": (BENCHMARKS, scale_section),
            "fsdp2": (BENCHMARKS, fsdp2_section),
            "cpu_rules": (BENCHMARKS, cpu_rules_section),
            "stochastic_rounding": (BENCHMARKS, stochastic_rounding_section),
            "kernels_cpu": (BENCHMARKS, kernels_cpu_section),
            "cpu_adam": (BENCHMARKS, cpu_adam_section),
            "seam": (BENCHMARKS, seam_section),
            "overlap": (BENCHMARKS, overlap_section),
            "rules_step": (BENCHMARKS, rules_step_section),
            "step_overhead": (BENCHMARKS, step_overhead_section),
            "nvme": (REPO / "docs" / "nvme.md", nvme_section),
            "deepspeed_choices": (REPO / "docs" / "deepspeed.md", deepspeed_choices),
            "deepspeed_rounding": (REPO / "docs" / "deepspeed.md", deepspeed_rounding)}


def wrap(text: str, width: int = 116) -> str:
    """Markdown lines of at most ``width`` characters (bullets continued with two spaces)."""
    import textwrap

    out = []
    for para in text.split("\n"):
        if not para:
            out.append("")
            continue
        stripped = para.lstrip(" ")
        indent = " " * (len(para) - len(stripped)) + "  " if stripped.startswith("- ") else ""
        out.extend(textwrap.wrap(para, width, subsequent_indent=indent, break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)


def section(name: str = "readme") -> str:
    """A section as it belongs in its file: the markers around its wrapped text (a table's lines kept whole)."""
    text = SECTIONS[name][1]()
    lines = "\n".join(line if line.startswith("|") else wrap(line) for line in text.split("\n"))
    return f"{begin(name)}\n{lines}\n{end(name)}"


def current(text: str, name: str = "readme") -> str:
    start, stop = text.find(begin(name)), text.find(end(name))
    if start < 0 or stop < start:
        raise SystemExit(f"no results markers for {name!r} ({begin(name)!r} ... {end(name)!r})")
    return text[start:stop + len(end(name))]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.readme_results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a section differs from its results")
    args = ap.parse_args(argv)
    stale = []
    for name, (path, _) in SECTIONS.items():
        text = path.read_text()
        old, new = current(text, name), section(name)
        if old != new:
            stale.append(path.name)
            if not args.check:
                path.write_text(text.replace(old, new))
    if args.check and stale:
        print(f"{', '.join(stale)}: results sections differ from bench/results: python -m bench.readme_results",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
