"""The README's Results section, written from the committed JSONs: every figure there is computed here from the key
it names, so none can drift from its result. ``python -m bench.readme_results`` rewrites the section between its
markers in README.md (after ``bench.refresh`` made results again); ``--check`` exits 1 when the README differs
(``tests/test_readme.py`` asserts it does not)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.harness import REPO, RESULTS_DIR, OneLineParser

README = REPO / "README.md"
BEGIN = "<!-- results: written by `python -m bench.readme_results` from bench/results/; edit that module, not this -->"
END = "<!-- /results -->"


def load(name: str) -> dict:
    return json.loads((RESULTS_DIR / name).read_text())


def link(name: str) -> str:
    return f"[`{Path(name).name}`](bench/results/{name})"


def where(result: dict) -> str:
    """The run's machine and commit, from its record (or, for a result made before records, its machine entry)."""
    record = result.get("record")
    machine = (record or result)["machine"]
    commit = record["commit"][:7] if record else f"{result['machine'].get('git_commit')}, no record"
    cpu = machine["cpu"].replace("(R)", "").replace(" Processor", "").strip()
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    return f"{cpu}, {machine['logical_cores']} cores{gpu}; {commit}"


def lr_text(lr: float) -> str:
    """3e-4 rather than 0.0003."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"


def recovered(result: dict, run: str) -> float:
    """The share of AdamW's held-out improvement (from the pre-trained model's held-out loss, at equal steps) that
    ``run`` made: 1 is AdamW's, 0 none, negative worse than where it started."""
    start = result["pretrain"]["heldout_loss"]
    final = {r["name"]: r["final_heldout_loss"] for r in result["runs"]}
    return (start - final[run]) / (start - final["adamw"])


def kernels_gpu() -> str:
    name = "h200-2026-11-30/kernels_gpu.json"
    rows = load(name)["rows"]
    sel = [r for r in rows if r["op"] == "selective_adamw"]
    ms = {(r["shape"], r["dtype"], r["impl"]): r["ms"] for r in sel}
    cases = sorted({(r["shape"], r["dtype"]) for r in sel})
    vs_foreach = [ms[c + ("deepspeed path (foreach AdamW)",)] / ms[c + ("triton",)] for c in cases]
    vs_fused = [ms[c + ("deepspeed path (fused AdamW)",)] / ms[c + ("triton",)] for c in cases]
    selection = next(r for r in rows if r["op"] == "selection" and r["impl"] == "triton multi")
    return (f"- **Kernels, H200** ({link(name)}; Triton kernels of `6d4eb75`, changed since: "
            f"[README](bench/results/h200-2026-11-30/README.md)): the fused selective AdamW at `topk_ratio="
            f"{load(name)['topk_ratio']}` is {span(vs_foreach)} DeepSpeed's gather / AdamW / scatter path with its "
            f"`foreach` AdamW and {span(vs_fused)} with its `fused` AdamW ({len(cases)} cases: "
            f"{', '.join(sorted({s for s, _ in cases}))}, fp32 and bf16); the whole model's column selection "
            f"({selection['matrices']} matrices) {selection['speedup_vs_torch']:.1f}x a torch loop.")


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
    demo, variants, lr3 = load("e2e.json"), load("e2e_variants.json"), load("e2e_lr1e-3.json")
    per_run = demo["comparison"]["per_run"]
    medians = {r["name"]: r["stall_pct_median"] for r in variants["runs"]}
    return (f"- **End to end, CPU** ({link('e2e.json')}, `make demo`; {where(demo)}): the byte GPT fine-tuned for "
            f"{demo['config']['steps']} steps at lr {lr_text(demo['config']['lr'])}. ZenFlow's stall "
            f"{per_run['zenflow']['stall_pct']:.1f}% of wall time against sync offload's "
            f"{per_run['offload']['stall_pct']:.1f}% (one run; the medians of {variants['config']['repeats']} "
            f"interleaved repeats {medians['zenflow_pt1']:.1f}% and {medians['offload']:.1f}%, "
            f"{link('e2e_variants.json')}). Quality, as the share of AdamW's held-out improvement recovered at "
            f"equal steps: {recovered(demo, 'zenflow'):.0%} with overlap and "
            f"{recovered(variants, 'zenflow_nooverlap'):.0%} without; at lr {lr_text(lr3['config']['lr'])} "
            f"{recovered(lr3, 'zenflow'):.0%} with overlap and {recovered(lr3, 'zenflow_nooverlap'):.0%} without "
            f"({link('e2e_lr1e-3.json')}). On a CPU the \"device\" is the host, so the stall ZenFlow removes is "
            f"small: the CPU shows exactness and per-byte speed, not ZenFlow's gain.")


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
    """The section's text between the markers."""
    gpu_e2e = ("- **End to end, GPU**: not measured for this version. `bench/gpu_suite.sh` is ready for a lent GPU "
               "(the optimizer tests on CUDA, the CUDA path's checklist, the 152 M GPT against AdamW and DeepSpeed, "
               "PCIe overlap).")
    head = ("Each figure below is computed from the JSON it links by `bench/readme_results.py` (machine and commit "
            "from the result's record); the method and the caveats in [docs/benchmarks.md](docs/benchmarks.md).")
    return "\n".join([head, "", kernels_gpu(), host_adam(), end_to_end(), gpu_e2e, host_memory()])


def wrap(text: str, width: int = 116) -> str:
    """Markdown lines of at most ``width`` characters (bullets continued with two spaces)."""
    import textwrap

    out = []
    for para in text.split("\n"):
        if not para:
            out.append("")
            continue
        indent = "  " if para.startswith("- ") else ""
        out.extend(textwrap.wrap(para, width, subsequent_indent=indent, break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)


def section() -> str:
    return f"{BEGIN}\n{wrap(render())}\n{END}"


def current(readme: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no results markers ({BEGIN!r} ... {END!r})")
    return readme[start:end + len(END)]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.readme_results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's section differs")
    args = ap.parse_args(argv)
    readme = README.read_text()
    old, new = current(readme), section()
    if args.check:
        if old != new:
            print("README.md's results differ from bench/results: python -m bench.readme_results", file=sys.stderr)
            return 1
        return 0
    README.write_text(readme.replace(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
