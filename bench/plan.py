"""The planner (``zenflow_kernels.planner``) against the modeled device: predicted and measured stall per step.

    python -m bench.plan [--out DIR] [--quick] [--params 4194304] [--steps 24]

The modeled device (docs/testing.md): ``testing.chaos`` with copy bandwidths, so a gradient copy or a write-back
takes ``bytes / bandwidth`` on its copy thread, and the device's compute a sleep of ``compute_ms`` on the training
thread (the host's cores stay free for the host's passes, as beside a GPU). The gradients are set by hand after the
"compute", so they cross at ``step()`` (the planner's ``handover="step"``). First this host's passes are probed
(``planner.probe_host``), once per compute time with that time as the probe's pause between steps: the training
thread's own step() work (the device's, on this stand-in) is then measured after as long an idle as the
configuration gives it (after 20 ms of sleep about twice what it is after 4 ms on a shared two-core VM; the probe
with its default pause is recorded too, ``step_work_s_by_pause``; a first probe warms the kernels and is discarded);
then each configuration runs ``--steps`` steps and its stall per step is measured as the median over whole update
intervals (after the first two) of the interval's wall time per step minus the compute's measured time per step.
Configurations: synchronous offload (every step a host update, no overlap), ZenFlow without overlap, and ZenFlow
with overlap where the interval hides the update and where it does not; the lanes issue 56 added (the sums kept on
the device, bf16 moments, the state on disk at the streamed update's rate, ``disk_probe``, in a temporary folder). Goal
(issue 43): each prediction within 20% or 2 ms of the measurement. Also per row: ``host_bytes()`` against the
planner's bytes.
Results: ``plan_cpu.json`` in bench/results (or ``--out``).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time

import torch

from bench.harness import OneLineParser, OtherLoad, Timing, int_at_least, output_dir, write_result

BANDWIDTH = 2e9  # bytes/s each way: copies of a few ms at these sizes, so the crossing counts
# (name, zenflow settings, compute ms per step[, the moments' dtype: "fp32" unless given])
CONFIGS = [
    ("sync_offload", dict(topk_ratio=0.0, update_interval=1, overlap_step=False), 20.0),
    ("zenflow_no_overlap", dict(topk_ratio=0.0, update_interval=4, overlap_step=False), 20.0),
    ("zenflow_overlap_hidden", dict(topk_ratio=0.0, update_interval=4, overlap_step=True), 20.0),
    ("zenflow_overlap_short", dict(topk_ratio=0.0, update_interval=2, overlap_step=True), 4.0),
    ("zenflow_overlap_hidden_ui8", dict(topk_ratio=0.0, update_interval=8, overlap_step=True), 6.0),
    # the lanes of issue 56: the sums crossing once per interval instead of folds (with a short step, so the next
    # step waits for the sums), and the moments in bf16 (the probe then times the bf16 rule)
    ("device_accumulation", dict(topk_ratio=0.0, update_interval=4, overlap_step=True, device_accumulation=True),
     2.0),
    ("device_accumulation_no_overlap", dict(topk_ratio=0.0, update_interval=4, overlap_step=False,
                                            device_accumulation=True), 20.0),
    ("bf16_state_overlap_short", dict(topk_ratio=0.0, update_interval=2, overlap_step=True), 4.0, "bf16"),
    ("bf16_state_no_overlap", dict(topk_ratio=0.0, update_interval=4, overlap_step=False), 20.0, "bf16"),
    # the disk lane: the master and moments in a state file (offload_device="nvme", in a temporary folder on this
    # VM's disk), read and written by each update at the rate disk_probe measures
    ("nvme_overlap_short", dict(topk_ratio=0.0, update_interval=2, overlap_step=True, offload_device="nvme"), 4.0),
    ("nvme_no_overlap", dict(topk_ratio=0.0, update_interval=4, overlap_step=False, offload_device="nvme"), 20.0),
]
WITHIN_REL, WITHIN_ABS_S = 0.20, 0.002


def state_of(config: tuple) -> str:
    return config[3] if len(config) > 3 else "fp32"


def rule_of(state: str):
    from zenflow_kernels import rules

    return rules.AdamW(state_dtype=torch.bfloat16 if state == "bf16" else torch.float32)


def disk_probe(params: int, folder: str, threads: int, passes: int = 5) -> float:
    """The state file's effective rate for the planner's ``nvme_bytes_per_s``: the disk bytes of one update (the master
    and AdamW's two moments, fp32, read and written: ``2 * 12 * params``) over the time of the streamed host update
    itself (``streamed_host_step_``: its reader and writer threads, AdamW's kernel on ``threads`` numba threads, as
    the host worker runs it), the median of ``passes`` after one discarded. The planner then models the update as
    ``max(compute, disk)`` = this pass, which holds whatever part of it the disk or the pipeline takes."""
    import numba

    from zenflow_kernels import planner, rules
    from zenflow_kernels.optim.build import Tunables
    from zenflow_kernels.state_files import StateFiles
    from zenflow_kernels.streamed_host import RangeStep, streamed_host_step_

    rule = rules.AdamW()
    # the optimizer's file: its block size, and O_DIRECT (the page cache does not hold it) where it uses that
    files = StateFiles(folder, params, fields=("master", *rule.state_names), block_numel=Tunables.NVME_BLOCK_NUMEL,
                       direct=Tunables.NVME_DIRECT)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        files.write_many([("master", 0, torch.randn(params))], fresh=True)
        acc = torch.zeros(params)
        out = torch.empty(params, dtype=torch.bfloat16)
        numbers = rule.hyperparams(dict(rule.group_defaults(), lr=1e-4))
        seconds = []
        for step in range(1, passes + 2):
            acc.normal_()
            t0 = time.perf_counter()
            streamed_host_step_(files, acc, [RangeStep(0, params, out, dict(step=step, grad_scale=1.0, **numbers))],
                                rule=rule)
            seconds.append(time.perf_counter() - t0)
    finally:
        numba.set_num_threads(before)
        files.close()
    # (the planner's disk bytes of an update: master and state, read and written; so its disk term is this pass)
    return 2 * (4 + planner.state_bytes_per_param(rule)) * params / statistics.median(seconds[1:])


def measure(name: str, zen: dict, compute_s: float, params: int, steps: int, state: str = "fp32") -> dict:
    """One configuration on the modeled device: the stall per step (median over whole intervals) and the
    optimizer's host bytes (``offload_device="nvme"``: the state file in a temporary folder)."""
    from zenflow_kernels import ZenFlow
    from zenflow_kernels.testing import chaos

    cols = 1024
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(params // cols, cols, generator=generator).to(torch.bfloat16))
    grads = [torch.randn(params // cols, cols, generator=generator).to(torch.bfloat16) for _ in range(2)]
    interval = zen["update_interval"]
    nvme = zen.get("offload_device") == "nvme"
    walls, computes = [], []
    with tempfile.TemporaryDirectory() if nvme else contextlib.nullcontext() as folder:
        settings = dict(zen, **(dict(nvme_path=folder) if nvme else {}), select_strategy="step", select_interval=10**6)
        with chaos(seed=0, max_delay=0.0, d2h_bytes_per_s=BANDWIDTH, h2d_bytes_per_s=BANDWIDTH):
            opt = ZenFlow([weight], rule_of(state), lr=1e-4, zenflow=settings)
        with opt:
            load = OtherLoad()
            start, slept = time.perf_counter(), 0.0
            for t in range(steps):
                t0 = time.perf_counter()
                time.sleep(compute_s)  # the device's forward and backward
                slept += time.perf_counter() - t0
                weight.grad = grads[t % 2]
                opt.step()
                if (t + 1) % interval == 0:  # an interval ends with its boundary's step
                    now = time.perf_counter()
                    walls.append((now - start) / interval)
                    computes.append(slept / interval)
                    start, slept = now, 0.0
            host_bytes = opt.host_bytes()["total"]
    skip = 2 if len(walls) > 4 else 1  # the state's first build and the first overlapped interval
    stalls = [w - c for w, c in zip(walls[skip:], computes[skip:], strict=True)]
    return dict(name=name, zenflow=zen, state=state, compute_s=statistics.median(computes[skip:]), steps=steps,
                intervals_measured=len(stalls), measured_stall_s=statistics.median(stalls),
                stall_iqr_s=Timing.from_samples(stalls).iqr, host_bytes=host_bytes,
                other_processes_cpu_fraction=load.fraction())


def probe_key(key: tuple | None) -> str:
    """A probe's key in the JSON: its pause in seconds (``default``: a third of the last update), and ``bf16``
    for the rule with bf16 moments."""
    if key is None:
        return "default"
    return f"{key[0] / 1e3:g}" + ("" if key[1] == "fp32" else f" {key[1]}")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="a small matrix and few steps: the structure only")
    ap.add_argument("--params", type=int_at_least(1 << 14), default=None, help="parameters (default 2^22)")
    ap.add_argument("--steps", type=int_at_least(16), default=None, help="steps per configuration (default 32)")
    args = ap.parse_args(argv)
    from zenflow_kernels import planner, rules

    params = args.params or (1 << 16 if args.quick else 1 << 22)
    steps = args.steps or (16 if args.quick else 32)
    out = output_dir(args.out)
    started = time.perf_counter()
    seconds = 1.0 if args.quick else 4.0
    # a first probe, discarded: numba's cache is per checkout, so a fresh clone compiles its kernels here
    rule = rules.AdamW()  # measure()'s rule, as ZenFlowAdamW's (the bf16 rows: its moments in bf16)
    planner.probe_host(rule, params=params, seconds=min(seconds, 1.0))
    planner.probe_host(rule_of("bf16"), params=params, seconds=min(seconds, 1.0))
    probes = {None: planner.probe_host(rule, params=params, seconds=seconds)}  # the default pause, for the record
    with tempfile.TemporaryDirectory() as folder:
        nvme_bytes_per_s = disk_probe(params, folder, probes[None].threads, passes=2 if args.quick else 5)
    for config in CONFIGS:
        key = (config[2], state_of(config))
        if key not in probes:
            probes[key] = planner.probe_host(rule_of(key[1]), params=params, seconds=seconds, pause_s=key[0] / 1e3)
    rows = []
    for config in CONFIGS:
        name, zen, compute_ms = config[:3]
        state = state_of(config)
        got = measure(name, zen, compute_ms / 1e3, params, steps, state)
        probe = probes[(compute_ms, state)]
        # the stand-in's step() work on the training thread is the modeled device's (a GPU's fingerprints and
        # copies): the device's time per step, and in the measured stall (wall time minus the compute)
        step_work = probe.step_work_s_per_param * params
        on_disk = zen.get("offload_device") == "nvme"
        plan = planner.predict(matrix_params=params, device_step_s=got["compute_s"] + step_work,
                               d2h_bytes_per_s=BANDWIDTH, h2d_bytes_per_s=BANDWIDTH, probe=probe, handover="step",
                               state_bytes=planner.state_bytes_per_param(rule_of(state)),
                               nvme_bytes_per_s=nvme_bytes_per_s if on_disk else None,
                               **{k: v for k, v in zen.items() if k != "offload_device"})
        predicted = step_work + (plan.sync_offload_stall_s if name == "sync_offload" else plan.zenflow_stall_s)
        error = got["measured_stall_s"] - predicted
        rows.append(dict(got, predicted_stall_s=predicted, error_s=error,
                         relative_error=error / got["measured_stall_s"] if got["measured_stall_s"] > 0 else None,
                         within=abs(error) <= max(WITHIN_ABS_S, WITHIN_REL * abs(got["measured_stall_s"])),
                         step_work_s=step_work, probe_pause_s=compute_ms / 1e3, lanes=plan.zenflow_lanes,
                         limit=plan.limit, predicted_host_bytes=plan.host_bytes,
                         smallest_hiding_update_interval=plan.smallest_hiding_update_interval))
        print(f"{name:28s} predicted {predicted * 1e3:7.2f} ms  measured {got['measured_stall_s'] * 1e3:7.2f} ms  "
              f"{'ok' if rows[-1]['within'] else 'OFF'}", flush=True)
    payload = dict(benchmark="plan", description=__doc__.split("\n\n")[1], params=params, steps=steps,
                   bandwidth_bytes_per_s=BANDWIDTH, goal=dict(relative=WITHIN_REL, absolute_s=WITHIN_ABS_S),
                   probes={probe_key(k): p.as_dict() for k, p in probes.items()}, nvme_bytes_per_s=nvme_bytes_per_s,
                   step_work_s_by_pause={probe_key(k): p.step_work_s_per_param * params for k, p in probes.items()},
                   rows=rows, all_within=all(r["within"] for r in rows), total_s=time.perf_counter() - started)
    path = write_result(out / "plan_cpu.json", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
