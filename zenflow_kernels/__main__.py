"""``python -m zenflow_kernels explain CONFIG [--steps N] [--steps-per-epoch N]`` and ``... plan --params N ...``.

``explain`` prints the resolved intervals, any warning, and the steps at which selections and host updates fall
in the first N steps: the table that would have caught ZenFlow silently never re-selecting its
columns. ``plan`` probes this host's passes for a few seconds and predicts the stall per step of synchronous
offload and of ZenFlow on a device of the given step time and PCIe bandwidth (``zenflow_kernels.planner``).
A missing file, bad JSON, an invalid config or argument is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from .config import ZenFlowConfig, ZenFlowConfigError
from .explain import explain_config
from .schedule import resolve_schedule

MAX_PARAMS = 10**13
"""The most ``plan --params`` (and ``--vector-params``) takes: 10 trillion parameters per rank, far above any model's
(beyond it the predictions are numbers without a machine to run them)."""


def _integer(text: str) -> int:
    """An integer written as one (``1000000``) or as an integral float (``1e6``), as every count here takes it."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (allowed e.g. 4096 or 1e6)")
    return int(value)


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return value


def _probe_params(text: str) -> int:
    value = _integer(text)
    if value < 1 << 12:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 4096 (the probe's matrix)")
    return value


def _param_count(text: str, *, zero: bool) -> int:
    """``--params`` / ``--vector-params``: a whole number of parameters (``7e9`` or ``7000000000``), > 0 (or >= 0
    with ``zero``), at most :data:`MAX_PARAMS`."""
    value = _number(text, zero=zero)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters (allowed e.g. 7e9)")
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"{text!r} is too large: allowed at most {MAX_PARAMS:.0e} parameters per "
                                         "rank")
    return int(value)


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
    plan = sub.add_parser("plan", help="predict the stall of offload and of ZenFlow on a GPU from this host's speed")
    plan.add_argument("--params", type=_params, required=True,
                      help="the model's matrix (2-D) parameters per rank, e.g. 7e9 (ZeRO: divided by the ranks; at "
                           f"most {MAX_PARAMS:.0e})")
    plan.add_argument("--vector-params", type=_vector_params, default=0,
                      help="its vector parameters (default 0)")
    step = plan.add_mutually_exclusive_group(required=True)
    step.add_argument("--device-step-ms", type=_positive_number,
                      help="the device's forward + backward (+ fast path) per step, in ms, as measured there")
    step.add_argument("--device-tflops", type=_positive_number,
                      help="the device's achieved TFLOP/s: the step is 6 * params * --tokens-per-step FLOPs")
    plan.add_argument("--tokens-per-step", type=_positive_number, default=None,
                      help="with --device-tflops (only): the tokens of one optimizer step")
    plan.add_argument("--pcie-gbps", type=_positive_number, default=25.0,
                      help="host <-> device bandwidth each way, GB/s (default 25: PCIe 4 x16)")
    plan.add_argument("--topk-ratio", type=float, default=0.1)
    plan.add_argument("--update-interval", type=_positive_int, default=4)
    plan.add_argument("--no-overlap", action="store_true", help="overlap_step=False")
    plan.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="parameters and gradients")
    plan.add_argument("--device-accumulation", action="store_true",
                      help="device_accumulation=True: the matrices' gradients summed on the device, crossing once "
                           "per interval in fp32 (no folds on the host)")
    plan.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                      help="the host's Adam moments (the probe times that rule)")
    plan.add_argument("--nvme-gbps", type=_positive_number, default=None,
                      help="the master and moments on disk (offload_device='nvme') at this read/write rate, GB/s")
    plan.add_argument("--host-cores", type=_positive_int, default=None,
                      help="the training host's cores (default: the probe's threads stand for the host worker's)")
    plan.add_argument("--ranks-per-node", type=_positive_int, default=1,
                      help="with --host-cores: ranks sharing those cores (default 1)")
    plan.add_argument("--pt-reserved-cores-perc", type=float, default=0.5,
                      help="with --host-cores: the share of each rank's cores kept for training (default 0.5, "
                           "the default beside a GPU)")
    plan.add_argument("--probe-seconds", type=_positive_number, default=3.0)
    plan.add_argument("--probe-params", type=_probe_params, default=1 << 22,
                      help="the probe's matrix size, an integer >= 4096 (default 4194304)")
    return parser


