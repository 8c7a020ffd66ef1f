"""Host Adam benchmark: zenflow_kernels.cpu_ops against torch, DeepSpeed and the memory roofline.

    python -m bench.cpu_adam [--out DIR] [--quick] [--sizes 2^16 2^20 ...] [--rounds N] [--wait-quiet S]

1. Plain fp32 AdamW over n params at 1 and 2 threads: ``cpu_adam_``, ``torch.optim.AdamW`` (``fused=True`` and
   ``foreach=True``), ``DeepSpeedCPUAdam`` (when deepspeed imports; ``DS_ACCELERATOR=cpu``) and the roofline, a numba
   loop with exactly Adam's memory traffic (read p, g, m, v; write p, m, v) and trivial arithmetic: 28 bytes/param,
   ``effective_gbps`` the same formula for all. Also DeepSpeed's native multi-tensor ZenFlow CPU Adam
   (``deepspeed_zenflow``: its ``cpu_adam`` extension's ``zenflow_adam_*``, DeepSpeed >= 0.19.8, the host path of its
   overlapped step) driven as its engine drives it (a pool pinned to the first 1 or 2 cores, each thread running the
   serial AVX Adam on its slice; ``submit``, then ``wait``; the worker loop on a thread here, not a spawned process).
   It also writes the fp32 ``stale`` snapshot the GPU copy reads, 36 bytes/param, so ``zenflow_out_fp32``
   (``cpu_adam_`` with ``out=`` a fp32 snapshot) moves the same beside it, and ``traffic_gbps`` uses each
   candidate's own traffic. All update the same tensors (torch-allocated, 64-byte aligned): none is favoured by
   placement.
2. The update-boundary pipeline of docs/design.md 2.5: the interval's last gradient (bf16) added into the fp32
   accumulation buffer, unscaled by ``interval * loss_scale / clip``, AdamW, the bf16 copy of the weights written.
   Fused: one ``accumulate_adam_(..., out=bf16)``, 36 bytes/param (read p, acc, g16, m, v; write p, acc, m, v,
   out16). Separate passes, as an unfused offload step: ``acc.add_(g)``, ``acc.mul_(1/scale)``, Adam (torch fused or
   DeepSpeed), ``out.copy_(p)``: 52 bytes/param at best, so at most 52/36 = 1.44x. torch's fp32 += bf16 ``add_`` is
   far from that best (a temporary fp32 copy of the gradient), so ``separate_zenflow`` runs the separate passes with
   this library's ``accumulate_`` and ``cpu_adam_``: what fusion itself gains. Also with the buffer zeroed for the
   next interval (fused ``zero_acc=True``; separate: one more ``acc.zero_()``): 36 against 56 bytes, at most 1.56x.
3. Thread scaling 1 -> 2 of every candidate, and numba's first-call compile time with an empty cache (a fresh clone)
   and a warm one, each in a fresh process.

Timing: per size and thread count (torch and numba at the same count; switching counts costs tens of microseconds
in libgomp, so counts are not mixed within a round) every candidate interleaved round by round (this machine drifts
by 2x within minutes: only medians taken side by side compare), ``calls_per_round`` = 2^22 / n, each timed block
after 25 ms of untimed calls of the same candidate (``interleaved_settled`` says why), medians over the rounds.
Every row records the CPU share other processes used meanwhile (``other_processes_cpu_fraction``); a block is
measured again after waiting for quiet when that exceeds 10%; ``--wait-quiet`` waits for an idle machine first.

Results: ``cpu_adam.json`` (with the machine description) and ``cpu_adam.png`` in ``bench/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed can be imported

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit, prange  # noqa: E402

from bench import harness  # noqa: E402
from zenflow_kernels.cpu_ops import accumulate_, accumulate_adam_, cpu_adam_  # noqa: E402

ADAM_BYTES = 28  # read p, g, m, v + write p, m, v, fp32
PIPE_BYTES = 36  # read p, acc, g(bf16), m, v + write p, acc, m, v, out(bf16)
PIPE_SEPARATE_BYTES = 52  # add: 4+2+4, scale: 4+4, adam: 28, copy: 4+2
ZENFLOW_NATIVE_BYTES = 36  # DeepSpeed's native ZenFlow Adam: Adam's 28 + the fp32 stale snapshot (read p, write)
TRAFFIC_36 = ("deepspeed_zenflow", "zenflow_out_fp32")
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
TORCH_HYPER = {"lr": HYPER["lr"], "eps": HYPER["eps"], "weight_decay": HYPER["weight_decay"], "betas": (0.9, 0.999)}
INTERVAL, LOSS_SCALE, CLIP = 4, 1024.0, 0.5
GRAD_SCALE = INTERVAL * LOSS_SCALE / CLIP
MAX_OTHER_LOAD = 0.1  # redo a block when other processes used more than this share of the CPUs
SETTLE_S = 0.025


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor, sharing its memory: fp32 as float32, bf16 as its int16 bits
    (numpy has no bf16), as the rooflines below take them."""
    t = t.detach()
    return (t.view(torch.int16).numpy() if t.dtype is torch.bfloat16 else t.numpy()).reshape(-1)


