"""ZenFlowAdamW on a model sharded with FSDP2 (fully_shard), under torchrun: each rank holds its rows of every
parameter, their host state (master, moments, gradient sums) and its slice of the batch.

    torchrun --nproc_per_node=2 examples/train_fsdp2.py                 # CPU (gloo), or GPUs (NCCL)
    torchrun --nproc_per_node=2 examples/train_fsdp2.py --steps 8       # shorter (the suite runs this)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST:29500 examples/train_fsdp2.py          # several nodes (node_rank 1 too)

A small byte-level GPT (every block its own FSDP2 unit, the root another), trained on this file's own
bytes. The optimizer is the same one a single process uses: it finds the DTensor parameters, sums each
column's partial scores over the ranks (one all-reduce of C floats per matrix), updates its rows of the
selected columns every step and the rest on the host every `update_interval` steps. Checkpoints go
through torch.distributed.checkpoint and load at any world size.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from zenflow_kernels import ZenFlowAdamW


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(D, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(steps: int, batch: int, context: int, seed: int = 0):
    """The same global batches on every rank (each rank then takes its slice): windows of this file."""
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, data.numel() - context - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + context + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=None, help="where to save the checkpoint (torch.distributed.checkpoint)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = ByteGPT().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    zenflow = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, select_strategy="step", select_interval=20)
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, zenflow=zenflow)
    batch, context = 8 * world, 32
    losses = []
    with opt:
        for x, y in batches(args.steps, batch, context):
            part = slice(rank * batch // world, (rank + 1) * batch // world)
            logits = model(x[part].to(device))
            loss = F.cross_entropy(logits.reshape(-1, 256), y[part].to(device).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        opt.flush()  # the last host update lands in the shards before saving
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="zenflow_fsdp2_"))
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=out)
        stats, host = opt.stats(), opt.host_bytes()
    local_rows = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}: holds {local_rows} of {total} parameters; host state {host['total'] / 2**20:.2f} MiB "
          f"({host['per_parameter']:.1f} bytes per parameter it holds)")
    dist.barrier()
    if rank == 0:
        moved = stats["collective_bytes_per_step"]
        print(f"rank 0: trained {args.steps} steps on {world} ranks with FSDP2, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}; {stats['selections']} selections, {stats['host_updates']} host updates")
        print("ZenFlow's collective bytes per step: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(moved.items())))
        print(f"checkpoint (torch.distributed.checkpoint, loadable at any world size): {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
