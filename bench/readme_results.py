"""The results sections of README.md and docs/benchmarks.md (the end-to-end runs), written from the committed JSONs:
every figure there is computed here from the key it names, so none can drift from its result. ``python -m
bench.readme_results`` rewrites each section between its markers (after ``bench.refresh`` made results again);
``--check`` exits 1 when one differs (``tests/test_readme.py`` asserts none does)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.harness import REPO, RESULTS_DIR, OneLineParser

README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"


def begin(name: str) -> str:
    return (f"<!-- results:{name}: written by `python -m bench.readme_results` from bench/results/; edit that module, "
            "not this -->")


def end(name: str) -> str:
    return f"<!-- /results:{name} -->"


def load(name: str) -> dict:
    return json.loads((RESULTS_DIR / name).read_text())


def link(name: str, up: str = "") -> str:
    """A markdown link to a result, from README.md (``up=""``) or from docs/ (``up="../"``)."""
    return f"[`{Path(name).name}`]({up}bench/results/{name})"


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


def sci(x: float) -> str:
    """5.6e-7 rather than 5.6e-07."""
    mantissa, exponent = f"{x:.1e}".split("e")
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
    """The README's section's text between the markers."""
    gpu_e2e = ("- **End to end, GPU**: not measured for this version. `bench/gpu_suite.sh` is ready for a lent GPU "
               "(the optimizer tests on CUDA, the CUDA path's checklist, the 152 M GPT against AdamW and DeepSpeed, "
               "PCIe overlap).")
    head = ("Each figure below is computed from the JSON it links by `bench/readme_results.py` (machine and commit "
            "from the result's record); the method and the caveats in [docs/benchmarks.md](docs/benchmarks.md).")
    return "\n".join([head, "", kernels_gpu(), host_adam(), end_to_end(), gpu_e2e, host_memory()])


def e2e_section() -> str:
    """docs/benchmarks.md's end-to-end figures (the demo, its variants, lr 1e-3, the base model)."""
    met = lambda ok: "**met**" if ok else "**missed**"  # noqa: E731
    demo, variants, lr3, base = (load(n) for n in ("e2e.json", "e2e_variants.json", "e2e_lr1e-3.json",
                                                     "e2e_base_batch2.json"))
    per_run = demo["comparison"]["per_run"]
    runs = {r["name"]: r for r in demo["runs"]}
    adamw_loss = runs["adamw"]["final_heldout_loss"]
    rows = ["| run | steps/s vs AdamW | stall, % of wall time | host updates | held-out loss vs AdamW, equal steps |",
            "|---|---|---|---|---|",
            f"| torch AdamW (fused) | 1.00x | 0 | 0 | ({adamw_loss:.4f} nats/byte) |"]
    for name, label in (("offload", "sync offload"),
                        ("zenflow", "ZenFlowAdamW (`topk_ratio=0.1`, `update_interval=4`, overlap)")):
        c, r = per_run[name], runs[name]
        gap = c["heldout_gap_vs_adamw_equal_steps"]
        rows.append(f"| {label} | {c['steps_per_s_vs_adamw']:.2f}x | {c['stall_pct']:.1f} | {r['host_updates']} | "
                    f"{gap:+.4f} ({gap / adamw_loss:+.1%}) |")
    start = demo["pretrain"]["heldout_loss"]
    vr = {r["name"]: r for r in variants["runs"]}
    l3 = {r["name"]: r for r in lr3["runs"]}
    l3_start = lr3["pretrain"]["heldout_loss"]
    gain = lambda runs_, name, s0: s0 - runs_[name]["final_heldout_loss"]  # noqa: E731
    gap = lambda runs_, name: runs_[name]["final_heldout_loss"] - runs_["adamw"]["final_heldout_loss"]  # noqa: E731
    over = l3["zenflow"]["final_heldout_loss"] - l3_start
    lr3_overlap = (f"**ZenFlow with overlap ends above the start** ({l3['zenflow']['final_heldout_loss']:.4f} against "
                   f"{l3_start:.4f}; AdamW {l3['adamw']['final_heldout_loss']:.4f})" if over > 0 else
                   f"ZenFlow with overlap improves it by only {-over:.4f}, **{recovered(lr3, 'zenflow'):.0%}**")
    meaning = (f"**What the held-out numbers mean.** The pre-trained start is at {start:.4f} nats/byte. AdamW improves "
               f"it by {gain(runs, 'adamw', start):.4f}; ZenFlow with overlap by {gain(runs, 'zenflow', start):.4f}, "
               f"**{recovered(demo, 'zenflow'):.0%} of AdamW's improvement**, and without overlap by "
               f"{gain(vr, 'zenflow_nooverlap', start):.4f}, {recovered(variants, 'zenflow_nooverlap'):.0%} "
               f"({link('e2e_variants.json', '../')}). At lr {lr_text(lr3['config']['lr'])} "
               f"({link('e2e_lr1e-3.json', '../')}) "
               f"AdamW improves it by {gain(l3, 'adamw', l3_start):.4f} and ZenFlow without overlap by "
               f"{gain(l3, 'zenflow_nooverlap', l3_start):.4f} ({recovered(lr3, 'zenflow_nooverlap'):.0%}), while "
               f"{lr3_overlap}. Why, as far as these runs show: 90% of each matrix's columns take one Adam step per 4 "
               "steps with the interval's mean gradient, and with overlap that step lands one interval late, computed "
               "before the fast columns' last 4 steps; the larger the learning rate, the more those late steps work "
               "against the progress made meanwhile (the gap at equal steps without overlap is "
               f"{gap(vr, 'zenflow_nooverlap') / gap(vr, 'zenflow_pt1'):.0%} of the gap with it at lr "
               f"{lr_text(variants['config']['lr'])}, {gap(l3, 'zenflow_nooverlap') / gap(l3, 'zenflow'):.0%} at "
               f"{lr_text(lr3['config']['lr'])}). The loss gap in the table is the loss, not the improvement.")
    med = {n: r["stall_pct_median"] for n, r in vr.items()}
    speed = {n: r["steps_per_s_median"] / vr["adamw"]["steps_per_s_median"] for n, r in vr.items()}
    per_repeat = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(vr["zenflow_pt1"]["repeats"],
                                                                      vr["adamw"]["repeats"], strict=True)]
    call_ms = {n: 1e3 * r["optimizer_step_call_s_mean"] for n, r in vr.items()}
    step_ms = {n: 1e3 * r["wall_s"] / r["steps"] for n, r in vr.items()}
    comp = variants["comparison"]["per_run"]
    goals = [
        f"**The goals**, checked on {link('e2e_variants.json', '../')} (the same setting, "
        f"{variants['config']['repeats']} "
        "interleaved repeats, medians):",
        "",
        f"- *Stall under 5% of step time*: {met(max(med['zenflow_pt1'], med['zenflow_nooverlap']) < 5)}. "
        f"{med['zenflow_pt1']:.1f}% with overlap ({med['zenflow_nooverlap']:.1f}% without); sync offload "
        f"{med['offload']:.1f}%.",
        f"- *Steps/s at least 0.9x AdamW's*: {met(min(speed['zenflow_pt1'], speed['zenflow_nooverlap']) >= 0.9)}. "
        f"{speed['zenflow_pt1']:.2f}x with overlap at `pt_reserved_cores_perc=1.0` "
        f"(per repeat {min(per_repeat):.2f}-{max(per_repeat):.2f}x), {speed['zenflow_nooverlap']:.2f}x without; "
        f"{speed['zenflow_pt0.5']:.2f}x at 0.5, where torch trains on one thread (AdamW itself on 1 thread: "
        f"{speed['adamw_t1']:.2f}x). A `ZenFlowAdamW.step()` call took {call_ms['zenflow_pt1']:.1f} ms against "
        f"AdamW's {call_ms['adamw']:.1f} ms (`optimizer_step_call_s_mean`): the fast path over the selected columns "
        f"and the gradient accumulation, on the cores that train; a step took {step_ms['zenflow_pt1']:.1f} ms with "
        f"overlap, {step_ms['zenflow_nooverlap']:.1f} ms without and {step_ms['adamw']:.1f} ms with AdamW.",
        f"- *Held-out loss at equal wall time no worse than sync offload's*: "
        f"{met(comp['zenflow_pt1']['heldout_gap_vs_offload_equal_wall'] <= 0)}. At "
        f"{comp['zenflow_pt1']['equal_wall_time_s']:.1f} s: {comp['zenflow_pt1']['heldout_at_equal_wall']:.4f} "
        f"(overlap) and {comp['zenflow_nooverlap']['heldout_at_equal_wall']:.4f} (no overlap) against "
        f"{comp['zenflow_pt1']['offload_heldout_at_equal_wall']:.4f}. Sync offload costs only a few percent here, so "
        "ZenFlow's per-step lag is not bought back by speed.",
        f"- *Gap to AdamW at equal steps* (expected: non-selected columns move every 4 steps, one interval late): "
        f"{gap(vr, 'zenflow_pt1'):+.3f} nats/byte ({gap(vr, 'zenflow_pt1') / vr['adamw']['final_heldout_loss']:+.1%}) "
        f"with overlap, {gap(vr, 'zenflow_nooverlap'):+.3f} "
        f"({gap(vr, 'zenflow_nooverlap') / vr['adamw']['final_heldout_loss']:+.1%}) without; at lr "
        f"{lr_text(lr3['config']['lr'])} {gap(l3, 'zenflow'):+.3f} "
        f"({gap(l3, 'zenflow') / l3['adamw']['final_heldout_loss']:+.1%}) with overlap, "
        f"{gap(l3, 'zenflow_nooverlap'):+.3f} ({gap(l3, 'zenflow_nooverlap') / l3['adamw']['final_heldout_loss']:+.1%})"
        " without.",
    ]
    bc, br = base["comparison"]["per_run"], {r["name"]: r for r in base["runs"]}
    bspeed = {n: r["steps_per_s_median"] / br["adamw"]["steps_per_s_median"] for n, r in br.items()}
    base_text = (f"**Where the host update weighs more** ({link('e2e_base_batch2.json', '../')}: "
                 f"{base['model']['params']['total'] / 1e6:.1f} M parameters, 2 x 48 tokens per step, "
                 f"{base['config']['repeats']} repeats): sync offload runs at {bspeed['offload']:.2f}x AdamW with "
                 f"{br['offload']['stall_pct_median']:.1f}% stall. ZenFlowAdamW runs at {bspeed['zenflow_pt1']:.2f}x "
                 f"with {br['zenflow_pt1']['stall_pct_median']:.1f}% stall, "
                 f"{br['zenflow_pt1']['steps_per_s_median'] / br['offload']['steps_per_s_median']:.2f}x sync "
                 f"offload's steps/s ({bspeed['zenflow_nooverlap']:.2f}x and "
                 f"{br['zenflow_nooverlap']['stall_pct_median']:.1f}% without overlap, {bspeed['zenflow_pt0.5']:.2f}x "
                 f"at `pt_reserved_cores_perc=0.5`). At equal wall time its held-out loss is "
                 f"{bc['zenflow_pt1']['heldout_at_equal_wall']:.4f} against sync offload's "
                 f"{bc['zenflow_pt1']['offload_heldout_at_equal_wall']:.4f}.")
    size = demo["config"]["size"]
    intro = (f"**End to end: `make demo`** ({link('e2e.json', '../')}, [`e2e.png`](../bench/results/e2e.png); "
             f"{where(demo)}). A byte-level GPT ({demo['model']['params']['total'] / 1e6:.2f} M parameters: "
             f"{size['n_layer']} layers, width {size['d_model']}, context {size['context']}, batch {size['batch']}) is "
             f"pre-trained for {demo['pretrain']['steps']} steps on 1 MB of the standard library's top-level modules "
             f"({demo['pretrain']['seconds']:.0f} s in the recorded run; cached in `data/e2e/` for the next), then "
             f"fine-tuned for {demo['config']['steps']} steps on 400 KB of its packages, three ways, on "
             f"{demo['config']['threads']} torch threads; the held-out loss is on 100 KB of other package files. "
             f"{demo['total_s']:.0f} s in all in the recorded run (`total_s`), pre-training included. The baseline is "
             "`torch.optim.AdamW(fused=True)` (torch 2.13 has fused AdamW on CPU).")
    return "\n".join([intro, "", "\n".join(rows), "", meaning, "", "\n".join(goals), "", base_text])


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
    return "\n".join(deepspeed_tables(load("deepspeed_semantics.json"))[0])