def parse_size(text: str, multiple: int = 1) -> int:
    """An argparse ``type=``: a count of elements, ``2^k`` or plain, at least 1 and a multiple of ``multiple``."""
    text = text.strip()
    try:
        value = 2 ** int(text[2:]) if text.startswith("2^") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of elements (65536 or 2^16)") from None
    if value < 1 or value % multiple:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1" + (f" and a multiple of {multiple}"
                                                                           if multiple > 1 else ""))
    return value


def set_threads(k: int) -> None:
    """The same thread count for torch (and DeepSpeed's OpenMP) and numba in this thread."""
    torch.set_num_threads(k)
    numba.set_num_threads(k)


@njit(parallel=True, nogil=True, cache=True)
def _roofline(p, g, m, v):
    """Adam's exact memory traffic (read p, g, m, v; write p, m, v) with trivial arithmetic."""
    for i in prange(p.size):
        gi = g[i]
        m[i] = m[i] + gi
        v[i] = v[i] + gi
        p[i] = p[i] + gi


@njit(parallel=True, nogil=True, cache=True)
def _pipeline_roofline(p, acc, g16, m, v, out16):
    """The fused pipeline's exact traffic (read p, acc, g16, m, v; write p, acc, m, v, out16)."""
    for i in prange(p.size):
        a = acc[i] + np.float32(g16[i])
        acc[i] = a
        m[i] = m[i] + a
        v[i] = v[i] + a
        p[i] = p[i] + a
        out16[i] = g16[i]


class DeepSpeedZenFlowAdam:
    """DeepSpeed's native ZenFlow CPU Adam over one flat fp32 group, driven the way its ZenFlow engine
    drives it (deepspeed/runtime/zenflow/zenflow_utils.py): a pinned pool per thread count, the worker
    loop blocking on a shared control block, ``zenflow_adam_submit`` + ``zenflow_adam_wait`` per step.
    Only gradient state 0 is used, so both states' moments are the same tensors."""

    OPT_ID_BASE = 1000  # C++ optimizer ids apart from DeepSpeedCPUAdam's (a class counter from 0)

    def __init__(self, op, p, g, m, v, stale, threads: list[int]):
        import threading

        self.op = op
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        self.ctrl, self.threads = {}, {}
        for k in threads:
            opt_id = self.OPT_ID_BASE + k
            op.create_adam(opt_id, *HYPER.values(), True, False)  # (HYPER in the extension's order)
            handle = op.zenflow_adam_create(opt_id, cores[:k])
            op.zenflow_adam_register_group(handle, p, g, g, m, m, v, v, stale)
            ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8)
            op.zenflow_adam_ctrl_init(ctrl.data_ptr(), 1)
            worker = threading.Thread(target=op.zenflow_adam_run_worker, args=(handle, ctrl.data_ptr()), daemon=True)
            worker.start()
            self.ctrl[k], self.threads[k] = ctrl, (worker, handle, opt_id)

    def step(self, k: int, step: int) -> None:
        ptr = self.ctrl[k].data_ptr()
        self.op.zenflow_adam_submit(ptr, 0, step, *([x] for x in HYPER.values()), [1])
        if not self.op.zenflow_adam_wait(ptr, 600.0):
            raise RuntimeError("DeepSpeed's ZenFlow Adam worker did not finish a step in 600 s")

    def close(self) -> None:
        for k, (worker, handle, opt_id) in self.threads.items():
            self.op.zenflow_adam_ctrl_exit(self.ctrl[k].data_ptr())
            worker.join()
            self.op.zenflow_adam_destroy(handle)
            self.op.destroy_adam(opt_id)
        self.threads = {}


