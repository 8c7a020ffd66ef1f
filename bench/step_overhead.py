"""Host time of ``step()`` per tensor: the training thread's time per step of the optimizer alone.

    python -m bench.step_overhead [--out DIR] [--quick] [--tensors 50 150 300 600] [--steps 300] [--block 10]
                                  [--repeats 3] [--rules]

On a GPU the training thread's Python work in ``step()`` is on the critical path; here it is measured with tiny
tensors, so that compute nearly vanishes: alternating fp32 [64, 64] matrices and [64] vectors (50, 150, 300 and 600
of them), ``torch.set_num_threads(1)``. Candidates, each on its own copy of the tensors:

* ``zenflow_cpu_link``: ``ZenFlowAdamW(topk_ratio=0.1, select_interval=update_interval=1000, overlap_step=True)``
  on the numba backend, through the synchronous CPU link, gradients set before each step;
* ``zenflow_async_link``: the same through the asynchronous link (``testing.chaos(seed=0, max_delay=0)``: the CUDA
  protocol's landing area, fingerprints, copy and fold threads, no sleeps); no hook copies the gradients, ``step()``
  copies them all;
* ``zenflow_async_link_hooks``: the same with each step's gradients made by a backward (untimed): its hooks copy
  them during backward and ``step()`` checks their fingerprints (a training loop's case);
* ``torch_adamw_foreach`` and ``torch_adamw_fused``: ``torch.optim.AdamW(foreach=True)`` and ``(fused=True)``;
* with ``--rules`` (results in ``step_overhead_rules_cpu.json``), ``RULE_CANDIDATES`` too: ``ZenFlow`` with
  ``rules.Lion()``, ``rules.SGD(momentum=0.9)`` and ``rules.Adam()`` on the asynchronous link, their device step the
  fused kernel (``ops.fused_kernels``) and, with ``_torch``, plain torch (``UpdateRule.reference_fast_step_``: what
  a rule without a fused kernel costs); and rules of one's own (``bench.custom_rules``), their device step compiled
  by Inductor (``rules.compiled``; ``_rmsprop_eager``: ``compile=False``), compiled in the untimed warm-up steps,
  each one's ``stats()["rule_paths"]`` at each count recorded in ``rule_paths``.

Two clocks around ``step()``: ``time.thread_time()`` of the training thread (what a step costs the thread that
drives the device; the workers' own work and the waits do not count) and ``time.perf_counter()`` (wall time, waits
included: on the CPU stand-in of the asynchronous link, the end of ``step()`` waits for the copies it started, as
the device's later work waits for the copy stream; docs/design.md section 5). Only steps that are not boundaries
count; the median over them. Every candidate at every count takes its turn, ``--block`` steps back to back (as in a
training loop), turn after turn, so that drift hits all alike; an asynchronous step's background work is waited for,
untimed, so that it does not run beside the next step. ``--repeats`` rounds of the whole schedule: each round's ratio
to torch's foreach AdamW, and their median. Per-tensor cost: the least-squares slope of the medians over the counts.
The goal (``GOALS``): the asynchronous link's CPU time at most 0.5x torch's foreach AdamW at 150 tensors, 0.6x at 600.

Results: ``step_overhead_cpu.json`` (with the machine description) and ``.png`` in ``bench/results``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

from bench import harness
from bench.harness import OneLineParser, int_at_least, style
from bench.scale import slope, tiny_tensors

COUNTS = [50, 150, 300, 600]
QUICK_COUNTS = [8, 16]
ZENFLOW = dict(topk_ratio=0.1, select_strategy="step", select_interval=1000, update_interval=1000,
               overlap_step=True)
LR = 1e-3
CANDIDATES = ("zenflow_cpu_link", "zenflow_async_link", "zenflow_async_link_hooks", "torch_adamw_foreach",
              "torch_adamw_fused")
RULE_CANDIDATES = ("zenflow_async_link_lion", "zenflow_async_link_sgd", "zenflow_async_link_adam",
                   "zenflow_async_link_lion_torch", "zenflow_async_link_sgd_torch", "zenflow_async_link_adam_torch",
                   "zenflow_async_link_rmsprop_compiled", "zenflow_async_link_rmsprop_eager",
                   "zenflow_async_link_ademamix_compiled", "zenflow_async_link_from_torch_rmsprop")
BASE = "torch_adamw_foreach"
GOALS = {150: 0.5, 600: 0.6}  # the asynchronous link's CPU time per step over torch's foreach AdamW's, at most


def _rule(name: str):
    """The update rule of a ``RULE_CANDIDATES`` name (a fresh instance: each candidate's paths are its own)."""
    from bench import custom_rules
    from zenflow_kernels import rules

    kind = name.removeprefix("zenflow_async_link_").removesuffix("_torch")
    return {"lion": rules.Lion, "sgd": lambda: rules.SGD(momentum=0.9), "adam": rules.Adam,
            "rmsprop_compiled": lambda: custom_rules.RMSprop(compile=True),
            "rmsprop_eager": lambda: custom_rules.RMSprop(compile=False),
            "ademamix_compiled": lambda: custom_rules.AdEMAMix(compile=True),
            "from_torch_rmsprop": custom_rules.from_torch_rmsprop}[kind]()


class _Candidate:
    def __init__(self, name: str, count: int):
        import torch

        from zenflow_kernels import ZenFlow, ZenFlowAdamW
        from zenflow_kernels.testing import chaos

        self.name, self.count = name, count
        self.params, self.grads = tiny_tensors(count)
        self.backward = name.endswith("_hooks")
        if name.startswith("torch_adamw"):
            self.opt = torch.optim.AdamW(self.params, lr=LR, **{name.rsplit("_", 1)[1]: True})  # foreach or fused
        elif name in RULE_CANDIDATES:
            rule = _rule(name)
            if name.endswith("_torch"):  # the device step in plain torch, as a rule without a fused kernel has it
                rule.fast_step_ = rule.reference_fast_step_
            with chaos(seed=0, max_delay=0):
                self.opt = ZenFlow(self.params, rule, lr=LR, zenflow=ZENFLOW)
        else:
            with chaos(seed=0, max_delay=0) if name.startswith("zenflow_async_link") else contextlib.nullcontext():
                self.opt = ZenFlowAdamW(self.params, lr=LR, zenflow=ZENFLOW)
        self.samples: list[tuple[int, float, float]] = []  # (repeat, CPU seconds, wall seconds)
        self.boundaries = 0
        self.rule_paths = None  # stats()["rule_paths"] at close, for a rule of one's own

    def _counters(self) -> tuple:
        return (getattr(self.opt, "selections", 0), getattr(self.opt, "host_updates", 0))

    def _gradients(self) -> None:
        if not self.backward:
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad = g
            return
        import torch

        for p in self.params:
            p.grad = None
        # d(sum(p * g))/dp = g: each parameter's gradient is its fixed one, through autograd and its hooks
        torch.stack([(p * g).sum() for p, g in zip(self.params, self.grads, strict=True)]).sum().backward()

    def step(self, repeat: int | None) -> None:
        self._gradients()
        before = self._counters()
        c0, t0 = time.thread_time(), time.perf_counter()
        self.opt.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        link = getattr(self.opt, "link", None)
        if link is not None and link.asynchronous:
            link.synchronize()  # its copies and accumulation finish here, untimed, not beside the next step
        if repeat is None:
            return
        if self._counters() != before:
            self.boundaries += 1
        else:
            self.samples.append((repeat, cpu, wall))

    def settle_compiles(self) -> None:
        """Untimed steps until a step compiles nothing more (a rule whose compiled step reads a number as a constant
        compiles again at each new step count, up to ``rules.compiled.MAX_COMPILES``, then runs eager)."""
        from zenflow_kernels.rules import compiled

        if self.name not in RULE_CANDIDATES:
            return
        for _ in range(compiled.MAX_COMPILES + 1):
            before = self.opt.stats()["rule_paths"]["fast"].get("compiles", 0)
            self.step(None)
            if self.opt.stats()["rule_paths"]["fast"].get("compiles", 0) == before:
                return

    def close(self) -> None:
        if hasattr(self.opt, "close"):
            paths = self.opt.stats().get("rule_paths", {})
            if any(place.get("path") != "kernel" for place in paths.values()) and self.name in RULE_CANDIDATES:
                self.rule_paths = paths
            self.opt.close()


def _load() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (runnable processes; compare with the core count)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def measure(counts: list[int], steps: int, warmup: int, block: int, repeats: int, names=CANDIDATES) -> dict:
    import torch

    from zenflow_kernels.ops import use_backend

    torch.set_num_threads(1)
    with use_backend("numba"):
        candidates = [_Candidate(name, count) for count in counts for name in names]
        try:
            for c in candidates:
                for _ in range(warmup):
                    c.step(None)
                c.settle_compiles()
            for repeat in range(repeats):
                for _ in range(-(-steps // block)):
                    for c in candidates:
                        for _ in range(block):
                            c.step(repeat)
        finally:
            for c in candidates:
                c.close()
    rows = []
    for c in candidates:
        for clock, k in (("cpu", 1), ("wall", 2)):
            for repeat in range(repeats):
                s = sorted(x[k] for x in c.samples if x[0] == repeat)
                q = statistics.quantiles(s, n=4) if len(s) >= 4 else [s[0], statistics.median(s), s[-1]]
                rows.append(dict(tensors=c.count, candidate=c.name, clock=clock, repeat=repeat,
                                 median_ms=statistics.median(s) * 1e3, p25_ms=q[0] * 1e3, p75_ms=q[2] * 1e3,
                                 min_ms=s[0] * 1e3, steps=len(s), boundary_steps_left_out=c.boundaries))
    rule_paths = {}
    for c in candidates:
        if c.rule_paths is not None:
            rule_paths.setdefault(c.name, {})[str(c.count)] = c.rule_paths
    return dict(rows=rows, torch_threads=torch.get_num_threads(), rule_paths=rule_paths)


def summarise(rows: list[dict], counts: list[int], repeats: int, names=CANDIDATES) -> dict:
    """Per candidate and clock: the median over the repeats of each count's median, the slope over the counts,
    and (not for the base) the median over the repeats of the ratio to the base in the same repeat."""
    by = {(r["candidate"], r["clock"], r["tensors"], r["repeat"]): r["median_ms"] for r in rows}
    out = {}
    for cand in names:
        out[cand] = {}
        for clock in ("cpu", "wall"):
            ms = {n: statistics.median(by[cand, clock, n, k] for k in range(repeats)) for n in counts}
            entry = {f"ms_at_{n}": ms[n] for n in counts}
            per_tensor = slope([(n, ms[n] / 1e3) for n in counts])  # (seconds a tensor)
            entry["us_per_tensor"] = None if per_tensor is None else per_tensor * 1e6
            if cand != BASE:
                entry.update({f"vs_{BASE}_at_{n}": statistics.median(
                    by[cand, clock, n, k] / by[BASE, clock, n, k] for k in range(repeats)) for n in counts})
            out[cand][clock] = entry
    goals = {n: g for n, g in GOALS.items() if n in counts}
    if goals:
        ratios = out["zenflow_async_link"]["cpu"]
        out["goal"] = dict(limits={str(n): g for n, g in goals.items()},
                           met=all(ratios[f"vs_{BASE}_at_{n}"] <= g for n, g in goals.items()))
    return out


def plot(payload: dict, path) -> None:
    counts = payload["config"]["tensors"]
    fig, axes = harness.figure(2, size=(11, 4.2))
    axes[1].sharey(axes[0])
    for ax, clock in zip(axes, ("cpu", "wall"), strict=True):
        for cand in payload["config"]["candidates"]:
            e = payload["summary"][cand][clock]
            ax.plot(counts, [e[f"ms_at_{n}"] for n in counts], marker="o", label=cand)
        style(ax, "tensors (alternating fp32 [64, 64] and [64])", "ms per step (median of repeats)",
              f"step() between boundaries, {'training-thread CPU' if clock == 'cpu' else 'wall'} time", logx=10,
              logy=10, legend=8 if clock == "cpu" else None)
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.step_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="two small counts and a few steps (the test suite's run)")
    ap.add_argument("--tensors", type=int_at_least(2), nargs="+", default=None,
                    help=f"tensor counts (default {' '.join(map(str, COUNTS))})")
    ap.add_argument("--steps", type=int_at_least(4), default=None,
                    help="measured steps per candidate and repeat (default 100)")
    ap.add_argument("--warmup", type=int_at_least(1), default=None, help="untimed steps first (default 20)")
    ap.add_argument("--block", type=int_at_least(1), default=None,
                    help="steps of one candidate per turn (default 10)")
    ap.add_argument("--repeats", type=int_at_least(1), default=None, help="rounds of the schedule (default 3)")
    ap.add_argument("--rules", action="store_true",
                    help="also ZenFlow with Lion, SGD and Adam (their fused device step, and their torch step) and "
                         "with rules of one's own compiled (bench.custom_rules)")
    args = ap.parse_args(argv)
    names = CANDIDATES + (RULE_CANDIDATES if args.rules else ())
    stem = "step_overhead_rules_cpu" if args.rules else "step_overhead_cpu"
    out_dir = harness.output_dir(args.out)
    counts = sorted(set(args.tensors or (QUICK_COUNTS if args.quick else COUNTS)))
    steps = args.steps or (8 if args.quick else 100)
    warmup = args.warmup or (2 if args.quick else 20)
    block = args.block or (4 if args.quick else 10)
    repeats = args.repeats or (2 if args.quick else 3)
    from zenflow_kernels.rules.compiled import MAX_COMPILES

    settle = MAX_COMPILES + 1 if args.rules else 0  # (_Candidate.settle_compiles's steps, at most)
    if warmup + settle + repeats * -(-steps // block) * block >= ZENFLOW["update_interval"]:
        ap.error(f"argument --steps: warmup + repeats * steps must stay below update_interval="
                 f"{ZENFLOW['update_interval']}")

    started, load_before = time.perf_counter(), _load()
    result = measure(counts, steps, warmup, block, repeats, names)
    summary = summarise(result["rows"], counts, repeats, names)
    payload = dict(
        config=dict(candidates=list(names), tensors=counts, steps=steps, warmup=warmup, block=block, repeats=repeats,
                    quick=args.quick, zenflow=ZENFLOW, lr=LR, backend="numba", torch_threads=result["torch_threads"],
                    clocks=dict(cpu="time.thread_time", wall="time.perf_counter"),
                    shapes="alternating fp32 [64, 64] matrices and [64] vectors",
                    goals={str(n): g for n, g in GOALS.items()}),
        rows=result["rows"], summary=summary, total_s=time.perf_counter() - started,
        machine=harness.machine_info(),
        rule_paths=result["rule_paths"],  # the rules of one's own: compiled or eager, compiles and their seconds
        load_average=dict(before=load_before, after=_load()),  # the machine is shared: others' work slows ours
    )
    path = harness.write_result(out_dir / f"{stem}.json", payload)
    plot(payload, out_dir / f"{stem}.png")

    for clock in ("cpu", "wall"):
        print(f"{'training-thread CPU' if clock == 'cpu' else 'wall'} time per step() that is not a boundary, ms "
              f"(median of {repeats} repeats), and x torch's foreach AdamW in the same repeat")
        print(f"{'candidate':<38}" + "".join(f"{f'{n} tensors':>20}" for n in counts) + f"{'us/tensor':>11}")
        for cand in names:
            e = summary[cand][clock]
            cells = "".join(f"{e[f'ms_at_{n}']:>12.3f}" + (f" ({e[f'vs_{BASE}_at_{n}']:.2f}x)" if cand != BASE
                                                           else " " * 8) for n in counts)
            slope = e["us_per_tensor"]
            print(f"{cand:<38}" + cells + (f"{slope:>11.2f}" if slope is not None else f"{'-':>11}"))
    if "goal" in summary:
        limits = ", ".join(f"{g}x at {n}" for n, g in summary["goal"]["limits"].items())
        print(f"goal (zenflow_async_link CPU time at most {limits}): {'met' if summary['goal']['met'] else 'not met'}")
    for cand, by_count in result["rule_paths"].items():
        print(f"{cand}: " + "; ".join(f"{n} tensors: fast path {p['fast']['path']} ({p['fast']['compiles']} compiles, "
                                      f"{p['fast']['compile_s']:.1f} s)" for n, p in by_count.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
