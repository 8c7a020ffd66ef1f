"""The tables of measured results in README.md and docs/*.md, each rendered from the JSON it names
(``python -m tools.docs_results`` writes them between their markers; ``--check`` compares)."""

from __future__ import annotations

from tools.docs_results import REPO, link, load, source, table, where  # noqa: F401

README = REPO / "README.md"
DOCS = REPO / "docs"


# -- README.md -----------------------------------------------------------------------------------------------------

def readme() -> str:
    return _old('readme')


# -- docs/benchmarks.md: kernels and host passes ------------------------------------------------------------------

def kernels_gpu() -> str:
    return _old('kernels_gpu')


def step_overhead() -> str:
    return _old('step_overhead')


def rules_step() -> str:
    return _old('rules_step')


def seam() -> str:
    return _old('seam')


def cpu_adam() -> str:
    return _old('cpu_adam')


def kernels_cpu() -> str:
    return _old('kernels_cpu')


def cpu_rules() -> str:
    return _old('cpu_rules')


def stochastic_rounding() -> str:
    return _old('stochastic_rounding')


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


def nvme_timeline() -> str:
    r = load("nvme_timeline_cpu.json")
    rows = [[f"`{x['variant']}`", f"{x['ratio']:g}", f"{x['update_s']:.2f}", f"{x['per_crossing_s']:.3f}",
             f"{x['crossing_inside_update_share']:.0%}",
             *(f"{x['waits_per_interval_s'].get(k, 0.0):.3f}" for k in ("sums", "join", "drain")),
             f"{x['predicted_drain_s']:.3f}"]
            for x in r["rows"] if x["bandwidth"] == "slow"]
    pipe = [[p["bandwidth"], f"{p['fetch_model_s']:.2f}", *(f"{p['median_s'][k]:.3f}" for k in
                                                             ("no fetch", "beside", "serial")),
             f"{p['serial_over_beside']:.2f}x",
             "yes" if min(p["seconds"]["serial"]) > max(p["seconds"]["beside"]) else "no",
             f"{min(min(v) for v in p['seconds'].values()):.2f}-{max(max(v) for v in p['seconds'].values()):.2f}"]
            for p in r["reader_pipeline"]]
    return "\n\n".join([source("nvme_timeline_cpu.json"), table(
        ["variant, at `slow`", "S x compute / update on disk", "host update, s", "crossing, s",
         "share of the crossing during the host update", "training thread's waits per interval, s: `sums`", "`join`",
         "drain", "drain predicted, s"], rows), table(
        [f"streamed pass alone ({r['reader_pipeline'][0]['numel'] / 2**20:.0f} M elements), link",
         "fetches alone (modeled), s", "pass without fetches, s", "fetch beside the read, s",
         "fetch after each read, s", "after / beside", "every after sample above every beside one",
         "single passes, s"], pipe)])


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

def deepspeed_choices() -> str:
    return _old('deepspeed_choices')


def deepspeed_rounding() -> str:
    return _old('deepspeed_rounding')


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
