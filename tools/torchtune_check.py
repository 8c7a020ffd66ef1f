"""ZenFlowAdamW through torchtune's own FSDP2 and checkpoint calls, on CPU with gloo (docs/torchtune.md).

Needs torchtune (0.6.1 was run, with torchao 0.11.0) besides this library; not part of the suite::

    torchrun --nproc_per_node 2 tools/torchtune_check.py [--no-sync]

It does what ``full_finetune_distributed`` does around the optimizer: a meta-device tiny Llama 3, a
("dp", "tp") device mesh, ``training.shard_model`` on the "dp" mesh, ``load_from_full_model_state_dict``,
the optimizer from a YAML block through ``config.instantiate``, token-normalised loss with gradient
accumulation and ``training.scale_grads``, a cosine LR schedule; a checkpoint taken with the checkpointer's
calls (``gather_cpu_state_dict``, ``get_full_optimizer_state_dict``) inside ``opt.flushed()``, resumed with
``load_from_full_model_state_dict`` and ``load_from_full_optimizer_state_dict``. Three runs: A never saves,
B saves at step SAVE, C resumes from B's checkpoint; D stops at SAVE and calls ``opt.flush()``. Exit code 0
when A, B and C end bit-identical and B's checkpoint holds D's weights.
``--no-sync`` declares the micro-batches with FSDP2's ``set_requires_gradient_sync``.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torchtune import config, training
from torchtune.models.llama3 import llama3
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

YAML = """
optimizer:
  _component_: zenflow_kernels.ZenFlowAdamW
  lr: 2e-3
  weight_decay: 0.01
  max_grad_norm: 1.0
  zenflow:
    topk_ratio: 0.1
    update_interval: 2
    overlap_step: true
    select_strategy: step
    select_interval: 4
"""
MODEL = dict(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64,
             intermediate_dim=128)
STEPS, SAVE, ACCUM = 8, 3, 2


def build(world: int, full_sd: dict):
    with training.set_default_dtype(torch.float32), torch.device("meta"):
        model = llama3(**MODEL)
    mesh = init_device_mesh("cpu", mesh_shape=(world, 1), mesh_dim_names=("dp", "tp"))
    if world > 1:  # as the recipe: FSDP2 only with more than one data-parallel rank
        conditions = [partial(training.get_shard_conditions, names_to_match=None)]
        training.shard_model(model=model, shard_conditions=conditions, cpu_offload=False, reshard_after_forward=True,
                             dp_mesh=mesh["dp"])
    with training.set_default_dtype(torch.float32), torch.device("cpu"):
        for m in model.modules():
            if hasattr(m, "rope_init"):
                m.rope_init()
    training.load_from_full_model_state_dict(model, full_sd, torch.device("cpu"), strict=True, cpu_offload=False)
    opt = config.instantiate(OmegaConf.create(YAML).optimizer, model.parameters())
    return model, opt, get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)


def tokens(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(
        1000 * step + 10 * micro + rank))


def train(model, opt, sched, rank, world, start, stop, *, no_sync, save_at=None):
    loss_fn, ignore = torch.nn.CrossEntropyLoss(ignore_index=-100), torch.full((2, 1), -100)
    losses, ckpt = [], None
    for step in range(start, stop):
        running, num_tokens = torch.tensor(0.0), torch.tensor(0)
        for micro in range(ACCUM):
            if no_sync and world > 1:
                model.set_requires_gradient_sync(micro == ACCUM - 1)
            x = tokens(rank, step, micro)
            n = x.numel()
            num_tokens += n
            logits = model(x)
            labels = torch.hstack((x[..., 1:], ignore))
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)) * n
            running += loss.detach()
            loss.backward()
        dist.all_reduce(num_tokens)
        dist.all_reduce(running)
        training.scale_grads(model, world / num_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(running / num_tokens))
        if step + 1 == save_at:
            with opt.flushed():  # what the recipe's checkpoint client calls, on the flushed weights
                msd = training.gather_cpu_state_dict(model, rank == 0, device=torch.device("cpu"))
                osd = training.get_full_optimizer_state_dict(model, opt, rank == 0, device=torch.device("cpu"))
            ckpt = [{"model": msd, "optim": osd, "sched": sched.state_dict()}]
            dist.broadcast_object_list(ckpt, src=0)  # every rank reads the checkpoint file in the recipe
            ckpt = ckpt[0]
    return losses, ckpt


def weights(model, opt=None) -> dict:
    """Every parameter, whole; the flushed weights when ``opt`` is given."""
    with opt.flushed() if opt is not None else contextlib.nullcontext():
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in model.named_parameters()}


def main(argv: list[str]) -> int:
    no_sync = "--no-sync" in argv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full_sd = {k: v.clone() for k, v in llama3(**MODEL).state_dict().items()}
    runs, ckpt = {}, None
    for name in ("A", "B"):
        model, opt, sched = build(world, full_sd)
        losses, saved = train(model, opt, sched, rank, world, 0, STEPS, no_sync=no_sync,
                              save_at=SAVE if name == "B" else None)
        runs[name] = (losses, weights(model, opt))
        ckpt = ckpt or saved
        opt.close()
    model, opt, sched = build(world, ckpt["model"])  # the recipe loads the model first, then the optimizer
    training.load_from_full_optimizer_state_dict(model, opt, ckpt["optim"], torch.device("cpu"))
    sched.load_state_dict(ckpt["sched"])
    losses, _ = train(model, opt, sched, rank, world, SAVE, STEPS, no_sync=no_sync)
    runs["C"] = (runs["B"][0][:SAVE] + losses, weights(model, opt))
    same = {pair: all(torch.equal(runs[pair[0]][1][k], runs[pair[1]][1][k]) for k in runs["A"][1])
            and runs[pair[0]][0] == runs[pair[1]][0] for pair in (("A", "B"), ("B", "C"))}
    stats = opt.stats()
    opt.close()
    # D: to step SAVE, then opt.flush(): the checkpoint must hold these weights, not the live (stale) ones
    model, opt, sched = build(world, full_sd)
    train(model, opt, sched, rank, world, 0, SAVE, no_sync=no_sync)
    live = weights(model)
    opt.flush()
    flushed = weights(model)
    opt.close()
    saved = {k: ckpt["model"][k] for k in flushed}
    same[("checkpoint", "flush()")] = all(torch.equal(saved[k], flushed[k]) for k in flushed)
    stale = [k for k in flushed if not torch.equal(live[k], flushed[k])]
    if rank == 0:
        print(f"{world} rank(s), {STEPS} steps of {ACCUM} micro-batches, no_sync={no_sync}, "
              f"DTensor parameters: {hasattr(next(model.parameters()), 'full_tensor')}")
        print("losses:", " ".join(f"{x:.4f}" for x in runs["A"][0]))
        print(f"host updates {stats['host_updates']}, selections {stats['selections']}")
        for (a, b), ok in same.items():
            print(f"{a} == {b} bit for bit: {ok}")
        print(f"at step {SAVE} a host result was pending for {len(stale)} of {len(flushed)} parameters (the live "
              "weights there differ from the saved ones)")
    dist.destroy_process_group()
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
