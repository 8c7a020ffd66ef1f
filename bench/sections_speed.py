"""The results sections of docs/benchmarks.md on speed: the host kernels (cpu_adam, cpu_rules, kernels_cpu),
step()'s own cost and the rules' device step, AdamW before and after the rule seam, and the optimizer at scale
(``bench/readme_results.py`` writes them into the page)."""

from __future__ import annotations

from bench.results_text import load, span, where


def step_overhead_section() -> str:
    """docs/benchmarks.md's paragraph on step()'s own cost and the two multi-tensor host passes."""
    result = load("step_overhead_cpu.json")
    cpu = {name: c["cpu"] for name, c in result["summary"].items() if name != "goal"}
    vs = lambda name, n: f"{cpu[name][f'vs_torch_adamw_foreach_at_{n}']:.2f}x"  # noqa: E731
    wall = result["summary"]["zenflow_async_link"]["wall"]["vs_torch_adamw_foreach_at_150"]
    limits = result["summary"]["goal"]["limits"]
    goal = " and ".join(f"{v}x at {k}" for k, v in limits.items()) + (
        ", met" if result["summary"]["goal"]["met"] else ", missed")
    if not result["summary"]["goal"]["met"]:
        name = "seam_speed_vs_89d3e24.json"
        side = load(name)
        ratio = lambda n, tree: side["summary"][f"step_vs_foreach_at_{n}"][tree]  # noqa: E731
        goal += (f"; the same ratio for {side['base']} and for {side['record']['commit'][:7]} side by side "
                 f"([`{name}`](../bench/results/{name}), {where(side)}, {side['rounds']} rounds): "
                 f"{ratio(150, 'base'):.2f}x and {ratio(150, 'head'):.2f}x at 150, {ratio(600, 'base'):.2f}x and "
                 f"{ratio(600, 'head'):.2f}x at 600, "
                 + ("so the miss is this machine's, not a slower step()"
                    if all(ratio(n, "head") <= 1.05 * ratio(n, "base") for n in (150, 600))
                    else "so step() is slower than at that commit"))
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
           "during it)." if "record" in result else ").")
        + _custom_rules_step(pair, cpu))


def _custom_rules_step(pair, cpu: dict) -> str:
    """The rules of one's own in ``step_overhead_rules_cpu.json``, where the run had them (empty otherwise)."""
    names = ("rmsprop_compiled", "rmsprop_eager", "ademamix_compiled", "from_torch_rmsprop")
    if not all(f"zenflow_async_link_{name}" in cpu for name in names):
        return ""
    p = {name: pair(f"zenflow_async_link_{name}") for name in names}
    return (" Rules of one's own, a plain-torch `step_` and no kernel (`bench/custom_rules.py`), their device step "
            f"compiled by Inductor: RMSprop {p['rmsprop_compiled']} (eager, `compile=False`: "
            f"{p['rmsprop_eager']}), an AdEMAMix without schedulers (three state tensors) {p['ademamix_compiled']}, "
            f"`rules.from_torch(torch.optim.RMSprop)` {p['from_torch_rmsprop']}.")


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
    seam_rounds = load("seam_speed.json")["rounds"]
    runs = load("seam_speed_fused_rules.json")["runs"]
    # the largest spread of one raw step time across rounds, either tree: why only ratios are quoted
    spread = max(max(r[k] for r in runs[tree]) / min(r[k] for r in runs[tree])
                 for tree in runs for k in runs[tree][0] if k.startswith("step_ms_"))
    return (
        "AdamW before the fused kernels of the other rules and at the head named (`python -m bench.seam_speed "
        f"--base eb8e975 --rounds 3`, {fused_where}): the host kernel {fused['cpu_adam_ms_at_2^20']:.2f}x and "
        f"{fused['cpu_adam_ms_at_2^24']:.2f}x of the base's time at 2^20 and 2^24; `step()` "
        f"{fused['step_vs_foreach_at_150']:.2f}x and {fused['step_vs_foreach_at_600']:.2f}x of the base's ratio to "
        "torch's foreach AdamW measured beside it at 150 and 600 tensors (a raw step time moved by up to "
        f"{spread:.2f}x between rounds of one tree; the side-by-side ratio is what is quoted). AdamW before "
        f"the rule seam and at the head named (`python -m bench.seam_speed --rounds {seam_rounds}`, {seam_where}): the "
        "host kernel "
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
        "DeepSpeed's gather / AdamW / scatter path with torch's AdamW as it runs on CPU by default, the per-tensor "
        "loop (`bench/kernels.py` asks for `foreach` on CUDA only)"
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
        f"{span(at(mid, 1), 2)} on one thread, {span(at(mid, 2), 2)} on two (the 2^{sizes[0].bit_length() - 1} rows "
        "sit in L3)." + _custom_rules_host(result, top))


