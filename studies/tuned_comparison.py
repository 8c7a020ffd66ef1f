"""What ZenFlow costs in quality, measured fairly: every variant at its own best learning rate (issue 56).

    python -m studies.tuned_comparison --workload study_flat [--out DIR] [--quick] [--variants ...]

Optimizers compare each at its own tuned rate and by the time to a target (MLCommons AlgoPerf; Schmidt et al. 2021):
at one shared rate, a variant taking larger steps looks better for its step size alone. Per workload
(studies/workloads.py) and variant (``VARIANTS``; the byte-GPT workloads, whose runs cost ~20x the MLP's, run
``GPT_VARIANTS``): rates ``center * 2**k`` over 6 points (32x), grown past an edge while the best (lowest mean final
held-out loss, seeds 0-2) is there (up to 8 each way); seeds 3 and 4 at the best two, the better on 5 seeds chosen
(at an edge, the grid grows and the choice is made again); a loss that is not finite counts as diverged (infinite).
The target, per seed (the seed changes the byte GPT's corpus and pre-training): AdamW's held-out loss, at its own
best rate, at 75% of its steps (a looser one at half: ``steps_to_half_target``); each variant's steps to it, linear
between evaluations, over AdamW's, paired by seed (``None`` where a seed never reaches it). At each best rate: the
final loss (mean, range over 5 seeds), its gap to and ratio over AdamW's, the share of AdamW's improvement recovered
``(L0 - L) / (L0 - L_adamw)`` (above 1: better than tuned AdamW), the steps to the target, the rate over AdamW's.
``offload`` (synchronous, AdamW's arithmetic on the host) runs at AdamW's rate only, a check that its curve is AdamW's.

Results in ``studies/results``: ``tuned_{workload}.json`` (command, machine, commit, every run's curve, the summary)
and ``tuned_{workload}.png`` (the tuning curves); runs are appended to ``tuned_{workload}.runs.jsonl`` as they finish,
and ``--resume`` takes them from there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import OneLineParser, figure, output_dir, save, style, write_result
from studies import workloads as wl

RESULTS = Path(__file__).resolve().parent / "results"
RATIO = 2.0
GRID = tuple(range(-2, 4))  # k: lr = center * RATIO**k, 6 points over 32x
MAX_EXTEND = 8
SEEDS = (0, 1, 2)
EXTRA_SEEDS = (3, 4)
TARGET_AT = 0.75

BASE_ZENFLOW = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8,
                    full_warm_up_rounds=0, overlap_step=False, pt_reserved_cores_perc=1.0)
OFFLOAD = dict(full_warm_up_rounds=10**9, overlap_step=False, select_strategy="step", select_interval=1,
               update_interval=1)


@dataclasses.dataclass(frozen=True)
class Variant:
    """``family``: whose grid centre it starts from ("adam", "lion", "sgd"); ``kind``: "adamw", "lion", "sgd"
    (plain), "zenflow" or "lr_times_interval"; ``zenflow``: overrides of ``BASE_ZENFLOW``; ``rule``: ZenFlow's rule;
    ``check``: run at AdamW's best rate only; ``state``: the host state ("fp32", or bf16 "nearest"/"stochastic")."""

    family: str
    kind: str
    zenflow: dict = dataclasses.field(default_factory=dict)
    rule: str = "adamw"
    check: bool = False
    state: str = "fp32"


def _zen(state: str = "fp32", **zenflow) -> Variant:
    return Variant("adam", "zenflow", zenflow, state=state)


