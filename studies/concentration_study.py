"""When ZenFlow wins: quality against gradient concentration, with concentration as a knob (issue 42, item 2).

    python -m studies.concentration_study [--out DIR] [--alphas 0 0.25 0.5 0.75 1.5] [--seeds 0 1 2]
                                        [--steps 300] [--quick]

A student MLP (1024 -> 64 -> 16, tanh) regresses a wider random teacher (256 hidden units, so the student keeps
improving) on inputs whose channel ``j`` has scale ``(rank_j + 1) ** -alpha`` (seeded ranks), as LLMs' outlier
channels are few and large: the first layer's gradient column ``j`` follows input channel ``j``, so ``alpha = 0`` is
flat and ``1.5`` puts nearly all the energy in the top 10%. The shares are measured (ZenFlow's
``stats()["concentration"]`` at every selection, whole model, averaged over the run). Per level and seed, from the
same student and batches: ``adamw`` (the target), ``zenflow_overlap`` and ``zenflow_sync`` (``ZenFlowAdamW``,
``topk_ratio`` 0.1, ``update_interval`` 4, ``select_interval`` 8, with and without ``overlap_step``). Quality: the
share of AdamW's held-out improvement recovered at equal steps, ``(L0 - L_zenflow) / (L0 - L_adamw)``;
``adamw_end_over_half`` shows AdamW still improving. Speed is not measured (one CPU: bench.e2e, bench.overlap).

Results in ``studies/results``: ``concentration_study.json`` (command, machine, commit, every run, the per-level
summary) and ``concentration_study.png`` (recovered share against the measured top-10% share); the committed run's
record names ``bench.concentration_study``, where this module was then.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import OneLineParser, figure, output_dir, save, style, write_result

STUDY_RESULTS = Path(__file__).resolve().parent / "results"
D_IN, HIDDEN, D_OUT = 1024, 64, 16
TEACHER_HIDDEN = 256
BATCH, HELDOUT = 64, 1024
LR = 1e-4
ZENFLOW = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8, full_warm_up_rounds=0)
CANDIDATES = ("adamw", "zenflow_overlap", "zenflow_sync")
SHARES = ("top1", "top10", "selected")


def channel_scales(alpha: float, seed: int) -> torch.Tensor:
    """Input channel ``j``'s scale ``(rank_j + 1) ** -alpha``, ranks a seeded permutation, normalised to RMS 1."""
    gen = torch.Generator().manual_seed(1000 + seed)
    s = (torch.randperm(D_IN, generator=gen).double() + 1).pow(-alpha)
    return (s / s.pow(2).mean().sqrt()).float()


def mlp(seed: int, hidden: int = HIDDEN) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, D_OUT))


class Task:
    """A level and seed: the teacher, the input scales, the batches and the held-out set (the same for every
    candidate)."""

    def __init__(self, alpha: float, seed: int, steps: int):
        self.alpha, self.seed, self.steps = alpha, seed, steps
        self.scales = channel_scales(alpha, seed)
        self.teacher = mlp(10_000 + seed, TEACHER_HIDDEN).requires_grad_(False)
        gen = torch.Generator().manual_seed(2000 + seed)
        self.batches = [self.inputs(BATCH, gen) for _ in range(steps)]
        self.heldout = self.inputs(HELDOUT, gen)

    def inputs(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, D_IN, generator=gen) * self.scales
        with torch.no_grad():
            return x, self.teacher(x)

    @torch.no_grad()
    def loss(self, model) -> float:
        x, y = self.heldout
        return float(torch.nn.functional.mse_loss(model(x), y))


def run(task: Task, candidate: str) -> dict:
    """One candidate's training from the level's initial student: its final held-out loss and, for ZenFlow,
    the gradient's concentration over the run's selections."""
    from zenflow_kernels import ZenFlowAdamW

    model, zen = mlp(task.seed), candidate != "adamw"
    opt = (ZenFlowAdamW(model.parameters(), lr=LR, zenflow=dict(ZENFLOW, overlap_step=candidate == "zenflow_overlap"))
           if zen else torch.optim.AdamW(model.parameters(), lr=LR))
    t0 = time.perf_counter()
    row = dict(candidate=candidate, alpha=task.alpha, seed=task.seed)
    try:
        for t, (x, y) in enumerate(task.batches):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if t + 1 == task.steps // 2 and not zen:
                row["heldout_loss_at_half"] = task.loss(model)  # whether AdamW still improves in the second half
        if zen:
            opt.flush()  # the pending host update applied: the weights the run ends with
            c = opt.stats()["concentration"]
            row.update({f"{name}_share": statistics.fmean(c[name]) for name in SHARES}, selections=len(c["top10"]))
        return dict(row, heldout_loss=task.loss(model), seconds=time.perf_counter() - t0)
    finally:
        if zen:
            opt.close()


