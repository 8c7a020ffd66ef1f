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


def _as_list(value, name: str, what: str) -> list:
    """``value`` as a list of per-matrix entries: a list or tuple as it is, one tensor as a list of one (a single
    matrix), or a TypeError naming the argument."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"gradient_concentration: {name}={type(value).__name__} is invalid: allowed {what}")


def gradient_concentration(energies: list[torch.Tensor] | torch.Tensor,
                           selected: list[torch.Tensor | None] | torch.Tensor | None = None) -> dict:
    """The energy shares of ``energies`` (each matrix's per-column squared L2 norms, fp32, [C]: for a gradient ``g``
    [R, C], ``g.float().square().sum(0)``; one tensor: one matrix) and of the ``selected`` columns (int64 indices per
    matrix, or None; one tensor with one matrix), as floats: ``{"top1", "top10", "selected", "per_matrix": [{"top1",
    "top10", "selected", "energy"}, ...]}`` (``selected`` None where no selection is given; a share is NaN where the
    energy is 0)."""
    energies = _as_list(energies, "energies", "a list of 1-D tensors (each matrix's per-column squared L2 norms), "
                                              "or one such tensor")
    for n, e in enumerate(energies):
        if not torch.is_tensor(e) or e.dim() != 1:
            shape = tuple(e.shape) if torch.is_tensor(e) else type(e).__name__
            raise TypeError(f"gradient_concentration: energies[{n}] is {shape}: allowed a 1-D tensor of one matrix's "
                            "per-column squared L2 norms ([C]; of a gradient g [R, C]: g.float().square().sum(0))")
    if selected is not None:
        selected = [selected] if torch.is_tensor(selected) and len(energies) == 1 else _as_list(
            selected, "selected", "None, or a list of int64 column indices (or None) per matrix")
        if len(selected) != len(energies):
            raise ValueError(f"gradient_concentration: selected has {len(selected)} entries, energies "
                             f"{len(energies)}: allowed one per matrix (None where a matrix has no selection)")
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
    if not isinstance(stats, dict):
        raise TypeError(f"concentration_report: stats={type(stats).__name__} is invalid: allowed the dict "
                        "opt.stats() returns")
    c = stats.get("concentration") or {}
    if not c.get("top10"):
        if stats.get("selections"):
            return (f"gradient concentration: not measured ({stats['selections']} selection(s) ran, but no matrix "
                    "was selected from: ZenFlow selects columns of matrices (2-D parameters) only; vectors are on "
                    "the fast path every step)")
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
