"""What the host worker's Python costs a Python-bound training thread (issue 55 item 6).

    python -m bench.worker_gil [--out DIR] [--quick] [--tensors 150 600 2000] [--rounds 40] [--rules adamw lion]

ZenFlow's overlapped host update runs on a background thread of the same process. Its numba kernels release the GIL
(``cpu_ops._common.launch``: ``nogil=True``), but what runs between them (``HostShard.update``'s loops over the
parameters, the launchers' checks, the worker's queue) is Python and holds it; a training thread that is itself
Python-bound (launching many small kernels) waits for the GIL meanwhile. Per tensor count (150, 600, 2,000 fp32
``[W, W]`` matrices, W = 64: a model of that many bias-free ``Linear`` layers applied to the batch, their outputs'
mean square the loss, so forward is one Python module call per layer) and per rule (``ZenFlowAdamW``,
``ZenFlow(rules.Lion())``), one optimizer trains on CPU with ``topk_ratio=0.1, update_interval=4, overlap_step=True``
(no re-selection among the timed steps; torch on one thread, the worker's numba team on the other core). At each
update boundary the bench chooses what the worker does during the next interval (the job handed to
``link.submit_update`` is wrapped; the modes shuffled within each round, seeded):

* ``update``: the host update as it is (``HostShard.update``), beside the training thread;
* ``kernel``: the same rule's numba pass over the same flat buffers in one launch: the update's compute without its
  Python, what an orchestration out of the GIL's way would leave;
* ``idle``: nothing (a job that returns at once);
* ``hold``: the host update with the training thread waiting for it at once (the worker alone in the process).

``hold_ms`` (and ``hold_us_per_tensor``): in ``hold`` intervals, the job's wall time minus its time inside the numba
kernels (each kernel ``launch`` runs is wrapped and clocked per thread). With no other Python thread runnable, a
thread outside a GIL-releasing call holds the GIL, so this is the GIL held per update (slightly over: numba's
argument dispatch and torch's GIL-free slicing count as held).

Cost to training: each interval's wall time on the training thread, submission to submission (four whole steps, the
drain of the interval's job included). Per round the ratios ``update / kernel`` (the GIL's share: both put the same
compute beside the training thread) and ``update / idle`` (all the update costs); ``added_pct_gil = 100 * (median
ratio - 1)`` (``added_pct_gil_se``: its standard error from the rounds' spread) and ``added_pct_total``.
``waited_ms``: the median of the training thread's off-CPU time (wall minus ``time.thread_time``; a thread waiting
for the GIL sleeps) in ``update`` minus that in ``kernel``: the GIL wait itself, free of the step's CPU-time noise.
``predicted_pct`` = hold / the ``kernel`` interval: an upper estimate, as if every held millisecond stopped the
training thread (it releases the GIL inside each torch op, so the worker takes it within microseconds and keeps it
for its Python stretch, up to the 5 ms switch interval). Goal (the issue): ``added_pct_gil`` <= 1%; above it, move
the orchestration out of the GIL's way (DeepSpeed's PR 8058 moved its host update into a native process for this).
``profile``: cProfile of one host update (after the timed rounds, on the training thread: the worker runs the same
code), the functions with the longest own time, the GIL-free kernels left out. Other processes blur the intervals:
``other_processes_share_of_cores`` per row; ``--wait-quiet`` waits for quiet before each row. Results:
``worker_gil_cpu.json`` in ``bench/results``.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

from bench import harness
from bench.harness import OneLineParser, int_at_least

COUNTS = (150, 600, 2000)
RULES = ("adamw", "lion")
MODES = ("update", "kernel", "idle", "hold")
WIDTH, QUICK_WIDTH, BATCH = 64, 8, 8
INTERVAL = 4
ZENFLOW = dict(topk_ratio=0.1, update_interval=INTERVAL, overlap_step=True, select_strategy="step",
               select_interval=10**6)
GOAL_PCT = 1.0


class KernelClock:
    """Seconds each thread spent inside numba kernels (GIL released) since its last :meth:`reset`: installed by
    wrapping ``cpu_ops._common.launch``'s kernel argument (every launcher calls it through the module)."""

    def __init__(self):
        from zenflow_kernels.cpu_ops import _common

        self._common, self._launch, self._local = _common, _common.launch, threading.local()
        local = self._local

        def timed_launch(kernel, n, nthreads, *args):
            def timed(*a):
                t0 = time.perf_counter()
                try:
                    return kernel(*a)
                finally:
                    local.seconds = getattr(local, "seconds", 0.0) + time.perf_counter() - t0

            return self._launch(timed, n, nthreads, *args)

        _common.launch = timed_launch

    def reset(self) -> None:
        self._local.seconds = 0.0

    def seconds(self) -> float:
        return getattr(self._local, "seconds", 0.0)

    def close(self) -> None:
        self._common.launch = self._launch