def _custom_rules_host(result: dict, size: int) -> str:
    """The compiled rules of one's own in ``cpu_rules.json`` at ``size``, where the run had them (empty otherwise)."""
    rows = {(r["threads"], r["candidate"]): r for r in result["rows"] if r["size"] == size}
    names = ("rmsprop_compiled", "rmsprop_eager", "ademamix_compiled", "from_torch_rmsprop")
    threads = sorted({k for k, _ in rows})
    if not all((k, name) in rows for k in threads for name in names):
        return ""
    frac = {name: " and ".join(f"{rows[k, name]['fraction_of_roofline']:.2f}x" for k in threads) for name in names}
    lion = " and ".join(f"{rows[k, 'rmsprop_compiled']['vs_lion']:.2f}x" for k in threads)
    on = " and ".join(str(k) for k in threads)
    fallback = [name for name in names if rows[threads[-1], name]["rule_path"] not in ("compiled", "eager")]
    return (" Rules of one's own, a plain-torch `step_` and no kernel (`bench/custom_rules.py`), their host pass "
            f"compiled by Inductor, in the same run at 2^{size.bit_length() - 1} on {on} threads: RMSprop "
            f"{frac['rmsprop_compiled']} of its roofline ({lion} Lion's time), eager (`compile=False`) "
            f"{frac['rmsprop_eager']}; an AdEMAMix without schedulers (three state tensors, 42 bytes per element) "
            f"{frac['ademamix_compiled']}; `rules.from_torch(torch.optim.RMSprop)` {frac['from_torch_rmsprop']}"
            + (f" ({', '.join(fallback)}: calls {', '.join(rows[threads[-1], n]['rule_path'] for n in fallback)}, "
               "a fall-back to eager after recompiles)" if fallback else "")
            + ".")


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
    # 1f58ea0 (2026-12-04T19:02Z) changed what a step reads: per-tensor times recorded before it are not today's
    stale = result["record"]["started_utc"] < "2026-12-04T19:02:50Z"
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
        f"{pt['torch_adamw_foreach']['us_per_tensor']:.0f}"
        + (" (recorded before 1f58ea0 changed what `step()` reads, so these per-tensor times are not this version's; "
           "`bench.step_overhead` above is)." if stale else "."))
    return "\n".join([intro, "", "\n".join(table), "", after])


def stochastic_rounding_section() -> str:
    """docs/benchmarks.md's sentence on the cost of stochastic rounding in the host Adam pass (``stochastic_rounding.
    json``)."""
    result = load("stochastic_rounding.json")
    rows = {(r["size"], r["threads"], r["candidate"]): r for r in result["rows"]}
    size = max(n for n, _, _ in rows)
    threads = sorted({t for n, t, _ in rows if n == size})
    cost = " and ".join(f"{rows[size, t, 'bf16_stochastic']['vs_bf16_nearest']:.2f}x" for t in threads)
    fp32 = " and ".join(f"{rows[size, t, 'fp32']['vs_bf16_nearest']:.2f}x" for t in threads)
    return ("**bf16 host state, rounded stochastically** (`python -m bench.stochastic_rounding`, "
            f"[`stochastic_rounding.json`](../bench/results/stochastic_rounding.json), {where(result)}): the host Adam "
            f"pass as the optimizer calls it, at 2^{size.bit_length() - 1} parameters, took {cost} the time of the "
            f"same pass rounding to nearest on {' and '.join(map(str, threads))} thread(s) (the median of per-round "
            f"ratios, interleaved); the pass with fp32 moments took {fp32} of it: on this CPU bf16 state saves host "
            "memory (4 bytes a parameter for AdamW), not time.")
