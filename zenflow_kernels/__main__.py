"""``python -m zenflow_kernels explain CONFIG [--steps N] [--steps-per-epoch N]``.

Prints the resolved intervals, any warning, and the steps at which selections and host updates fall
in the first N steps: the table that would have caught ZenFlow silently never re-selecting its
columns. A missing file, bad JSON or an invalid config is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from .config import (
    RESERVED_CORES_PERC_CPU,
    RESERVED_CORES_PERC_DEVICE,
    ZenFlowConfig,
    ZenFlowConfigError,
    num_selected,
)
from .schedule import Schedule, resolve_schedule


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other error here."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m zenflow_kernels", description=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    explain = sub.add_parser("explain", help="print the resolved ZenFlow schedule of a config")
    explain.add_argument(
        "config", help="a JSON file: a DeepSpeed config, a {'zenflow': ...} wrapper or the zenflow block itself"
    )
    explain.add_argument("--steps", type=_positive_int, default=40, help="steps to tabulate (default 40)")
    explain.add_argument(
        "--steps-per-epoch", type=_positive_int, default=None, help="epoch length, as a dataloader would give it"
    )
    return parser


def _fmt_steps(steps: list[int], limit: int = 24) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


_AUTO_NOTES = {
    "pt_reserved_cores_perc": f"  ({RESERVED_CORES_PERC_CPU} for CPU parameters: training and the host worker share "
                              f"the cores; {RESERVED_CORES_PERC_DEVICE} on a GPU)",
}


def explain(config: ZenFlowConfig, schedule: Schedule, steps: int) -> str:
    """The human-readable report printed by ``explain``."""
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
    lines.append(f"  warm-up           = {s.warmup} steps of synchronous host AdamW")
    lines.append("warnings:")
    lines.extend(f"  - {w}" for w in s.warnings) if s.warnings else lines.append("  none")

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


def explain_optimizer(opt, steps: int) -> str:
    """``ZenFlowAdamW.explain()``: :func:`explain`, the CPUs of training and of the host worker (and why: those the
    first step picks, before it), and per param group its ``topk_ratio`` and ``importance`` and each matrix's ``k``
    of ``C`` columns on the fast path."""
    from .optim import build

    config, param_groups = opt.config, opt.param_groups
    params = [p for g in param_groups for p in g["params"]]
    cores = opt.run.cores if opt.built else build.split_cores(config, build.device_of(params))
    lines = [explain(config, opt.schedule, steps)]
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
                what = "host only" if k == 0 else "every column on the device (AdamW)" if k == C else \
                    f"{k} of {C} columns on the device"
                lines.append(f"    matrix {tuple(p.shape)}: {what}")
        vectors = sum(1 for p in g["params"] if p.dim() != 2)
        if vectors:
            lines.append(f"    {vectors} vector parameter(s): on the device every step")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        config = ZenFlowConfig.from_dict(args.config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report prints them itself, once
            schedule = resolve_schedule(config, steps_per_epoch=args.steps_per_epoch)
    except ZenFlowConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(explain(config, schedule, args.steps))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`
        sys.exit(0)