class Modes:
    """Wraps ``opt.link.submit_update``: each host update's job is replaced by its interval's mode's, and the
    training thread's clocks at each submission and the worker's job times are recorded."""

    def __init__(self, opt, clock: KernelClock):
        import torch

        self.clock, self.link = clock, opt.link
        self._submit = self.link.submit_update
        self.link.submit_update = self.submit
        self.mode = "update"
        self.submitted: list[tuple[str, float, float]] = []  # (mode, perf_counter, thread_time) at submission
        self.jobs: list[dict] = []  # per job: mode, wall_s, kernel_s
        host = opt.host_shard
        rule, out = host.rule, host.out[torch.float32]
        numbers = rule.hyperparams(opt.param_groups[0])
        fields = [host.fields[name] for name in rule.state_names]

        def kernel_only(buf: int):
            rule.host_step_(host.master, host.acc[buf], fields, step=2, grad_scale=float(INTERVAL), out=out,
                            zero_grad=True, **numbers)
            return {"seconds": 0.0}

        self.interval = opt.interval  # (its buf, at a submission: the sums buffer that interval's update reads)
        self.work = {"kernel": kernel_only, "idle": lambda buf: {"seconds": 0.0}}

    def submit(self, fn):
        mode = self.mode
        self.submitted.append((mode, time.perf_counter(), time.thread_time()))
        work, buf = self.work.get(mode), self.interval.buf

        def job():
            self.clock.reset()
            t0 = time.perf_counter()
            result = fn() if work is None else work(buf)
            self.jobs.append(dict(mode=mode, wall_s=time.perf_counter() - t0, kernel_s=self.clock.seconds()))
            return result

        future = self._submit(job)
        if mode == "hold":
            future.wait()  # the worker alone: its time outside the kernels is time it holds the GIL
        return future

    def intervals(self) -> list[dict]:
        """Each whole interval, from one submission to the next: its mode, wall and training-thread CPU seconds."""
        return [dict(mode=m, wall=w1 - w0, cpu=c1 - c0)
                for (m, w0, c0), (_, w1, c1) in zip(self.submitted, self.submitted[1:], strict=False)]


def measure(rule: str, count: int, width: int, rounds: int, seed: int) -> dict:
    import torch

    from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules

    clock = KernelClock()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(count))
    x = torch.randn(BATCH, width)
    if rule == "adamw":
        opt = ZenFlowAdamW(layers.parameters(), lr=1e-4, zenflow=ZENFLOW)
    else:
        opt = ZenFlow(layers.parameters(), rules.Lion(), lr=1e-5, zenflow=ZENFLOW)

    def step():
        torch.stack([layer(x) for layer in layers]).square().mean().backward()  # one module call per layer
        opt.step()
        opt.zero_grad(set_to_none=False)

    try:
        while opt.host_shard is None:
            step()
        modes = Modes(opt, clock)
        order = random.Random(seed)
        warm = ["hold"]  # untimed: the worker's first kernel compiles (or loads) here
        schedule = warm + [m for _ in range(rounds) for m in order.sample(MODES, len(MODES))] + ["idle"]
        load = harness.OtherLoad()
        for mode in schedule:
            modes.mode = mode
            submitted = len(modes.submitted)
            while len(modes.submitted) == submitted:
                step()
        share = load.fraction()
        opt.flush()
        profile = hold_profile(opt)
    finally:
        opt.close()
        clock.close()
    intervals, jobs = modes.intervals()[len(warm):], modes.jobs[len(warm):]
    by_round = [{i["mode"]: i for i in intervals[r * len(MODES): (r + 1) * len(MODES)]} for r in range(rounds)]
    return dict(rule=rule, tensors=count, width=width, parameters=count * width * width,
                **summarize(by_round, jobs, count), other_processes_share_of_cores=round(share, 4), profile=profile)


def median_se(xs: list[float]) -> float:
    """The standard error of a median of ``xs``: 1.2533 sigma / sqrt(n), sigma from the interquartile range (robust
    to the outliers a shared machine adds); 0 for fewer than 4 values."""
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return 1.2533 * (q[2] - q[0]) / 1.349 / len(xs) ** 0.5


