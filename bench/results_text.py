"""What the results sections (``bench/readme_results.py``) share: a committed result read, linked and described
(its machine and commit), and the number formats the docs use."""

from __future__ import annotations

import json
from pathlib import Path

from bench.harness import REPO, RESULTS_DIR

STUDIES_DIR = REPO / "studies" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS_DIR / name).read_text())


def load_study(name: str) -> dict:
    """A study's result (studies/results/: the concentration study, the DeepSpeed semantics replay)."""
    return json.loads((STUDIES_DIR / name).read_text())


def link(name: str, up: str = "") -> str:
    """A markdown link to a result, from README.md (``up=""``) or from docs/ (``up="../"``)."""
    return f"[`{Path(name).name}`]({up}bench/results/{name})"


def where(result: dict) -> str:
    """The run's machine and commit, from its record (or, for a result made before records, its machine entry)."""
    record = result.get("record")
    machine = (record or result)["machine"]
    commit = record["commit"][:7] if record else f"{result['machine'].get('git_commit')}, no record"
    cpu = machine["cpu"].replace("(R)", "").replace(" Processor", "").strip()
    detail = machine.get("cpu_detail")
    if detail:  # records from before cpu_detail name the model only
        l3 = detail["caches"].get("L3")
        cpu += " (" + ", ".join([f"{detail['mhz']} MHz"] + ([f"L3 {l3}"] if l3 else []) + [
            "AVX-512" if "avx512f" in detail["flags"] else "AVX2" if "avx2" in detail["flags"] else "no AVX2"]) + ")"
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


def span(values, digits: int = 1) -> str:
    """A range of ratios, ``lo-hix`` (one figure where both round alike) to ``digits`` decimals."""
    lo, hi = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def recovered(result: dict, run: str) -> float:
    """The share of AdamW's held-out improvement (from the pre-trained model's held-out loss, at equal steps) that
    ``run`` made: 1 is AdamW's, 0 none, negative worse than where it started."""
    start = result["pretrain"]["heldout_loss"]
    final = {r["name"]: r["final_heldout_loss"] for r in result["runs"]}
    return (start - final[run]) / (start - final["adamw"])
