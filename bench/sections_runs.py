"""The results sections of docs/benchmarks.md on whole runs: the demo and its variants, ZeRO, FSDP2, the gradients'
crossing and device_accumulation's on the modeled device, and the byte GPT's ablation on two CPUs
(``bench/readme_results.py`` writes them into the page)."""

from __future__ import annotations

from bench.results_text import link, load, lr_text, recovered, sci, where


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
    cfg = demo["config"]
    zen_label = (f"ZenFlowAdamW (`topk_ratio={cfg['topk_ratio']:g}`, `update_interval={cfg['update_interval']}`, "
                 f"{'overlap' if cfg['overlap'] else 'no overlap'})")
    for name, label in (("offload", "sync offload"), ("zenflow", zen_label)):
        c, r = per_run[name], runs[name]
        gap = c["heldout_gap_vs_adamw_equal_steps"]
        rows.append(f"| {label} | {c['steps_per_s_vs_adamw']:.2f}x | {c['stall_pct']:.1f} | {r['host_updates']} | "
                    f"{gap:+.4f} ({gap / adamw_loss:+.1%}) |")
    start = variants["pretrain"]["heldout_loss"]
    vr = {r["name"]: r for r in variants["runs"]}
    l3 = {r["name"]: r for r in lr3["runs"]}
    l3_start = lr3["pretrain"]["heldout_loss"]
    gain = lambda runs_, name, s0: s0 - runs_[name]["final_heldout_loss"]  # noqa: E731
    gap = lambda runs_, name: runs_[name]["final_heldout_loss"] - runs_["adamw"]["final_heldout_loss"]  # noqa: E731
    over = l3["zenflow"]["final_heldout_loss"] - l3_start
    lr3_overlap = (f"**ZenFlow with overlap ends above the start** ({l3['zenflow']['final_heldout_loss']:.4f} against "
                   f"{l3_start:.4f}; AdamW {l3['adamw']['final_heldout_loss']:.4f})" if over > 0 else
                   f"ZenFlow with overlap improves it by only {-over:.4f}, **{recovered(lr3, 'zenflow'):.0%}**")
    d_start = demo["pretrain"]["heldout_loss"]
    demo_text = ("**The demo's own run** is at the tuned comparison's pick "
                 "([`tuned_gpt_finetune.json`](../studies/results/tuned_gpt_finetune.json), tiny model): lr "
                 f"{lr_text(cfg['lr'])}, each run's own best there, and ZenFlow at `topk_ratio` "
                 f"{cfg['topk_ratio']:g} with `update_interval` {cfg['update_interval']}, the one setting that beat "
                 f"the defaults on all four workloads. From the pre-trained {d_start:.4f} nats/byte AdamW improves by "
                 f"{gain(runs, 'adamw', d_start):.4f} and ZenFlow by {gain(runs, 'zenflow', d_start):.4f}, "
                 f"**{recovered(demo, 'zenflow'):.0%} of AdamW's improvement** at equal steps. " + to_target_text(demo))
    meaning = (f"**What the held-out numbers mean, at bench/e2e.py's defaults** "
               f"({link('e2e_variants.json', '../')}: lr "
               f"{lr_text(variants['config']['lr'])}, `topk_ratio` {variants['config']['topk_ratio']:g}, "
               f"`update_interval` {variants['config']['update_interval']}). The pre-trained start is at {start:.4f} "
               f"nats/byte. AdamW improves it by {gain(vr, 'adamw', start):.4f}; ZenFlow with overlap by "
               f"{gain(vr, 'zenflow_pt1', start):.4f}, **{recovered(variants, 'zenflow_pt1'):.0%} of AdamW's "
               f"improvement**, and without overlap by {gain(vr, 'zenflow_nooverlap', start):.4f}, "
               f"{recovered(variants, 'zenflow_nooverlap'):.0%}. At lr {lr_text(lr3['config']['lr'])} "
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
             + ("(loaded from `data/e2e/`, where an earlier run left it), then " if demo["pretrain"]["cached"] else
                f"({demo['pretrain']['seconds']:.0f} s in the recorded run; cached in `data/e2e/` for the next), then ")
             + f"fine-tuned for {demo['config']['steps']} steps on 400 KB of its packages, three ways, on "
             f"{demo['config']['threads']} torch threads; the held-out loss is on 100 KB of other package files. "
             f"{demo['total_s']:.0f} s in all in the recorded run (`total_s`), pre-training "
             f"{'not ' if demo['pretrain']['cached'] else ''}included. The baseline is "
             "`torch.optim.AdamW(fused=True)` (torch 2.13 has fused AdamW on CPU).")
    return "\n".join([intro, "", "\n".join(rows), "", demo_text, "", meaning, "", "\n".join(goals), "", base_text])


