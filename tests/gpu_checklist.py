"""The CUDA path's checklist, for a lent GPU: one call, one row of ``gpu_checklist.json`` per item.

    python -m tests.gpu_checklist [--out DIR]              # on CUDA (bench/gpu_suite.sh stage 1b)
    python -m tests.gpu_checklist --device cpu --quick     # the same code on CPU, small (tests/test_gpu_checklist.py)

A test of the GPU paths, not a benchmark: it lives under tests/ (run from the repository root; it uses
bench.harness's rank launcher and result writer, as the GPU suite's benchmarks do).

What a GPU shows that the CPU stand-ins cannot (tests/test_cuda_stand_in.py checks the ordering on CPU). Every
row trains one model from the same weights on the same batches under a reference link and the link under test,
and compares them. On CUDA the reference is the CUDA engine with the host waiting for every gradient copy job
(nothing outlives its copy: the synchronous path's memory), the link under test the CUDA engine; on CPU the
reference is the synchronous CPU link, the link under test the asynchronous one (``testing.chaos``: the CUDA
engine's protocol with threads for streams). A slow D2H is ``torch.cuda._sleep`` queued on the D2H stream before
every copy job (CPU: chaos delays). Rows:

* ``memory``: a large-vocabulary model (embedding, LM head), hooks on: memory allocated after
  ``zero_grad(set_to_none=True)`` and at the forward's peak, each step, against the reference (CUDA:
  ``torch.cuda.memory_allocated``, as a change from the run's start; CPU: bytes of gradient storages still alive,
  by weak reference, once the copy threads are idle); ok when every step is within ``MEMORY_SLACK`` bytes and
  the weights are bit-identical.
* ``slow_d2h``: the hand-over with every copy job delayed: bit-identical to the reference at every step.
* ``grad_scaler``: ``torch.amp.GradScaler`` (fp16 autocast on CUDA, bf16 on CPU), an overflow at step 0 (an inf
  in the loss), a slow D2H: step 0 changes no weight and backs the scale off; bit-identical to the reference.
* ``pinned``: every D2H destination (gradient copies, fetches of the device sums) lies in a buffer the engine
  allocated and, on CUDA, ``is_pinned()``.
* ``fsdp2_stream``: FSDP2 (``fully_shard``, one rank) with hooks: the streams current when the gradients were
  handed over (FSDP2's post-reduce stream on CUDA), bit-identical to the reference.
* ``device_sums_disk``: ``device_accumulation`` with the state on disk, clipping, overlap, a slow compute stream
  (``torch.cuda._sleep`` before each ``step()``) and a slow D2H: bit-identical to the same in memory on the
  reference link.
* ``close_during_update``: ``close()`` right after the step that started a host update lands it (bit-identical to
  ``flush()`` then ``close()`` on the reference) within ``CLOSE_BOUND_S`` and unlocks every page-locked buffer.
* ``zero``: ZeRO-1 at 2 ranks (processes started as torchrun starts them; NCCL and a GPU each when there are 2
  GPUs, else gloo): ``memory``'s measure per rank, the ranks' weights equal, a profile of one update boundary
  (rank 0: ``zero_boundary_trace.json``; ok when it holds no pageable host-to-device copy; device synchronisations
  counted), and with a GPU per rank no CUDA context on GPU 0 in rank 1 (else that item says why it is skipped).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from bench.harness import OneLineParser, machine_info, output_dir, run_ranks, write_result
from zenflow_kernels import ZenFlowAdamW, link
from zenflow_kernels.testing import chaos

ZEN = dict(topk_ratio=0.1, update_interval=2, overlap_step=True, full_warm_up_rounds=0, select_strategy="step",
           select_interval=4)
HYPER = dict(lr=1e-3, weight_decay=0.01)
# bytes a row's memory may differ from the reference's: on CUDA the caching allocator's rounding (a held
# weight gradient of the full-size model is >= 2 MiB); on CPU the measure is exact
MEMORY_SLACK = dict(cuda=1 << 20, cpu=0)
CLOSE_BOUND_S = 60.0
SLEEP_CYCLES = 20_000_000  # torch.cuda._sleep: ~10 ms at 2 GHz


class Device:
    """The device under test and what each row asks of it: links, delays, the memory measure."""

    def __init__(self, device: torch.device, quick: bool):
        self.device, self.quick, self.cuda = device, quick, device.type == "cuda"
        self.engine = link.CudaEngine if self.cuda else link.ThreadEngine

    @contextlib.contextmanager
    def link(self, kind: str):
        """Optimizers built inside get the reference link (``"sync"``), the link under test (``"async"``) or the
        link under test with every D2H copy job delayed (``"slow"``)."""
        if not self.cuda:
            if kind == "sync":
                yield
            else:
                with chaos(seed=0, max_delay=0.004 if kind == "slow" else 0.0):
                    yield
            return
        original = link.CudaEngine.d2h

        def d2h(engine, copies):
            if copies and kind == "slow":
                compute = torch.cuda.current_stream(engine.device)

                def delay():  # on the D2H stream (behind_d2h makes it current), after the device work so far
                    torch.cuda.current_stream(engine.device).wait_stream(compute)
                    torch.cuda._sleep(SLEEP_CYCLES // 4)

                engine.behind_d2h(delay)
            original(engine, copies)
            if copies and kind == "sync":
                engine.d2h_marker().wait()  # the host waits for these copies: the synchronous reference

        link.CudaEngine.d2h = d2h
        try:
            yield
        finally:
            link.CudaEngine.d2h = original

    def slow_compute(self) -> None:
        """Keep the compute stream busy (CUDA; on CPU chaos delays the host side instead)."""
        if self.cuda:
            torch.cuda._sleep(SLEEP_CYCLES)

    def baseline(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def held_after_zero_grad(self, opt, model, baseline: int) -> int:
        """Bytes the run holds after ``zero_grad(set_to_none=True)`` (see the module docstring)."""
        if self.cuda:
            opt.zero_grad(set_to_none=True)
            return torch.cuda.memory_allocated(self.device) - baseline
        refs = [(StorageWeakRef(p.grad.untyped_storage()), p.grad.untyped_storage().nbytes())
                for p in model.parameters() if p.grad is not None]
        opt.zero_grad(set_to_none=True)
        opt.link.synchronize()  # the copy threads idle: what is alive now is held by the program
        return sum(n for ref, n in refs if not ref.expired())

    @contextlib.contextmanager
    def forward_peak(self, out: list, baseline: int):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        if self.cuda:
            out.append(torch.cuda.max_memory_allocated(self.device) - baseline)


@contextlib.contextmanager
def watch_engine(engine_cls, seen: dict):
    """Record every buffer ``engine_cls`` allocates, every D2H destination with the stream current when it was
    handed over, and every fetch destination."""
    alloc, d2h, fetcher = engine_cls.alloc, engine_cls.d2h, engine_cls.fetcher

    def watched_alloc(engine, numel, dtype):
        t = alloc(engine, numel, dtype)
        seen["buffers"].append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    def watched_d2h(engine, copies):
        stream = str(torch.cuda.current_stream()) if torch.cuda.is_available() and copies and copies[0][1].is_cuda \
            else "cpu"
        seen["d2h"] += [(dst, stream) for dst, _ in copies]
        return d2h(engine, copies)

    def watched_fetcher(engine, flat):
        fetch = fetcher(engine, flat)

        def recorded(dst, lo, hi):
            seen["fetch"].append(dst)
            return fetch(dst, lo, hi)

        return recorded

    engine_cls.alloc, engine_cls.d2h, engine_cls.fetcher = watched_alloc, watched_d2h, watched_fetcher
    try:
        yield
    finally:
        engine_cls.alloc, engine_cls.d2h, engine_cls.fetcher = alloc, d2h, fetcher


def inside_buffers(t: torch.Tensor, buffers) -> bool:
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(start <= lo and hi <= start + n for start, n in buffers)


# -- models and loops ---------------------------------------------------------------------------------------------


class VocabModel(torch.nn.Module):
    """Embedding -> MLP -> LM head: the embedding's gradient comes last in backward and is the largest."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        return self.head(self.mlp(self.embed(tokens)))


