"""ZeRO-1/2 benchmark: steps/s, collective bytes per kind and host state per rank, world sizes side by side.

    python -m bench.zero                       # world 1 and 2, ZeRO-2, the small byte GPT, CPU (gloo)
    python -m bench.zero --worlds 1 2 4 --stage 1 --model base

Each world size runs as its own set of processes (one per rank, started like torchrun would: RANK,
WORLD_SIZE, MASTER_ADDR/PORT), on the same global batches (each rank trains on its slice), ``--repeats``
times, world sizes interleaved round by round. On CPU each rank gets ``cores // world`` torch threads; on
a machine with as many GPUs as ranks each rank takes ``cuda:<rank>`` and NCCL. Writes
``zero_cpu.json`` (or ``zero_cuda.json``) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench import harness
from bench.fsdp2 import one_selection_zenflow, per_step, write_rank


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from bench.model import SIZES, build_model
    from zenflow_kernels import ZenFlowAdamW

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["RANK"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    size = SIZES[args.model]
    model = build_model(args.model, seed=0, device=device)
    batch = size.batch * args.batch_scale
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.warmup + args.steps, batch, size.context + 1), generator=g)
    opt = ZenFlowAdamW(model.parameters(), lr=3e-4, zenflow=one_selection_zenflow(args, 0.5 if cuda else 1.0),
                       zero_stage=args.stage if world > 1 else 0)
    part = slice(rank * batch // world, (rank + 1) * batch // world)
    losses, t0, held = [], None, dict(grad=0, own=0, in_flight=0)
    for t in range(args.warmup + args.steps):
        if t == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        loss = model.loss(tokens[t, part, :-1].to(device), tokens[t, part, 1:].to(device))
        loss.backward()
        # gradient elements this rank holds once backward is done (after the first step, where the hooks
        # start): in .grad, and in ZeRO-2's reductions (its own range's sums, other ranks' buckets in flight)
        if t > 0:
            now = dict(grad=sum(p.grad.numel() for p in model.parameters() if p.grad is not None),
                       **(opt.sharding.reducer.held_numel() if opt.sharding.reducer is not None
                          else dict(own=0, in_flight=0)))
            held = {k: max(v, now[k]) for k, v in held.items()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    wall = time.perf_counter() - t0
    opt.flush()
    stats = opt.stats()
    host = opt.host_shard
    result = dict(rank=rank, world=world, steps=args.steps, wall_s=wall, steps_per_s=args.steps / wall,
                  stall_fraction=stats["stall_fraction"],
                  collective_bytes_per_step=per_step(stats["collective_bytes"], args.warmup + args.steps),
                  host_state_bytes=sum(t.numel() * t.element_size()
                                       for t in [host.master, host.exp_avg, host.exp_avg_sq, *host.acc]),
                  final_loss=statistics.fmean(losses[-4:]), device=str(device),
                  gradient_elements_held=held, parameter_elements=sum(p.numel() for p in model.parameters()),
                  torch_threads=torch.get_num_threads())
    opt.close()
    write_rank(args, rank, result)
    dist.destroy_process_group()


def main(argv=None) -> int:
    from bench.model import SIZES

    ap = harness.OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=harness.int_at_least(1), nargs="+", default=[1, 2])
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2))
    ap.add_argument("--model", default="small", choices=sorted(SIZES))
    ap.add_argument("--steps", type=harness.int_at_least(1), default=40)
    ap.add_argument("--warmup", type=harness.int_at_least(1), default=8)
    ap.add_argument("--batch-scale", type=harness.int_at_least(1), default=2,
                    help="global batch = the preset's batch times this")
    ap.add_argument("--repeats", type=harness.int_at_least(1), default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    started = time.time()
    worker_args = ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--stage",
                   str(args.stage), "--batch-scale", str(args.batch_scale)]
    runs: dict[int, list[list[dict]]] = {w: [] for w in args.worlds}
    for repeat in range(args.repeats):
        for world in args.worlds:
            ranks = harness.run_ranks("bench.zero", world, worker_args, timeout=1800,
                                      what=f"a rank of world size {world}")
            runs[world].append(ranks)
            print(f"repeat {repeat}: world {world}: {ranks[0]['steps_per_s']:.2f} steps/s, host state per rank "
                  f"{[r['host_state_bytes'] for r in ranks]} bytes", flush=True)
    summary = {}
    for world, reps in runs.items():
        rates = [r[0]["steps_per_s"] for r in reps]
        summary[world] = dict(
            steps_per_s_median=statistics.median(rates), steps_per_s=rates,
            host_state_bytes_per_rank=[r["host_state_bytes"] for r in reps[0]],
            gradient_elements_held_per_rank=[r["gradient_elements_held"] for r in reps[0]],
            parameter_elements=reps[0][0]["parameter_elements"],
            collective_bytes_per_step=reps[0][0]["collective_bytes_per_step"],
            final_loss=reps[0][0]["final_loss"], device=reps[0][0]["device"],
            torch_threads_per_rank=reps[0][0]["torch_threads"],
        )
    base = summary[args.worlds[0]]["steps_per_s_median"]
    for s in summary.values():
        s["steps_per_s_vs_first_world"] = s["steps_per_s_median"] / base
    kind = "cuda" if summary[args.worlds[-1]]["device"].startswith("cuda") else "cpu"
    payload = dict(benchmark="zero", command="python -m bench." + " ".join(["zero", *(argv or sys.argv[1:])]),
                   config=dict(model=args.model, steps=args.steps, warmup=args.warmup, stage=args.stage,
                               batch_scale=args.batch_scale, repeats=args.repeats,
                               zenflow="topk 0.1, update_interval 4, overlap"),
                   summary={str(k): v for k, v in summary.items()}, runs={str(k): v for k, v in runs.items()},
                   machine=harness.machine_info(), total_s=time.time() - started)
    out = harness.output_dir(args.out)
    path = harness.write_result(out / f"zero_{kind}.json", payload)
    plot(payload, out / f"zero_{kind}.png")
    for world, s in summary.items():
        moved = s["collective_bytes_per_step"]
        grads = moved.get("gradients", 0.0)
        scores = moved.get("selection scores", 0.0)
        print(f"world {world}: {s['steps_per_s_median']:.2f} steps/s ({s['steps_per_s_vs_first_world']:.2f}x), "
              f"host state per rank {s['host_state_bytes_per_rank']}, gradient elements held after backward "
              f"{s['gradient_elements_held_per_rank']} of {s['parameter_elements']}, gradients {grads:.0f} B/step, "
              f"selection scores {scores:.1f} B/step")
    print(f"wrote {path}")
    return 0


def plot(payload: dict, path: Path) -> None:
    summary = payload["summary"]
    worlds = list(summary)
    fig, (a, b) = harness.figure(2)
    a.bar(worlds, [summary[w]["steps_per_s_median"] for w in worlds])
    harness.style(a, "world size", "steps/s (median)",
          f"ZeRO-{payload['config']['stage']}, {payload['config']['model']} model, same global batch", grid=None)
    bottom = [0.0] * len(worlds)
    for k in sorted({k for w in worlds for k in summary[w]["collective_bytes_per_step"]}):
        vals = [summary[w]["collective_bytes_per_step"].get(k, 0.0) for w in worlds]
        b.bar(worlds, vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    harness.style(b, "world size", "collective payload bytes per step (rank 0)", grid=None)
    harness.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
