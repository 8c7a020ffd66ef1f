"""ZenFlowAdamW on a model sharded with HSDP (fully_shard on a 2-D mesh, replicate x shard), under torchrun:
every parameter is split by rows within a replica group and the replica groups hold the same copy.

    torchrun --nproc_per_node=4 examples/train_hsdp.py --replicas 2     # one machine: 2 replicas x 2 shards
    torchrun --nproc_per_node=4 examples/train_hsdp.py --replicas 2 --steps 6   # shorter (the suite runs this)
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST:29500 examples/train_hsdp.py          # two nodes: run it on each node,
                                                                        # --node_rank=1 on the second
                                                                        # (c10d may renumber the nodes)

The mesh is (replicas, world // replicas); --replicas defaults to the number of nodes (WORLD_SIZE //
LOCAL_WORLD_SIZE), so on two nodes of 8 GPUs it is (2, 8): shard within a node (NVLink carries FSDP2's
all-gathers and reduce-scatters), replicate across nodes (the network carries one all-reduce of each
gradient shard). CPU with gloo or GPUs with NCCL, one GPU per local rank, unchanged.

The byte-level GPT and data of examples/train_fsdp2.py (imported from it), trained on that file's bytes.
ZenFlow needs nothing of its own for HSDP: it finds the parameters placed (Replicate(), Shard(0)), runs its
collectives (column scores, gradient norms) over the shard dimension only, and every replica takes the same
steps bit for bit, which the end of the run checks. The checkpoint (torch.distributed.checkpoint) loads at any layout.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# the one-node example's model and data (this folder is on sys.path when a script of it runs)
from train_fsdp2 import ByteGPT, batches

from zenflow_kernels import ZenFlowAdamW


def replicas_identical(model: nn.Module, mesh, device) -> bool:
    """Whether every rank's rows equal, bit for bit, the same rows on every other replica: an element-wise
    max and min over the replicate dimension agree only where all copies do (a sum could cancel out)."""
    flat = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=mesh.get_group("replicate"))
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=mesh.get_group("replicate"))
    same = torch.tensor([int(torch.equal(hi, lo))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # every rank's verdict, so every rank answers the same
    return bool(same.item())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--replicas", type=int, default=None,
                    help="replica groups (the mesh's first dimension); default: the number of nodes")
    ap.add_argument("--out", default=None, help="where to save the checkpoint (torch.distributed.checkpoint); "
                    "on several nodes a path every node sees, or gather each node's files into one folder")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, known before the process group exists
    replicas = args.replicas or world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if replicas < 1 or world % replicas:
        ap.error(f"--replicas {replicas} does not divide the {world} ranks")
    shards = world // replicas
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # init_device_mesh lays the ranks out row-major: ranks [r * shards, (r + 1) * shards) are replica r,
    # and torchrun numbers a node's ranks consecutively, so a replica is a node and a shard group stays in it
    mesh = init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    replica, shard = mesh.get_coordinate()
    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    model = ByteGPT().to(device)
    for block in model.blocks:  # each block its own unit: one all-gather in flight at a time, not the model
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    zenflow = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, select_strategy="step", select_interval=20)
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, zenflow=zenflow)
    batch, context = 8 * world, 32
    # data parallel over every rank, replicas and shards alike: rank i takes the i-th slice of the global batch
    part = slice(rank * batch // world, (rank + 1) * batch // world)
    losses = []
    with opt:
        for step, (x, y) in enumerate(batches(args.steps, batch, context), 1):
            logits = model(x[part].to(device))
            loss = F.cross_entropy(logits.reshape(-1, 256), y[part].to(device).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 1 or step % 20 == 0 or step == args.steps:  # the same steps on every rank: collective
                mean = loss.detach().reshape(1) / world
                dist.all_reduce(mean)  # the global batch's loss, not rank 0's slice
                losses.append(float(mean))
                if rank == 0:
                    print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
        opt.flush()  # the last host update lands in the shards before checking and saving
        identical = replicas_identical(model, mesh, device)
        if args.out:  # each row block is written once (replicas hold the same rows); loads at any layout
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=args.out)
        stats, host = opt.stats(), opt.host_bytes()
    held = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"rank {rank} (replica {replica}, shard {shard}): holds {held} of {total} parameters; host state "
          f"{host['total'] / 2**20:.2f} MiB ({host['per_parameter']:.1f} bytes per parameter it holds)", flush=True)
    dist.barrier()
    if rank == 0:
        moved = stats["collective_bytes_per_step"]
        print(f"rank 0: trained {args.steps} steps on {world} ranks with HSDP ({replicas} replicas x {shards} "
              f"shards), loss {losses[0]:.4f} -> {losses[-1]:.4f}; {stats['selections']} selections, "
              f"{stats['host_updates']} host updates")
        print(f"replicas identical: {identical}")
        print("ZenFlow's collective bytes per step (within a shard group): "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(moved.items())))
        if args.out:
            print(f"checkpoint (torch.distributed.checkpoint, loadable at any layout): {args.out}")
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
