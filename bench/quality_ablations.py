"""Which of ZenFlow's choices bring its quality closest to AdamW's, and at which concentration (issue 42, item 4).

    python -m bench.quality_ablations [--task study|gpt] [--out DIR] [--seeds 0 1 2] [--quick]

Quality is the share of AdamW's held-out improvement a variant recovers at equal steps, ``(L0 - L) / (L0 -
L_adamw)``, with AdamW (``torch.optim.AdamW``) at the same learning rate, from the same start on the same batches;
3 seeds each. The variants, each one change from the base ZenFlow (``topk_ratio`` 0.1, ``update_interval`` 4,
``select_interval`` 8, no overlap, our six choices):

* ``overlap``: ``overlap_step=True``;
* each of DeepSpeed's six choices alone (``zenflow`` fields, docs/deepspeed.md), and all six
  (``semantics="deepspeed"``); ``select_anchor`` acts only with a warm-up, so it runs with ``full_warm_up_rounds``
  3 against the base with the same warm-up (``warm_up3``);
* ``lr_times_interval``: the host update's learning rate times its interval's length (examples/ablations.py's
  ``LrTimesInterval``: one step with the interval's mean gradient standing for the interval's steps);
* ``topk_ratio`` x ``update_interval``: 0.05, 0.1, 0.25 x 2, 4, 8 (``select_interval`` twice the interval);
* ``zen_auto``: ``update_interval="auto"`` (bounded by the select interval);
* at three times the learning rate, with AdamW at that rate too: the base (``lr3x``) and with overlap
  (``lr3x_overlap``).

Tasks:

* ``study``: the controlled study's teacher-student MLP (bench/concentration_study.py, 300 steps, lr 1e-4) at three
  levels of concentration (``alpha`` 0, 0.5, 1.5: about 19%, 74% and 94% of the gradient's energy in the top 10% of
  columns);
* ``gpt``: the demo's byte GPT (bench/e2e_core.py, the small model fine-tuned 160 steps at lr 3e-4 with warm-up),
  whose gradient is flat (about a third of the energy in the top 10% of columns), with selections every 8 steps as
  in the study (the demo selects once per epoch, longer than the run: the choices about re-selection would do
  nothing); the seed changes the corpus sample, the pre-training and the batches. ``topk_ratio`` x
  ``update_interval`` runs only its corners there (0.05 and 0.25 x 2 and 8).

Results: ``quality_ablations_{task}.json`` (command, machine, commit, every run's held-out loss, the summary: each
variant's recovered share, mean and range over seeds, per level) and ``quality_ablations_{task}.png``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.harness import OneLineParser, machine_info_light, output_dir, plt, write_json_light

STUDY_ALPHAS = (0.0, 0.5, 1.5)
GRID_TOPK = (0.05, 0.1, 0.25)
GRID_UI = (2, 4, 8)
CHOICE_VALUES = {"gradient_scale": "interval", "host_step_count": "steps", "reselect_state": "reset",
                 "vector_state": "reset", "importance": "l1"}


def variants(task: str) -> dict[str, dict]:
    """Each variant: ``zenflow`` overrides of the base, ``lr_scale`` (1 or 3), ``lr_times_interval``."""
    out = {"base": {}, "overlap": dict(zenflow=dict(overlap_step=True))}
    for name, value in CHOICE_VALUES.items():
        out[name] = dict(zenflow={name: value})
    out["warm_up3"] = dict(zenflow=dict(full_warm_up_rounds=3))
    out["select_anchor"] = dict(zenflow=dict(full_warm_up_rounds=3, select_anchor="absolute"))
    out["deepspeed"] = dict(zenflow=dict(semantics="deepspeed"))
    out["lr_times_interval"] = dict(lr_times_interval=True)
    grid = [(k, u) for k in GRID_TOPK for u in GRID_UI]
    if task == "gpt":
        grid = [(k, u) for k, u in grid if k != 0.1 and u != 4]
    for k, u in grid:
        if (k, u) != (0.1, 4):
            out[f"topk{k:g}_ui{u}"] = dict(zenflow=dict(topk_ratio=k, update_interval=u, select_interval=2 * u))
    out["zen_auto"] = dict(zenflow=dict(update_interval="auto"))
    out["lr3x"] = dict(lr_scale=3)
    out["lr3x_overlap"] = dict(lr_scale=3, zenflow=dict(overlap_step=True))
    return out


def make_zenflow(params, lr: float, zenflow: dict, lr_times_interval: bool, weight_decay: float | None = None):
    from zenflow_kernels import ZenFlowAdamW

    kwargs = {} if weight_decay is None else dict(weight_decay=weight_decay)
    if lr_times_interval:
        from examples.ablations import LrTimesInterval

        return LrTimesInterval(params, lr=lr, zenflow=zenflow, **kwargs)
    return ZenFlowAdamW(params, lr=lr, zenflow=zenflow, **kwargs)


# -- the controlled study -------------------------------------------------------------------------------------


def study_rows(seeds, steps: int, alphas=STUDY_ALPHAS, names=None) -> list[dict]:
    from bench import concentration_study as cs

    table = variants("study")
    rows = []
    for alpha in alphas:
        for seed in seeds:
            task = cs.Task(alpha, seed, steps)
            start = task.loss(cs.mlp(seed))
            adamw = {}
            for scale in (1, 3):
                model = cs.mlp(seed)
                opt = torch.optim.AdamW(model.parameters(), lr=cs.LR * scale)
                train_study(task, model, opt)
                adamw[scale] = task.loss(model)
                rows.append(dict(task="study", alpha=alpha, seed=seed, variant=f"adamw_lr{scale}x",
                                 heldout_loss=adamw[scale], initial_heldout_loss=start))
            for name, spec in table.items():
                if names is not None and name not in names:
                    continue
                scale = spec.get("lr_scale", 1)
                model = cs.mlp(seed)
                zen = dict(cs.ZENFLOW, **spec.get("zenflow", {}))
                with make_zenflow(model.parameters(), cs.LR * scale, zen, spec.get("lr_times_interval", False)) as opt:
                    train_study(task, model, opt)
                    opt.flush()
                    top10 = statistics.fmean(opt.stats()["concentration"]["top10"])
                loss = task.loss(model)
                rows.append(dict(task="study", alpha=alpha, seed=seed, variant=name, heldout_loss=loss,
                                 initial_heldout_loss=start, top10_share=top10,
                                 recovered=(start - loss) / (start - adamw[scale])))
            print(f"study alpha {alpha:g} seed {seed}: " + ", ".join(
                f"{r['variant']} {r['recovered']:.2f}" for r in rows
                if r["alpha"] == alpha and r["seed"] == seed and "recovered" in r), flush=True)
    return rows


def train_study(task, model, opt) -> None:
    for x, y in task.batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# -- the byte GPT -------------------------------------------------------------------------------------------------


def gpt_rows(seeds, steps: int | None, model: str, names=None) -> list[dict]:
    from bench import e2e_core

    table = variants("gpt")
    rows = []
    for seed in seeds:
        # selections every 8 steps, as in the study (the demo's once per epoch would make the choices about
        # re-selection no-ops: an epoch is longer than the run)
        base_cfg = e2e_core.E2EConfig(model=model, seed=seed, overlap=False, device="cpu", select_interval=8,
                                      **({} if steps is None else dict(steps=steps)))
        prepared = {}
        for scale in (1, 3):
            cfg = e2e_core.E2EConfig(**{**base_cfg.__dict__, "lr": base_cfg.lr * scale})
            prepared[scale] = prep = e2e_core.prepare(cfg, e2e_core.cache_dir())
            start = prep.pretrain["heldout_loss"]
            run = e2e_core.train_run(e2e_core.RunSpec(f"adamw_lr{scale}x", "adamw"), prep)
            rows.append(dict(task="gpt", seed=seed, variant=f"adamw_lr{scale}x", heldout_loss=run["final_heldout_loss"],
                             initial_heldout_loss=start))
        adamw = {s: next(r["heldout_loss"] for r in rows if r["seed"] == seed and r["variant"] == f"adamw_lr{s}x")
                 for s in (1, 3)}
        for name, spec in table.items():
            if names is not None and name not in names:
                continue
            scale = spec.get("lr_scale", 1)
            prep = prepared[scale]
            cfg = prep.cfg
            zen = e2e_core.zenflow_block(cfg, prep.n_epoch, **spec.get("zenflow", {}))

            def factory(params, zen=zen, spec=spec, cfg=cfg):
                return make_zenflow(params, cfg.lr, zen, spec.get("lr_times_interval", False), cfg.weight_decay)

            run = e2e_core.train_run(e2e_core.RunSpec(name, "zenflow", zen, optimizer=factory), prep)
            start = prep.pretrain["heldout_loss"]
            top10 = statistics.fmean(run["concentration"]["top10"])
            rows.append(dict(task="gpt", seed=seed, variant=name, heldout_loss=run["final_heldout_loss"],
                             initial_heldout_loss=start, top10_share=top10,
                             recovered=(start - run["final_heldout_loss"]) / (start - adamw[scale])))
            print(f"gpt seed {seed} {name}: held-out {run['final_heldout_loss']:.4f} recovered "
                  f"{rows[-1]['recovered']:.2f}", flush=True)
    return rows


# -- summary, plot ------------------------------------------------------------------------------------------------


def summarise(rows: list[dict]) -> list[dict]:
    """Per level (``alpha``; the byte GPT: one) and variant: the recovered share (mean, min, max over seeds), the
    held-out gap to AdamW at the same learning rate (``gap_vs_adamw``: L - L_adamw, mean and range; better
    conditioned than the share where AdamW's own improvement is small), AdamW's improvement, and the measured
    top-10% share."""
    table = {**variants("study"), **variants("gpt")}
    out = []
    levels = sorted({r.get("alpha") for r in rows}, key=lambda a: -1 if a is None else a)
    for level in levels:
        at = [r for r in rows if r.get("alpha") == level]
        adamw = {(r["seed"], r["variant"]): r for r in at if r["variant"].startswith("adamw_")}
        zen = [r for r in at if "recovered" in r]
        for variant in dict.fromkeys(r["variant"] for r in zen):
            mine = [r for r in zen if r["variant"] == variant]
            rec = [r["recovered"] for r in mine]
            ref = [adamw[(r["seed"], f"adamw_lr{table[variant].get('lr_scale', 1)}x")] for r in mine]
            gap = [r["heldout_loss"] - a["heldout_loss"] for r, a in zip(mine, ref, strict=True)]
            out.append(dict(alpha=level, variant=variant, recovered=statistics.fmean(rec),
                            recovered_range=[min(rec), max(rec)], seeds=len(rec),
                            gap_vs_adamw=statistics.fmean(gap), gap_vs_adamw_range=[min(gap), max(gap)],
                            adamw_improvement=statistics.fmean(a["initial_heldout_loss"] - a["heldout_loss"]
                                                               for a in ref),
                            top10_share=statistics.fmean(r["top10_share"] for r in mine)))
    return out


def draw(ax, summary: list[dict], title: str) -> None:
    """Each variant's recovered share (mean, range over seeds) as bars, one colour per level."""
    levels = sorted({s["alpha"] for s in summary}, key=lambda a: -1 if a is None else a)
    names = list(dict.fromkeys(s["variant"] for s in summary))
    height = 0.8 / len(levels)
    for j, level in enumerate(levels):
        got = {s["variant"]: s for s in summary if s["alpha"] == level}
        ys = [i + j * height for i in range(len(names))]
        means = [got[n]["recovered"] if n in got else float("nan") for n in names]
        lo = [m - got[n]["recovered_range"][0] if n in got else 0 for n, m in zip(names, means, strict=True)]
        hi = [got[n]["recovered_range"][1] - m if n in got else 0 for n, m in zip(names, means, strict=True)]
        share = statistics.fmean(s["top10_share"] for s in got.values())
        label = f"top-10% share {share:.2f}" + ("" if level is None else f" (alpha {level:g})")
        ax.barh(ys, means, height=height, xerr=[lo, hi], label=label, capsize=2)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="share of AdamW's held-out improvement recovered at equal steps (mean, range over seeds)",
           title=title)
    ax.legend(fontsize=8, loc="lower right")


