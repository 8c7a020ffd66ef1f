"""FSDP2 benchmark: one process against ``fully_shard`` at 2 ranks, same global batch, ZenFlow beside AdamW.

    python -m bench.fsdp2                  # the small byte GPT, 40 timed steps, 5 interleaved repeats, CPU (gloo)
    python -m bench.fsdp2 --quick          # the tiny model, a few steps, one repeat (the test's run)

Five configurations (``CONFIGS``: one process or 2 ranks with ``fully_shard`` per transformer block and at the
root; ``ZenFlowAdamW``, ``torch.optim.AdamW``, or AdamW with ``CPUOffloadPolicy(pin_memory=False)``), each its own
processes (one per rank, started like torchrun would), run round by round (a, b, c, d, e, then b, c, d, e, a, ...)
so drift hits all alike, on the same initial weights and global batches (standard-library source, bench/data.py; a
rank trains on its half). One process gets ``cores`` torch threads, each of 2 ranks ``cores // 2``. Measured per
configuration: steps/s (timed steps over their wall time, and the median single step), the optimizer's host state
per rank (``opt.host_bytes()`` for ZenFlow; the storage of AdamW's state tensors), the parameter shard, peak RSS, the
global batch's loss at every step, and the payload bytes of every collective per step by kind: ZenFlow's from
``opt.stats()["collective_bytes"]``, FSDP2's counted (with the time inside the calls) by shims around
``torch.distributed``'s collectives installed before the model is wrapped (a call on the FSDP2 mesh's group is
FSDP2's; ZenFlow's groups' shim count is checked against ZenFlow's figure). The machine is shared: each launch
records the CPU time the rest of the machine used meanwhile (/proc/stat); the ``*_calm`` figures take only the
repeats where that stayed under ``CALM_OTHER`` of the cores. Writes ``fsdp2_cpu.json`` and ``fsdp2_cpu.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import harness

CONFIGS: dict[str, dict] = {
    "one_zenflow": dict(world=1, fsdp2=False, optimizer="zenflow"),
    "one_adamw": dict(world=1, fsdp2=False, optimizer="adamw"),
    "fsdp2_zenflow": dict(world=2, fsdp2=True, optimizer="zenflow"),
    "fsdp2_adamw": dict(world=2, fsdp2=True, optimizer="adamw"),
    "fsdp2_offload_adamw": dict(world=2, fsdp2=True, optimizer="adamw", offload=True),
}
# each FSDP2 run's one-process twin: the same optimizer on the whole batch (its loss curve must match)
TWIN = {"fsdp2_zenflow": "one_zenflow", "fsdp2_adamw": "one_adamw", "fsdp2_offload_adamw": "one_adamw"}
HYPER = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# torch.optim.AdamW's implementations; fused (one kernel over all tensors, on CPU too, DTensors included) is
# torch's fastest here: its default on CPU is the per-tensor loop, slow on FSDP2's DTensors (--adamw default)
ADAMW_FORMS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "default": {}}
LOSS_TAIL = 4  # the final loss: the mean of the last steps' global-batch losses
CALM_OTHER = 0.15  # a repeat is calm when the rest of the machine used at most this share of the cores


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def one_selection_zenflow(args, pt_reserved_cores_perc: float) -> dict:
    """The ZenFlow config of this benchmark and bench.zero: top 10% of the columns, chosen once over the whole run
    (warm-up and timed steps), the rest updated on the host every 4 steps, overlapped."""
    return dict(topk_ratio=0.1, update_interval=4, overlap_step=True, select_strategy="step",
                select_interval=max(4, args.warmup + args.steps), pt_reserved_cores_perc=pt_reserved_cores_perc)


def per_step(counts: dict, steps: int, prefix: str = "") -> dict:
    """Bytes per step by collective kind, from the run's totals (over every step it took, warm-up included)."""
    return {f"{prefix}{kind}": nbytes / steps for kind, nbytes in counts.items()}