VARIANTS: dict[str, Variant] = {
    "adamw": Variant("adam", "adamw"), "offload": Variant("adam", "zenflow", OFFLOAD, check=True),
    "zenflow": _zen(), "overlap": _zen(overlap_step=True), "deepspeed": _zen(semantics="deepspeed"),
    **{name: _zen(**{name: value}) for name, value in dict(
        gradient_scale="interval", host_step_count="steps", reselect_state="reset", vector_state="reset",
        importance="l1").items()},
    # without warm-up the two selection anchors coincide: select_anchor has 3 rounds, compared with warm_up3
    "warm_up3": _zen(full_warm_up_rounds=3), "select_anchor": _zen(full_warm_up_rounds=3, select_anchor="absolute"),
    **{f"topk{k:g}_ui{u}": _zen(topk_ratio=k, update_interval=u, select_interval=2 * u)
       for k in (0.05, 0.25) for u in (2, 8)},
    "lr_times_interval": Variant("adam", "lr_times_interval"),
    # ZenFlow's defaults with the host moments in bf16
    "bf16_nearest": _zen("nearest"), "bf16_stochastic": _zen("stochastic"),
    "lion": Variant("lion", "lion"), "zenflow_lion": Variant("lion", "zenflow", rule="lion"),
    "sgd": Variant("sgd", "sgd"), "zenflow_sgd": Variant("sgd", "zenflow", rule="sgd"),
}
# (in the order they run: a sweep cut short still holds the main comparisons)
GPT_VARIANTS = ("adamw", "offload", "zenflow", "deepspeed", "overlap", "lr_times_interval", "lion", "zenflow_lion",
                "sgd", "zenflow_sgd", "host_step_count", "reselect_state", "topk0.05_ui8", "topk0.25_ui2",
                "topk0.05_ui2", "bf16_nearest", "bf16_stochastic")


class PlainLion(torch.optim.Optimizer):
    """Lion as the paper writes it (Chen et al. 2023, Algorithm 2), in plain torch: ZenFlow's Lion's reference."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (beta1 * m + (1 - beta1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def build_optimizer(variant: Variant, params, lr: float, weight_decay: float):
    """The variant's optimizer over ``params`` at ``lr``."""
    from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules

    zen, wd = dict(BASE_ZENFLOW, **variant.zenflow), dict(weight_decay=weight_decay)
    plain = {"adamw": torch.optim.AdamW, "lion": PlainLion, "sgd": functools.partial(torch.optim.SGD, momentum=0.9)}
    if variant.kind in plain:
        return plain[variant.kind](params, lr=lr, **wd)
    if variant.kind == "lr_times_interval":
        from examples.ablations import LrTimesInterval

        return LrTimesInterval(params, lr=lr, zenflow=zen, **wd)
    if variant.rule != "adamw" or variant.state != "fp32":  # (rules.AdamW's defaults are ZenFlowAdamW's)
        rule = {"lion": lambda: rules.Lion(**wd), "sgd": lambda: rules.SGD(momentum=0.9, **wd),
                "adamw": lambda: rules.AdamW(state_dtype=torch.bfloat16, state_rounding=variant.state, **wd)}
        return ZenFlow(params, rule[variant.rule](), lr=lr, zenflow=zen)
    return ZenFlowAdamW(params, lr=lr, zenflow=zen, **wd)


