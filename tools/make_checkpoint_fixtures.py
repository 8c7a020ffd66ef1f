"""Write the checkpoint fixtures of tests/test_checkpoint_fixtures.py: checkpoints written by this version of the
optimizer, and the weights their continuation must reach, for later versions to load (issue 33 item 5).

    python tools/make_checkpoint_fixtures.py            # rewrites tests/fixtures/checkpoints/*.pt

Run it only to add a case, never to make a failing fixture test pass: a fixture is a promise that checkpoints
written before a change keep loading and continuing after it.

Each case trains a few parameters (fp32 and bf16 matrices, an fp32 vector) on stored gradients (no model forward,
so the continuation depends on the optimizer alone, not on the CPU's matmul kernels), saves the model and the
optimizer at ``SAVE_AT`` as a user would (a host update in flight, or inside ``flushed()``), and records the
weights after every later step of the run that never stopped. Cases: one process in memory (overlap, the save
with an update in flight and inside ``flushed()``; without overlap; ``device_accumulation``) and with the state
on disk (``offload_device="nvme"``), and ZeRO-1/2 at 2 ranks, per-rank and consolidated
(one file per rank), and FSDP2 through torch.distributed.checkpoint at 2 ranks (a folder per case:
tests/checkpoint_fixture_ranks.py). The file holds the inputs (initial weights, every step's
gradients), the saved dicts and the expected weights, so a later version needs nothing of this one to check
itself.
"""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zenflow_kernels import ZenFlowAdamW  # noqa: E402
from zenflow_kernels.ops import use_backend  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "checkpoints"
HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, full_warm_up_rounds=1,
           overlap_step=True)
STEPS, SAVE_AT = 10, 4  # the save after step 4: the update it started in flight, its result pending for step 6
SHAPES = (((16, 12), torch.float32), ((16,), torch.float32), ((8, 16), torch.bfloat16))

CASES = {
    "memory_overlap_inflight": dict(zenflow=ZEN, flushed=False),
    "memory_overlap_flushed": dict(zenflow=ZEN, flushed=True),
    "memory_sync": dict(zenflow=dict(ZEN, overlap_step=False), flushed=False),
    "memory_device_accumulation": dict(zenflow=dict(ZEN, device_accumulation=True), flushed=True),
    "nvme_overlap_inflight": dict(zenflow=dict(ZEN, offload_device="nvme"), flushed=False),
    "nvme_overlap_flushed": dict(zenflow=dict(ZEN, offload_device="nvme"), flushed=True),
}


def inputs(seed: int = 0):
    """Initial weights and every step's gradients (in the parameters' dtypes)."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES]
    grads = [[torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES] for _ in range(STEPS)]
    return init, grads


def with_disk(zenflow: dict, where: str) -> dict:
    return dict(zenflow, nvme_path=where) if zenflow.get("offload_device") == "nvme" else zenflow


def steps(params, opt, grads, start: int, stop: int, after=None) -> list[list[torch.Tensor]]:
    """Steps ``start..stop-1`` on the stored gradients; the weights after each."""
    history = []
    for t in range(start, stop):
        for p, grad in zip(params, grads[t], strict=True):
            p.grad = grad.clone()
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in params])
        if after is not None:
            after(t)
    return history


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def make_case(case: dict) -> dict:
    init, grads = inputs()
    with tempfile.TemporaryDirectory() as where:
        zenflow = with_disk(case["zenflow"], where)
        params = [torch.nn.Parameter(t.clone()) for t in init]
        saved = {}

        def save(t):
            if t != SAVE_AT:
                return
            if case["flushed"]:
                with opt.flushed():
                    saved.update(model=[p.detach().clone() for p in params], optimizer=roundtrip(opt.state_dict()))
            else:
                saved.update(model=[p.detach().clone() for p in params], optimizer=roundtrip(opt.state_dict()))

        with ZenFlowAdamW(params, **HYPER, zenflow=zenflow) as opt:
            history = steps(params, opt, grads, 0, STEPS, after=save)
            opt.flush()
            history.append([p.detach().clone() for p in params])
    # the saved dicts continue to the same weights here, now (the fixture's promise holds for this version)
    with tempfile.TemporaryDirectory() as where:
        params = [torch.nn.Parameter(t.clone()) for t in saved["model"]]
        with ZenFlowAdamW(params, **HYPER, zenflow=with_disk(case["zenflow"], where)) as opt:
            opt.load_state_dict(roundtrip(saved["optimizer"]))
            resumed = steps(params, opt, grads, SAVE_AT + 1, STEPS)
            opt.flush()
            resumed.append([p.detach().clone() for p in params])
    expected = history[SAVE_AT + 1:]
    for t, (a, b) in enumerate(zip(resumed, expected, strict=True)):
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            raise SystemExit(f"the resumed run differs at step {SAVE_AT + 1 + t}: no fixture written")
    return dict(version=1, hyper=HYPER, zenflow=case["zenflow"], flushed=case["flushed"], save_at=SAVE_AT,
                init=init, grads=grads, model=saved["model"], optimizer=saved["optimizer"], expected=expected)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    with use_backend("numba"):
        for name, case in CASES.items():
            path = OUT / f"{name}.pt"
            torch.save(make_case(case), path)
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB)")
    # ZeRO-1/2 at 2 ranks (per-rank dicts and the consolidated one) and FSDP2 with torch.distributed.checkpoint
    # (tests/checkpoint_fixture_ranks.py)
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoint_fixture_ranks import launch

    launch("make", str(OUT))
    for path in sorted([*OUT.glob("zero*_rank*.pt"), *OUT.glob("fsdp2_*")]):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