def sizes(dev: Device) -> dict:
    if dev.quick:
        return dict(vocab=512, width=32, batch=4, seq=16, steps=6)
    return dict(vocab=131072, width=1024, batch=4, seq=512, steps=8)


def make_model(dev: Device, dtype=None) -> VocabModel:
    s = sizes(dev)
    torch.manual_seed(0)
    model = VocabModel(s["vocab"], s["width"])
    return model.to(device=dev.device, dtype=dtype or (torch.bfloat16 if dev.cuda else torch.float32))


def make_batches(dev: Device, n: int):
    s = sizes(dev)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s["vocab"], (n, s["batch"], s["seq"] + 1), generator=g)
    return [(t[:, :-1].to(dev.device), t[:, 1:].to(dev.device)) for t in tokens]


def lm_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def weights(model) -> list[torch.Tensor]:
    """The parameters' values on the host (an FSDP2 shard's whole tensor: one rank here)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", copy=True)
            for p in model.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(dev: Device, kind: str, base, batches, *, zenflow=ZEN, memory=False, each_step=None, own=False,
          **opt_kw):
    """Train a copy of ``base`` (``own``: ``base`` itself) on ``batches`` on the link ``kind``; returns the weights
    after each step (and the flush) and, with ``memory``, the bytes held after each ``zero_grad`` and the forwards'
    peaks."""
    model = base if own else copy.deepcopy(base)
    held, peaks, history = [], [], []
    with dev.link(kind):
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=zenflow, **opt_kw)
        with opt:
            baseline = dev.baseline()
            for x, y in batches:
                with dev.forward_peak(peaks, baseline):
                    loss = lm_loss(model, x, y)
                loss.backward()
                opt.step()
                if memory:
                    held.append(dev.held_after_zero_grad(opt, model, baseline))
                else:
                    opt.zero_grad(set_to_none=True)
                history.append(weights(model))
                if each_step is not None:
                    each_step(opt)
            opt.flush()
            history.append(weights(model))
            stats = opt.stats()
    return dict(history=history, held=held, peaks=peaks, stats=stats)


def bit_identical(a: dict, b: dict) -> bool:
    return len(a["history"]) == len(b["history"]) and all(
        same(x, y) for x, y in zip(a["history"], b["history"], strict=True))


# -- rows ---------------------------------------------------------------------------------------------------------


def check_memory(dev: Device, out: Path) -> dict:
    base, data = make_model(dev), make_batches(dev, sizes(dev)["steps"])
    ref = train(dev, "sync", base, data, memory=True)
    got = train(dev, "async", base, data, memory=True)
    held_diff = [g - r for g, r in zip(got["held"], ref["held"], strict=True)]
    peak_diff = [g - r for g, r in zip(got["peaks"], ref["peaks"], strict=True)]
    worst = max(map(abs, held_diff + peak_diff), default=0)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    slack = MEMORY_SLACK[dev.device.type]
    return dict(ok=worst <= slack and bit_identical(ref, got) and got["stats"]["handover"] == "on",
                held_after_zero_grad=got["held"], held_reference=ref["held"], forward_peak=got["peaks"],
                forward_peak_reference=ref["peaks"], worst_difference_bytes=worst, gradient_bytes=grad_bytes,
                handover=got["stats"]["handover"])


def check_slow_d2h(dev: Device, out: Path) -> dict:
    base, data = make_model(dev), make_batches(dev, sizes(dev)["steps"])
    ref, got = train(dev, "sync", base, data), train(dev, "slow", base, data)
    steps_equal = [same(a, b) for a, b in zip(ref["history"], got["history"], strict=True)]
    return dict(ok=all(steps_equal) and got["stats"]["handover"] == "on", steps_bit_identical=steps_equal,
                handover=got["stats"]["handover"], d2h_bytes_in_backward=got["stats"]["d2h_bytes_in_backward"])


def _scaled_run(dev: Device, kind: str, base, data):
    model = copy.deepcopy(base)
    dtype = torch.float16 if dev.cuda else torch.bfloat16
    scaler = torch.amp.GradScaler(dev.device.type, init_scale=2.0**16)
    history, scales = [], []
    with dev.link(kind), ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZEN) as opt:
        for t, (x, y) in enumerate(data):
            with torch.autocast(dev.device.type, dtype=dtype):
                loss = lm_loss(model, x, y)
            scaler.scale(loss * float("inf") if t == 0 else loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(float(scaler.get_scale()))
            history.append(weights(model))
        opt.flush()
        history.append(weights(model))
    return dict(history=history, scales=scales)


def check_grad_scaler(dev: Device, out: Path) -> dict:
    base, data = make_model(dev, torch.float32), make_batches(dev, sizes(dev)["steps"])
    ref, got = _scaled_run(dev, "sync", base, data), _scaled_run(dev, "slow", base, data)
    step0_skipped = same(got["history"][0], weights(base)) and got["scales"][0] == 2.0**15
    trained = not same(got["history"][-1], weights(base))
    return dict(ok=step0_skipped and trained and bit_identical(ref, got) and ref["scales"] == got["scales"],
                step0_skipped=step0_skipped, scales=got["scales"], bit_identical=bit_identical(ref, got))


def check_pinned(dev: Device, out: Path) -> dict:
    seen = dict(buffers=[], d2h=[], fetch=[])
    base, data = make_model(dev), make_batches(dev, sizes(dev)["steps"])
    with tempfile.TemporaryDirectory() as tmp, watch_engine(dev.engine, seen):
        train(dev, "async", base, data)
        disk = dict(ZEN, device_accumulation=True, offload_device="nvme", nvme_path=tmp)
        train(dev, "async", base, data, zenflow=disk, max_grad_norm=1.0)
    dsts = [d for d, _ in seen["d2h"]] + seen["fetch"]
    outside = sum(not inside_buffers(d, seen["buffers"]) for d in dsts)
    unpinned = sum(not d.is_pinned() for d in dsts) if dev.cuda else None
    return dict(ok=bool(seen["d2h"]) and bool(seen["fetch"]) and outside == 0 and not unpinned,
                d2h_destinations=len(seen["d2h"]), fetch_destinations=len(seen["fetch"]),
                outside_engine_buffers=outside, not_pinned=unpinned)


@contextlib.contextmanager
def one_rank_group(dev: Device):
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if dev.cuda else "gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def check_fsdp2_stream(dev: Device, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seen = dict(buffers=[], d2h=[], fetch=[])
    data = make_batches(dev, sizes(dev)["steps"])
    runs = {}
    with one_rank_group(dev):
        mesh = init_device_mesh(dev.device.type, (1,))
        for kind in ("sync", "async"):
            base = make_model(dev)
            for block in (base.embed, base.mlp, base.head):
                fully_shard(block, mesh=mesh)
            fully_shard(base, mesh=mesh)
            with watch_engine(dev.engine, seen) if kind == "async" else contextlib.nullcontext():
                runs[kind] = train(dev, kind, base, data, own=True)
    streams = sorted({s for _, s in seen["d2h"]})
    return dict(ok=bit_identical(runs["sync"], runs["async"]) and runs["async"]["stats"]["handover"] == "on",
                streams_at_handover=streams, handover=runs["async"]["stats"]["handover"])


def check_device_sums_disk(dev: Device, out: Path) -> dict:
    base, data = make_model(dev), make_batches(dev, sizes(dev)["steps"])
    sums = dict(ZEN, device_accumulation=True)
    with tempfile.TemporaryDirectory() as tmp:
        ref = train(dev, "sync", base, data, zenflow=sums, max_grad_norm=0.5)
        got = train(dev, "slow", base, data, zenflow=dict(sums, offload_device="nvme", nvme_path=tmp),
                    max_grad_norm=0.5, each_step=lambda opt: dev.slow_compute())
    return dict(ok=bit_identical(ref, got), bit_identical=bit_identical(ref, got),
                host_updates=got["stats"].get("host_updates"))


def _close_run(dev: Device, kind: str, base, data, close_early: bool):
    model = copy.deepcopy(base)
    with dev.link(kind):
        opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZEN)
        started = False
        for x, y in data:
            lm_loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            started = opt.host_update_in_flight
            if started:
                break
        if not close_early:
            opt.flush()
        t0 = time.perf_counter()
        opt.close()
        seconds = time.perf_counter() - t0
    pinned = opt.link.engine.pinned if dev.cuda else []
    return dict(weights=weights(model), started=started, close_s=seconds, pinned_left=len(pinned))


def check_close_during_update(dev: Device, out: Path) -> dict:
    base, data = make_model(dev), make_batches(dev, sizes(dev)["steps"])
    ref, got = _close_run(dev, "sync", base, data, False), _close_run(dev, "slow", base, data, True)
    return dict(ok=got["started"] and same(ref["weights"], got["weights"]) and got["close_s"] < CLOSE_BOUND_S
                and got["pinned_left"] == 0, update_in_flight=got["started"], close_s=got["close_s"],
                pinned_buffers_left=got["pinned_left"], bit_identical=same(ref["weights"], got["weights"]))


def zero_rank(args) -> None:
    """One rank of the ``zero`` row (``--worker-out``)."""
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda":
        index = rank if gpus >= world else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" and gpus >= world else "gloo")
    dev = Device(device, args.quick)
    base, data = make_model(dev), make_batches(dev, sizes(dev)["steps"])
    part = slice(rank * sizes(dev)["batch"] // world, (rank + 1) * sizes(dev)["batch"] // world)
    data = [(x[part], y[part]) for x, y in data]
    ref = train(dev, "sync", base, data, memory=True, zero_stage=1)
    boundary = ZEN["update_interval"]  # the step at which the first interval's host update lands
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.cuda else [])
    prof = torch.profiler.profile(activities=activities)
    counted = dict(steps=0)

    def profile_boundary(opt):
        counted["steps"] += 1
        if counted["steps"] == boundary:
            prof.start()
        elif counted["steps"] == boundary + 1:
            if dev.cuda:
                torch.cuda.synchronize()
            prof.stop()

    got = train(dev, "async", base, data, memory=True, zero_stage=1, each_step=profile_boundary)
    names = [e.name for e in prof.events()]
    result = dict(rank=rank, device=str(device), backend=dist.get_backend(),
                  digest=digest(got["history"][-1]), bit_identical=bit_identical(ref, got),
                  held=got["held"], held_reference=ref["held"], peaks=got["peaks"], peaks_reference=ref["peaks"],
                  pageable_h2d=sum("Pageable" in n and "HtoD" in n for n in names),
                  device_syncs=sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
                                   for n in names), profiled_events=len(names))
    if rank == 0 and args.zero_trace:
        prof.export_chrome_trace(str(Path(args.zero_trace, "zero_boundary_trace.json")))
    if dev.cuda and gpus >= world:
        result["context_on_gpu0"] = bool(torch._C._cuda_hasPrimaryContext(0)) if rank != 0 else None
    Path(args.worker_out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def check_zero(dev: Device, out: Path) -> dict:
    extra = ["--device", dev.device.type] + (["--quick"] if dev.quick else [])
    try:
        ranks = run_ranks("tests.gpu_checklist", 2, extra + ["--zero-trace", str(out)], timeout=600,
                          what="a ZeRO-1 rank")
    except SystemExit as exc:
        return dict(ok=False, error=str(exc)[-3000:])
    worst = max(abs(g - r) for rank in ranks for g, r in zip(rank["held"] + rank["peaks"],
                                                             rank["held_reference"] + rank["peaks_reference"],
                                                             strict=True))
    row = dict(ranks=ranks, worst_difference_bytes=worst,
               ranks_equal=len({r["digest"] for r in ranks}) == 1,
               pageable_h2d=sum(r["pageable_h2d"] for r in ranks))
    context = ranks[1].get("context_on_gpu0")
    row["context_on_gpu0"] = context if context is not None else (
        "skipped: needs a GPU per rank" if dev.cuda else "skipped: CPU")
    row["ok"] = (worst <= MEMORY_SLACK[dev.device.type] and row["ranks_equal"]
                 and all(r["bit_identical"] for r in ranks) and row["pageable_h2d"] == 0 and context is not True)
    return row


CHECKS = dict(memory=check_memory, slow_d2h=check_slow_d2h, grad_scaler=check_grad_scaler, pinned=check_pinned,
              fsdp2_stream=check_fsdp2_stream, device_sums_disk=check_device_sums_disk,
              close_during_update=check_close_during_update, zero=check_zero)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m tests.gpu_checklist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="a small model (the test suite's run)")
    ap.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=None, help="run these rows only")
    ap.add_argument("--worker-out", default=None, help="(a ZeRO rank's output folder)")
    ap.add_argument("--zero-trace", default=None, help="(the folder rank 0 writes its trace to)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: tests.gpu_checklist needs a CUDA GPU; --device cpu --quick runs the code path on CPU")
        return 2
    if args.worker_out:
        zero_rank(args)
        return 0
    out = output_dir(args.out)
    dev = Device(torch.device(args.device), args.quick)
    rows = {}
    for name in args.only or CHECKS:
        t0 = time.perf_counter()
        try:
            rows[name] = CHECKS[name](dev, out)
        except Exception as exc:  # a row that fails to run is a failed row; the next still runs
            import traceback

            rows[name] = dict(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        rows[name]["seconds"] = time.perf_counter() - t0
        print(f"{name:<20} {'ok' if rows[name]['ok'] else 'FAILED':<7} {rows[name]['seconds']:6.1f} s", flush=True)
        if not rows[name]["ok"]:
            print(json.dumps({k: v for k, v in rows[name].items() if k != "ranks"}, default=str)[-3000:],
                  file=sys.stderr)
    payload = dict(config=dict(device=args.device, quick=args.quick, sizes=sizes(dev), zenflow=ZEN,
                               memory_slack=MEMORY_SLACK[args.device], sleep_cycles=SLEEP_CYCLES),
                   rows=rows, machine=machine_info())
    if dev.cuda:
        payload["machine"]["gpu"] = torch.cuda.get_device_name(dev.device)
    path = write_result(out / f"gpu_checklist_{args.device}.json", payload)
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
