"""The tuned comparison's findings as text, computed from its summaries (studies/results/tuned_*.json): what the
notebook (notebooks/tuned_comparison.ipynb) and docs/benchmarks.md print, so no figure in them is typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from studies.tuned_comparison import RESULTS

WORKLOADS = ("study_flat", "study_concentrated", "gpt_finetune", "gpt_classify")
LABELS = {"study_flat": "the MLP, flat gradient", "study_concentrated": "the MLP, concentrated gradient",
          "gpt_finetune": "the byte GPT fine-tuned on a new corpus", "gpt_classify": "the byte GPT given a new head"}
NOT_ZENFLOW = ("adamw", "offload")


def load_results(results: Path = RESULTS) -> dict:
    """Every workload's whole result file (summary, runs, record), by name."""
    return {w: json.loads((results / f"tuned_{w}.json").read_text()) for w in WORKLOADS}


def load(results: Path = RESULTS) -> dict:
    """Every workload's summary, by name."""
    return {w: r["summary"] for w, r in load_results(results).items()}


def final_ratio(summary: dict, name: str) -> dict:
    """The variant's final held-out loss over tuned AdamW's, paired by seed: mean, min and max over the seeds."""
    return summary["variants"][name]["final_over_adamw"]


def steps_ratio(summary: dict, name: str) -> float | None:
    """Steps to the target over AdamW's (paired by seed, mean), where every seed reached it; else None."""
    return summary["variants"][name]["steps_over_adamw"]["mean"]


def beats_adamw(summary: dict, name: str) -> bool:
    """Below tuned AdamW's mean final loss on every seed."""
    return final_ratio(summary, name)["max"] < 1.0


def wins_everywhere(summaries: dict, name: str, against: str = "zenflow") -> bool:
    """Lower mean final loss than ``against`` on every workload that ran both."""
    both = [s["variants"] for s in summaries.values() if name in s["variants"] and against in s["variants"]]
    return bool(both) and all(v[name]["final"]["mean"] < v[against]["final"]["mean"] for v in both)


def _fmt(r: dict) -> str:
    return f"{r['mean']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"


def _over(s: dict, name: str, base: str) -> float:
    return s["variants"][name]["final"]["mean"] / s["variants"][base]["final"]["mean"]


def lines(summaries: dict) -> list[str]:
    out = []
    for w, s in summaries.items():
        v = s["variants"]
        z, st, bound = final_ratio(s, "zenflow"), steps_ratio(s, "zenflow"), v["zenflow"]["steps_over_adamw_at_least"]
        reach = (f"{st:.2f}x AdamW's steps to its 75% target" if st is not None else
                 f"AdamW's 75% target in {v['zenflow']['reached']} of {v['zenflow']['seeds']} seeds within the run"
                 + (f" (at least {bound:.2f}x AdamW's steps)" if bound is not None else ""))
        gain = 1 - v["adamw"]["final"]["mean"] / s["initial_heldout"]
        accuracy = v["adamw"].get("metrics", {}).get("accuracy")
        weak = (f" AdamW itself improves the held-out loss by only {gain:.1%} here"
                + (f" (accuracy {accuracy['mean']:.2f}, chance 0.125)" if accuracy else "")
                + ": differences this small are within the seeds' noise." if gain < 0.03 else "")
        best = min((n for n in v if v[n]["family"] == "adam" and n not in NOT_ZENFLOW),
                   key=lambda n: final_ratio(s, n)["mean"])  # the paired ratio the sentence prints
        out.append(f"- **{LABELS.get(w, w)}** (top-10% share {v['zenflow']['top10_share']:.2f}): ZenFlow's base "
                   f"setting ends at {_fmt(z)} tuned AdamW's final loss, {reach}; their best rate is "
                   f"{v['zenflow']['lr_over_adamw']:.2g}x AdamW's. The best ZenFlow variant there is `{best}` "
                   f"({_fmt(final_ratio(s, best))}, at {v[best]['lr_over_adamw']:.2g}x AdamW's rate).{weak}")
    adam = sorted({n for s in summaries.values() for n, v in s["variants"].items()
                   if v["family"] == "adam" and n not in NOT_ZENFLOW})
    winners = [n for n in adam if any(n in s["variants"] and beats_adamw(s, n) for s in summaries.values())]
    out.append("- **Better than tuned AdamW on every seed:** " + (
        ", ".join(f"`{n}` on " + ", ".join(w for w, s in summaries.items() if n in s["variants"] and beats_adamw(s, n))
                  for n in winners) if winners else "no ZenFlow variant of AdamW, on any workload") + ".")
    everywhere = [n for n in adam if n != "zenflow" and wins_everywhere(summaries, n)
                  and sum(n in t["variants"] for t in summaries.values()) == len(summaries)]
    out.append("- **Better than the base setting on every workload:** " + (", ".join(
        f"`{n}` (" + ", ".join(f"{final_ratio(s, n)['mean']:.3f}x against {final_ratio(s, 'zenflow')['mean']:.3f}x"
                               for s in summaries.values()) + ")" for n in everywhere) if everywhere else "none")
        + ", each as final loss over tuned AdamW's.")
    for name in ("deepspeed", "lr_times_interval", "host_step_count", "overlap"):
        ratios = [f"{w} {final_ratio(s, name)['mean']:.2f}x (rate {s['variants'][name]['lr_over_adamw']:.2g}x)"
                  for w, s in summaries.items() if name in s["variants"]]
        verdict = "beats" if wins_everywhere(summaries, name) else "does not beat"
        out.append(f"- `{name}` {verdict} the base setting on every workload: final loss over tuned AdamW's "
                   + ", ".join(ratios) + ".")
    stored = [f"{w} {_over(s, 'bf16_nearest', 'zenflow'):.3f}x and {_over(s, 'bf16_stochastic', 'zenflow'):.3f}x"
              for w, s in summaries.items() if {"bf16_nearest", "bf16_stochastic"} <= set(s["variants"])]
    if stored:
        out.append("- The host moments in bf16, rounded to nearest and stochastically (ZenFlow's base setting "
                   "otherwise, each at its own best rate), over the fp32 base setting's final loss: "
                   + ", ".join(stored) + ".")
    for plain in ("lion", "sgd"):
        ratios = [f"{w} {_over(s, f'zenflow_{plain}', plain):.2f}x" for w, s in summaries.items()
                  if f"zenflow_{plain}" in s["variants"]]
        out.append(f"- ZenFlow's {plain} over plain {plain}'s final loss, each tuned: " + ", ".join(ratios) + ".")
    return out


def markdown(summaries: dict) -> str:
    return "\n".join(lines(summaries))


if __name__ == "__main__":
    print(markdown(load()))