def deepspeed_rounding() -> str:
    result = load("deepspeed_semantics.json")
    worst = {mode: max(r["max"] for r in result["rows"] if r["variant"] == "deepspeed" and r["mode"] == mode)
             for mode in ("sync", "reference")}
    return "\n".join(deepspeed_tables(result)[1] + [
        "", f"Each cell is the largest difference in any weight over the 16 steps, on the machine of "
        f"[`deepspeed_semantics.json`](../bench/results/deepspeed_semantics.json) ({where(result)}): at most "
        f"{sci(worst['sync'])} on our kernels and {sci(worst['reference'])} in the reference."])


def step_overhead_section() -> str:
    """docs/benchmarks.md's paragraph on step()'s own cost and the two multi-tensor host passes."""
    result = load("step_overhead_cpu.json")
    cpu = {name: c["cpu"] for name, c in result["summary"].items() if name != "goal"}
    vs = lambda name, n: f"{cpu[name][f'vs_torch_adamw_foreach_at_{n}']:.2f}x"  # noqa: E731
    wall = result["summary"]["zenflow_async_link"]["wall"]["vs_torch_adamw_foreach_at_150"]
    limits = result["summary"]["goal"]["limits"]
    goal = " and ".join(f"{v}x at {k}" for k, v in limits.items()) + (
        ", met" if result["summary"]["goal"]["met"] else ", missed")
    rows = load("host_multi_cpu.json")["rows"]
    span_of = lambda op, dtype: span([r["speedup_unchecked"] for r in rows  # noqa: E731
                                      if r["op"] == op and (dtype is None or r["dtype"] == dtype)])
    sizes = sorted({r["elements"] for r in rows})
    return (
        "On CPU, the training thread's time in a non-boundary `step()` with small tensors (`python -m "
        "bench.step_overhead`, [`step_overhead_cpu.json`](../bench/results/step_overhead_cpu.json) and `.png`, "
        f"{where(result)}; alternating fp32 [64, 64] and [64], {result['config']['repeats']} repeats side by side in "
        "one process, the median of the per-repeat ratios to torch's `AdamW(foreach=True)`, key "
        "`summary.<candidate>.cpu.vs_torch_adamw_foreach_at_<n>`): through the asynchronous link (the GPU's protocol) "
        f"with the gradients set by hand {cpu['zenflow_async_link']['ms_at_150']:.2f} ms at 150 tensors, "
        f"{vs('zenflow_async_link', 150)} foreach's, and {vs('zenflow_async_link', 600)} at 600 (the goal: {goal}); "
        "with the gradients made by a backward, whose hooks copy them to the host and whose fingerprints `step()` "
        f"compares, {vs('zenflow_async_link_hooks', 150)} and {vs('zenflow_async_link_hooks', 600)} (that check is "
        "the \"device's\" work, charged to the training thread on CPU, a launch on a GPU); the synchronous CPU link "
        f"{vs('zenflow_cpu_link', 150)} and {vs('zenflow_cpu_link', 600)}. torch's `AdamW(fused=True)` on CPU: "
        f"{vs('torch_adamw_fused', 150)} and {vs('torch_adamw_fused', 600)} of foreach. The wall-clock figures "
        "(`...wall...`) add, on the asynchronous link without hooks, the stand-in's wait for the copies `step()` "
        f"started ({wall:.2f}x at 150), which on a GPU is a stream wait (docs/design.md section 5.3). The two "
        "multi-tensor host passes against torch's foreach ops (`python -m bench.host_multi`, "
        f"[`host_multi_cpu.json`](../bench/results/host_multi_cpu.json), {where(load('host_multi_cpu.json'))}): the "
        f"gradient norm {span_of('grad_norm', None)} faster (bf16 and fp32, {sizes[0] / 1e6:.1f} M to "
        f"{sizes[-1] / 1e6:.0f} M elements), the fp32 accumulation of bf16 gradients "
        f"{span_of('accumulate', 'bfloat16')}, of fp32 gradients {span_of('accumulate', 'float32')} (the unchecked "
        "forms the optimizer calls; the public `multi_accumulate_` checks every tensor first).")