def _deepspeed_zenflow_op():
    """DeepSpeed's cpu_adam extension when it has the native ZenFlow Adam (0.19.8), or None with the reason."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        op = CPUAdamBuilder().load()
        missing = [f for f in ("zenflow_adam_create", "zenflow_adam_submit", "zenflow_adam_run_worker")
                   if not hasattr(op, f)]
        if missing:
            return None, f"this DeepSpeed's cpu_adam extension has no {', '.join(missing)} (needs >= 0.19.8)"
        return op, None
    except Exception as exc:  # noqa: BLE001 - import or JIT build failures of an optional package
        return None, f"{type(exc).__name__}: {exc}"


def _deepspeed_adam():
    """DeepSpeedCPUAdam, or None with the reason (it is an optional comparison, never a dependency)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], lr=1e-3).step()
        return DeepSpeedCPUAdam, None
    except Exception as exc:  # noqa: BLE001 - import or JIT build failures of an optional package
        return None, f"{type(exc).__name__}: {exc}"


class State:
    """One set of Adam tensors shared by every candidate (optimizer states injected, not copied)."""

    def __init__(self, n: int, ds_cls, zenflow_op=None, threads: list[int] = (1,)):
        gen = torch.Generator().manual_seed(0)
        self.p = torch.randn(n, generator=gen)
        self.g = torch.randn(n, generator=gen) * 1e-2
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.acc = torch.randn(n, generator=gen) * 1e-2
        self.g16 = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
        self.out16 = torch.empty(n, dtype=torch.bfloat16)
        self.param = torch.nn.Parameter(self.p)  # shares p's memory
        self.param.grad = self.g
        self.step = 0
        self.opts = {"torch_fused": torch.optim.AdamW([self.param], fused=True, **TORCH_HYPER),
                     "torch_foreach": torch.optim.AdamW([self.param], foreach=True, **TORCH_HYPER)}
        if ds_cls is not None:
            self.opts["deepspeed"] = ds_cls([self.param], adamw_mode=True, **TORCH_HYPER)
        for name, opt in self.opts.items():
            step = 0 if name == "deepspeed" else torch.zeros((), dtype=torch.float32)
            opt.state[self.param] = {"step": step, "exp_avg": self.m, "exp_avg_sq": self.v}
        self.stale = torch.empty(n)  # the fp32 snapshot of the updated weights (36-byte candidates)
        self.ds_zenflow = (DeepSpeedZenFlowAdam(zenflow_op, self.p, self.g, self.m, self.v, self.stale, list(threads))
                           if zenflow_op is not None else None)
        # the rooflines get their numpy views once: they measure memory, not call overhead
        self.np_adam = [numpy_view(t) for t in (self.p, self.g, self.m, self.v)]
        self.np_pipe = [numpy_view(t) for t in (self.p, self.acc, self.g16, self.m, self.v, self.out16)]

    def ours(self, k: int, out=None):
        self.step += 1
        cpu_adam_(self.p, self.g, self.m, self.v, step=self.step, out=out, num_threads=k, **HYPER)

    def deepspeed_zenflow(self, k: int):
        self.step += 1
        self.ds_zenflow.step(k, self.step)

    def close(self) -> None:
        if self.ds_zenflow is not None:
            self.ds_zenflow.close()

    def roofline(self):
        _roofline(*self.np_adam)

    def torch_step(self, name: str):
        self.param.grad = self.g
        self.opts[name].step()

    def fused(self, k: int, zero_acc: bool = False):
        self.step += 1
        accumulate_adam_(self.p, self.acc, self.g16, self.m, self.v, step=self.step, grad_scale=GRAD_SCALE,
                         out=self.out16, zero_acc=zero_acc, num_threads=k, **HYPER)

    def pipeline_roofline(self):
        _pipeline_roofline(*self.np_pipe)

    def separate(self, name: str, k: int, zero_acc: bool = False):
        """The same work as ``fused`` in separate passes. ``name`` picks the Adam; "zenflow" also uses
        this library's accumulate_ (torch's in-place fp32 += bf16 add goes through a temporary
        fp32 copy of the gradient and costs ~9x our accumulate_ at 2^24: measured 39 ms vs 4.5 ms)."""
        if name == "zenflow":
            accumulate_(self.acc, self.g16, num_threads=k)
            self.acc.mul_(1.0 / GRAD_SCALE)
            self.step += 1
            cpu_adam_(self.p, self.acc, self.m, self.v, step=self.step, num_threads=k, **HYPER)
        else:
            self.acc.add_(self.g16)
            self.acc.mul_(1.0 / GRAD_SCALE)
            self.param.grad = self.acc
            self.opts[name].step()
        self.out16.copy_(self.p)
        if zero_acc:
            self.acc.zero_()