def write_rank(args, rank: int, result: dict) -> None:
    """A rank's result where ``harness.run_ranks`` reads it."""
    Path(args.worker_out, f"rank{rank}.json").write_text(json.dumps(result))


class CollectiveCounter:
    """Shims around ``torch.distributed``'s collective functions that count calls and payload bytes by
    (group, kind). FSDP2 looks its collectives up on the module at call time (``dist.all_gather_single``,
    ``dist.reduce_scatter_single`` in torch 2.13's ``_fsdp_collectives.py``), so replacing the module's
    attributes sees them. Payload: the unsharded buffer for all-gather (its output: world x this rank's
    shard) and reduce-scatter (its input), the tensor for all-reduce, broadcast and reduce (as ZenFlow
    counts its own). A call made inside another counted call (one function implemented by another) is not
    counted twice. Counters are updated under a lock: ZenFlow's host worker may run collectives too."""

    OPS = {  # function -> (kind, which tensor argument is the payload)
        "all_gather_single": ("all-gather", "out"), "all_gather_into_tensor": ("all-gather", "out"),
        "reduce_scatter_single": ("reduce-scatter", "in"), "reduce_scatter_tensor": ("reduce-scatter", "in"),
        "all_reduce": ("all-reduce", "in"), "broadcast": ("broadcast", "in"), "reduce": ("reduce", "in"),
    }

    def __init__(self):
        self.lock = threading.Lock()
        self.local = threading.local()
        # (group, kind) -> [calls, bytes, this rank's part (a shard in or out), seconds inside the call (the
        # transfer when synchronous)]
        self.counts: dict[tuple[object, str], list] = {}
        self.saved: dict[str, object] = {}

    def reset_seconds(self) -> None:
        with self.lock:
            for row in self.counts.values():
                row[3] = 0.0

    def install(self) -> None:
        import torch.distributed as dist

        for name, (kind, which) in self.OPS.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                self.saved[name] = fn
                setattr(dist, name, self._shim(fn, kind, which))

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        self.saved.clear()

    def _shim(self, fn, kind: str, which: str):
        import torch

        def nbytes(t) -> int:
            return t.numel() * t.element_size()

        def shim(*args, **kwargs):
            if getattr(self.local, "depth", 0):
                return fn(*args, **kwargs)
            tensors = [a for a in args if torch.is_tensor(a)]
            tensors += [kwargs[n] for n in ("output_tensor", "output", "input_tensor", "input", "tensor")
                        if n in kwargs and torch.is_tensor(kwargs[n])]
            if which == "out":  # (output, input, ...): the output is the unsharded buffer
                total, shard = nbytes(tensors[0]), nbytes(tensors[1]) if len(tensors) > 1 else 0
            else:  # reduce-scatter (output, input) or a single tensor
                total = nbytes(tensors[1] if kind == "reduce-scatter" else tensors[0])
                shard = nbytes(tensors[0]) if kind == "reduce-scatter" else total
            self.local.depth = 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.local.depth = 0
                with self.lock:
                    row = self.counts.setdefault((kwargs.get("group"), kind), [0, 0, 0, 0.0])
                    row[:] = [row[0] + 1, row[1] + total, row[2] + shard, row[3] + took]

        return shim

    def split(self, mesh_group) -> tuple[dict, dict]:
        """({kind: (calls, bytes, shard bytes, seconds)} on the FSDP2 mesh's group, the same on every other
        group)."""
        import torch.distributed as dist

        mesh, other = {}, {}
        with self.lock:
            for (group, kind), row in self.counts.items():
                on_mesh = mesh_group is not None and (group is mesh_group or (group is None
                                                                                and mesh_group is dist.group.WORLD))
                into = mesh if on_mesh else other
                into[kind] = tuple(a + b for a, b in zip(into.get(kind, (0, 0, 0, 0.0)), row, strict=True))
        return mesh, other