def zero_section() -> str:
    """docs/benchmarks.md's ZeRO paragraph, from ``zero_cpu.json``."""
    result = load("zero_cpu.json")
    one, two = result["summary"]["1"], result["summary"]["2"]
    per_step = two["collective_bytes_per_step"]
    steps = result["config"]["steps"]
    mb = lambda b: f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.0f} KB"  # noqa: E731
    held = two["gradient_elements_held_per_rank"]
    return (
        "**ZeRO** ([`zero_cpu.json`](../bench/results/zero_cpu.json), `python -m bench.zero`; "
        f"{where(result)}): the small byte GPT at ZeRO-{result['config']['stage']}, the same global batch, 1 rank on "
        f"{one['torch_threads_per_rank']} threads against 2 ranks on {two['torch_threads_per_rank']} thread each: "
        f"{one['steps_per_s_median']:.2f} and {two['steps_per_s_median']:.2f} steps/s "
        f"({two['steps_per_s_vs_first_world']:.2f}x; one machine's two cores either way), host state per rank "
        f"{one['host_state_bytes_per_rank'][0] / 1e6:.1f} MB against "
        f"{' and '.join(f'{b / 1e6:.1f}' for b in two['host_state_bytes_per_rank'])} MB; per step "
        f"{mb(per_step['gradients'])} of matrix gradients reduced to their owners, {mb(per_step['selected columns'])} "
        f"of selected columns, {mb(per_step['write-back'])} of write-back, and "
        f"{mb(per_step['selection scores'] * steps)} of selection scores over the whole run "
        f"({steps} steps). Gradient elements a rank holds once backward is done (measured, the most over the run): 1 "
        f"rank, all {one['gradient_elements_held_per_rank'][0]['grad']:,} in `.grad`; 2 ranks, {held[0]['grad']:,} in "
        f"`.grad` (the vectors), its own range's sums ({held[0]['own']:,} and {held[1]['own']:,}) and the other "
        "rank's bucket while its reduction is in flight (this small model has one bucket per owner; buckets are at "
        "most 8 M elements). Scaling across machines or GPUs is not measurable here; the same command runs on a "
        "multi-GPU machine (NCCL, one GPU per rank).")


