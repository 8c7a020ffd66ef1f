"""ZenFlowAdamW in a plain PyTorch training loop: a small MLP regression, a checkpoint, a resume.

    python examples/custom_loop.py            # a few seconds on CPU (CUDA if present)
    python examples/custom_loop.py --steps 20 # shorter (the test suite runs it like this)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from zenflow_kernels import ZenFlowAdamW


def batches(steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(64, 16, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, 64, generator=g)
        yield x, torch.tanh(x @ w_true)


def stall_report(stats: dict, device: str) -> str:
    """``stats()["stall_fraction"]``, what it measured in this run, and how to read it."""
    wall, stall = stats["wall_s"], stats["stall_s"]
    waited, accumulated = stats["worker_wait_s"], stats["accumulate_s"]
    parts = [f"waiting for the background host update {waited:.3f} s",
             f"adding gradients into the host buffers itself {accumulated:.3f} s"]
    if stall - waited - accumulated > 0.0005:
        parts.append(f"synchronous host updates {stall - waited - accumulated:.3f} s")
    lines = [f"stall {100 * stats['stall_fraction']:.1f}% of wall time: the training thread spent {stall:.3f} s of "
             f"{wall:.2f} s on host work instead of training ({', '.join(parts)})"]
    updates = stats["host_update_s"]
    if len(updates) > 1 and updates[0] > 0.05 * wall and updates[0] > 10 * statistics.median(updates[1:]):
        lines.append(f"  most of it: the first host update took {updates[0]:.2f} s, the others "
                     f"{1e3 * statistics.median(updates[1:]):.1f} ms (median); numba compiles its host kernels "
                     "on a first run, later runs load them from the cache in milliseconds")
    if device == "cpu":
        lines.append('  on a CPU-only machine the "device" and the host are the same cores: there is no slow host '
                     "update for ZenFlow to hide, and this figure says little about it; on a GPU it is the figure "
                     "to drive down (the README's goal: under 5%)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)).to(device)
    data = list(batches(args.steps, batch=32))
    zenflow = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, select_strategy="step", select_interval=50)
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, zenflow=zenflow)
    half = args.steps // 2
    with opt:
        for x, y in data[:half]:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
        # a checkpoint of the flushed weights (every host update computed so far applied) and the optimizer
        # state; after the block the weights training continues from are back, bit for bit
        path = Path(tempfile.mkdtemp()) / "ckpt.pt"
        with opt.flushed():
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        for x, y in data[half:]:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.flush()  # the last host update lands in the weights before they are used or saved
        stats = opt.stats()
    print(f"trained {args.steps} steps on {device}: final loss {loss.item():.4f}, {stats['host_updates']} host updates")
    print(stall_report(stats, device))

    # resume from the checkpoint in a fresh model and optimizer: the same trajectory
    torch.manual_seed(1)
    again = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)).to(device)
    ckpt = torch.load(path, weights_only=False)
    again.load_state_dict(ckpt["model"])  # the model first, then the optimizer
    with ZenFlowAdamW(again.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, zenflow=zenflow) as opt2:
        opt2.load_state_dict(ckpt["opt"])
        for x, y in data[half:]:
            torch.nn.functional.mse_loss(again(x.to(device)), y.to(device)).backward()
            opt2.step()
            opt2.zero_grad()
        opt2.flush()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    print(f"resumed from step {half}: {'identical' if same else 'DIFFERENT'} weights at the end")
    return 0 if same or device != "cpu" else 1


if __name__ == "__main__":
    raise SystemExit(main())