def _state_bytes(optimizer) -> int:
    """The storage of torch.optim's state tensors on this rank (DTensors: their local shard), each once."""
    import torch

    storages = {}
    for v in (v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)):
        s = (v.to_local() if hasattr(v, "to_local") else v).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _param_bytes(model) -> int:
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from bench.model import build_model
    from zenflow_kernels import ZenFlowAdamW

    cfg = CONFIGS[args.worker_config]
    world = cfg["world"]
    torch.set_num_threads(max(1, cores() // world))
    rank, mesh_group, counter = 0, None, CollectiveCounter()
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if dist.get_world_size() != world:
            raise SystemExit(f"bench.fsdp2: {args.worker_config} expects {world} ranks, got {dist.get_world_size()}")
    counter.install()  # before the model is wrapped: every collective of the run is seen
    model = build_model(args.model, seed=0)
    if cfg["fsdp2"]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mesh_group = mesh.get_group()
        extra = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if cfg.get("offload") else {}
        for block in [*model.blocks, model]:
            fully_shard(block, mesh=mesh, **extra)
    if cfg["optimizer"] == "zenflow":
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=one_selection_zenflow(args, 1.0))
    else:
        opt = torch.optim.AdamW(model.parameters(), **HYPER, **ADAMW_FORMS[args.adamw])
    tokens = torch.load(args.worker_data)  # [warmup + steps, global batch, context + 1]
    batch = tokens.shape[1]
    part = slice(rank * batch // world, (rank + 1) * batch // world)
    losses, step_s, call_s, t0 = [], [], [], None
    for t in range(args.warmup + args.steps):
        if t == args.warmup:
            if world > 1:
                dist.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            counter.reset_seconds()  # the time inside collectives: over the timed steps
        start = time.perf_counter()
        loss = model.loss(tokens[t, part, :-1], tokens[t, part, 1:])
        loss.backward()
        called = time.perf_counter()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if t >= args.warmup:
            done = time.perf_counter()
            step_s.append(done - start)
            call_s.append(done - called)
    if world > 1:
        dist.barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    total_steps = args.warmup + args.steps
    zen = None
    if cfg["optimizer"] == "zenflow":
        stats = opt.stats()  # before flush(): the steps' collectives only
        opt.flush()
        host = opt.host_bytes()
        zen = dict(host_bytes=host, selections=stats["selections"], host_updates=stats["host_updates"],
                   stall_fraction=stats["stall_fraction"], collective_bytes=stats["collective_bytes"])
        state_bytes = host["total"] + host["fast_state"] + host["device_sums"]
    else:
        state_bytes = _state_bytes(opt)
    mesh_counts, other_counts = counter.split(mesh_group)
    counter.uninstall()
    result = dict(
        rank=rank, world=world, config=args.worker_config, steps=args.steps, warmup=args.warmup,
        wall_s=wall, cpu_s=cpu, load_average_end=os.getloadavg(), steps_per_s=args.steps / wall, step_s=step_s,
        step_call_s=call_s, losses=losses, optimizer_state_bytes=state_bytes, parameter_bytes=_param_bytes(model),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        collective_bytes_per_step={**per_step({kind: b for kind, (_, b, _, _) in mesh_counts.items()}, total_steps,
                                              "FSDP2 "),
                                   **per_step(zen["collective_bytes"] if zen else {}, total_steps)},
        fsdp2_collectives={kind: dict(calls_per_step=c / total_steps, bytes_per_step=b / total_steps,
                                      shard_bytes_per_step=s / total_steps, ms_per_step=1e3 * sec / args.steps)
                           for kind, (c, b, s, sec) in mesh_counts.items()},
        other_groups_bytes={kind: b for kind, (_, b, _, _) in other_counts.items()},
        zenflow=zen, torch_threads=torch.get_num_threads(),
    )
    if hasattr(opt, "close"):
        opt.close()
    write_rank(args, rank, result)
    if world > 1:
        dist.destroy_process_group()


def machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has used since boot, all cores (None without /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_config(name: str, args, data: Path) -> list[dict]:
    """One launch of a configuration: its ranks' results, each with ``other_cpu_share``: the CPU time the
    rest of the machine used meanwhile (every process but these ranks), per wall second, over the cores."""
    worker_args = ["--worker-config", name, "--worker-data", str(data), "--model", args.model, "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--adamw", args.adamw]

    def children_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    busy0, wall0, mine0 = machine_busy_s(), time.perf_counter(), children_s()
    ranks = harness.run_ranks("bench.fsdp2", CONFIGS[name]["world"], worker_args, timeout=1800,
                              what=f"a rank of {name}")
    busy1, wall, mine = machine_busy_s(), time.perf_counter() - wall0, children_s() - mine0
    other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - mine) / (wall * cores()))
    for r in ranks:
        r["other_cpu_share"] = other
    return ranks


def median_ms(ranks: list[dict], key: str) -> float:
    """The median over the timed steps of the slowest rank's time at each step, in ms."""
    return 1e3 * statistics.median(max(step) for step in zip(*(r[key] for r in ranks), strict=True))


def summarise(name: str, reps: list[list[dict]]) -> dict:
    first = reps[0]
    step_ms = [median_ms(ranks, "step_s") for ranks in reps]
    walls = [min(r["steps_per_s"] for r in ranks) for ranks in reps]  # the slowest rank sets the pace
    # the share of the machine's cores the configuration's processes used over the timed steps (their CPU time,
    # every thread, per wall second, summed over the ranks, over the cores)
    shares = [sum(r["cpu_s"] / r["wall_s"] for r in ranks) / cores() for ranks in reps]
    others = [ranks[0]["other_cpu_share"] for ranks in reps]
    # the machine is shared: while other work held a core, one process on 2 threads ran up to 17x slower
    # here and 2 ranks on 1 thread ~2x. Calm repeats: the rest of the machine used at most CALM_OTHER of the
    # cores during the launch (every repeat when that is unknown)
    calm_at = [i for i, o in enumerate(others) if o is None or o <= CALM_OTHER]
    calm = [step_ms[i] for i in calm_at]
    # the global batch's loss at each step: the ranks' equal halves' mean losses, averaged
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in first), strict=True)]

    def collective_ms(kind: str, which) -> float | None:
        vals = [reps[i][0]["fsdp2_collectives"][kind]["ms_per_step"] for i in which]
        return statistics.median(vals) if vals else None

    out = dict(
        world=first[0]["world"], optimizer=CONFIGS[name]["optimizer"], fsdp2=CONFIGS[name]["fsdp2"],
        offload=bool(CONFIGS[name].get("offload")),
        steps_per_s_median=1e3 / statistics.median(step_ms), step_ms_median=statistics.median(step_ms),
        step_ms_per_repeat=step_ms,
        steps_per_s_calm=1e3 / statistics.median(calm) if calm else None,
        step_ms_calm=statistics.median(calm) if calm else None, calm_repeats=len(calm),
        other_cpu_share_per_repeat=others, cpu_share_per_repeat=shares,
        steps_per_s_best=1e3 / min(step_ms), step_ms_best=min(step_ms),
        steps_per_s_wall=statistics.median(walls), steps_per_s_wall_per_repeat=walls,
        step_call_ms_median=statistics.median(median_ms(ranks, "step_call_s") for ranks in reps),
        step_call_ms_calm=statistics.median(median_ms(reps[i], "step_call_s") for i in calm_at) if calm else None,
        load_average_1min_per_repeat=[ranks[0]["load_average_end"][0] for ranks in reps],
        optimizer_state_bytes_per_rank=[r["optimizer_state_bytes"] for r in first],
        parameter_bytes_per_rank=[r["parameter_bytes"] for r in first],
        peak_rss_bytes_per_rank=[max(ranks[i]["peak_rss_bytes"] for ranks in reps) for i in range(len(first))],
        collective_bytes_per_step=first[0]["collective_bytes_per_step"],
        fsdp2_collectives={kind: dict(row, ms_per_step=collective_ms(kind, range(len(reps))),
                                      ms_per_step_calm=collective_ms(kind, calm_at))
                           for kind, row in first[0]["fsdp2_collectives"].items()},
        losses=losses, final_loss=statistics.fmean(losses[-LOSS_TAIL:]),
        torch_threads_per_rank=first[0]["torch_threads"],
    )
    if first[0]["zenflow"] is not None:
        zen = [r["zenflow"] for r in first]
        out["zenflow"] = dict(
            host_bytes_per_rank=[z["host_bytes"] for z in zen], selections=zen[0]["selections"],
            host_updates=zen[0]["host_updates"],
            stall_fraction_per_repeat=[ranks[0]["zenflow"]["stall_fraction"] for ranks in reps],
            collective_bytes_total=zen[0]["collective_bytes"],
            # ZenFlow's own count beside what the shims saw on groups other than FSDP2's mesh: must agree
            shim_bytes_total_other_groups=sum(first[0]["other_groups_bytes"].values()),
        )
    return out