def rules_step_section() -> str:
    """docs/benchmarks.md's sentence on each rule's device step, from ``step_overhead_rules_cpu.json``."""
    result = load("step_overhead_rules_cpu.json")
    cpu = {name: c["cpu"] for name, c in result["summary"].items() if name != "goal"}
    vs = lambda name, n: cpu[name][f"vs_torch_adamw_foreach_at_{n}"]  # noqa: E731
    pair = lambda name: f"{vs(name, 150):.2f}x and {vs(name, 600):.2f}x"  # noqa: E731
    fused = {rule: span([vs(f"zenflow_async_link_{rule}_torch", n) / vs(f"zenflow_async_link_{rule}", n)
                         for n in (150, 600)]) for rule in ("lion", "sgd", "adam")}
    load_before = result["load_average"]["before"][0]
    return (
        "The device step: every built-in rule has a fused multi-tensor kernel (numba on CPU, Triton on GPU, "
        "`ops.fused_kernels`); `python -m bench.step_overhead --rules` "
        f"([`step_overhead_rules_cpu.json`](../bench/results/step_overhead_rules_cpu.json), {where(result)}; "
        "training-thread CPU time against torch's foreach AdamW in the same repeat, median of "
        f"{result['config']['repeats']}) puts ZenFlow with AdamW at {pair('zenflow_async_link')} at 150 and 600 "
        f"tensors, Lion {pair('zenflow_async_link_lion')}, SGD (momentum 0.9) {pair('zenflow_async_link_sgd')}, "
        f"Adam {pair('zenflow_async_link_adam')}; the same rules with their device step in plain torch "
        "(`UpdateRule.reference_fast_step_`, what a rule of one's own without a kernel costs) "
        f"{pair('zenflow_async_link_lion_torch')}, {pair('zenflow_async_link_sgd_torch')}, "
        f"{pair('zenflow_async_link_adam_torch')}: the fused kernels take a Lion step {fused['lion']} faster, SGD's "
        f"{fused['sgd']} and Adam's {fused['adam']} (the 1-minute load average was {load_before:.1f} before the run"
        + (f"; other processes took {result['record']['load']['other_processes_share_of_cores']:.0%} of the cores "
           "during it)." if "record" in result else ")."))


def overlap_section() -> str:
    """docs/benchmarks.md's table of gradients crossing during backward on the modeled device (``overlap_cpu.json``)."""
    result = load("overlap_cpu.json")
    rows = {(r["size"], r["bandwidth"], r["variant"]): r for r in result["rows"]}
    sizes = sorted({r["size"] for r in result["rows"]})
    slow = [rows[(n, "slow", "handover")] for n in sizes]
    share = [r["transfer_share_of_backward"] for r in slow]
    line = lambda label, cells: f"| {label} | " + " | ".join(cells) + " |"  # noqa: E731
    table = [line("model / fold job", [f"{n}x" for n in sizes]), "|---|" + "---|" * len(sizes),
             line("transfer per step (ms)", [f"{1e3 * r['transfer_s']:.1f}" for r in slow]),
             line("hand-over from hooks: added wall time / transfer", [f"{r['added_stall_share']:.2f}" for r in slow]),
             line("hand-over from hooks: added training-thread waits / transfer",
                  [f"{r['added_waits_share']:.2f}" for r in slow]),
             line("crossing at `step()` (`ablations.early_handover=False`): added wall time / transfer",
                  [f"{rows[(n, 'slow', 'at_step')]['added_stall_share']:.2f}" for n in sizes])]
    met = [n for n, r in zip(sizes, slow, strict=True) if r["added_stall_share"] <= 0.10]
    folds = [1e3 * r["fold_s"] for r in result["rows"] if r["variant"] == "handover"]
    head = ("**Overlap on the modeled device** ([`overlap_cpu.json`](../bench/results/overlap_cpu.json), "
            f"[`overlap_cpu.png`](../bench/results/overlap_cpu.png), `python -m bench.overlap`, {where(result)}): how "
            "much of a step's gradient transfer backward hides, with `testing.chaos` modeling the copies (bytes / "
            "bandwidth on the copy thread) and the fold jobs shrunk to 4 MiB so that fp32 MLPs of 1 M to 67 M "
            "parameters are 1x to 64x one, as a 7 B model is to the default 64 MiB. At a bandwidth where the "
            f"transfer takes {min(share):.0%}-{max(share):.0%} of backward (`slow`), each variant against itself "
            "without the model, paired step by step:")
    tail = ("The goal (added stall at most 10% of the transfer where backward is longer) is met at "
            f"{', '.join(f'{n}x' for n in met) if met else 'no size'}"
            f"{'' if len(met) == len(sizes) else ', not at ' + ', '.join(f'{n}x' for n in sizes if n not in met)}. "
            f"The folds of the landing area into the sums take {min(folds):.1f}-{max(folds):.0f} ms a step here "
            "(`fold_s`, on the accumulate worker, beside the next forward; the hooks waited for them "
            f"{max(1e3 * r['fold_wait_s'] for r in result['rows']):.1f} ms at most: `fold_wait_s`).")
    return "\n".join([head, "", "\n".join(table), "", tail])


def seam_section() -> str:
    """docs/benchmarks.md's AdamW-before-and-after sentences, from the two ``bench.seam_speed`` results."""
    def ratios(name: str) -> tuple[dict, str]:
        result = load(name)
        r = {k: v["head_over_base"] for k, v in result["summary"].items()}
        head = result["record"]["commit"][:7] if "record" in result else result["head"][:7]
        return r, (f"[`{name}`](../bench/results/{name}), {where(result)}, base {result['base']}, head {head}, the "
                   "two trees alternating")
    fused, fused_where = ratios("seam_speed_fused_rules.json")
    seam, seam_where = ratios("seam_speed.json")
    return (
        "AdamW before the fused kernels of the other rules and at the head named (`python -m bench.seam_speed "
        f"--base eb8e975 --rounds 3`, {fused_where}): the host kernel {fused['cpu_adam_ms_at_2^20']:.2f}x and "
        f"{fused['cpu_adam_ms_at_2^24']:.2f}x of the base's time at 2^20 and 2^24; `step()` "
        f"{fused['step_vs_foreach_at_150']:.2f}x and {fused['step_vs_foreach_at_600']:.2f}x of the base's ratio to "
        "torch's foreach AdamW measured beside it at 150 and 600 tensors (the raw step times moved by up to 2x "
        "between rounds on this machine, both trees alike, so only the side-by-side ratio is quoted). AdamW before "
        f"the rule seam and at the head named (`python -m bench.seam_speed --rounds 3`, {seam_where}): the host kernel "
        f"{seam['cpu_adam_ms_at_2^20']:.2f}x and {seam['cpu_adam_ms_at_2^24']:.2f}x of the base's time at 2^20 and "
        f"2^24; `step()` {seam['step_ms_at_150']:.2f}x and {seam['step_ms_at_600']:.2f}x of the base's time at 150 "
        f"and 600 tensors, and {seam['step_vs_foreach_at_150']:.2f}x and {seam['step_vs_foreach_at_600']:.2f}x of "
        "the base's ratio to torch's foreach AdamW measured beside it.")


