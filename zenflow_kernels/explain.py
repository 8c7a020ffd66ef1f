"""What a ZenFlow config (:func:`explain_config`) and a ZenFlow optimizer (:func:`explain_optimizer`) will do, as
text: the report ``python -m zenflow_kernels explain`` prints and ``ZenFlow.explain()`` returns.

The command line (``zenflow_kernels.__main__``) parses arguments and prints; the optimizer imports this module, not
the command line.
"""

from __future__ import annotations

from .config import RESERVED_CORES_PERC_CPU, RESERVED_CORES_PERC_DEVICE, ZenFlowConfig, num_selected
from .schedule import Schedule


def _fmt_steps(steps: list[int], limit: int = 24) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


_AUTO_NOTES = {
    "pt_reserved_cores_perc": f"  ({RESERVED_CORES_PERC_CPU} for CPU parameters: training and the host worker share "
                              f"the cores; {RESERVED_CORES_PERC_DEVICE} on a GPU)",
}


def explain_config(config: ZenFlowConfig, schedule: Schedule, steps: int, rule_name: str | None = None) -> str:
    """The human-readable report ``python -m zenflow_kernels explain`` prints; ``rule_name``: the optimizer's update
    rule (``AdamW``, ``Lion``, ...), None where only a config is known (the command line)."""
    lines = ["zenflow config:"]
    for key, value in config.to_dict().items():
        lines.append(f"  {key} = {value!r}" + (_AUTO_NOTES.get(key, "") if value == "auto" else ""))
    s = schedule
    lines.append("resolved schedule:")
    strategy_note = " (from 'auto')" if config.select_strategy == "auto" else ""
    lines.append(f"  select_strategy   = {s.select_strategy}{strategy_note}")
    if s.select_strategy == "epoch":
        epoch = f"{s.steps_per_epoch} (from {s.steps_per_epoch_source})" if s.steps_per_epoch else "unknown"
        lines.append(f"  steps_per_epoch   = {epoch}")
    never = "  (0 = chosen once, never re-selected)" if s.select_interval == 0 else " steps"
    lines.append(f"  select_interval   = {s.select_interval}{never}")
    if s.is_auto:
        lines.append(f"  update_interval   = auto (Zen-auto, bounded by {s.auto_bound} steps)")
    else:
        lines.append(f"  update_interval   = {s.update_interval} steps")
    lines.append(f"  warm-up           = {s.warmup} steps of synchronous host {rule_name or 'updates'}")
    lines.append("warnings:")
    found = [*config.notes, *s.warnings]  # the config's (fields kept against semantics) and the schedule's
    lines.extend(f"  - {w}" for w in found) if found else lines.append("  none")

    selects = s.select_steps(steps)
    updates = s.update_steps(steps)
    warm = [t for t in range(steps) if s.is_warmup(t)]
    lines.append(f"first {steps} steps:")
    what = "forced host updates" if s.is_auto else "host updates"
    for label, found in (("warm-up steps", warm), ("selections", selects), (what, updates)):
        lines.append(f"  {label:<20}({len(found)}): {_fmt_steps(found)}")
    if s.is_auto:
        lines.append("  (Zen-auto adds updates where gradients call for them; these fall regardless)")
    lines.append("")
    lines.append("  step  phase    select  host-update")
    select_set, update_set = set(selects), set(updates)
    for t in range(steps):
        phase = "warm-up" if s.is_warmup(t) else "zenflow"
        sel = "S" if t in select_set else "."
        upd = "sync" if s.is_warmup(t) else ("U" if t in update_set else ".")
        lines.append(f"  {t:>4}  {phase:<7}  {sel:^6}  {upd:^11}")
    return "\n".join(lines)


def explain_optimizer(opt, steps: int, cores: dict) -> str:
    """``ZenFlow.explain()``: :func:`explain_config`, the CPUs of training and of the host worker (and why: those the
    first step picks, before it), and per param group its ``topk_ratio`` and ``importance`` and each matrix's ``k``
    of ``C`` columns on the fast path. ``cores``: the optimizer's ``{"train", "host", "why"}`` (its run's, or those
    its first step will pick)."""
    config, param_groups = opt.config, opt.param_groups
    rule_name = getattr(opt.rule, "name", "") or type(opt.rule).__name__  # (as build.display_name names it)
    lines = [explain_config(config, opt.schedule, steps, rule_name)]
    lines += [f"cores: training {cores['train']}, host worker {cores['host']} ({cores['why']})", "param groups:"]
    for gi, g in enumerate(param_groups):
        ratio, importance = g.get("topk_ratio", config.topk_ratio), g.get("importance", config.importance)
        own = [k for k in ("topk_ratio", "importance") if k in g]
        name = getattr(importance, "__name__", None) or repr(importance) if callable(importance) else importance
        lines.append(f"  group {gi}: topk_ratio={ratio!r}, importance={name}"
                     + (f" (its own: {', '.join(own)})" if own else " (the optimizer's)"))
        for p in g["params"]:
            if p.dim() == 2:
                C = p.shape[1]
                k = num_selected(ratio, C)
                what = "host only" if k == 0 else f"every column on the device ({rule_name})" if k == C else \
                    f"{k} of {C} columns on the device"
                lines.append(f"    matrix {tuple(p.shape)}: {what}")
        vectors = sum(1 for p in g["params"] if p.dim() != 2)
        if vectors:
            lines.append(f"    {vectors} vector parameter(s): on the device every step")
    return "\n".join(lines)
