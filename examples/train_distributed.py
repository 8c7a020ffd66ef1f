"""ZenFlowAdamW with ZeRO-1/2 under torchrun: each rank holds 1/world of the host state.

    torchrun --nproc_per_node=2 examples/train_distributed.py                 # CPU (gloo), or GPUs (NCCL)
    torchrun --nproc_per_node=2 examples/train_distributed.py --steps 12      # shorter (the suite runs this)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST:29500 examples/train_distributed.py           # several nodes (node_rank 1 too)

The model is not wrapped in DistributedDataParallel: the optimizer averages the gradients itself
(stage 2: each matrix's gradient goes to the rank that holds its host state, from backward hooks).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from zenflow_kernels import ZenFlowAdamW


def batches(steps: int, batch: int, seed: int = 0):
    """The same global batches on every rank (each rank then takes its slice)."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(64, 16, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, 64, generator=g)
        yield x, torch.tanh(x @ w_true)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2))
    ap.add_argument("--out", default=None, help="where rank 0 saves the consolidated checkpoint")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)).to(device)
    zenflow = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, select_strategy="step", select_interval=50)
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, zenflow=zenflow,
                       zero_stage=args.zero_stage)
    batch = 16 * world
    losses = []
    with opt:
        for x, y in batches(args.steps, batch):
            part = slice(rank * batch // world, (rank + 1) * batch // world)
            loss = torch.nn.functional.mse_loss(model(x[part].to(device)), y[part].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        opt.flush()
        # every replica holds the same weights
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        spread = flat.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        dist.all_reduce(flat, op=dist.ReduceOp.MIN)
        identical = bool(torch.equal(spread, flat))
        state = opt.consolidated_state_dict()  # collective: every rank calls it
        stats = opt.stats()
    if rank == 0:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / "zenflow_consolidated.pt"
        torch.save({"model": model.state_dict(), "optimizer": state}, out)
        moved = stats["collective_bytes_per_step"]
        print(f"rank 0: trained {args.steps} steps on {world} ranks (ZeRO-{args.zero_stage}), loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}; replicas identical: {identical}")
        print("collective bytes per step: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(moved.items())))
        print(f"consolidated checkpoint (loadable at any world size): {out}")
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