def cpu_adam_section() -> str:
    """docs/benchmarks.md's host AdamW paragraph, from ``cpu_adam.json``."""
    result = load("cpu_adam.json")
    goals = result["goals"]
    size, threads = goals["size"], goals["threads"]
    rows = {(r["size"], r["threads"], r["candidate"]): r for r in result["adam"]}
    ours = {t: rows[(size, t, "zenflow")] for t in (1, 2) if (size, t, "zenflow") in rows}
    load_share = {t: r["other_processes_cpu_fraction"] for t, r in ours.items()}
    ds_per_tensor = rows.get((size, threads, "deepspeed"), {}).get("ratio_to_deepspeed_zenflow")
    separate_others = [goals[k]["measured"] for k in goals if k.startswith("fused_") and "zenflow_kernels" not in k
                       and "zenflow_zero_acc" not in k]
    separate_ours = [goals[k]["measured"] for k in ("fused_pipeline_vs_separate_zenflow_kernels",
                                                    "fused_zero_acc_vs_separate_zenflow_zero_acc") if k in goals]
    limit = goals["fused_pipeline_vs_separate_zenflow_kernels"]["memory_bound_limit"]
    exp = size.bit_length() - 1
    return (
        "**Kernels.** Host AdamW (`cpu_adam_`, [`cpu_adam.json`](../bench/results/cpu_adam.json), "
        f"{where(result)}): at 2^{exp} fp32 parameters and {threads} threads "
        f"{goals['adam_vs_roofline']['measured']:.2f}x the memory roofline, "
        f"{goals['adam_vs_deepspeed']['measured']:.2f}x DeepSpeed's CPU Adam and "
        f"{goals['adam_vs_torch_fused']['measured']:.2f}x torch's fused CPU AdamW "
        f"({ours[1]['ratio_to_torch_fused']:.2f}x on 1 thread), interleaved in one run (other processes took "
        f"{load_share.get(1, 0):.0%} of the cores during the 1-thread block and {load_share.get(2, 0):.0%} during the "
        "2-thread one; each row records it). Beside DeepSpeed's native multi-tensor ZenFlow CPU Adam (its `cpu_adam` "
        "extension's `zenflow_adam_*`: the host update of DeepSpeed ZenFlow's overlapped step, a pinned thread pool "
        "over one flat buffer, driven as its engine drives it), `cpu_adam_` is "
        f"{goals['adam_vs_deepspeed_zenflow_native']['measured']:.2f}x faster at 2^{exp} on {threads} threads, most "
        "of it bytes: DeepSpeed's pass also writes an fp32 snapshot of the weights (36 bytes per parameter against "
        "28), and with the same snapshot written by `cpu_adam_(out=...)` the ratio is "
        f"{goals['adam_out_fp32_vs_deepspeed_zenflow_native']['measured']:.2f}x at 2^{exp} ({threads} threads)."
        + (f" On this machine DeepSpeed's per-tensor `DeepSpeedCPUAdam` steps {ds_per_tensor:.1f}x faster than its "
           "native ZenFlow Adam." if ds_per_tensor else "")
        + " The fused update-boundary pipeline (last gradient + unscale + clip + AdamW + bf16 copy-out) is "
        f"{span(separate_others)} the same work done as separate torch/DeepSpeed passes ({span(separate_ours)} our "
        f"own kernels run as separate passes; the memory-bound limit of {limit:.2f}x assumes every separate pass at "
        "the roofline, and the separate unscale, a torch op, is not).")


def kernels_cpu_section() -> str:
    """docs/benchmarks.md's sentence on the CPU fast path, from ``kernels_cpu.json``."""
    result = load("kernels_cpu.json")
    rows = result["rows"]
    ours = [r for r in rows if r["op"] == "selective_adamw" and r["impl"] == "numba"]
    shapes = sorted({r["shape"] for r in ours}, key=lambda shape: [int(x) for x in shape.split("x")])
    fused = any("fused" in r["impl"] for r in rows if r["op"] == "selective_adamw")
    multi = next(r for r in rows if r["op"] == "multi_selective_adamw" and r["impl"] == "numba multi")
    selection = next(r for r in rows if r["op"] == "selection" and r["impl"] != "torch loop")
    return (
        f"The CPU fast path ([`kernels_cpu.json`](../bench/results/kernels_cpu.json), {where(result)}): numba "
        f"selective AdamW at `topk_ratio={result['topk_ratio']}`, {span([r['speedup_vs_deepspeed'] for r in ours])} "
        "DeepSpeed's gather / AdamW / scatter path with torch's `foreach` AdamW"
        + ("" if fused else " (the fused variant was not in this CPU run)")
        + f" for {shapes[0]} to {shapes[-1]} matrices (fp32, and bf16 with an fp32 master), and the multi-tensor "
        f"form over a {int(multi['shape'].split()[0])}-layer model's {multi['matrices']} matrices in one launch "
        f"{multi['speedup_vs_deepspeed']:.1f}x; on CPU, scores and top-k are the torch reference, and whole-model "
        f"selection runs at {selection['speedup_vs_torch']:.1f}x a plain torch loop (it runs once per epoch). The "
        "Triton kernels are timed only on a GPU.")


def cpu_rules_section() -> str:
    """docs/benchmarks.md's sentence on the rules' host kernels against the memory roofline (``cpu_rules.json``)."""
    result = load("cpu_rules.json")
    frac = {(r["size"], r["threads"], r["candidate"]): r["fraction_of_roofline"] for r in result["rows"]
            if "fraction_of_roofline" in r}
    sizes = sorted({size for size, _, _ in frac})
    top, mid = sizes[-1], sizes[-2]
    rules = ("lion", "sgd", "adam")
    at = lambda size, t: [frac[(size, t, rule)] for rule in rules]  # noqa: E731
    one, two = at(top, 1), at(top, 2)
    return (
        "**Update rules** (issue 41). Host kernels against an in-place read-modify-write pass over the same bytes "
        f"(`python -m bench.cpu_rules`, [`cpu_rules.json`](../bench/results/cpu_rules.json), {where(result)}; the "
        f"optimizer's use: sums from the fp32 accumulation buffer, zeroed, bf16 copy-out): at 2^{top.bit_length() - 1} "
        f"elements Lion {one[0]:.2f}x, SGD (momentum 0.9) {one[1]:.2f}x and Adam {one[2]:.2f}x of that roofline on one "
        f"thread, {two[0]:.2f}x, {two[1]:.2f}x and {two[2]:.2f}x on two; at 2^{mid.bit_length() - 1} "
        f"{span2(at(mid, 1))} on one thread, {span2(at(mid, 2))} on two (the 2^{sizes[0].bit_length() - 1} rows sit in "
        "L3).")


