"""docs/benchmarks.md's quality sections. ``concentration``: the controlled study of quality against gradient
concentration (``studies/results/concentration_study.json``, ``python -m studies.concentration_study``). ``tuned``:
every variant at its own best learning rate (``studies/results/tuned_*.json``, ``python -m
studies.tuned_comparison``) and the time to target on a modeled machine (``time_to_target.json``, ``python -m
studies.time_to_target``). Every figure is computed here from those files (the findings by ``studies.findings``,
which notebooks/tuned_comparison.ipynb prints too)."""

from __future__ import annotations

from bench.results_text import load_study, lr_text, where

STUDIES = "studies/results"


def study_link(workload: str | None = None, name: str | None = None) -> str:
    """A link from docs/ to a file of the studies' results."""
    name = name or f"tuned_{workload}.json"
    return f"[`{name}`](../{STUDIES}/{name})"


def tuned_summaries() -> dict:
    from studies import findings

    return findings.load()


def at_most(share: float) -> str:
    """'at most 0.02', or 'under 0.01' where the figure would round to zero."""
    return "under 0.01" if share < 0.005 else f"at most {share:.2f}"


def tuned_section() -> str:
    """The tuned comparison: per workload, each main variant's final loss and steps to the target over tuned AdamW's
    with its best rate; the time to target on the modeled machine; the findings."""
    from studies import findings

    records = findings.load_results()
    summaries = {w: r["summary"] for w, r in records.items()}
    names = ["zenflow", "overlap", "deepspeed", "host_step_count", "reselect_state", "lr_times_interval",
             "topk0.05_ui2", "topk0.05_ui8", "topk0.25_ui2", "zenflow_lion", "zenflow_sgd"]
    lines = ["| variant | " + " | ".join(f"{w} ({summaries[w]['variants']['zenflow']['top10_share']:.2f})"
                                       for w in summaries) + " |", "|---|" + "---|" * len(summaries)]
    for name in names:
        cells = []
        for s in summaries.values():
            if name not in s["variants"]:
                cells.append("-")
                continue
            v = s["variants"][name]
            steps = findings.steps_ratio(s, name) if v["family"] == "adam" else None
            bound = v["steps_over_adamw_at_least"]
            reach = f"{steps:.2f}" if steps is not None else f">={bound:.2f}" if bound is not None else "-"
            cells.append(f"{v['final_over_adamw']['mean']:.2f} / {reach} / {v['lr_over_adamw']:.2g}x")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    adamw = ", ".join(f"{w} {lr_text(s['adamw_best_lr'])}" for w, s in summaries.items())
    ttt = load_study("time_to_target.json")
    tt_lines = []
    for key, t in ttt["tables"].items():
        rows = t["rows"]
        cells = [f"`{n}` {'>=' if rows[n]['at_least'] else ''}{rows[n]['time_vs_' + t['base']]:.2f}"
                 for n in ("offload", "zenflow", "overlap", "deepspeed", "lr_times_interval", "topk0.25_ui2")
                 if n in rows and rows[n]["time_vs_" + t["base"]] is not None]
        tt_lines.append(f"- {key}: " + ", ".join(cells))
    runs = sum(len(r["runs"]) for r in records.values())
    return "\n".join(
        [f"Cells: final held-out loss over tuned AdamW's (mean over 5 seeds, paired) / steps to the target over "
         "AdamW's (paired; `>=` where a seed did not reach it within the run: a lower bound) / the variant's best "
         "rate over "
         f"AdamW's. The header gives each workload's top-10% share. AdamW's best rates: {adamw}. {runs} runs in all "
         f"({', '.join(f'{study_link(w)} ({where(r)})' for w, r in records.items())})"
         # a --resume record is the summary's run: the training runs came from the log it read
         + ("; the records are of the summaries written with `--resume` from the runs' log, whose runs came from "
            "earlier commits and record none" if any("--resume" in r["record"]["command"] for r in records.values())
            else "") + ".", ""] + lines
        + ["", f"**Time to target on a modeled machine** ({study_link(name='time_to_target.json')}; "
           f"{ttt['assumption']}): the time to the target over AdamW's on the device, per workload and model:", ""]
        + tt_lines + ["", "What the sweeps show:", ""] + findings.lines(summaries))


def concentration_section() -> str:
    """The study's setup figures, its table (shares of the gradient's energy, recovered with and without overlap)
    and what it shows."""
    result = load_study("concentration_study.json")
    config, rows = result["config"], result["summary"]
    zen = config["zenflow"]
    halves = [r["adamw_end_over_half"] for r in rows]
    lr = lr_text(config["lr"])
    lines = [
        f"{config['steps']} steps at lr {lr} (AdamW still improving: its final held-out loss is "
        f"{min(halves):.2f}-{max(halves):.2f} of its loss at half the steps), `topk_ratio` {zen['topk_ratio']}, "
        f"`update_interval` {zen['update_interval']}, `select_interval` {zen['select_interval']}, "
        f"{len(config['seeds'])} seeds ({where(result)}). The share of AdamW's held-out improvement ZenFlow recovers "
        "at equal steps, with / without `overlap_step`:", "",
        "| exponent | top 1% | top 10% | selected | recovered, overlap | recovered, no overlap |",
        "|---|---|---|---|---|---|"]
    for r in rows:
        name = f"{r['alpha']:g}" + (" (flat)" if r["alpha"] == 0 else "")
        lines.append(f"| {name} | {r['top1_share']:.2f} | {r['top10_share']:.2f} | {r['selected_share']:.2f} | "
                     f"{r['zenflow_overlap_recovered']:.2f} | {r['zenflow_sync_recovered']:.2f} |")
    width = max(r[k][1] - r[k][0] for r in rows for k in ("zenflow_overlap_recovered_range",
                                                           "zenflow_sync_recovered_range"))
    flat = min(rows, key=lambda r: r["top10_share"])
    near = [r for r in rows if r["zenflow_overlap_recovered"] >= 0.98]
    overlap = max(abs(r["zenflow_overlap_recovered"] - r["zenflow_sync_recovered"]) for r in rows)
    gpt = tuned_summaries()["gpt_finetune"]["variants"]["zenflow"]
    lines += ["", (
        f"The seeds' range is within {max(width, 0.005):.2f} at every level. On this task ZenFlow recovers 0.98 or "
        f"more of AdamW's improvement once the top 10% of columns hold "
        f"{min(r['top10_share'] for r in near):.0%} of the gradient's energy, and "
        f"{flat['zenflow_overlap_recovered']:.2f} when the energy is flat; overlap costs {at_most(overlap)} here "
        f"(lr {lr}: a host update one interval stale moves the weights little). These shares are at one learning "
        "rate, below AdamW's best on this task; the tuned comparison below gives each variant its own. The byte "
        f"GPT fine-tuned there sits at the flat end ({gpt['top10_share']:.0%} of its energy in the top 10% of "
        f"columns, the mean over the selections of ZenFlow's runs at its best rate in {study_link('gpt_finetune')}).")]
    return "\n".join(lines)
