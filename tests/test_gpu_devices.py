"""Parameters on a GPU that is not the current one (model.to("cuda:1"), torchrun without set_device):
every public op, and a short ZenFlowAdamW run, with tensors on the last visible GPU while device 0 is
current give what they give on device 0, and leave device 0 current. Needs two GPUs; the CPU half
(each launch inside its tensors' device guard) is tests/test_triton_devices.py."""

from __future__ import annotations

import os

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW, ops

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.skipif(GPUS == 0, reason="needs CUDA"),
    pytest.mark.skipif(0 < GPUS < 2, reason=f"needs 2 or more GPUs (tensors on one while another is current); "
                                             f"{GPUS} visible"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"),
                       reason="compiled kernels only (TRITON_INTERPRET=0)"),
]

from device_ops import OP_CALLS  # noqa: E402

ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1,
           overlap_step=True)


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max()) if a.numel() else 0.0


def run_ops(device: str) -> dict[str, list[torch.Tensor]]:
    with ops.use_backend("triton"):
        out = {name: call(device) for name, call in OP_CALLS.items()}
    torch.cuda.synchronize(device)
    return out


def train(device: str, steps: int = 8) -> list[torch.Tensor]:
    """A tiny model trained by backward for a few steps (ZenFlow with overlapped host updates)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8)).to(device)
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 8, generator=gen).to(device))
               for _ in range(steps)]
    with ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, zenflow=ZEN) as opt:
        for x, y in batches:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
    torch.cuda.synchronize(device)
    return [p.detach().clone() for p in model.parameters()]


def test_every_op_on_a_device_that_is_not_current():
    last = f"cuda:{GPUS - 1}"
    with torch.cuda.device(0):
        ref = run_ops("cuda:0")
        got = run_ops(last)
        assert torch.cuda.current_device() == 0
    for name in OP_CALLS:
        for i, (a, b) in enumerate(zip(got[name], ref[name], strict=True)):
            assert a.device == torch.device(last), (name, i, a.device)
            assert torch.equal(a.cpu(), b.cpu()), f"{name} output {i}: worst difference {worst(a, b)}"


def test_zenflow_on_a_device_that_is_not_current():
    last = f"cuda:{GPUS - 1}"
    with torch.cuda.device(0):
        ref = train("cuda:0")
        got = train(last)
        assert torch.cuda.current_device() == 0
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.device == torch.device(last)
        assert worst(a, b) <= 1e-6, f"parameter {i}: worst difference {worst(a, b)}"