def span2(values) -> str:
    """A range of ratios to two decimals."""
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def fsdp2_section() -> str:
    """docs/benchmarks.md's FSDP2 table and the figures of the paragraph after it, from ``fsdp2_cpu.json``."""
    result = load("fsdp2_cpu.json")
    summary, comp, cfg = result["summary"], result["comparisons"], result["config"]
    steps = cfg["warmup"] + cfg["steps"]
    labels = {"one_zenflow": "one process, ZenFlowAdamW", "one_adamw": "one process, `torch.optim.AdamW(fused=True)`",
              "fsdp2_zenflow": "FSDP2, ZenFlowAdamW", "fsdp2_adamw": "FSDP2, AdamW",
              "fsdp2_offload_adamw": "FSDP2 + `CPUOffloadPolicy(pin_memory=False)`, AdamW"}
    calm = [summary[n]["calm_repeats"] for n in labels]
    mb = lambda b: f"{b / 1e6:.3g} MB"  # noqa: E731
    rows = [f"| run | steps/s | vs one process, same optimizer | `step()` | optimizer state per rank | loss after "
            f"{steps} steps |", "|---|---|---|---|---|---|"]
    for name, label in labels.items():
        r = summary[name]
        ratio = f"{comp[name]['steps_per_s_ratio_calm']:.2f}x" if name in comp else ""
        rows.append(f"| {label} | {r['steps_per_s_calm']:.1f} | {ratio} | {r['step_call_ms_calm']:.1f} ms | "
                    f"{mb(r['optimizer_state_bytes_per_rank'][0])} | {r['final_loss']:.4f} |")
    z = summary["fsdp2_zenflow"]
    coll = z["fsdp2_collectives"]
    inside = [coll["all-gather"]["ms_per_step_calm"] + coll["reduce-scatter"]["ms_per_step_calm"]
              for coll in (summary[n]["fsdp2_collectives"] for n in labels if n.startswith("fsdp2"))]
    longer = [summary[n]["step_ms_calm"] - summary[comp[n]["twin"]]["step_ms_calm"] for n in comp]
    scores = z["zenflow"]["collective_bytes_total"]["selection scores"]
    loss_diff = max(c["max_abs_loss_diff"] for c in comp.values())
    head = (f"**FSDP2** ([`fsdp2_cpu.json`](../bench/results/fsdp2_cpu.json), "
            f"[`fsdp2_cpu.png`](../bench/results/fsdp2_cpu.png), `python -m bench.fsdp2`, {where(result)}): the small "
            f"byte GPT from the same initial weights on the same global batches ({cfg['global_batch']} x "
            f"{cfg['model_size']['context']} bytes of standard-library source), {cfg['warmup']} + {cfg['steps']} "
            "steps, one process on 2 threads against `fully_shard` (each block and the root, a CPU gloo mesh) at 2 "
            f"ranks on 1 thread each; {len(labels)} configurations interleaved over {cfg['repeats']} rounds. Steps/s "
            "is 1 / the median step over the calm repeats, those during which the rest of the machine used at most "
            f"15% of the cores ({sum(calm)} of {len(labels) * cfg['repeats']} here).")
    after = (f"Per step FSDP2 itself all-gathers {mb(coll['all-gather']['bytes_per_step'])} "
             f"({coll['all-gather']['calls_per_step']:.0f} calls) and reduce-scatters "
             f"{mb(coll['reduce-scatter']['bytes_per_step'])} of fp32 gradients "
             f"({coll['reduce-scatter']['calls_per_step']:.0f} calls), whatever the optimizer, counted by shims around "
             f"`torch.distributed`'s collectives in each rank: {min(inside):.0f}-{max(inside):.0f} ms of a step is "
             f"spent inside those calls on gloo, against the {min(longer):.0f}-{max(longer):.0f} ms by which a 2-rank "
             "step is longer than a one-process step. ZenFlow adds an 8-byte all-reduce of the gradient norm a step "
             "(its non-finite check) and one all-reduce of the selection's column scores, "
             f"{scores / 1e3:.1f} KB for the run's one selection. Each FSDP2 run's loss is "
             f"within {sci(loss_diff)} of its one-process twin's at every step.")
    return "\n".join([head, "", "\n".join(rows), "", after])