def to_target_text(demo: dict) -> str:
    """The demo's time to AdamW's loss at 75% of its steps: CPU seconds here, modeled seconds on the profile."""
    t = demo["to_target"]
    runs = t["runs"]
    names = [("zenflow", "ZenFlow"), ("offload", "sync offload"), ("adamw", "AdamW")]
    cpu = ", ".join(f"{label} {runs[n]['cpu_s']:.1f} s" if runs[n]["steps"] is not None else
                    f"{label} not within the run" for n, label in names)
    modeled = ", ".join(f"{label} {runs[n]['modeled_s']:.0f} s" for n, label in names
                        if runs[n]["modeled_s"] is not None)
    return (f"To AdamW's held-out loss at {t['target_at']:.0%} of its steps ({t['target']:.4f}): {cpu} on this CPU; "
            f"**modeled** for a {t['model']} model on the H200 profile of `studies/time_to_target.py` (its "
            f"assumptions: the steps carry over, the device's, link's and host's speeds partly assumed): {modeled}.")


def zero_section() -> str:
    """docs/benchmarks.md's ZeRO paragraph, from ``zero_cpu.json``."""
    result = load("zero_cpu.json")
    one, two = result["summary"]["1"], result["summary"]["2"]
    per_step = two["collective_bytes_per_step"]
    # bench.zero divides each kind's bytes by every step it ran, warm-up included
    steps, warmup = result["config"]["steps"], result["config"]["warmup"]
    mb = lambda b: f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.0f} KB"  # noqa: E731
    held = two["gradient_elements_held_per_rank"]
    return (
        "**ZeRO** ([`zero_cpu.json`](../bench/results/zero_cpu.json), `python -m bench.zero`; "
        f"{where(result)}): the small byte GPT at ZeRO-{result['config']['stage']}, the same global batch, 1 rank on "
        f"{one['torch_threads_per_rank']} threads against 2 ranks on {two['torch_threads_per_rank']} thread each: "
        f"{one['steps_per_s_median']:.2f} and {two['steps_per_s_median']:.2f} steps/s "
        f"({two['steps_per_s_vs_first_world']:.2f}x; one machine's two cores either way), host state per rank "
        f"{one['host_state_bytes_per_rank'][0] / 1e6:.1f} MB against "
        f"{' and '.join(f'{b / 1e6:.1f}' for b in two['host_state_bytes_per_rank'])} MB; a step on average "
        f"{mb(per_step['gradients'])} of matrix gradients reduced to their owners, {mb(per_step['selected columns'])} "
        f"of selected columns, {mb(per_step['write-back'])} of write-back, and "
        f"{mb(per_step['selection scores'] * (steps + warmup))} of selection scores over the whole run "
        f"({steps + warmup} steps: {warmup} of warm-up, {steps} timed). Gradient elements a rank holds once "
        "backward is done (measured, the most over the run): 1 "
        f"rank, all {one['gradient_elements_held_per_rank'][0]['grad']:,} in `.grad`; 2 ranks, {held[0]['grad']:,} in "
        f"`.grad` (the vectors), its own range's sums ({held[0]['own']:,} and {held[1]['own']:,}) and the other "
        "rank's bucket while its reduction is in flight (this small model has one bucket per owner; buckets are at "
        "most 8 M elements). Scaling across machines or GPUs is not measurable here; the same command runs on a "
        "multi-GPU machine (NCCL, one GPU per rank).")


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
             line("crossing at `step()` (`orderings.early_handover=False`): added wall time / transfer",
                  [f"{rows[(n, 'slow', 'at_step')]['added_stall_share']:.2f}" for n in sizes])]
    met = [n for n, r in zip(sizes, slow, strict=True) if r["added_stall_share"] <= 0.10]
    folds = [1e3 * r["fold_s"] for r in result["rows"] if r["variant"] == "handover"]
    head = ("**Overlap on the modeled device** ([`overlap_cpu.json`](../bench/results/overlap_cpu.json), "
            f"[`overlap_cpu.png`](../bench/results/overlap_cpu.png), `python -m bench.overlap`, {where(result)}): how "
            "much of a step's gradient transfer backward hides, with `testing.chaos` modeling the copies (bytes / "
            "bandwidth on the copy thread) and the fold jobs shrunk to 4 MiB so that fp32 MLPs of 1 M to 67 M "
            "parameters are 1x to 64x one, as a large model is many times the default 64 MiB (a 7 B model's bf16 "
            "gradient is about 200 of them). At a bandwidth where the "
            f"transfer takes {min(share):.0%}-{max(share):.0%} of backward (`slow`), each variant against itself "
            "without the model, paired step by step:")
    tail = ("The goal (added stall at most 10% of the transfer where backward is longer) is met at "
            f"{', '.join(f'{n}x' for n in met) if met else 'no size'}"
            f"{'' if len(met) == len(sizes) else ', not at ' + ', '.join(f'{n}x' for n in sizes if n not in met)}. "
            f"The folds of the landing area into the sums take {min(folds):.1f}-{max(folds):.0f} ms a step here "
            "(`fold_s`, on the accumulate worker, beside the next forward; the hooks waited for them "
            f"{max(1e3 * r['fold_wait_s'] for r in result['rows']):.1f} ms at most: `fold_wait_s`).")
    return "\n".join([head, "", "\n".join(table), "", tail])


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
    rows = [f"| run | steps/s | vs one process, same optimizer | `step()` | optimizer state per rank | loss, mean of "
            f"steps {steps - 3}-{steps} |", "|---|---|---|---|---|---|"]
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
        f"({hi:g}); with the former order (`orderings.sums_wait_at_boundary`), {fmt(wait('memory eager', lo, 'sums'))} "
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