def interleaved_settled(candidates: dict, rounds: int, calls_per_round: int, settle_s: float = SETTLE_S) -> dict:
    """``bench.harness.interleaved`` with each timed block preceded by untimed calls of the same candidate for
    ``settle_s`` seconds.

    Why: torch (its bundled libgomp) and numba (the system libgomp) are two OpenMP runtimes here, and an idle OpenMP
    worker spin-waits for up to ~10 ms after each parallel region (none with OMP_WAIT_POLICY=PASSIVE). On two cores
    a candidate timed right after one of the *other* runtime shares a core with that spinning worker, so plain
    interleaving charges one candidate's spin to the next, by order alone (two plain runs put our kernel, timed after
    DeepSpeed, at 0.95x and 0.85x the roofline at 2^24 params; the settled run at 0.97x). Untimed calls let the
    foreign workers park and keep the candidate's own awake; a pause would put every pool to sleep, and waking a
    sleeping thread on this VM sometimes takes a scheduler tick.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t_end = time.perf_counter() + settle_s
            fn()
            while time.perf_counter() < t_end:
                fn()
            t0 = time.perf_counter()
            for _ in range(calls_per_round):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls_per_round)
    return {name: harness.Timing.from_samples(s) for name, s in samples.items()}


def measure_quietly(candidates: dict, n: int, k: int, rounds: int, attempts: int, wait_s: float,
                    deadline: float = float("inf")) -> tuple[dict, int, float, int]:
    """One ``interleaved_settled`` block at n elements and k threads (``calls_per_round`` = 2^22 / n); redone (after
    waiting up to ``wait_s`` for quiet, up to ``attempts`` times in all, and only before ``deadline``, a
    ``perf_counter`` time) when other processes took more than MAX_OTHER_LOAD of the CPUs meanwhile. Returns the
    timings, the calls per round, that share and the attempts made."""
    calls = max(1, (1 << 22) // n)
    for attempt in range(1, attempts + 1):
        load = harness.OtherLoad()
        timings = interleaved_settled(candidates, rounds, calls)
        other = load.fraction()
        if other <= MAX_OTHER_LOAD or attempt == attempts or time.perf_counter() > deadline:
            break
        print(f"  n={n} threads={k}: other processes used {other:.0%} of the CPUs, measuring again", flush=True)
        harness.wait_quiet(wait_s)
    return timings, calls, other, attempt


def _measure(candidates: dict, n: int, k: int, rounds: int, bytes_per_param: int, attempts: int = 3) -> list[dict]:
    """One block (``measure_quietly``) as rows that say how it went."""
    timings, calls, other, attempt = measure_quietly(candidates, n, k, rounds, attempts, wait_s=120)
    return [{"size": n, "threads": k, "candidate": name, **t.as_row(), "calls_per_round": calls,
             "mparams_per_s": n / t.median / 1e6, "effective_gbps": n / t.median * bytes_per_param / 1e9,
             "other_processes_cpu_fraction": other, "attempts": attempt} for name, t in timings.items()]


def bench_adam(state: State, n: int, threads: list[int], rounds: int, attempts: int = 3) -> list[dict]:
    """Per thread count, every candidate interleaved (a thread count switch between calls costs tens of
    microseconds in libgomp, so candidates at different counts are not mixed within one round)."""
    rows = []
    for k in threads:
        set_threads(k)
        candidates = {"zenflow": lambda k=k: state.ours(k), "roofline": state.roofline}
        for name in state.opts:
            candidates[name] = lambda name=name: state.torch_step(name)
        if state.ds_zenflow is not None:
            candidates["deepspeed_zenflow"] = lambda k=k: state.deepspeed_zenflow(k)
            candidates["zenflow_out_fp32"] = lambda k=k: state.ours(k, out=state.stale)
        rows += _measure(candidates, n, k, rounds, ADAM_BYTES, attempts)
    by = {(r["threads"], r["candidate"]): r for r in rows}
    for r in rows:
        for base in ("roofline", "deepspeed", "torch_fused", "deepspeed_zenflow"):
            if (r["threads"], base) in by:  # > 1: faster than base
                r[f"ratio_to_{base}"] = by[r["threads"], base]["median_s"] / r["median_s"]
        # each candidate's own traffic (effective_gbps keeps the one formula for all)
        r["traffic_bytes_per_param"] = ZENFLOW_NATIVE_BYTES if r["candidate"] in TRAFFIC_36 else ADAM_BYTES
        r["traffic_gbps"] = r["mparams_per_s"] * 1e6 * r["traffic_bytes_per_param"] / 1e9
    return rows


def bench_pipeline(state: State, n: int, threads: list[int], rounds: int, attempts: int = 3) -> list[dict]:
    rows = []
    for k in threads:
        set_threads(k)
        candidates = {"fused": lambda k=k: state.fused(k), "fused_zero_acc": lambda k=k: state.fused(k, zero_acc=True),
                      "pipeline_roofline": state.pipeline_roofline}
        for name in ["zenflow", *state.opts]:
            if name != "torch_foreach":
                candidates[f"separate_{name}"] = lambda k=k, name=name: state.separate(name, k)
                candidates[f"separate_{name}_zero_acc"] = lambda k=k, name=name: state.separate(name, k, zero_acc=True)
        rows += _measure(candidates, n, k, rounds, PIPE_BYTES, attempts)
    by = {(r["threads"], r["candidate"]): r for r in rows}
    for r in rows:
        zero = r["candidate"].endswith("zero_acc")
        for base in ("zenflow", "torch_fused", "deepspeed"):
            sep = by.get((r["threads"], f"separate_{base}{'_zero_acc' if zero else ''}"))
            if sep is not None and r["candidate"].startswith("fused"):
                r[f"speedup_vs_separate_{base}"] = sep["median_s"] / r["median_s"]
        r["ratio_to_roofline"] = by[r["threads"], "pipeline_roofline"]["median_s"] / r["median_s"]
    return rows


def scaling(rows: list[dict]) -> list[dict]:
    by = {(r["size"], r["candidate"], r["threads"]): r for r in rows}
    return [{"size": size, "candidate": cand, "speedup_2_over_1": r["median_s"] / by[size, cand, 2]["median_s"]}
            for (size, cand, k), r in by.items() if k == 1 and (size, cand, 2) in by]


_COMPILE_PROBE = textwrap.dedent(
    """
    import time, json
    t0 = time.perf_counter()
    import torch
    from zenflow_kernels.cpu_ops import cpu_adam_, accumulate_adam_
    t1 = time.perf_counter()
    p, g, m, v = (torch.ones(1000) for _ in range(4))
    cpu_adam_(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    t2 = time.perf_counter()
    accumulate_adam_(p, torch.zeros(1000), g.bfloat16(), m, v, step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, out=torch.empty(1000, dtype=torch.bfloat16))
    t3 = time.perf_counter()
    times = {"import_s": t1 - t0, "cpu_adam_first_call_s": t2 - t1, "accumulate_adam_bf16_first_call_s": t3 - t2}
    print(json.dumps(times))
    """
)


def compile_times() -> dict:
    """First-call times in fresh processes: with an empty numba cache (a fresh clone), then warm."""
    result = {}
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold_cache", "warm_cache"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env={**os.environ, "NUMBA_CACHE_DIR": cache},
                                 capture_output=True, text=True, check=True, timeout=600, cwd=harness.REPO)
            result[label] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


ADAM_COLORS = {"zenflow": "C0", "roofline": "k", "torch_fused": "C1", "torch_foreach": "C2", "deepspeed": "C3",
               "deepspeed_zenflow": "C4", "zenflow_out_fp32": "C9"}
PIPE_COLORS = {"fused": "C0", "fused_zero_acc": "C4", "pipeline_roofline": "k", "separate_zenflow": "C8",
               "separate_torch_fused": "C1", "separate_deepspeed": "C3", "separate_torch_fused_zero_acc": "C5",
               "separate_deepspeed_zero_acc": "C6"}


def plot(payload: dict, path) -> None:
    """Four panels from the JSON payload: Adam throughput, Adam as a fraction of the roofline of its own traffic, the
    update-boundary pipeline at the most threads, thread scaling at the goal size."""
    fig, axes = harness.figure(2, 2, size=(15, 10))
    top = max(payload["config"]["threads"])

    def lines(ax, rows, colors, threads, key="mparams_per_s", traffic=False):
        for cand, color in colors.items():
            own = ZENFLOW_NATIVE_BYTES / ADAM_BYTES if traffic and cand in TRAFFIC_36 else 1.0
            for k, ls in zip(threads, ("-", ":"), strict=False):
                pts = sorted((r["size"], r[key] * own) for r in rows if r["candidate"] == cand and r["threads"] == k)
                if pts:
                    ax.plot(*zip(*pts, strict=True), ls, color=color, marker="o", ms=3,
                            label=f"{cand} ({k} thr{', 36 B' if own != 1.0 else ''})")

    both = sorted({top, 1}, reverse=True)
    lines(axes[0, 0], payload["adam"], ADAM_COLORS, both)
    harness.style(axes[0, 0], "params", "M params/s (median of interleaved rounds)", "fp32 AdamW step (28 B/param)",
                  logx=2, logy=10)
    lines(axes[0, 1], payload["adam"], {c: v for c, v in ADAM_COLORS.items() if c != "roofline"}, both,
          "ratio_to_roofline", traffic=True)
    axes[0, 1].axhline(1.0, color="k", lw=0.8)
    axes[0, 1].axhline(0.95, color="k", lw=0.8, ls="--")
    harness.style(axes[0, 1], "params", "time(roofline of its traffic) / time(candidate)",
                  "fraction of the memory roofline (its own traffic, trivial math); dashed: 0.95", logx=2)
    lines(axes[1, 0], payload["pipeline"], PIPE_COLORS, [top])
    harness.style(axes[1, 0], "params", "M params/s",
                  f"update boundary: acc += g(bf16), unscale, AdamW, bf16 copy ({top} thr)", logx=2, logy=10)
    size = payload["goals"]["size"]
    rows = [r for r in payload["scaling"] if r["size"] == size]
    axes[1, 1].bar([r["candidate"] for r in rows], [r["speedup_2_over_1"] for r in rows], color="C0")
    axes[1, 1].axhline(1.0, color="k", lw=0.8)
    axes[1, 1].tick_params(axis="x", labelrotation=60, labelsize=7)
    harness.style(axes[1, 1], None, "time(1 thread) / time(2 threads)", f"thread scaling 1 -> 2 at {size} params",
                  grid=None)
    harness.save(fig, path)


def goals(adam: list[dict], pipeline: list[dict], size: int, threads: int) -> dict:
    def pick(rows, cand):
        return next((r for r in rows if r["size"] == size and r["candidate"] == cand and r["threads"] == threads), None)

    ours, fused, fused_zero = pick(adam, "zenflow"), pick(pipeline, "fused"), pick(pipeline, "fused_zero_acc")
    out = {"size": size, "threads": threads}
    if ours:
        out["adam_vs_roofline"] = {"measured": ours.get("ratio_to_roofline"), "goal": 0.95}
        out["adam_vs_deepspeed"] = {"measured": ours.get("ratio_to_deepspeed"), "goal": 1.0}
        out["adam_vs_torch_fused"] = {"measured": ours.get("ratio_to_torch_fused")}
        if ours.get("ratio_to_deepspeed_zenflow") is not None:
            same = pick(adam, "zenflow_out_fp32")
            out["adam_vs_deepspeed_zenflow_native"] = {
                "measured": ours["ratio_to_deepspeed_zenflow"],
                "note": "ours moves 28 bytes/param, DeepSpeed's native ZenFlow Adam 36 (its fp32 stale snapshot)"}
            out["adam_out_fp32_vs_deepspeed_zenflow_native"] = {
                "measured": same.get("ratio_to_deepspeed_zenflow") if same else None,
                "note": "the same 36 bytes/param: cpu_adam_ with out= a fp32 snapshot"}
    if fused:
        for base, name in (("zenflow", "zenflow_kernels"), ("deepspeed", "deepspeed"), ("torch_fused", "torch_fused")):
            out[f"fused_pipeline_vs_separate_{name}"] = {"measured": fused.get(f"speedup_vs_separate_{base}"),
                                                         "goal": 1.5,
                                                         "memory_bound_limit": PIPE_SEPARATE_BYTES / PIPE_BYTES}
    if fused_zero:
        for base in ("zenflow", "deepspeed"):
            out[f"fused_zero_acc_vs_separate_{base}_zero_acc"] = {
                "measured": fused_zero.get(f"speedup_vs_separate_{base}"),
                "memory_bound_limit": (PIPE_SEPARATE_BYTES + 4) / PIPE_BYTES}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.OneLineParser(prog="python -m bench.cpu_adam", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="three sizes, few rounds, no compile-time probe")
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                    help="param counts, e.g. 65536 or 2^20 (default 2^16..2^26)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per size (default 15, quick 5)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to go idle (shared machines)")
    args = ap.parse_args(argv)
    out_dir = harness.output_dir(args.out)
    sizes = args.sizes or ([2**16, 2**20, 2**22] if args.quick else [2**16, 2**18, 2**20, 2**22, 2**24, 2**26])
    rounds = args.rounds or (5 if args.quick else 15)
    threads = [k for k in (1, 2) if k <= numba.config.NUMBA_NUM_THREADS and k <= (os.cpu_count() or 1)]
    ds_cls, ds_reason = _deepspeed_adam()
    zenflow_op, zenflow_reason = _deepspeed_zenflow_op() if ds_cls is not None else (None, ds_reason)
    if args.wait_quiet > 0:
        print(f"other processes' CPU share before starting: {harness.wait_quiet(args.wait_quiet):.2f}", flush=True)
    print(f"sizes {sizes}, threads {threads}, rounds {rounds}, deepspeed: {'yes' if ds_cls else ds_reason}, "
          f"its native ZenFlow Adam: {'yes' if zenflow_op else zenflow_reason}", flush=True)

    adam_rows, pipe_rows = [], []
    for n in sizes:
        t0 = time.perf_counter()
        state = State(n, ds_cls, zenflow_op, threads)
        attempts = 1 if args.quick else 3  # --quick never waits for a quiet machine
        adam_rows += bench_adam(state, n, threads, rounds, attempts)
        pipe_rows += bench_pipeline(state, n, threads, rounds, attempts)
        state.close()
        del state
        summary = ", ".join(f"{r['candidate']} {r['mparams_per_s']:.0f}" for r in adam_rows
                            if r["size"] == n and r["threads"] == max(threads))
        load = max(r["other_processes_cpu_fraction"] for r in adam_rows + pipe_rows if r["size"] == n)
        print(f"n={n}: M params/s at {max(threads)} threads: {summary} ({time.perf_counter() - t0:.0f}s, "
              f"other processes used up to {load:.0%} of the CPUs)", flush=True)

    payload = {
        "description": __doc__,
        "bytes_per_param": {"adam": ADAM_BYTES, "pipeline_fused": PIPE_BYTES, "pipeline_separate": PIPE_SEPARATE_BYTES},
        "config": {
            "sizes": sizes, "threads": threads, "rounds": rounds, "hyper": HYPER,
            "pipeline": {"interval": INTERVAL, "loss_scale": LOSS_SCALE, "clip": CLIP, "grad_dtype": "bfloat16",
                         "out_dtype": "bfloat16"},
            "numba_threading_layer": numba.threading_layer(),
            "NUMBA_NUM_THREADS": numba.config.NUMBA_NUM_THREADS,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "deepspeed": "DeepSpeedCPUAdam" if ds_cls else ds_reason,
            "deepspeed_zenflow": "cpu_adam extension zenflow_adam_* (native multi-tensor ZenFlow Adam)"
            if zenflow_op else zenflow_reason,
            "traffic_bytes_per_param": {**dict.fromkeys(TRAFFIC_36, ZENFLOW_NATIVE_BYTES), "others": ADAM_BYTES},
        },
        "adam": adam_rows,
        "pipeline": pipe_rows,
        "scaling": scaling(adam_rows) + scaling([{**r, "candidate": "pipeline_" + r["candidate"]} for r in pipe_rows]),
        "machine": harness.machine_info(),
    }
    goal_size = 2**24 if 2**24 in sizes else max(sizes)
    payload["goals"] = goals(adam_rows, pipe_rows, goal_size, max(threads))
    if not args.quick:
        payload["compile"] = compile_times()
    json_path = harness.write_result(out_dir / "cpu_adam.json", payload)
    plot(payload, out_dir / "cpu_adam.png")
    print(f"goals at n={goal_size}: {payload['goals']}")
    print(f"wrote {json_path} and {out_dir / 'cpu_adam.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
