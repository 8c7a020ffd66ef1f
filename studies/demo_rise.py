"""Why the demo's held-out loss rose over its first steps with ZenFlow while AdamW's fell (issue 56, item 6), in the
demo's setting of then (the demo now runs the tuned comparison's pick, without overlap).

    python -m studies.demo_rise [--steps 40] [--out DIR]

The demo as it was (``make demo``: the small byte GPT, lr 3e-4 with a 16-step warm-up, ``topk_ratio`` 0.1,
``update_interval`` 4, ``overlap_step``) fine-tuned again for ``--steps`` steps, evaluated every 4, with one thing
changed at a time, each against the same start and batches:

* ``adamw``: ``torch.optim.AdamW``;
* ``zenflow``: the demo's ZenFlow;
* ``no_overlap``: the same without ``overlap_step`` (each host update lands at its boundary);
* ``host_only`` / ``host_only_no_overlap``: no fast path (``topk_ratio`` 0): every column waits for the host;
* ``all_fast``: every column on the fast path (``topk_ratio`` 1): AdamW's arithmetic every step;
* ``warm_up16`` / ``host_only_warm_up16``: the first 16 steps synchronous AdamW (``full_warm_up_rounds`` 16, the
  learning-rate warm-up's length), then as ``zenflow`` / ``host_only``.

What it separates: whether the rise comes from the fast path's columns (their first Adam step from zero state) or
from the host's update, and there from the update's arithmetic or from its landing one interval late. Results:
``demo_rise.json`` (every run's held-out curve) in ``studies/results``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.harness import OneLineParser, write_json_light
from studies.tuned_comparison import RESULTS

CASES = {
    "adamw": None,
    "zenflow": {},
    "no_overlap": dict(overlap_step=False),
    "host_only": dict(topk_ratio=0.0),
    "host_only_no_overlap": dict(topk_ratio=0.0, overlap_step=False),
    "all_fast": dict(topk_ratio=1.0),
    "warm_up16": dict(full_warm_up_rounds=16),
    "host_only_warm_up16": dict(topk_ratio=0.0, full_warm_up_rounds=16),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m studies.demo_rise", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", default="small", help="the byte GPT preset (the demo's: small)")
    ap.add_argument("--out", default=None, help="output directory (default studies/results)")
    args = ap.parse_args(argv)
    from bench import e2e_core

    t0 = time.perf_counter()
    cfg = e2e_core.E2EConfig(model=args.model, seed=0, device="cpu", threads=torch.get_num_threads())
    prep = e2e_core.prepare(cfg, e2e_core.cache_dir())
    base = e2e_core.zenflow_block(cfg, prep.n_epoch)
    runs = {}
    for name, changes in CASES.items():
        spec = (e2e_core.RunSpec(name, "adamw") if changes is None else
                e2e_core.RunSpec(name, "zenflow", dict(base, **changes)))
        r = e2e_core.train_run(spec, prep, steps=args.steps, eval_points=max(1, args.steps // 4))
        runs[name] = dict(zenflow=None if changes is None else dict(base, **changes),
                          curve=[[e["step"], e["heldout_loss"]] for e in r["evals"]])
        print(f"{name:>22}: " + " ".join(f"{loss:.4f}" for _, loss in runs[name]["curve"]), flush=True)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = write_json_light(out / "demo_rise.json", dict(
        command=" ".join(["python -m studies.demo_rise", *argv]), description=__doc__,
        config=dict(model=args.model, steps=args.steps, lr=cfg.lr, warmup_frac=cfg.warmup_frac), runs=runs,
        total_s=time.perf_counter() - t0))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