def plot(summary: list[dict], path, title: str) -> None:
    names = {s["variant"] for s in summary}
    fig, ax = plt().subplots(figsize=(11, 0.3 * len(names) * max(1, len({s["alpha"] for s in summary})) ** 0.5 + 1.5))
    draw(ax, summary, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m bench.quality_ablations", description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=("study", "gpt"), default="study")
    ap.add_argument("--out", default=None, help="output directory (default bench/results)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=None, help="only these variants (default all)")
    ap.add_argument("--quick", action="store_true",
                    help="one seed, a few steps, two variants (the test suite's run; the gpt task on the tiny model)")
    args = ap.parse_args(argv)
    known = set(variants(args.task))
    if args.variants is not None and not set(args.variants) <= known:
        ap.error(f"argument --variants: {sorted(set(args.variants) - known)} unknown: allowed {sorted(known)}")
    names = args.variants
    if args.quick:
        args.seeds, names = [0], names or ["base", "deepspeed"]
    torch.set_num_threads(1 if args.task == "study" else torch.get_num_threads())
    out_dir = output_dir(args.out)
    t0 = time.perf_counter()
    if args.task == "study":
        steps = 24 if args.quick else 300
        rows = study_rows(args.seeds, steps, alphas=(0.0, 1.5) if args.quick else STUDY_ALPHAS, names=names)
        config = dict(alphas=STUDY_ALPHAS, steps=steps)
    else:
        steps, model = (8, "tiny") if args.quick else (None, "small")
        rows = gpt_rows(args.seeds, steps, model, names=names)
        config = dict(model=model, steps=steps or 160)
    summary = summarise(rows)
    payload = {
        "command": " ".join(["python -m bench.quality_ablations", *argv]),
        "description": __doc__,
        "config": dict(config, task=args.task, seeds=args.seeds, quick=args.quick, variants=variants(args.task)),
        "summary": summary,
        "runs": rows,
        "total_s": time.perf_counter() - t0,
        "machine": machine_info_light(),
    }
    path = write_json_light(out_dir / f"quality_ablations_{args.task}.json", payload)
    plot(summary, out_dir / f"quality_ablations_{args.task}.png",
         "controlled study" if args.task == "study" else "byte GPT")
    for s in summary:
        level = "gpt" if s["alpha"] is None else f"alpha {s['alpha']:g}"
        print(f"{level} {s['variant']}: recovered {s['recovered']:.3f} "
              f"[{s['recovered_range'][0]:.3f}, {s['recovered_range'][1]:.3f}]")
    print(f"wrote {path} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
