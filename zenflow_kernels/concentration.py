"""Gradient concentration: how much of a gradient's energy its few largest columns hold (ZenFlow's premise).

ZenFlow updates only the top ``topk_ratio`` of each matrix's columns at every step and the rest at update
boundaries, with their interval's mean gradient. That costs little when a few columns carry most of the gradient's
energy (DeepSpeed's ZenFlow blog reports more than 85-90% of the L2 energy in the top 1% of channels when fine-tuning
LLMs) and much when the energy is spread evenly. This module measures it from the per-column squared L2 norms the
selection computes anyway (``importance="l2"``, the default; other importances score the columns a second time, in
l2, at each selection):

* ``top1`` / ``top10``: the share of the energy in the 1% / 10% of each matrix's columns that hold the most
  (at least one column), summed over the matrices and divided by their total energy;
* ``selected``: the share in the columns ZenFlow selected;
* per matrix, the same three shares.

``gradient_concentration(energies, selected)`` computes them (one device sync for all matrices); the optimizer records
them at every selection (``stats()["concentration"]``) and :func:`concentration_report` says what they imply.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SHARES", "PREMISE_TOP10", "gradient_concentration", "concentration_report"]

SHARES = {"top1": 0.01, "top10": 0.10}
"""The column fractions measured: name -> fraction of each matrix's columns (at least one column)."""

PREMISE_TOP10 = 0.85
"""The top-10% energy share from which the premise counts as met (the blog's LLM fine-tuning figure, 85-90% in the
top 1%, is stricter; a gradient this concentrated leaves the unselected columns little to carry)."""

SPREAD_TOP10 = 0.5
"""Below this top-10% share the energy counts as spread: the unselected columns carry most of the gradient."""


def top_count(columns: int, fraction: float) -> int:
    """The number of columns ``fraction`` of ``columns`` means: rounded up, at least one (zero for no columns)."""
    return min(columns, max(1, math.ceil(fraction * columns))) if columns else 0


def gradient_concentration(energies: list[torch.Tensor], selected: list[torch.Tensor | None] | None = None) -> dict:
    """The energy shares of ``energies`` (each matrix's per-column squared L2 norms, fp32, [C]) and of the
    ``selected`` columns (int64 indices per matrix, or None), as floats: ``{"top1", "top10", "selected",
    "per_matrix": [{"top1", "top10", "selected", "energy"}, ...]}`` (``selected`` None where no selection is given;
    a share is NaN where the energy is 0)."""
    if not energies:
        return {name: float("nan") for name in (*SHARES, "selected")} | {"per_matrix": []}
    selected = [None] * len(energies) if selected is None else selected
    rows = []
    for e, sel in zip(energies, selected, strict=True):
        e = e.float()
        C = e.numel()
        parts = [torch.topk(e, top_count(C, f), sorted=False).values.sum() if C else e.new_zeros(())
                 for f in SHARES.values()]
        parts.append(e[sel].sum() if sel is not None and sel.numel() else e.new_zeros(()))
        parts.append(e.sum())
        rows.append(torch.stack(parts))
    table = torch.stack(rows).double().tolist()  # one device sync for every matrix

    def share(part: float, total: float) -> float:
        return part / total if total > 0 else float("nan")

    names = (*SHARES, "selected")
    has_selection = [s is not None for s in selected]
    per_matrix = [{**{n: share(row[k], row[-1]) for k, n in enumerate(names)}, "energy": row[-1]} for row in table]
    for m, given in zip(per_matrix, has_selection, strict=True):
        if not given:
            m["selected"] = float("nan")
    total = sum(row[-1] for row in table)
    out = {n: share(sum(row[k] for row in table), total) for k, n in enumerate(names)}
    if not all(has_selection):
        out["selected"] = float("nan")
    return out | {"per_matrix": per_matrix}


def verdict(top10: float) -> str:
    """What a top-10% share implies for ZenFlow: "concentrated", "partly concentrated" or "spread"."""
    if not math.isfinite(top10):
        return "unmeasured"
    if top10 >= PREMISE_TOP10:
        return "concentrated"
    return "partly concentrated" if top10 >= SPREAD_TOP10 else "spread"


def concentration_report(stats: dict) -> str:
    """A few lines on the run's gradient concentration from ``stats()`` (its ``concentration`` entry): the shares at
    the last selection, the top-10% share's range over the run, and what they mean for ZenFlow."""
    c = stats.get("concentration") or {}
    if not c.get("top10"):
        return "gradient concentration: not measured yet (no selection has run)"
    last = {n: c[n][-1] for n in ("top1", "top10", "selected")}
    lo, hi = min(c["top10"]), max(c["top10"])
    kind = verdict(last["top10"])
    rest = 1 - last["selected"]
    lines = [f"gradient concentration at the last of {len(c['top10'])} selection(s): the top 1% of each matrix's "
             f"columns hold {last['top1']:.0%} of the gradient's energy, the top 10% {last['top10']:.0%} (over the "
             f"run {lo:.0%}-{hi:.0%}), the selected columns {last['selected']:.0%}"]
    if kind == "concentrated":
        lines.append(f"  -> concentrated (top 10% >= {PREMISE_TOP10:.0%}): ZenFlow's premise holds; the columns "
                     f"updated only at update boundaries carry {rest:.0%} of the energy")
    elif kind == "partly concentrated":
        lines.append(f"  -> partly concentrated (top 10% {SPREAD_TOP10:.0%}-{PREMISE_TOP10:.0%}): the columns "
                     f"updated only at update boundaries, with the interval's mean gradient, carry {rest:.0%} of the "
                     "energy; a larger topk_ratio or a smaller update_interval moves more of it to every step")
    else:
        lines.append(f"  -> spread (top 10% < {SPREAD_TOP10:.0%}): ZenFlow's premise does not hold; the columns "
                     f"updated only at update boundaries carry {rest:.0%} of the energy, so most of the gradient "
                     "reaches the weights once per update_interval")
    return "\n".join(lines)