def summarize(by_round: list[dict], jobs: list[dict], tensors: int) -> dict:
    """Medians over rounds; the ratios are taken within each round (its modes ran back to back), then their
    median."""
    median = statistics.median
    timed = ("update", "kernel", "idle")
    interval_ms = {m: median(r[m]["wall"] for r in by_round) * 1e3 for m in timed}
    off_cpu_ms = {m: median(r[m]["wall"] - r[m]["cpu"] for r in by_round) * 1e3 for m in timed}
    ratios_gil = [r["update"]["wall"] / r["kernel"]["wall"] for r in by_round]
    ratio_gil, ratio_all = median(ratios_gil), median(r["update"]["wall"] / r["idle"]["wall"] for r in by_round)
    waited_ms = median((r["update"]["wall"] - r["update"]["cpu"]) - (r["kernel"]["wall"] - r["kernel"]["cpu"])
                       for r in by_round) * 1e3
    hold = [j for j in jobs if j["mode"] == "hold"]
    hold_ms = median(j["wall_s"] - j["kernel_s"] for j in hold) * 1e3
    return dict(
        rounds=len(by_round), hold_ms=hold_ms, hold_kernel_ms=median(j["kernel_s"] for j in hold) * 1e3,
        job_wall_ms={m: median(j["wall_s"] for j in jobs if j["mode"] == m) * 1e3 for m in ("hold", "update",
                                                                                                "kernel")},
        interval_ms=interval_ms, step_ms={m: v / INTERVAL for m, v in interval_ms.items()}, off_cpu_ms=off_cpu_ms,
        added_pct_gil=100 * (ratio_gil - 1), added_pct_total=100 * (ratio_all - 1),
        added_pct_gil_se=100 * median_se(ratios_gil), hold_us_per_tensor=hold_ms * 1e3 / tensors,
        added_pct_gil_of_medians=100 * (interval_ms["update"] / interval_ms["kernel"] - 1),
        waited_ms=waited_ms, waited_pct=100 * waited_ms / interval_ms["kernel"],
        predicted_pct=100 * hold_ms / interval_ms["kernel"],
        intervals=[{m: dict(wall_s=r[m]["wall"], cpu_s=r[m]["cpu"]) for m in MODES} for r in by_round],
        holds=[dict(wall_s=j["wall_s"], kernel_s=j["kernel_s"]) for j in hold],
    )


def hold_profile(opt, top: int = 12) -> list[dict]:
    """One host update under cProfile on this thread (the worker runs the same code): the functions with the
    longest own time."""
    import cProfile
    import pstats
    from pathlib import Path

    from zenflow_kernels.cpu_ops import kernels as cpu_kernels

    host = opt.host_shard
    counts = {s.index: INTERVAL for s in host.order}
    hyper = [host.rule.hyperparams(g) for g in opt.param_groups]
    profiler = cProfile.Profile()
    profiler.runcall(host.update, 0, counts, hyper, None)
    stats = pstats.Stats(profiler)
    # (the numba kernels themselves, in cpu_ops/kernels/, release the GIL: left out; so is this module's kernel clock)
    kernels = str(Path(cpu_kernels.__file__).parent)
    rows = sorted(((key, row) for key, row in stats.stats.items()
                   if not (key[0].startswith(kernels) or key[0].endswith(__file__))), key=lambda kv: -kv[1][2])[:top]
    return [dict(function=f"{file.rsplit('/', 1)[-1]}:{line}({name})", calls=nc, own_ms=tt * 1e3, cum_ms=ct * 1e3)
            for (file, line, name), (_cc, nc, tt, ct, _callers) in rows]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.worker_gil", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="narrow layers, AdamW, 1 round: checks the script runs")
    ap.add_argument("--tensors", type=int_at_least(1), nargs="+", default=list(COUNTS))
    ap.add_argument("--rules", nargs="+", choices=RULES, default=None, help="default both (--quick: adamw)")
    ap.add_argument("--rounds", type=int_at_least(1), default=None, help="rounds of the four modes (default 40)")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before each measurement, wait up to this many seconds for other processes to go quiet")
    args = ap.parse_args(argv)
    out_dir = harness.output_dir(args.out)
    import torch

    torch.set_num_threads(1)
    width = QUICK_WIDTH if args.quick else WIDTH
    rounds = args.rounds or (1 if args.quick else 40)
    rules = args.rules or (["adamw"] if args.quick else list(RULES))
    started = time.perf_counter()
    rows = []
    for count in args.tensors:
        for i, rule in enumerate(rules):
            if args.wait_quiet > 0:
                harness.wait_quiet(args.wait_quiet)
            rows.append(measure(rule, count, width, rounds, seed=count + i))
            r = rows[-1]
            print(f"bench.worker_gil: {rule:5s} {count:5d} tensors: hold {r['hold_ms']:.2f} ms/update, step "
                  f"{r['step_ms']['kernel']:.1f} ms, {r['added_pct_gil']:+.2f}% (GIL), {r['added_pct_total']:+.2f}% "
                  f"(all), waited {r['waited_ms']:+.2f} ms ({r['waited_pct']:+.2f}%), predicted "
                  f"{r['predicted_pct']:.2f}%, other load {r['other_processes_share_of_cores']:.0%}", flush=True)
    worst = max(rows, key=lambda r: r["added_pct_gil"])
    payload = dict(
        config=dict(tensors=args.tensors, rules=rules, width=width, batch=BATCH, rounds=rounds,
                    quick=args.quick, zenflow=ZENFLOW, torch_threads=torch.get_num_threads(), modes=MODES,
                    goal_pct=GOAL_PCT),
        rows=rows,
        summary=dict(max_added_pct_gil=worst["added_pct_gil"], at=dict(rule=worst["rule"], tensors=worst["tensors"]),
                     max_predicted_pct=max(r["predicted_pct"] for r in rows),
                     exceeds_goal=worst["added_pct_gil"] > GOAL_PCT),
        other_processes_share_of_cores=max(r["other_processes_share_of_cores"] for r in rows),
        total_s=time.perf_counter() - started, machine=harness.machine_info_light(),
    )
    path = harness.write_json_light(out_dir / "worker_gil_cpu.json", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
