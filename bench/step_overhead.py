"""Host time of ``step()`` per tensor: the training thread's CPU time per step of the optimizer alone.

    python -m bench.step_overhead [--out DIR] [--quick] [--tensors 50 150 300 600] [--steps 300] [--block 10]

On a GPU the training thread's Python work in ``step()`` is on the critical path; here it is measured
with tiny tensors, so that compute nearly vanishes: alternating fp32 [64, 64] matrices and [64] vectors
(50, 150, 300 and 600 of them), gradients set before each step (no backward), ``torch.set_num_threads(1)``.
Candidates, each on its own copy of the tensors:

* ``zenflow_cpu_link``: ``ZenFlowAdamW(topk_ratio=0.1, select_interval=update_interval=1000,
  overlap_step=True)`` on the numba backend, through the synchronous CPU link;
* ``zenflow_async_link``: the same through the asynchronous link (``testing.chaos(seed=0, max_delay=0)``:
  the CUDA protocol's landing area, fingerprints, copy and fold threads, no sleeps);
* ``torch_adamw_foreach``: ``torch.optim.AdamW(foreach=True)``.

Time: ``time.thread_time()`` of the training thread around ``step()`` (CPU time: what a step costs the
thread that drives the device; waits and the workers' own work do not count). Only steps that are not
boundaries (no selection, no host update) count; the median over them. Every candidate at every count
takes its turn, ``--block`` steps back to back (as one optimizer steps in a training loop; one step per
turn would start every step in caches the other candidates filled), turn after turn, so that drift hits
all alike; after an asynchronous step its background work is waited for, untimed, so that it does not run
beside the next step. Per-tensor cost: the least-squares slope of the medians over the counts. The goal
(the issue "step() host time per tensor"): at most 1.5 ms at 150 tensors and 10 us per additional tensor.

Results: ``step_overhead_cpu.json`` (with the machine description) in ``bench/results``.
"""

from __future__ import annotations

import os
import statistics
import time

from bench.harness import OneLineParser, int_at_least, machine_info_light, output_dir, write_json_light

COUNTS = [50, 150, 300, 600]
QUICK_COUNTS = [8, 16]
ZENFLOW = dict(topk_ratio=0.1, select_strategy="step", select_interval=1000, update_interval=1000,
               overlap_step=True)
LR = 1e-3
CANDIDATES = ("zenflow_cpu_link", "zenflow_async_link", "torch_adamw_foreach")
GOAL_MS_AT_150 = 1.5
GOAL_US_PER_TENSOR = 10.0


def _tensors(count: int, seed: int = 0):
    """Parameters and their gradients: alternating fp32 [64, 64] and [64]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params, grads = [], []
    for i in range(count):
        shape = (64, 64) if i % 2 == 0 else (64,)
        params.append(torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02))
        grads.append(torch.randn(shape, generator=g) * 1e-3)
    return params, grads


class _Candidate:
    def __init__(self, name: str, count: int):
        import torch

        from zenflow_kernels import ZenFlowAdamW
        from zenflow_kernels.testing import chaos

        self.name, self.count = name, count
        self.params, self.grads = _tensors(count)
        if name == "torch_adamw_foreach":
            self.opt = torch.optim.AdamW(self.params, lr=LR, foreach=True)
        elif name == "zenflow_async_link":
            with chaos(seed=0, max_delay=0):
                self.opt = ZenFlowAdamW(self.params, lr=LR, zenflow=ZENFLOW)
        else:
            self.opt = ZenFlowAdamW(self.params, lr=LR, zenflow=ZENFLOW)
        self.samples: list[float] = []
        self.boundaries = 0

    def _counters(self) -> tuple:
        return (getattr(self.opt, "selections", 0), getattr(self.opt, "host_updates", 0))

    def step(self, record: bool) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g
        before = self._counters()
        t0 = time.thread_time()
        self.opt.step()
        elapsed = time.thread_time() - t0
        link = getattr(self.opt, "_link", None)
        if link is not None and link.asynchronous:
            link.synchronize()  # its copies and accumulation finish here, untimed, not beside the next step
        if not record:
            return
        if self._counters() != before:
            self.boundaries += 1
        else:
            self.samples.append(elapsed)

    def close(self) -> None:
        if hasattr(self.opt, "close"):
            self.opt.close()


def _load() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (runnable processes; compare with the core count)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _slope_us(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (tensors, seconds) in microseconds per tensor."""
    if len(points) < 2:
        return None
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs) * 1e6