def run(task: wl.Task, workload: str, name: str, lr: float) -> dict:
    """One training run of ``name`` at ``lr``: the held-out curve and, for ZenFlow, the concentration."""
    spec = wl.WORKLOADS[workload]
    model = task.model()
    opt = build_optimizer(VARIANTS[name], task.trainable(model), lr, spec.weight_decay)
    zen = hasattr(opt, "flush")
    warm = max(1, math.ceil(spec.warmup_frac * task.steps)) if spec.warmup_frac > 0 else 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm)) if warm else None
    # evaluations every a divisor of 75% of the steps, so the target's step is one (a quick run's few: every quarter)
    every = max(1, task.steps // (4 if task.steps < 100 else 20 if workload.startswith("study_") else 16))
    curve, error, top10 = [[0, task.heldout(model)]], None, None
    t0 = time.perf_counter()
    try:
        for s in range(task.steps):
            loss = task.loss(model, s)
            if not math.isfinite(float(loss.detach())):
                error = f"training loss {float(loss.detach())} at step {s}"
                break
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            if (s + 1) % every == 0 or s + 1 == task.steps:
                if s + 1 == task.steps and zen:
                    opt.flush()
                curve.append([s + 1, task.heldout(model)])
        if zen:
            shares = opt.stats()["concentration"]["top10"]
            top10 = statistics.fmean(shares) if shares else None
    except (RuntimeError, ValueError) as exc:  # a diverging run may fail inside the optimizer: it is a result
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        if zen:
            opt.close()
    final = curve[-1][1] if error is None and len(curve) > 1 and curve[-1][0] == task.steps else math.inf
    final = final if math.isfinite(final) else math.inf
    return dict(final=final, curve=curve, error=error, top10_share=top10, metrics=task.metrics(model) if
                final < math.inf else {}, seconds=time.perf_counter() - t0)


# -- the sweep -------------------------------------------------------------------------------------------------


class Sweep:
    """The runs of one workload, cached by (variant, k, seed) and appended to a JSON-lines file as they finish."""

    def __init__(self, workload: str, quick: bool, log: Path | None, resume: bool):
        self.workload, self.quick, self.log = workload, quick, log
        self.spec = wl.WORKLOADS[workload]
        self.tasks: dict[int, wl.Task] = {}
        self.runs: dict[tuple[str, int, int], dict] = {}
        if log is not None and resume and log.exists():
            for r in map(json.loads, log.read_text().splitlines()):
                if math.isclose(r["lr"], self.lr(r["variant"], r["k"]), rel_tol=1e-9):
                    self.runs[(r["variant"], r["k"], r["seed"])] = r
        elif log is not None and log.exists():
            log.unlink()

    def lr(self, name: str, k: int) -> float:
        return self.spec.centers[VARIANTS[name].family] * RATIO ** k

    def task(self, seed: int) -> wl.Task:
        if seed not in self.tasks:
            self.tasks[seed] = wl.task(self.workload, seed, self.quick)
        return self.tasks[seed]

    def ensure(self, name: str, k: int, seeds) -> list[dict]:
        for seed in seeds:
            if (name, k, seed) not in self.runs:
                lr = self.lr(name, k)
                r = self.runs[(name, k, seed)] = dict(variant=name, k=k, seed=seed, lr=lr,
                                                      **run(self.task(seed), self.workload, name, lr))
                if self.log is not None:
                    with self.log.open("a") as f:
                        f.write(json.dumps(r) + "\n")
                print(f"{self.workload} {name} lr {lr:.3g} seed {seed}: {r['final']:.4f}"
                      + (f" ({r['error']})" if r["error"] else ""), flush=True)
        return [self.runs[(name, k, seed)] for seed in seeds]

    def mean_final(self, name: str, k: int, seeds) -> float:
        finals = [r["final"] for r in self.ensure(name, k, seeds)]
        return statistics.fmean(finals) if all(math.isfinite(v) for v in finals) else math.inf

    def tune(self, name: str, seeds=SEEDS, extra=EXTRA_SEEDS, grid=GRID, max_extend: int = MAX_EXTEND) -> dict:
        """The grid, extended until the best is inside (or ``max_extend`` points each way), then the best two on
        the extra seeds; where the better of those is at an edge, the grid grows past it and the choice is made
        again. Returns the chosen ``k``, the grid and whether ``k`` is inside it."""
        ks = list(grid)
        full = tuple(seeds) + tuple(extra)

        def grow(best) -> bool:
            if best == ks[0] and ks[0] > grid[0] - max_extend:
                ks.insert(0, ks[0] - 1)
            elif best == ks[-1] and ks[-1] < grid[-1] + max_extend:
                ks.append(ks[-1] + 1)
            else:
                return False
            return True

        while True:
            means = {k: self.mean_final(name, k, seeds) for k in ks}
            if grow(min(ks, key=lambda k: means[k])):
                continue
            two = sorted(ks, key=lambda k: means[k])[:2]
            best = min(two, key=lambda k: self.mean_final(name, k, full))
            if not grow(best):
                return dict(k=best, ks=ks, inside=ks[0] < best < ks[-1], seeds=list(full))


def value_at(curve, step: float) -> float:
    """The held-out loss at ``step``, linear between the curve's points."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    raise ValueError(f"step={step} is outside the curve's steps {curve[0][0]}..{curve[-1][0]}")


def steps_to(curve, target: float, rtol: float = 1e-6) -> float | None:
    """The first step at which the curve reaches ``target`` (linear between points); None if it never does.
    Within ``rtol`` counts as reached: AdamW's own run meets its target exactly at an evaluation point, and a run
    equal to it but for float noise (synchronous offload) must meet it there too."""
    within = target + rtol * abs(target)
    if curve[0][1] <= within:
        return float(curve[0][0])
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= within:
            return float(s1) if l1 >= target else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def ratio(steps: float | None, adamw_steps: float | None) -> float | None:
    """Steps over AdamW's; None where either is missing or AdamW's is 0 (its own target no lower than its start: a
    run that did not improve on it gives no ratio)."""
    return None if steps is None or not adamw_steps else steps / adamw_steps


def spread(values) -> dict:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < len(values):
        return dict(mean=None, min=None, max=None, n=len(values), missing=len(values) - len(finite))
    return dict(mean=statistics.fmean(finite), min=min(finite), max=max(finite), n=len(finite), missing=0)


def study(workload: str, names, quick: bool, log: Path | None, resume: bool, sweep: Sweep | None = None) -> dict:
    """Every variant's sweep and its figures at its own best rate; AdamW's first (its curve sets the target).
    ``sweep``: one holding runs already (the tests summarise the committed runs again)."""
    sweep = sweep or Sweep(workload, quick, log, resume)
    seeds, extra = (SEEDS[:1], EXTRA_SEEDS[:1]) if quick else (SEEDS, EXTRA_SEEDS)
    grid, extend = (GRID[1:4], 1) if quick else (GRID, MAX_EXTEND)
    tuned = {"adamw": sweep.tune("adamw", seeds, extra, grid, extend)}
    for name in [n for n in names if n != "adamw"]:
        if VARIANTS[name].check:
            k = tuned["adamw"]["k"]
            sweep.ensure(name, k, tuple(seeds) + tuple(extra))
            tuned[name] = dict(k=k, ks=[k], inside=None, seeds=list(seeds) + list(extra))
        else:
            tuned[name] = sweep.tune(name, seeds, extra, grid, extend)
    return summarise(workload, sweep, tuned)


def summarise(workload: str, sweep: Sweep, tuned: dict) -> dict:
    steps = sweep.task(0).steps
    at_best = {n: [sweep.runs[(n, t["k"], s)] for s in t["seeds"]] for n, t in tuned.items()}
    adamw = at_best["adamw"]
    target_step = TARGET_AT * steps
    # per seed: the loss AdamW's run of that seed reaches at 75% of the steps, and a looser one at half the steps
    targets = {r["seed"]: value_at(r["curve"], target_step) for r in adamw}
    half_targets = {r["seed"]: value_at(r["curve"], steps / 2) for r in adamw}
    adamw_steps = {r["seed"]: steps_to(r["curve"], targets[r["seed"]]) for r in adamw}
    adamw_half = {r["seed"]: steps_to(r["curve"], half_targets[r["seed"]]) for r in adamw}
    adamw_final = {r["seed"]: r["final"] for r in adamw}

    def finals(name, k, seeds):
        return spread([sweep.runs[(name, k, s)]["final"] for s in seeds if (name, k, s) in sweep.runs])

    out = {}
    for name, t in tuned.items():
        runs = at_best[name]
        seed = [r["seed"] for r in runs]
        reached = [steps_to(r["curve"], targets[r["seed"]]) for r in runs]
        reached_half = [steps_to(r["curve"], half_targets[r["seed"]]) for r in runs]
        over = [ratio(x, adamw_steps[s]) for x, s in zip(reached, seed, strict=True)]
        # where a seed never reached it, it needed more than the run's steps: a lower bound on the mean ratio
        at_least = [ratio(steps, adamw_steps[s]) if x is None else x for x, s in zip(over, seed, strict=True)]
        top10 = [r["top10_share"] for r in runs if r["top10_share"] is not None]
        out[name] = dict(
            family=VARIANTS[name].family, best_lr=sweep.lr(name, t["k"]), best_k=t["k"], best_inside=t["inside"],
            lr_over_adamw=sweep.lr(name, t["k"]) / sweep.lr("adamw", tuned["adamw"]["k"]),
            final=spread([r["final"] for r in runs]),
            gap_vs_adamw=spread([r["final"] - adamw_final[r["seed"]] for r in runs]),
            final_over_adamw=spread([r["final"] / adamw_final[r["seed"]] for r in runs]),
            recovered=spread([(r["curve"][0][1] - r["final"]) / (r["curve"][0][1] - adamw_final[r["seed"]])
                              for r in runs]),
            steps_to_target=spread(reached), steps_over_adamw=spread(over),
            steps_over_adamw_at_least=None if None in at_least else statistics.fmean(at_least),
            half_steps_over_adamw=spread([ratio(x, adamw_half[s]) for x, s in zip(reached_half, seed, strict=True)]),
            reached=sum(x is not None for x in reached), seeds=len(runs), steps_to_target_per_seed=reached,
            steps_to_half_target=spread(reached_half), reached_half=sum(x is not None for x in reached_half),
            top10_share=statistics.fmean(top10) if top10 else None,
            grid=[dict(k=k, lr=sweep.lr(name, k), final_3_seeds=finals(name, k, SEEDS),
                       final_all_seeds=finals(name, k, t["seeds"])) for k in t["ks"]],
            errors=sorted({r["error"] for key, r in sweep.runs.items() if key[0] == name and r["error"]}),
        )
        metrics = [r["metrics"] for r in runs if r["metrics"]]
        if metrics:
            out[name]["metrics"] = {key: spread([m[key] for m in metrics]) for key in metrics[0]}
    for plain, zen in (("lion", "zenflow_lion"), ("sgd", "zenflow_sgd")):
        if plain in out and zen in out:
            pf = {r["seed"]: r["final"] for r in at_best[plain]}
            out[zen]["gap_vs_plain"] = spread([r["final"] - pf[r["seed"]] for r in at_best[zen]])
    return dict(workload=workload, steps=steps, initial_heldout=statistics.fmean(r["curve"][0][1] for r in adamw),
                target=statistics.fmean(targets.values()), target_step=target_step,
                half_target=statistics.fmean(half_targets.values()), targets_per_seed=targets,
                adamw_best_lr=sweep.lr("adamw", tuned["adamw"]["k"]), variants=out)


# -- plot, command line ----------------------------------------------------------------------------------------


def draw_tuning(ax, summary: dict, families, only=None) -> None:
    """One panel of tuning curves: each variant of ``families`` (and in ``only``, where given), its final held-out
    loss (mean over seeds 0-2, their range as a band) against the learning rate, a star at its chosen rate, the
    target as a dotted line."""
    for name, v in summary["variants"].items():
        if v["family"] not in families or len(v["grid"]) < 2 or (only is not None and name not in only):
            continue
        pts = [(g["lr"], g["final_3_seeds"]) for g in v["grid"] if g["final_3_seeds"]["mean"] is not None]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        line, = ax.plot(xs, [s["mean"] for _, s in pts], marker="o", ms=3, lw=1, label=name,
                        ls="-" if "zenflow" in name or v["family"] == "adam" else "--")
        ax.fill_between(xs, [s["min"] for _, s in pts], [s["max"] for _, s in pts], color=line.get_color(),
                        alpha=0.12)
        ax.plot([v["best_lr"]], [v["final"]["mean"]], marker="*", ms=10, color=line.get_color())
    ax.axhline(summary["target"], color="grey", lw=0.8, ls=":",
               label="target (AdamW at 75% of the steps, mean of the seeds)")
    finite = [g["final_3_seeds"]["mean"] for v in summary["variants"].values() for g in v["grid"]
              if v["family"] in families and g["final_3_seeds"]["mean"] is not None]
    if finite:
        lo = min(finite)
        ax.set_ylim(lo - 0.02 * abs(lo), min(max(finite), summary["initial_heldout"] * 1.05))
    style(ax, "learning rate", "final held-out loss (mean, range over seeds 0-2)",
          f"{summary['workload']}: {'/'.join(families)}", logx=10, legend=None, grid=None)
    ax.legend(fontsize=7, ncol=2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m studies.tuned_comparison", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=sorted(wl.WORKLOADS), required=True)
    ap.add_argument("--out", default=None, help="output directory (default studies/results)")
    ap.add_argument("--variants", nargs="+", default=None, help="only these (AdamW always runs: it sets the target)")
    ap.add_argument("--quick", action="store_true",
                    help="a few steps, 3 rates (one more each way at most), 2 seeds (the tests' run)")
    ap.add_argument("--resume", action="store_true", help="take the runs already in the .runs.jsonl file")
    args = ap.parse_args(argv)
    allowed = tuple(VARIANTS) if args.workload.startswith("study_") else GPT_VARIANTS
    names = list(args.variants or allowed)
    if not set(names) <= set(allowed):
        ap.error(f"argument --variants: {sorted(set(names) - set(allowed))} unknown for {args.workload}: "
                 f"allowed {list(allowed)}")
    out_dir = output_dir(args.out or RESULTS)
    torch.set_num_threads(1)  # one core each: the workloads run side by side
    t0 = time.perf_counter()
    log = out_dir / f"tuned_{args.workload}.runs.jsonl"
    summary = study(args.workload, names, args.quick, log, args.resume)
    sweep_runs = [json.loads(line) for line in log.read_text().splitlines()]
    payload = {
        "command": " ".join(["python -m studies.tuned_comparison", *argv]),
        "description": __doc__,
        "config": dict(workload=dataclasses.asdict(wl.WORKLOADS[args.workload]), quick=args.quick, ratio=RATIO,
                       grid=list(GRID), max_extend=MAX_EXTEND, seeds=list(SEEDS), extra_seeds=list(EXTRA_SEEDS),
                       target_at=TARGET_AT, base_zenflow=BASE_ZENFLOW,
                       variants={n: dataclasses.asdict(VARIANTS[n]) for n in names}),
        "summary": summary, "runs": sweep_runs,
        "total_s": time.perf_counter() - t0,  # (a --resume run: the runs it made; runs_s: all of them)
        "runs_s": sum(r["seconds"] for r in sweep_runs),
    }
    path = write_result(out_dir / f"tuned_{args.workload}.json", payload)
    # the tuning curves: the Adam family in one panel, Lion and SGD, plain and under ZenFlow, in the other
    fig, axes = figure(2, size=(13, 5))
    for ax, families in zip(axes, (("adam",), ("lion", "sgd")), strict=True):
        draw_tuning(ax, summary, families)
    save(fig, out_dir / f"tuned_{args.workload}.png")
    for name, v in summary["variants"].items():
        st = v["steps_to_target"]
        print(f"{args.workload} {name}: lr {v['best_lr']:.3g} ({v['lr_over_adamw']:.2g}x AdamW's"
              f"{'' if v['best_inside'] is not False else ', AT THE GRID EDGE'}), final {v['final']['mean']}, "
              f"recovered {v['recovered']['mean']}, steps to target {st['mean']} ({v['reached']}/{v['seeds']})")
    print(f"wrote {path} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