def corpus_batches(args, path: Path) -> dict:
    import torch

    from bench.data import batch_starts, load_corpus, windows
    from bench.model import SIZES

    size = SIZES[args.model]
    batch = size.batch * args.batch_scale
    corpus = load_corpus(seed=0, pretrain_bytes=1_000, train_bytes=args.train_bytes, heldout_bytes=1_000)
    steps = args.warmup + args.steps
    starts = batch_starts(corpus.train.nbytes, size.context, batch, steps, seed=1)
    x, y = windows(corpus.train.data, starts.reshape(-1), size.context)
    torch.save(torch.cat([x, y[:, -1:]], dim=1).reshape(steps, batch, size.context + 1), path)
    return dict(corpus.train.describe(), global_batch=batch, context=size.context)


def main(argv=None) -> int:
    from bench.model import SIZES

    at_least = harness.int_at_least
    ap = harness.OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, choices=sorted(SIZES), help="default small (tiny with --quick)")
    ap.add_argument("--steps", type=at_least(1), default=None, help="timed steps (default 40; --quick 6)")
    ap.add_argument("--warmup", type=at_least(1), default=None, help="untimed steps first (default 8; --quick 2)")
    ap.add_argument("--batch-scale", type=at_least(1), default=None,
                    help="global batch = the preset's batch times this (default 2; --quick 1)")
    ap.add_argument("--repeats", type=at_least(1), default=None,
                    help="rounds over the configurations (default 5; --quick 1)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, in the order each round runs them (of {', '.join(CONFIGS)})")
    ap.add_argument("--adamw", default="fused", choices=list(ADAMW_FORMS),
                    help="torch.optim.AdamW's implementation for the AdamW runs (default fused)")
    ap.add_argument("--train-bytes", type=at_least(10_000), default=200_000, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="the tiny model, a few steps, one repeat")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-config", default=None, choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--worker-data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = dict(model="tiny", steps=6, warmup=2, batch_scale=1, repeats=1)
    full = dict(model="small", steps=40, warmup=8, batch_scale=2, repeats=5)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker_out:
        worker(args)
        # the rank's work and its results are done: leave without the interpreter's teardown, where gloo's
        # threads sometimes abort an exiting process ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        ap.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; allowed {', '.join(CONFIGS)}")
    out = harness.output_dir(args.out)
    started = time.time()
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="fsdp2-data-") as tmp:
        data = Path(tmp, "tokens.pt")
        corpus = corpus_batches(args, data)
        for repeat in range(args.repeats):
            # round r starts at configuration r (mod their number): no configuration always runs first or
            # right after the same neighbour
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                ranks = run_config(name, args, data)
                runs[name].append(ranks)
                print(f"repeat {repeat}: {name}: median step {median_ms(ranks, 'step_s'):.1f} ms, "
                      f"{min(r['steps_per_s'] for r in ranks):.2f} steps/s over the wall time", flush=True)
    summary = {n: summarise(n, reps) for n, reps in runs.items()}
    base = summary[names[0]]["steps_per_s_median"]
    for s in summary.values():
        s["steps_per_s_vs_first"] = s["steps_per_s_median"] / base
    comparisons = {}
    for name, twin in TWIN.items():
        if name in summary and twin in summary:
            a, b = summary[name], summary[twin]
            comparisons[name] = dict(
                twin=twin, steps_per_s_ratio=a["steps_per_s_median"] / b["steps_per_s_median"],
                steps_per_s_ratio_best=a["steps_per_s_best"] / b["steps_per_s_best"],
                steps_per_s_ratio_calm=(a["steps_per_s_calm"] / b["steps_per_s_calm"]
                                        if a["steps_per_s_calm"] and b["steps_per_s_calm"] else None),
                max_abs_loss_diff=max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
                final_loss_diff=a["final_loss"] - b["final_loss"],
                optimizer_state_per_rank_ratio=max(a["optimizer_state_bytes_per_rank"])
                / b["optimizer_state_bytes_per_rank"][0])
    payload = dict(
        benchmark="fsdp2", command="python -m bench." + " ".join(["fsdp2", *(argv or sys.argv[1:])]),
        config=dict(model=args.model, model_size=SIZES[args.model].as_dict(), steps=args.steps, warmup=args.warmup,
                    batch_scale=args.batch_scale, global_batch=corpus["global_batch"], repeats=args.repeats,
                    quick=args.quick, configs=names, hyper=HYPER,
                    zenflow="topk_ratio 0.1, update_interval 4, overlap_step, select_strategy step with "
                            "select_interval warmup+steps (one selection), pt_reserved_cores_perc 1.0",
                    adamw=f"torch.optim.AdamW, {args.adamw} ({ADAMW_FORMS[args.adamw] or 'torch defaults'})",
                    fsdp2="fully_shard per transformer block and at the root, init_device_mesh('cpu', (2,)), gloo; "
                          "offload: CPUOffloadPolicy(pin_memory=False)",
                    threads=f"torch.set_num_threads: {cores()} for one process, {max(1, cores() // 2)} per rank "
                            "at 2 ranks",
                    steps_per_s="steps_per_s_median: 1 / the median step (each step timed on every rank, the slowest "
                                "rank's time; the median over the timed steps, then over the repeats); "
                                "steps_per_s_wall: timed steps / their wall time on the slowest rank (host updates' "
                                "and boundary steps' costs included), median over the repeats; step_call_ms_median: "
                                "the same median of opt.step() + zero_grad() alone; *_best: the repeat with the "
                                "shortest median step; *_calm: the median over the calm repeats, those during whose "
                                f"launch the rest of the machine used at most {CALM_OTHER} of the cores "
                                "(other_cpu_share_per_repeat: /proc/stat's busy time less the ranks' own, per wall "
                                "second, over the cores); cpu_share_per_repeat: the ranks' own CPU time over the "
                                "timed steps, the same way",
                    collective_bytes="payload bytes per step over all warm-up and timed steps, rank 0: FSDP2's "
                                     "counted by shims on torch.distributed (all-gather: the unsharded output; "
                                     "reduce-scatter: the unsharded input), ZenFlow's from opt.stats(); "
                                     "fsdp2_collectives: calls, bytes, this rank's shard bytes and (over the timed "
                                     "steps) the time inside the calls per step (on CPU FSDP2 calls them "
                                     "synchronously: the transfer and the wait for the other rank; rank 0, the median "
                                     "over the repeats)",
                    optimizer_state_bytes="ZenFlow: host_bytes() total + fast_state + device_sums; AdamW: the "
                                          "storage of its state tensors (this rank's shards)",
                    final_loss=f"mean of the last {LOSS_TAIL} steps' global-batch losses"),
        corpus=corpus, summary=summary, comparisons=comparisons,
        runs={n: [[{k: v for k, v in r.items() if k != "losses"} for r in ranks] for ranks in reps]
              for n, reps in runs.items()},
        machine=harness.machine_info(), total_s=time.time() - started)
    path = harness.write_result(out / "fsdp2_cpu.json", payload)
    plot(payload, out / "fsdp2_cpu.png")
    for name, s in summary.items():
        moved = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(s["collective_bytes_per_step"].items()))
        print(f"{name}: {s['steps_per_s_median']:.2f} steps/s ({s['steps_per_s_vs_first']:.2f}x; median step "
              f"{s['step_ms_median']:.1f} ms, calm repeats {s['calm_repeats']} at "
              f"{s['step_ms_calm'] or float('nan'):.1f} ms, best repeat {s['step_ms_best']:.1f} ms, step() "
              f"{s['step_call_ms_median']:.1f} ms; over the wall time {s['steps_per_s_wall']:.2f}), "
              f"optimizer state per rank {s['optimizer_state_bytes_per_rank']} B, "
              f"final loss {s['final_loss']:.4f}; bytes/step: {moved or 'none'}")
    print(f"wrote {path}")
    return 0


