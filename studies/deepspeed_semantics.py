"""How far ``semantics="deepspeed"`` is from DeepSpeed's own ZenFlow, and what each of the six choices does to the
trajectory (issue 42, item 3; docs/deepspeed.md).

    python -m studies.deepspeed_semantics [--out DIR] [--settings ui2_si4_w0 ui3_si4_w0 ui2_si4_w2]

Replays without DeepSpeed its 0.19.8 runs recorded in tests/fixtures/deepspeed/ (studies/deepspeed_zenflow.py: the
tiny MLP, 16 fixed-seed batches, three settings): ``semantics="deepspeed"`` on the synchronous link, on the
asynchronous one (``testing.chaos``) and in ``ReferenceZenFlow``; each choice turned back to ours (the other five
DeepSpeed's), and all six ours. Each row: the largest difference of any weight from DeepSpeed's after every step,
and its maximum. Results: ``deepspeed_semantics.json`` in ``studies/results`` (quoted by docs/deepspeed.md's tables,
checked by tests/test_deepspeed_semantics.py; the committed run's record names ``bench.deepspeed_semantics``, where
this module was then).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import OneLineParser, output_dir, write_result
from studies import deepspeed_zenflow as DS

STUDY_RESULTS = Path(__file__).resolve().parent / "results"
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed"
SETTINGS = {"ui2_si4_w0": (2, 4, 0), "ui3_si4_w0": (3, 4, 0), "ui2_si4_w2": (2, 4, 2)}
STEPS = 16


def recorded(setting: str) -> dict:
    """DeepSpeed's recorded run of ``setting`` (``weights``: name -> [steps, *shape])."""
    return torch.load(FIXTURES / f"{setting}.pt")


def replay(setting: str, mode: str, **zen) -> list[float]:
    """Our optimizer (``mode`` "sync" or "chaos"; "reference": ReferenceZenFlow) on DeepSpeed's model and batches of
    ``setting`` with these ``zenflow`` fields: the largest difference from DeepSpeed's weights after each step."""
    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.reference import ReferenceZenFlow
    from zenflow_kernels.testing import chaos

    want = recorded(setting)["weights"]
    model = DS.make_model()
    block = dict(DS.zenflow_block(*SETTINGS[setting]), **zen)
    if mode == "reference":
        opt = ReferenceZenFlow(model.parameters(), **DS.HYPER, zenflow=block)
    else:
        with chaos(seed=0, max_delay=0.001) if mode == "chaos" else contextlib.nullcontext():
            opt = ZenFlowAdamW(model.parameters(), **DS.HYPER, zenflow=block)
    worst = []
    for t, (x, y) in enumerate(DS.make_batches(STEPS)):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        worst.append(max(float((p.detach() - want[name][t]).abs().max()) for name, p in model.named_parameters()))
    if mode != "reference":
        opt.close()
    return worst


def variants() -> dict[str, dict]:
    """Each row's ``zenflow`` fields: all six DeepSpeed's, each one turned back to ours, all six ours."""
    from zenflow_kernels.config import CHOICES

    out = {"deepspeed": dict(semantics="deepspeed")}
    for name, (ours, _, _) in CHOICES.items():
        out[f"{name}_ours"] = {n: (ours if n == name else theirs) for n, (_, theirs, _) in CHOICES.items()}
    out["all_ours"] = {}
    return out


def measure(settings: list[str]) -> list[dict]:
    """Every row of these settings: ``semantics="deepspeed"`` on both links and in the reference, then each variant
    (sync link)."""
    from zenflow_kernels.ops import use_backend

    rows = []
    with use_backend("numba"):
        for setting in settings:
            cases = [("deepspeed", m, dict(semantics="deepspeed"), {}) for m in ("sync", "chaos", "reference")]
            cases += [(v, "sync", zen, dict(zenflow=zen)) for v, zen in variants().items() if v != "deepspeed"]
            for variant, mode, zen, shown in cases:
                per_step = replay(setting, mode, **zen)
                rows.append(dict(setting=setting, variant=variant, mode=mode, **shown, per_step=per_step,
                                 max=max(per_step)))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m studies.deepspeed_semantics", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output directory (default studies/results)")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="the recorded runs to replay (default all three)")
    args = ap.parse_args(argv)
    out_dir = output_dir(args.out or STUDY_RESULTS)
    started = time.perf_counter()
    torch.set_num_threads(1)
    rows = measure(args.settings)
    fixtures = {s: {k: v for k, v in recorded(s).items() if k != "weights"} for s in args.settings}
    payload = {
        "command": " ".join(["python -m studies.deepspeed_semantics", *argv]),
        "description": __doc__,
        "config": dict(settings={s: SETTINGS[s] for s in args.settings}, steps=STEPS, hyper=DS.HYPER,
                       topk_ratio=DS.TOPK_RATIO, torch_threads=1, recorded=fixtures),
        "rows": rows, "total_s": time.perf_counter() - started,
    }
    path = write_result(out_dir / "deepspeed_semantics.json", payload)
    for r in rows:
        print(f"{r['setting']} {r['variant']} ({r['mode']}): max {r['max']:.1e}", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