def measure(counts: list[int], steps: int, warmup: int, block: int) -> dict:
    import torch

    from zenflow_kernels.ops import use_backend

    torch.set_num_threads(1)
    with use_backend("numba"):
        candidates = [_Candidate(name, count) for count in counts for name in CANDIDATES]
        try:
            for c in candidates:
                for _ in range(warmup):
                    c.step(record=False)
            for _ in range(-(-steps // block)):
                for c in candidates:
                    for _ in range(block):
                        c.step(record=True)
        finally:
            for c in candidates:
                c.close()
    rows = []
    for c in candidates:
        s = sorted(c.samples)
        q = statistics.quantiles(s, n=4) if len(s) >= 4 else [s[0], statistics.median(s), s[-1]]
        rows.append(dict(tensors=c.count, candidate=c.name, median_ms=statistics.median(s) * 1e3, p25_ms=q[0] * 1e3,
                         p75_ms=q[2] * 1e3, min_ms=s[0] * 1e3, steps=len(s), boundary_steps_left_out=c.boundaries))
    return dict(rows=rows, torch_threads=torch.get_num_threads())


def summarise(rows: list[dict], counts: list[int]) -> dict:
    by = {(r["candidate"], r["tensors"]): r["median_ms"] for r in rows}
    out = {}
    for cand in CANDIDATES:
        entry = {f"ms_at_{n}": by[cand, n] for n in counts}
        entry["us_per_tensor"] = _slope_us([(n, by[cand, n] / 1e3) for n in counts])
        if cand != "torch_adamw_foreach":
            entry.update({f"vs_torch_adamw_at_{n}": by[cand, n] / by["torch_adamw_foreach", n] for n in counts})
            if 150 in counts:
                entry["goal_met"] = (by[cand, 150] <= GOAL_MS_AT_150 and entry["us_per_tensor"] is not None
                                     and entry["us_per_tensor"] <= GOAL_US_PER_TENSOR)
        out[cand] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.step_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="two small counts and a few steps (the test suite's run)")
    ap.add_argument("--tensors", type=int_at_least(2), nargs="+", default=None,
                    help=f"tensor counts (default {' '.join(map(str, COUNTS))})")
    ap.add_argument("--steps", type=int_at_least(4), default=None, help="measured steps per candidate (default 300)")
    ap.add_argument("--warmup", type=int_at_least(1), default=None, help="untimed steps first (default 20)")
    ap.add_argument("--block", type=int_at_least(1), default=None,
                    help="steps of one candidate per turn (default 10)")
    args = ap.parse_args(argv)
    out_dir = output_dir(args.out)
    counts = sorted(set(args.tensors or (QUICK_COUNTS if args.quick else COUNTS)))
    steps = args.steps or (8 if args.quick else 300)
    warmup = args.warmup or (2 if args.quick else 20)
    block = args.block or (4 if args.quick else 10)
    if warmup + -(-steps // block) * block >= ZENFLOW["update_interval"]:
        ap.error(f"argument --steps: steps + warmup must stay below update_interval={ZENFLOW['update_interval']}")

    started, load_before = time.perf_counter(), _load()
    result = measure(counts, steps, warmup, block)
    summary = summarise(result["rows"], counts)
    payload = dict(
        config=dict(tensors=counts, steps=steps, warmup=warmup, block=block, quick=args.quick, zenflow=ZENFLOW, lr=LR,
                    backend="numba", torch_threads=result["torch_threads"], clock="time.thread_time",
                    shapes="alternating fp32 [64, 64] matrices and [64] vectors",
                    goal=dict(ms_at_150=GOAL_MS_AT_150, us_per_tensor=GOAL_US_PER_TENSOR)),
        rows=result["rows"], summary=summary, total_s=time.perf_counter() - started, machine=machine_info_light(),
        load_average=dict(before=load_before, after=_load()),  # the machine is shared: others' work slows ours
    )
    path = write_json_light(out_dir / "step_overhead_cpu.json", payload)

    header = f"{'candidate':<22}" + "".join(f"{f'{n} tensors':>12}" for n in counts) + f"{'us/tensor':>11}"
    print("training-thread time per step() that is not a boundary, ms (median)")
    print(header)
    for cand in CANDIDATES:
        e = summary[cand]
        slope = e["us_per_tensor"]
        print(f"{cand:<22}" + "".join(f"{e[f'ms_at_{n}']:>12.3f}" for n in counts)
              + (f"{slope:>11.2f}" if slope is not None else f"{'-':>11}"))
    if 150 in counts:
        for cand in CANDIDATES[:2]:
            print(f"goal (<= {GOAL_MS_AT_150} ms at 150, <= {GOAL_US_PER_TENSOR} us/tensor) {cand}: "
                  f"{'met' if summary[cand]['goal_met'] else 'not met'}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