def _grouped_bars(ax, names: list[str], series: dict) -> None:
    """A group of bars per name, one bar per series side by side; the names (first "_" a line break) below."""
    w = 0.8 / max(1, len(series))
    for j, (label, vals) in enumerate(series.items()):
        ax.bar([i + (j - (len(series) - 1) / 2) * w for i in range(len(names))], vals, w, label=label)
    ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)


def plot(payload: dict, path: Path) -> None:
    summary, cfg = payload["summary"], payload["config"]
    names = list(summary)
    fig, (a, b, c) = harness.figure(3, size=(16, 4.5))
    _grouped_bars(a, names, {"all repeats": [summary[n]["steps_per_s_median"] for n in names],
                             f"calm repeats (others used <= {CALM_OTHER} of the cores)":
                                 [summary[n]["steps_per_s_calm"] or 0.0 for n in names]})
    for i, n in enumerate(names):
        for ms, other in zip(summary[n]["step_ms_per_repeat"], summary[n]["other_cpu_share_per_repeat"], strict=True):
            a.plot([i], [1e3 / ms], "k." if other is None or other <= CALM_OTHER else "kx", ms=4)
    a.set_ylim(top=1.3 * max(1e3 / ms for n in names for ms in summary[n]["step_ms_per_repeat"]))
    harness.style(a, None, "steps/s = 1 / median step (dots: calm repeats, x: others)",
                  f"{cfg['model']} model, global batch {cfg['global_batch']}, {cfg['steps']} timed steps", grid=None)
    _grouped_bars(b, names, {
        "optimizer state": [max(summary[n]["optimizer_state_bytes_per_rank"]) / 2**20 for n in names],
        "parameters (own shard)": [max(summary[n]["parameter_bytes_per_rank"]) / 2**20 for n in names]})
    harness.style(b, None, "MiB per rank (largest rank)", "host memory per rank, measured", grid=None)
    shown = [n for n in names if summary[n]["collective_bytes_per_step"]]
    kinds = sorted({k for n in names for k in summary[n]["collective_bytes_per_step"]})
    _grouped_bars(c, shown, {k: [summary[n]["collective_bytes_per_step"].get(k, 0.0) for n in shown] for k in kinds})
    top = max((v for n in shown for v in summary[n]["collective_bytes_per_step"].values()), default=1.0)
    harness.style(c, None, "payload bytes per step (rank 0), log scale", "collectives by kind", logy=10, legend=6,
                  grid=None)
    c.set_ylim(top=top * 300)  # room for the legend above the bars
    harness.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
