"""Checkpoints written by an earlier version load and continue bit-identically (issue 33 item 5).

tests/fixtures/checkpoints/*.pt were written by tools/make_checkpoint_fixtures.py with the optimizer as it was
before the optimizer layer was restructured: each holds the initial weights, every step's gradients, the model and
optimizer dicts saved mid-run (a host update in flight, or inside ``flushed()``) and the weights every later step
reached in the run that never stopped. Loading them into today's ``ZenFlowAdamW`` and continuing on the stored
gradients must reach those weights bit for bit; ZeRO-1/2's per-rank and consolidated dicts the same at 2 ranks.
The gradients are stored, not computed, so nothing but the optimizer decides the numbers (its kernels are
elementwise: the same bits on AVX2 and AVX-512).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_fixture_ranks import CASES as ZERO_CASES
from checkpoint_fixture_ranks import FSDP2_CASES, launch

from zenflow_kernels import ZenFlowAdamW

HERE = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
FIXTURES = sorted(p for p in HERE.glob("*.pt") if not p.name.startswith("zero"))  # one process


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


def test_the_fixtures_are_there():
    names = {p.stem for p in FIXTURES}
    assert {"memory_overlap_inflight", "memory_overlap_flushed", "memory_sync", "memory_device_accumulation",
            "nvme_overlap_inflight", "nvme_overlap_flushed"} <= names, names


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_an_old_checkpoint_loads_and_continues_bit_identically(path, tmp_path):
    case = torch.load(path, weights_only=False)
    assert case["version"] == 1
    zenflow = dict(case["zenflow"])
    if zenflow.get("offload_device") == "nvme":
        zenflow["nvme_path"] = str(tmp_path)
    params = [torch.nn.Parameter(t.clone()) for t in case["model"]]
    with ZenFlowAdamW(params, **case["hyper"], zenflow=zenflow) as opt:
        opt.load_state_dict(case["optimizer"])  # the model first, then the optimizer (flushed(): it restores)
        for t in range(case["save_at"] + 1, len(case["grads"])):
            for p, grad in zip(params, case["grads"][t], strict=True):
                p.grad = grad.clone()
            opt.step()
            opt.zero_grad()
            want = case["expected"][t - case["save_at"] - 1]
            for n, (p, w) in enumerate(zip(params, want, strict=True)):
                assert torch.equal(p.detach(), w), f"step {t}, parameter {n}: {(p.float() - w.float()).abs().max()}"
        opt.flush()
        for n, (p, w) in enumerate(zip(params, case["expected"][-1], strict=True)):
            assert torch.equal(p.detach(), w), f"after flush(), parameter {n}"


@pytest.mark.ranks
def test_old_zero_and_fsdp2_checkpoints_load_and_continue_bit_identically_at_the_same_world_size(tmp_path):
    """At 2 ranks (tests/checkpoint_fixture_ranks.py): ZeRO-1 and ZeRO-2, each rank's own dict (ZeRO-2's saved
    inside ``flushed()``) and the consolidated one; FSDP2 through torch.distributed.checkpoint, saved with a host
    update in flight and inside ``flushed()``. Each rank of a fresh run loads and continues."""
    assert all((HERE / f"{name}_rank{r}.pt").exists() for name in ZERO_CASES for r in (0, 1))
    assert all((HERE / name / ".metadata").exists() for name in FSDP2_CASES)
    launch("check", str(HERE), str(tmp_path))
    for r in (0, 1):
        lines = (tmp_path / f"rank{r}.txt").read_text().splitlines()
        assert lines == [f"{name}: ok" for name in [*ZERO_CASES, *FSDP2_CASES]], (r, lines)