def scale_section() -> str:
    """docs/benchmarks.md's scale paragraph, its table at the largest size and the per-tensor figures
    (``scale_cpu.json``)."""
    result = load("scale_cpu.json")
    runs = result["runs"]
    configs = ("overlap", "sync", "devacc")
    biggest = max(r["params"] for r in runs)
    at = {r["config"]: r for r in runs if r["params"] == biggest}
    mid_params = sorted({r["params"] for r in runs})[-2]
    mid = {r["config"]: r for r in runs if r["params"] == mid_params}
    top = at["overlap"]
    per_param = {c: at[c]["bytes_per_param"]["total"] for c in configs}
    ds = result["deepspeed_reference"]
    growth = result["growth"]
    roof = [at[c]["host_update"]["fraction_of_roofline_last"] for c in configs]
    ns = lambda c: growth[c]["mean_step"]["ns_per_param"]  # noqa: E731
    other = max(r["other_processes_cpu_fraction"] for r in runs)
    machine = (result.get("record") or result)["machine"]
    holds = machine["memory_gib"] * 2**30 / top["rss"]["peak_over_base_per_param"] / 1e6
    m = lambda n: f"{n / 1e6:.0f} M" if n >= 1e6 else f"{n / 1e3:.0f} K"  # noqa: E731
    intro = (
        f"**Scale** ([`scale_cpu.json`](../bench/results/scale_cpu.json), "
        f"[`scale_cpu.png`](../bench/results/scale_cpu.png), `python -m bench.scale`, {where(result)}): the optimizer "
        "alone on synthetic gradients of transformer-shaped parameter lists (bf16 matrices, fp32 norms), one process "
        f"per size and configuration, {min(r['params'] for r in runs) / 1e6:.1f} M to {m(biggest)} parameters (the "
        "default's sizes; what fits is below). Host buffers per parameter, as `host_bytes()` measures them: "
        f"{per_param['overlap']:.1f} with overlap and host accumulation, {per_param['sync']:.1f} without overlap, "
        f"{per_param['devacc']:.1f} with `device_accumulation` (DeepSpeed's ZeRO-Offload holds about "
        f"{ds['zero_offload']['bytes_per_param']}, its ZenFlow with overlap about "
        f"{ds['zenflow_overlap']['bytes_per_param']}: `deepspeed_reference` in the JSON lists the buffers counted in "
        f"DeepSpeed 0.19.8's code: {ds['zero_offload']['counted_in_deepspeed_0.19.8']['total_bf16_params']} and "
        f"{ds['zenflow_overlap']['counted_in_deepspeed_0.19.8']['total_bf16_params']} with the bf16 copy of the "
        f"partition each also allocates); RSS grew {top['rss']['growth_per_param']:.1f} bytes per parameter over a run "
        f"at {m(biggest)} (the buffers plus the fast path's {top['bytes_per_param']['fast_state']:.1f}, host memory on "
        f"CPU). The host update runs at {min(roof):.0%}-{max(roof):.0%} of this machine's measured memory roofline at "
        f"{m(biggest)} ({top['host_update']['bytes_per_element']} bytes moved per element); step time grows linearly "
        f"with the parameter count ({min(ns('overlap'), ns('sync')):.1f}-{max(ns('overlap'), ns('sync')):.1f} ns per "
        f"parameter a step on 2 cores with overlap or without, {ns('devacc'):.1f} with `device_accumulation`). The run "
        f"({result['total_s'] / 60:.1f} minutes, other processes under {other:.0%} of the cores in every run) at "
        f"{m(biggest)} ({top['size'].replace('x', ' x ')}, {top['tensors']} tensors):")
    cell = lambda c, f: f(at[c])  # noqa: E731
    row = lambda label, f: f"| {label} | " + " | ".join(cell(c, f) for c in configs) + " |"  # noqa: E731
    threads = lambda r: (f"{r['host_update']['last_s']:.2f} s ({r['host_threads']}"  # noqa: E731
                         f"{', fused' if r['host_update']['pattern'].startswith('fused') else ''}), "
                         f"{r['host_update']['fraction_of_roofline_last']:.2f}")
    table = [
        f"| {m(biggest)} parameters | overlap | no overlap | `device_accumulation` |", "|---|---|---|---|",
        row("host buffers, bytes per parameter", lambda r: f"{r['bytes_per_param']['total']:.1f}"
            + (f" + {r['bytes_per_param']['device_sums']:.1f} (the device-side sums: host memory on CPU)"
               if r["bytes_per_param"]["device_sums"] else "")),
        row("fast path's state (the selected columns)", lambda r: f"{r['bytes_per_param']['fast_state']:.1f}"),
        row("peak RSS, bytes per parameter (parameters and gradients: 4)",
            lambda r: f"{r['rss']['peak_per_param']:.1f}"),
        row("first `step()` (cold)", lambda r: f"{r['times']['cold_first_step_s']:.1f} s"),
        row("`step()` between update boundaries / at one",
            lambda r: f"{r['times']['between_boundaries_median_s']:.2f} / {r['times']['boundary_median_s']:.2f} s"),
        row("host update, alone (threads), fraction of the roofline", threads),
    ]
    between = [mid[c]["times"]["between_boundaries_median_s"] * 1e3 for c in ("overlap", "sync")]
    cold = [mid[c]["times"]["cold_first_step_s"] for c in configs]
    pt = result["per_tensor"]["summary"]
    after = (
        f"At {m(mid_params)} a step between boundaries takes {min(between):.0f}-{max(between):.0f} ms with overlap or "
        f"without: the fast path {mid['overlap']['fast_path_median_s'] * 1e3:.0f} ms, the rest one pass over the "
        "gradients for their norm and one adding them into the accumulation buffer. `device_accumulation` adds into "
        "its device-side sums with `torch._foreach_add_` (on a GPU a device kernel; on CPU "
        f"{mid['devacc']['times']['between_boundaries_median_s']:.2f} s a step between boundaries). The cold first "
        f"step ({min(cold):.1f}-{max(cold):.1f} s at {m(mid_params)} across configurations) lays out the host buffers "
        f"and zeroes them, writing every page, and makes the first selection. {m(biggest)} is the default's largest "
        f"size: at {top['rss']['peak_over_base_per_param']:.1f} bytes per parameter over the process's base this "
        f"machine's {machine['memory_gib']} GiB would hold about {round(holds, -2):.0f} M with nothing else running; "
        "`--sizes` takes others, and sizes that do not fit the free memory are skipped and listed. Per tensor "
        "(`step()` wall-clock medians over 300 interleaved steps, boundaries included, tiny tensors: alternating fp32 "
        "[64, 64] and [64]; `bench.step_overhead` above measures the training thread's CPU time between boundaries): "
        f"{pt['zenflow_cpu_link']['ms_at_150']:.2f} / {pt['zenflow_async_link']['ms_at_150']:.2f} ms at 150 tensors "
        "through the CPU link / the asynchronous one (`testing.chaos(seed=0, max_delay=0)`) against "
        f"`torch.optim.AdamW(foreach=True)`'s {pt['torch_adamw_foreach']['ms_at_150']:.2f} ms, "
        f"{pt['zenflow_cpu_link']['ms_at_300']:.2f} / {pt['zenflow_async_link']['ms_at_300']:.2f} against "
        f"{pt['torch_adamw_foreach']['ms_at_300']:.2f} ms at 300, {pt['zenflow_cpu_link']['us_per_tensor']:.0f}-"
        f"{pt['zenflow_async_link']['us_per_tensor']:.0f} us per additional tensor against torch's "
        f"{pt['torch_adamw_foreach']['us_per_tensor']:.0f}.")
    return "\n".join([intro, "", "\n".join(table), "", after])