def _number(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 if zero else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {'>=' if zero else '>'} 0")
    return value


def _positive_number(text: str) -> float:
    return _number(text, zero=False)


def _params(text: str) -> int:
    return _param_count(text, zero=False)


def _vector_params(text: str) -> int:
    return _param_count(text, zero=True)


def plan_report(args) -> str:
    """``plan``: probe this host, then the planner's prediction, as text."""
    import torch

    from .planner import predict, probe_host, state_bytes_per_param
    from .rules import AdamW

    if args.device_tflops is not None and args.tokens_per_step is None:
        raise ValueError("--device-tflops needs --tokens-per-step (the step's FLOPs: 6 * params * tokens)")
    if args.tokens_per_step is not None and args.device_tflops is None:
        raise ValueError(f"--tokens-per-step {args.tokens_per_step:g} needs --device-tflops (it sizes the step from "
                         "the device's TFLOP/s); with --device-step-ms the step time is given: leave it out")
    if not 0.0 <= args.topk_ratio <= 1.0:
        raise ValueError(f"--topk-ratio {args.topk_ratio!r} is invalid: allowed a number in [0, 1]")
    matrix, vector = int(args.params), int(args.vector_params)
    step_s = args.device_step_ms / 1e3 if args.device_step_ms is not None else \
        6.0 * (matrix + vector) * args.tokens_per_step / (args.device_tflops * 1e12)
    if not 0.0 <= args.pt_reserved_cores_perc < 1.0:
        raise ValueError(f"--pt-reserved-cores-perc {args.pt_reserved_cores_perc!r} is invalid: allowed a number in "
                         "[0, 1)")
    if args.ranks_per_node != 1 and args.host_cores is None:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} needs --host-cores (the cores they share)")
    host_threads = None
    if args.host_cores is not None:
        host_threads = max(1, int(args.host_cores * (1 - args.pt_reserved_cores_perc)) // args.ranks_per_node)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # the rule plan predicts for: ZenFlowAdamW's (the command has no choice of rule), its state in --state-dtype
    rule = AdamW(state_dtype=torch.bfloat16 if args.state_dtype == "bf16" else torch.float32)
    probe = probe_host(rule, params=args.probe_params, seconds=args.probe_seconds, grad_dtype=dtype)
    bandwidth = args.pcie_gbps * 1e9
    plan_args = dict(matrix_params=matrix, vector_params=vector, device_step_s=step_s, d2h_bytes_per_s=bandwidth,
                     probe=probe, topk_ratio=args.topk_ratio, update_interval=args.update_interval,
                     overlap_step=not args.no_overlap, grad_bytes=dtype.itemsize, param_bytes=dtype.itemsize,
                     state_bytes=state_bytes_per_param(rule), device_accumulation=args.device_accumulation,
                     nvme_bytes_per_s=args.nvme_gbps * 1e9 if args.nvme_gbps else None, host_threads=host_threads)
    plan = predict(**plan_args)
    lanes = plan.zenflow_lanes
    hiding = plan.smallest_hiding_update_interval
    at_hiding = None
    if hiding is not None:  # what still stalls once the update is hidden (the folds, say)
        at_hiding = predict(**{**plan_args, "update_interval": hiding, "overlap_step": True})
    pct = lambda s: f"{1e3 * s:9.1f} ms/step ({100 * s / (step_s + s):.0f}% of the step)"  # noqa: E731
    return "\n".join([
        f"this host: update {probe.update_s_per_param * 1e9:.2f} ns/param, accumulate "
        f"{probe.accumulate_s_per_param * 1e9:.2f} ns/param (the host worker on {probe.threads} thread(s), probed on "
        f"{probe.params:,} "
        f"{probe.grad_dtype} parameters)",
        f"device step {step_s * 1e3:.1f} ms; PCIe {args.pcie_gbps:g} GB/s; {matrix + vector:,} parameters on the host",
        f"synchronous offload stall: {pct(plan.sync_offload_stall_s)}",
        f"ZenFlow stall:             {pct(plan.zenflow_stall_s)}  (topk_ratio={args.topk_ratio:g}, "
        f"update_interval={args.update_interval}, overlap_step={not args.no_overlap})",
        f"  gradients' crossing not hidden by backward {lanes['crossing_s'] * 1e3:.1f} ms, folds beyond the step "
        f"{lanes['fold_excess_s'] * 1e3:.1f} ms, host update {lanes['update_s'] * 1e3:.1f} ms of which waited "
        f"{lanes['update_wait_s'] * 1e3:.1f} ms, write-back {lanes['write_back_s'] * 1e3:.1f} ms per interval"
        + (f", sums' crossing {lanes['sums_crossing_s'] * 1e3:.1f} ms per interval" if args.device_accumulation
           else "") + (f", disk {lanes['disk_s'] * 1e3:.1f} ms per update" if args.nvme_gbps else ""),
        f"what limits the step: {plan.remedy}",
        "smallest update_interval that hides the host update (overlap_step=True): "
        + (str(hiding) if hiding is not None else "none up to 64 (the host is too slow for this device)")
        + (f"; there the stall is {pct(at_hiding.zenflow_stall_s).strip()}, limited by {at_hiding.remedy}"
           if at_hiding is not None and at_hiding.limit != "none" else ""),
        f"host memory: {plan.host_bytes / 2**30:.1f} GiB ({plan.host_bytes / plan.host_params:.0f} bytes per "
        "parameter)" + (f"; on disk {plan.disk_bytes / 2**30:.1f} GiB" if plan.disk_bytes else ""),
        *([f"host worker threads: {host_threads} ({args.host_cores} cores x {1 - args.pt_reserved_cores_perc:g} / "
           f"{args.ranks_per_node} rank(s)); the probe's passes scaled from its {probe.threads} linearly (memory "
           "bandwidth caps that: more threads than probed give an optimistic stall)"] if host_threads else []),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "plan":
        try:
            print(plan_report(args))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report prints them itself, once
            config = ZenFlowConfig.from_dict(args.config)
            schedule = resolve_schedule(config, steps_per_epoch=args.steps_per_epoch)
    except ZenFlowConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(explain_config(config, schedule, args.steps))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`
        sys.exit(0)