def summarise(rows: list[dict], alphas: list[float]) -> list[dict]:
    """Per level: the measured shares (mean over seeds and both ZenFlow runs) and, per ZenFlow candidate, the
    share of AdamW's improvement recovered (mean and min/max over seeds)."""
    out = []
    for alpha in alphas:
        at = [r for r in rows if r["alpha"] == alpha]
        zen = [r for r in at if r["candidate"] != "adamw"]
        entry = dict(alpha=alpha, **{f"{n}_share": statistics.fmean(r[f"{n}_share"] for r in zen) for n in SHARES})
        for cand in CANDIDATES[1:]:
            rec = [r["recovered"] for r in at if r["candidate"] == cand]
            entry[f"{cand}_recovered"] = statistics.fmean(rec)
            entry[f"{cand}_recovered_range"] = [min(rec), max(rec)]
        adamw = [r for r in at if r["candidate"] == "adamw"]
        entry["adamw_improvement"] = statistics.fmean(r["improvement"] for r in adamw)
        # AdamW's held-out loss at the end over the one at half the steps: < 1 while it is still improving
        entry["adamw_end_over_half"] = statistics.fmean(r["heldout_loss"] / r["heldout_loss_at_half"] for r in adamw)
        out.append(entry)
    return out


def plot(summary: list[dict], path) -> None:
    fig, ax = figure(size=(6.5, 4.2))
    x = [s["top10_share"] for s in summary]
    for cand, marker in (("zenflow_overlap", "o-"), ("zenflow_sync", "s--")):
        y = [s[f"{cand}_recovered"] for s in summary]
        err = [[m - s[f"{cand}_recovered_range"][0] for m, s in zip(y, summary, strict=True)],
               [s[f"{cand}_recovered_range"][1] - m for m, s in zip(y, summary, strict=True)]]
        ax.errorbar(x, y, yerr=err, fmt=marker, capsize=3, label=cand.replace("_", ", "))
    for s in summary:
        ax.annotate(f"a={s['alpha']:g}", (s["top10_share"], s["zenflow_sync_recovered"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlim(0, 1.02)
    style(ax, "measured share of the gradient's energy in the top 10% of columns",
          "share of AdamW's held-out improvement recovered",
          "ZenFlow against gradient concentration (equal steps; bars: seeds' range)", legend=8)
    ax.title.set_fontsize(9)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m studies.concentration_study", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default studies/results)")
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.5],
                    help="concentration levels: channel scale exponents (default 0 0.25 0.5 0.75 1.5)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default 0 1 2)")
    ap.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    ap.add_argument("--quick", action="store_true", help="2 levels, 1 seed, 24 steps (the test suite's run)")
    args = ap.parse_args(argv)
    if args.steps < 8:
        ap.error(f"argument --steps: {args.steps} is too few: allowed at least 8 (one selection interval)")
    if any(a < 0 for a in args.alphas):
        ap.error(f"argument --alphas: {args.alphas} has a negative exponent: allowed >= 0")
    if args.quick:
        args.alphas, args.seeds, args.steps = [0.0, 1.25], [0], 24
    torch.set_num_threads(1)
    out_dir = output_dir(args.out or STUDY_RESULTS)
    t_start = time.perf_counter()
    rows = []
    for alpha in args.alphas:
        for seed in args.seeds:
            task = Task(alpha, seed, args.steps)
            start = task.loss(mlp(seed))
            got = [dict(run(task, cand), initial_heldout_loss=start) for cand in CANDIDATES]
            adamw_gain = start - got[0]["heldout_loss"]
            for r in got:
                r["improvement"] = start - r["heldout_loss"]
                r["recovered"] = r["improvement"] / adamw_gain if adamw_gain > 0 else float("nan")
            rows += got
            print(f"alpha {alpha:g} seed {seed}: top10 {got[1]['top10_share']:.2f}, recovered "
                  f"overlap {got[1]['recovered']:.2f}, sync {got[2]['recovered']:.2f} "
                  f"(held-out {start:.4f} -> AdamW {got[0]['heldout_loss']:.4f})", flush=True)
    summary = summarise(rows, args.alphas)
    payload = {
        "command": " ".join(["python -m studies.concentration_study", *argv]),
        "description": __doc__,
        "config": dict(alphas=args.alphas, seeds=args.seeds, steps=args.steps, quick=args.quick, d_in=D_IN,
                       hidden=HIDDEN, d_out=D_OUT, batch=BATCH, heldout=HELDOUT, lr=LR, zenflow=ZENFLOW,
                       torch_threads=1),
        "summary": summary, "runs": rows, "total_s": time.perf_counter() - t_start,
    }
    path = write_result(out_dir / "concentration_study.json", payload)
    plot(summary, out_dir / "concentration_study.png")
    for s in summary:
        print(f"alpha {s['alpha']:g}: top1 {s['top1_share']:.2f} top10 {s['top10_share']:.2f} selected "
              f"{s['selected_share']:.2f}; recovered with overlap {s['zenflow_overlap_recovered']:.2f}, without "
              f"{s['zenflow_sync_recovered']:.2f}")
    print(f"wrote {path} and concentration_study.png ({payload['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