def nvme_timeline_section() -> str:
    """docs/benchmarks.md's paragraph on ``device_accumulation``'s crossing on the modeled device
    (``nvme_timeline_cpu.json``)."""
    result = load("nvme_timeline_cpu.json")
    rows = {(r["variant"], r["bandwidth"], r["ratio"]): r for r in result["rows"]}
    lo, hi = sorted(result["config"]["ratios"])
    wait = lambda variant, ratio, key: rows[(variant, "slow", ratio)]["waits_per_interval_s"].get(key, 0.0)  # noqa: E731
    crossing = rows[("memory", "slow", lo)]["per_crossing_s"]
    disk = rows[("disk", "slow", lo)]
    pipe = {p["bandwidth"]: p for p in result["reader_pipeline"]}
    rate, slow = pipe["disk rate"], pipe["slow"]
    samples = [x for p in result["reader_pipeline"] for xs in p["seconds"].values() for x in xs]
    updates = [r["update_s"] for r in result["rows"] if r["variant"].startswith("disk")]
    every = min(rate["seconds"]["serial"]) > max(rate["seconds"]["beside"])
    fmt = lambda x: f"{x:.3f}".rstrip("0").rstrip(".") if x else "0"  # noqa: E731
    return (
        "**`device_accumulation`'s crossing on the modeled device** "
        "([`nvme_timeline_cpu.json`](../bench/results/nvme_timeline_cpu.json), "
        "[`nvme_timeline_cpu.png`](../bench/results/nvme_timeline_cpu.png), `python -m bench.nvme_timeline`, "
        f"{where(result)}): the once-per-interval crossing of the fp32 gradient sums (4 bytes per parameter) read like "
        f"a profiler trace. {result['params'] / 1e6:.0f} M parameters ({result['sums_bytes'] / 2**20:.0f} MiB of "
        "sums), "
        f"`update_interval` {result['interval']}, the device's forward and backward a sleep sized from the host update "
        f"on disk (S x compute = {lo:g} and {hi:g} of it), copies at {result['config']['pcie_bytes_per_s'] / 1e9:.0f} "
        f"GB/s and at `slow` (the crossing takes {result['config']['slow_share']:.0%} of the disk's update: "
        f"{crossing:.2f} s); every variant side by side in one run:\n\n"
        "- State in memory: the boundary step no longer waits for the crossing. The sums are zeroed behind their "
        "copies and only the next write into them waits. At `slow` the training thread waits for the sums "
        f"{fmt(wait('memory', lo, 'sums'))} s per interval (S x compute = {lo:g}) and "
        f"{fmt(wait('memory', hi, 'sums'))} "
        f"({hi:g}); with the former order (`ablations.sums_wait_at_boundary`), {fmt(wait('memory eager', lo, 'sums'))} "
        f"and {fmt(wait('memory eager', hi, 'sums'))} s, the whole crossing ({crossing:.3f} s). What stays at the "
        "boundary is the write-back of the weights the next forward needs "
        f"({wait('memory', lo, 'join'):.2f} s at `slow`).\n"
        "- State on disk: all of the fetch time is inside the host update job, none on the training thread; it waits "
        "only at the boundary that drains the update, for about `max(0, update - S x (compute + step))` "
        f"({wait('disk', lo, 'drain'):.2f} s measured, {disk['predicted_drain_s']:.2f} predicted at `slow`, {lo:g}; "
        f"{'none' if not wait('disk', hi, 'drain') else fmt(wait('disk', hi, 'drain')) + ' s'} at {hi:g}). The reader "
        "now starts a block's fetch before reading the block and waits for it after. The streamed pass alone "
        f"({rate['numel'] / 2**20:.0f} M elements, {rate['repeats']} interleaved rounds) with a link as slow as the "
        f"disk ({rate['fetch_model_s']:.2f} s of fetches, {rate['median_s']['no fetch']:.2f} s of pass without them): "
        f"{rate['median_s']['beside']:.3f} s against {rate['median_s']['serial']:.3f} s fetching after each read "
        f"({rate['serial_over_beside']:.2f}x"
        + ("; every serial sample above every beside one" if every else "") + "); at `slow` "
        f"({slow['fetch_model_s']:.2f} s of fetches) {slow['median_s']['beside']:.3f} against "
        f"{slow['median_s']['serial']:.3f} s ({slow['serial_over_beside']:.2f}x, inside this disk's noise: single "
        f"passes range from {min(samples):.2f} to {max(samples):.2f} s, and whole runs' updates from "
        f"{min(updates):.1f} to {max(updates):.1f} s for the same work). For a 7 B rank on a GPU node (28 GB of sums "
        "at ~25 GB/s, 1.1 s, against a 168 GB disk pass, ~28 s at 6 GB/s) the fetch is ~4% of the pass and this order "
        "hides it behind the reads: a prediction from the model, not measured on a GPU.")


def gpt_repeat_section() -> str:
    """docs/benchmarks.md's note on the byte GPT's ablation made on two CPUs (``quality_ablations_gpt.json`` and
    ``quality_ablations_gpt_xeon.json``): how far its shares move with the machine."""
    from bench import quality_ablations as qa

    table, again = ({s["variant"]: s for s in qa.summarise(load(name)["runs"])}
                    for name in ("quality_ablations_gpt.json", "quality_ablations_gpt_xeon.json"))
    common = [v for v in table if v in again]
    moved = {v: again[v]["recovered"] - table[v]["recovered"] for v in common}
    worst = max(common, key=lambda v: abs(moved[v]))
    picks = [v for v in ("base", "deepspeed", "lr_times_interval") if v in common]
    return (
        "The byte GPT's column depends on the CPU at three seeds. The same command on another machine "
        "([`quality_ablations_gpt_xeon.json`](../bench/results/quality_ablations_gpt_xeon.json), "
        f"{where(load('quality_ablations_gpt_xeon.json'))}; the table's run: "
        f"{where(load('quality_ablations_gpt.json'))}) moves the recovered shares by up to {abs(moved[worst]):.2f} "
        f"(`{worst}`): "
        + ", ".join(f"`{v}` {table[v]['recovered']:.2f} in the table against {again[v]['recovered']:.2f} (gap "
                    f"{again[v]['gap_vs_adamw']:+.4f})" for v in picks)
        + ". torch's kernels round by CPU, training carries that along, and single seeds' shares range from "
        f"{min(again[v]['recovered_range'][0] for v in common):.2f} to "
        f"{max(again[v]['recovered_range'][1] for v in common):.2f} on that machine, so read the byte GPT's shares as "
        "a ranking with wide error bars. The study's columns, made again on that machine "
        "([`quality_ablations_study.json`](../bench/results/quality_ablations_study.json)), agree with the table to "
        "its two decimals.")


SECTIONS = {"readme": (README, render), "e2e": (BENCHMARKS, e2e_section), "zero": (BENCHMARKS, zero_section),
            "gpt_repeat": (BENCHMARKS, gpt_repeat_section),
            "nvme_timeline": (BENCHMARKS, nvme_timeline_section),
            "scale": (BENCHMARKS, scale_section),
            "fsdp2": (BENCHMARKS, fsdp2_section),
            "cpu_rules": (BENCHMARKS, cpu_rules_section),
            "kernels_cpu": (BENCHMARKS, kernels_cpu_section),
            "cpu_adam": (BENCHMARKS, cpu_adam_section),
            "seam": (BENCHMARKS, seam_section),
            "overlap": (BENCHMARKS, overlap_section),
            "rules_step": (BENCHMARKS, rules_step_section),
            "step_overhead": (BENCHMARKS, step_overhead_section),
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
        indent = "  " if para.startswith("- ") else ""
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
