"""What the end-to-end benchmarks share: configuration, the pre-trained model, the training loop, result rows.

``bench.e2e`` (the CPU comparison and ``make demo``; it re-exports these names for the notebooks) and
``bench.gpu_e2e`` (the GPU benchmark) both build on this module; neither imports the other. :func:`prepare` gives
the corpus, the pre-trained byte GPT (cached by its inputs), the batches and the held-out windows;
:func:`train_run` one timed fine-tuning run (the result row); :func:`run_all` every run, interleaved, after
:func:`warm_up`; :func:`compare` the ratios against the baselines measured in the same process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from bench.data import Corpus, batch_starts, epoch_steps, eval_starts, load_corpus, windows
from bench.model import SIZES, CharGPT, build_model

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO / "data" / "e2e"
QUICK_ENV = "ZENFLOW_NOTEBOOK_QUICK"  # "1": the notebooks' reduced mode (fewer steps, a tiny model)
CACHE_ENV = "ZENFLOW_E2E_CACHE"  # overrides DEFAULT_CACHE (the tests point it at a temporary folder)
# synchronous ZeRO-Offload through ZenFlowAdamW: every step is a warm-up step (host AdamW on the fp32 master of
# every parameter, the training thread waits, the whole model is copied back)
OFFLOAD = dict(full_warm_up_rounds=10**9, overlap_step=False, select_strategy="step", select_interval=1,
               update_interval=1)


def quick_mode() -> bool:
    """Whether the notebooks run in their reduced mode (``ZENFLOW_NOTEBOOK_QUICK=1``)."""
    return os.environ.get(QUICK_ENV, "").strip() not in ("", "0")


def cache_dir() -> Path:
    """Where pre-trained models are cached: ``$ZENFLOW_E2E_CACHE`` or ``data/e2e`` (git-ignored)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


@dataclass
class E2EConfig:
    """Everything a fine-tuning comparison depends on (recorded in the JSON)."""

    model: str = "small"
    steps: int = 160
    pretrain_steps: int = 300
    lr: float = 3e-4
    warmup_frac: float = 0.1  # linear learning-rate warm-up over this share of the fine-tuning steps
    pretrain_lr: float = 3e-3
    weight_decay: float = 0.01
    topk_ratio: float = 0.1
    update_interval: int | str = 4
    overlap: bool = True
    # None: 1.0 on a CPU-only run, where training and the host worker share the cores and the worker
    # takes what torch leaves free; 0.5 (DeepSpeed's default) with a GPU
    pt_reserved_cores_perc: float | None = None
    select_interval: int | None = None  # steps; None: once per epoch of the fine-tuning data
    seed: int = 0
    eval_points: int = 8
    eval_windows: int = 48
    pretrain_bytes: int = 1_000_000
    train_bytes: int = 400_000
    heldout_bytes: int = 100_000
    device: str = "auto"
    threads: int | None = None
    repeats: int = 1
    batch: int | None = None  # None: the model preset's batch
    context: int | None = None  # None: the model preset's context
    autocast: str | None = None  # "bf16": forward and backward under torch.autocast (parameters stay fp32)

    def size(self):
        preset = SIZES[self.model]
        return replace(preset, batch=self.batch or preset.batch, context=self.context or preset.context)

    def cores_perc(self) -> float:
        """``pt_reserved_cores_perc`` for the ZenFlow runs (see the field)."""
        if self.pt_reserved_cores_perc is not None:
            return self.pt_reserved_cores_perc
        return 1.0 if self.resolved_device().type == "cpu" else 0.5

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class RunSpec:
    """One fine-tuning run: ``kind`` is "adamw", "offload" (synchronous ZeRO-Offload through ZenFlowAdamW),
    "zenflow", or "deepspeed" (a DeepSpeed engine, ``zenflow`` then holds its whole config; bench.gpu_e2e).
    ``optimizer(params)``, optional, builds the run's optimizer instead (the update-rules notebook); ``kind`` still
    says how the run treats it: "zenflow" or "offload" a ZenFlow one (flushed, ``stats()`` read, closed), others
    a ``torch.optim`` one."""

    name: str
    kind: str
    zenflow: dict = field(default_factory=dict)
    label: str = ""
    threads: int | None = None  # torch threads for this run (None: the prepared count)
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "label": self.label or self.name, "zenflow": dict(self.zenflow)}


def zenflow_block(cfg: E2EConfig, n_epoch: int, **overrides) -> dict:
    """The ZenFlow config of a run: selection once per epoch (the paper's choice) unless
    ``select_interval`` is set in steps; never the silent "never re-selected" case."""
    block = dict(topk_ratio=cfg.topk_ratio, update_interval=cfg.update_interval, overlap_step=cfg.overlap,
                 pt_reserved_cores_perc=cfg.cores_perc(), full_warm_up_rounds=0)
    if cfg.select_interval is None:
        block.update(select_strategy="epoch", select_interval=1, steps_per_epoch=n_epoch)
    else:
        block.update(select_strategy="step", select_interval=cfg.select_interval)
    block.update(overrides)
    ui, si = block["update_interval"], block.get("select_interval")
    if block["select_strategy"] == "step" and isinstance(ui, int) and si < ui:
        block["select_interval"] = ui
    if block["select_strategy"] == "epoch" and isinstance(ui, int) and n_epoch < ui:
        block.update(select_strategy="step", select_interval=ui)
    return block


def offload_block(cfg: E2EConfig) -> dict:
    """The ZenFlow config of the synchronous offload run (:data:`OFFLOAD`)."""
    return dict(OFFLOAD)


@dataclass
class Prepared:
    cfg: E2EConfig
    corpus: Corpus
    device: torch.device
    threads: int
    state: dict  # pre-trained weights (CPU tensors)
    pretrain: dict  # what the pre-training did (or the cache said)
    starts: torch.Tensor  # [steps, batch] fine-tuning window starts
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    n_epoch: int


def fused_supported(device: torch.device) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` steps on this device (checked by doing it once)."""
    try:
        p = torch.nn.Parameter(torch.zeros(2, device=device))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def pretrain(cfg: E2EConfig, corpus: Corpus, device: torch.device, cache_dir: Path | None, progress: bool) -> tuple:
    """The starting model: AdamW on the pre-training split (cosine schedule), cached by its inputs."""
    key = json.dumps(dict(size=cfg.size().as_dict(), steps=cfg.pretrain_steps, lr=cfg.pretrain_lr, seed=cfg.seed,
                          data=corpus.pretrain.digest(), version=1), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_dir / f"pretrain-{cfg.model}-{digest}.pt" if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            return saved["state"], dict(saved["meta"], cached=True, cache_file=str(path))
        except (OSError, RuntimeError, KeyError, EOFError):
            pass  # a broken cache file is rebuilt
    size = cfg.size()
    model = build_model(size, seed=cfg.seed, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=cfg.weight_decay,
                            fused=fused_supported(device))
    warm = max(1, cfg.pretrain_steps // 20)

    def lr_at(s):
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, cfg.pretrain_steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    starts = batch_starts(corpus.pretrain.nbytes, size.context, size.batch, cfg.pretrain_steps, cfg.seed + 1)
    bar = Progress(cfg.pretrain_steps, "pre-train", enabled=progress)
    t0 = time.perf_counter()
    losses = []
    model.train()
    for s in range(cfg.pretrain_steps):
        x, y = windows(corpus.pretrain.data, starts[s], size.context)
        loss = model.loss(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        bar.update(s + 1, losses[-1])
    bar.close()
    meta = dict(steps=cfg.pretrain_steps, seconds=time.perf_counter() - t0, lr=cfg.pretrain_lr,
                final_train_loss=statistics.fmean(losses[-max(1, len(losses) // 10):]) if losses else None,
                cached=False, cache_file=str(path) if path is not None else None)
    state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save({"state": state, "meta": meta}, tmp)
            os.replace(tmp, path)
        except OSError as exc:
            print(f"warning: could not cache the pre-trained model in {str(path)!r}: {exc}", file=sys.stderr)
    return state, meta


def prepare(cfg: E2EConfig, cache_dir: str | Path | None = DEFAULT_CACHE, progress: bool = False) -> Prepared:
    """Corpus, pre-trained weights (cached), fine-tuning batches and the held-out set for ``cfg``."""
    device = cfg.resolved_device()
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    corpus = load_corpus(cfg.seed, cfg.pretrain_bytes, cfg.train_bytes, cfg.heldout_bytes)
    size = cfg.size()
    state, meta = pretrain(cfg, corpus, device, Path(cache_dir) if cache_dir is not None else None, progress)
    starts = batch_starts(corpus.train.nbytes, size.context, size.batch, cfg.steps, cfg.seed + 2)
    ex, ey = windows(corpus.heldout.data, eval_starts(corpus.heldout.nbytes, size.context, cfg.eval_windows),
                     size.context)
    n_epoch = epoch_steps(corpus.train.nbytes, size.context, size.batch)
    prep = Prepared(cfg, corpus, device, threads, state, meta, starts, ex, ey, n_epoch)
    prep.pretrain["heldout_loss"] = heldout_loss(prep, state)
    return prep


def make_model(prep: Prepared, state: dict | None = None) -> CharGPT:
    model = build_model(prep.cfg.size(), seed=prep.cfg.seed, device=prep.device)
    model.load_state_dict(state if state is not None else prep.state)
    return model


def make_optimizer(spec: RunSpec, model: torch.nn.Module, prep: Prepared):
    cfg = prep.cfg
    if spec.optimizer is not None:
        return spec.optimizer(model.parameters())
    if spec.kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 fused=fused_supported(prep.device))
    if spec.kind in ("offload", "zenflow"):
        from zenflow_kernels import ZenFlowAdamW

        return ZenFlowAdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, zenflow=dict(spec.zenflow))
    if spec.kind == "deepspeed":
        return DeepSpeedEngine(model, spec.zenflow, prep)
    raise ValueError(f"run kind {spec.kind!r} is invalid: allowed 'adamw', 'offload', 'zenflow', 'deepspeed'")


class DeepSpeedEngine:
    """``deepspeed.initialize`` (one process, world size 1) driven like a torch optimizer by :func:`train_run`
    (``backward(loss)``, ``step()``, ``zero_grad()``, ``close()``). DeepSpeed is optional, never a dependency of the
    library: only ``bench.gpu_e2e``'s DeepSpeed runs, made when it imports, build this."""

    def __init__(self, model: torch.nn.Module, config: dict, prep: Prepared):
        import deepspeed
        import torch.distributed as dist

        from zenflow_kernels.testing import free_port

        if not dist.is_initialized():
            for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                               ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)
            deepspeed.init_distributed(dist_backend="nccl" if prep.device.type == "cuda" else "gloo")
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears its gradients in ``step()``."""

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()


def autocast(cfg: E2EConfig, device: torch.device):
    """The forward's precision context: bf16 autocast when ``cfg.autocast == "bf16"``, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


@torch.no_grad()
def heldout_loss(prep: Prepared, state: dict, batch: int = 16) -> float:
    """Mean next-byte loss (nats/byte) of weights ``state`` on the fixed held-out windows."""
    return model_heldout_loss(prep, make_model(prep, state), batch)


@torch.no_grad()
def model_heldout_loss(prep: Prepared, model: torch.nn.Module, batch: int = 16) -> float:
    """:func:`heldout_loss` of a live model (evaluated in eval mode; its training mode is put back)."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, prep.eval_x.shape[0], batch):
        x, y = prep.eval_x[i:i + batch].to(prep.device), prep.eval_y[i:i + batch].to(prep.device)
        with autocast(prep.cfg, prep.device):
            total += float(model.loss(x, y)) * x.shape[0]
        n += x.shape[0]
    model.train(was)
    return total / n


def gradient_shares(model: torch.nn.Module) -> dict:
    """The top-1% and top-10% shares of the matrices' gradient energy now (zenflow_kernels.concentration)."""
    from zenflow_kernels.concentration import gradient_concentration

    energies = [p.grad.float().square().sum(0) for p in model.parameters() if p.grad is not None and p.dim() == 2]
    got = gradient_concentration(energies)
    return dict(top1=got["top1"], top10=got["top10"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the ZenFlow optimizer's figures a run's row takes: row key -> stats() key
_STATS = dict(host_updates="host_updates", selections="selections", host_update_s_mean="host_update_s_mean",
              fast_path_s_mean="fast_path_s_mean", optimizer_step_s_mean="step_s_mean",
              optimizer_stall_fraction="stall_fraction", overlap_fraction="overlap_fraction",
              score_mass_captured="score_mass_captured")


def train_run(spec: RunSpec, prep: Prepared, steps: int | None = None, progress: bool = False,
              grad_hook: Callable[[int, torch.nn.Module, torch.optim.Optimizer], None] | None = None,
              eval_points: int | None = None, tag: str = "", evaluate: bool = True) -> dict:
    """Fine-tune the pre-trained model with one optimizer; return its figures and curves.

    ``grad_hook(step, model, optimizer)`` (optional) runs after each backward, before the optimizer
    step, off the clock (the selection-dynamics notebook reads the gradients there). ``evaluate=False``
    skips the held-out evaluations (warm-up runs).
    """
    cfg = prep.cfg
    steps = cfg.steps if steps is None else steps
    if steps > prep.starts.shape[0]:
        raise ValueError(f"steps={steps} is more than the {prep.starts.shape[0]} prepared batches")
    size = cfg.size()
    torch.set_num_threads(spec.threads or prep.threads)
    model = make_model(prep)
    model.train()
    if prep.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(prep.device)
    opt = make_optimizer(spec, model, prep)
    warm = max(1, round(cfg.warmup_frac * steps))
    # a DeepSpeed engine keeps the learning rate it was configured with (the GPU preset uses a constant one)
    sched = None
    if spec.kind != "deepspeed":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    points = eval_points or cfg.eval_points
    eval_at = {round(i * steps / points) for i in range(points + 1)} if evaluate else set()
    snapshots: list[tuple[int, float, dict]] = []
    bar = Progress(steps, tag or spec.label or spec.name, enabled=progress)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    train_loss, wall_at, opt_s, concentration_at = [], [], [], []
    wall, threads_during = 0.0, None
    zen = spec.kind in ("offload", "zenflow")
    backward = getattr(opt, "backward", None)  # a DeepSpeed engine runs its own backward
    try:
        if 0 in eval_at:
            snapshots.append((0, 0.0, prep.state))
        for s in range(steps):
            t0 = time.perf_counter()
            x, y = windows(prep.corpus.train.data, prep.starts[s], size.context)
            with autocast(cfg, prep.device):
                loss = model.loss(x.to(prep.device), y.to(prep.device))
            if backward is not None:
                backward(loss)
            else:
                loss.backward()
            if grad_hook is not None:
                _sync(prep.device)
                paused = time.perf_counter()
                grad_hook(s, model, opt)
                t0 += time.perf_counter() - paused
            # the gradient's concentration along the run (off the clock)
            if spec.kind == "zenflow" and (s in eval_at or s + 1 == steps):
                paused = time.perf_counter()
                concentration_at.append(dict(step=s, **gradient_shares(model)))
                t0 += time.perf_counter() - paused
            t_opt = time.perf_counter()
            opt.step()
            opt_s.append(time.perf_counter() - t_opt)  # on CUDA: the time of the call, not of the kernels
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            lv = loss.item()  # a device sync: the step is done
            if s == steps - 1 and zen:
                opt.flush()  # the last host update lands: part of the run, on the clock
                _sync(prep.device)
            wall += time.perf_counter() - t0
            if threads_during is None:
                threads_during = torch.get_num_threads()
            train_loss.append(lv)
            wall_at.append(wall)
            if s + 1 in eval_at:
                snapshots.append((s + 1, wall, {k: v.detach().to("cpu", copy=True)
                                                for k, v in model.state_dict().items()}))
            bar.update(s + 1, lv)
        stats = opt.stats() if zen else None
        peak = torch.cuda.max_memory_allocated(prep.device) if prep.device.type == "cuda" else None
    finally:
        if zen or spec.kind == "deepspeed":
            opt.close()
        bar.close()
    torch.set_num_threads(prep.threads)
    evals = [{"step": st, "wall_s": w, "heldout_loss": heldout_loss(prep, sd)} for st, w, sd in snapshots]
    result = {
        **spec.describe(), "steps": steps, "wall_s": wall, "steps_per_s": steps / wall if wall > 0 else float("nan"),
        "torch_threads": spec.threads or prep.threads, "loadavg_1min_before": load_before,
        "torch_threads_during_run": threads_during, "optimizer_step_call_s_mean": statistics.fmean(opt_s),
        "final_train_loss": statistics.fmean(train_loss[-max(1, steps // 10):]),
        "final_heldout_loss": evals[-1]["heldout_loss"] if evals else float("nan"),
        "step_ms": [1e3 * (b - a) for a, b in zip([0.0] + wall_at[:-1], wall_at, strict=True)],
        "peak_device_bytes": peak, "train_loss": train_loss, "wall_at_step": wall_at, "evals": evals,
    }
    if zen:
        result.update(
            stall_s=stats["stall_s"], stall_pct=100.0 * stats["stall_s"] / wall if wall > 0 else float("nan"),
            **{key: stats[name] for key, name in _STATS.items()},
            # the gradient's energy in the top 1% / 10% of each matrix's columns and in the selected ones, at each
            # selection (zenflow_kernels.concentration: ZenFlow's premise)
            concentration={k: stats["concentration"][k] for k in ("top1", "top10", "selected")},
            # the same shares of the step's gradient at the evaluation points (the selections may be far apart)
            concentration_at_evals=concentration_at,
            selection_jaccard=[None if math.isnan(j) else j for j in stats["selection_jaccard"]],
            selection_steps=stats["selection_steps"], d2h_bytes_per_step=stats["d2h_bytes_per_step"],
            h2d_bytes_per_step=stats["h2d_bytes_per_step"])
    else:  # (a DeepSpeed engine's stall and bytes are not known)
        none = float("nan") if spec.kind == "deepspeed" else 0.0
        result.update(stall_s=none, stall_pct=none, host_updates=0, selections=0, d2h_bytes_per_step=none,
                      h2d_bytes_per_step=none)
    return result


WARMUP_STEPS = 9  # untimed steps per run kind first: numba kernels compile (or load from cache) there


def warm_up(specs: Sequence[RunSpec], prep: Prepared) -> None:
    """A short untimed run of each spec, so that no timed run pays for first-call work (numba kernels
    compiling or loading from their cache, allocator growth)."""
    for spec in specs:
        train_run(spec, prep, steps=min(WARMUP_STEPS, prep.starts.shape[0]), evaluate=False)


def run_all(specs: Sequence[RunSpec], prep: Prepared, repeats: int = 1, progress: bool = False) -> list[dict]:
    """Every spec ``repeats`` times, interleaved; per spec the repeat with the median wall time, with the
    steps/s of every repeat and their median attached. :func:`warm_up` runs first."""
    warm_up(specs, prep)
    done: dict[str, list[dict]] = {s.name: [] for s in specs}
    for r in range(repeats):
        for j, spec in enumerate(specs):
            tag = f"[{r * len(specs) + j + 1}/{repeats * len(specs)}] {spec.label or spec.name}"
            done[spec.name].append(train_run(spec, prep, progress=progress, tag=tag))
    out = []
    for spec in specs:
        runs = done[spec.name]
        chosen = dict(sorted(runs, key=lambda d: d["wall_s"])[(len(runs) - 1) // 2])
        chosen["repeats"] = [{k: d[k] for k in ("wall_s", "steps_per_s", "stall_s", "stall_pct", "final_heldout_loss")}
                             for d in runs]
        chosen["steps_per_s_median"] = statistics.median(d["steps_per_s"] for d in runs)
        chosen["stall_pct_median"] = statistics.median(d["stall_pct"] for d in runs)
        out.append(chosen)
    return out


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear value of (x, y) points at x (clamped at the ends)."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def compare(runs: list[dict]) -> dict:
    """Ratios against the baselines measured in the same process, and the goals of the optimizer issue."""
    by = {r["name"]: r for r in runs}
    adamw, offload = by.get("adamw"), by.get("offload")
    out: dict = {"per_run": {}, "goals": {}}
    for r in runs:
        row: dict = {"steps_per_s": r["steps_per_s_median"], "stall_pct": r["stall_pct_median"]}
        if adamw is not None:
            row["steps_per_s_vs_adamw"] = r["steps_per_s_median"] / adamw["steps_per_s_median"]
            row["heldout_gap_vs_adamw_equal_steps"] = r["final_heldout_loss"] - adamw["final_heldout_loss"]
            row["heldout_ratio_vs_adamw_equal_steps"] = r["final_heldout_loss"] / adamw["final_heldout_loss"]
        if offload is not None:
            row["steps_per_s_vs_offload"] = r["steps_per_s_median"] / offload["steps_per_s_median"]
            t = min(r["wall_s"], offload["wall_s"])
            mine = _interp([(e["wall_s"], e["heldout_loss"]) for e in r["evals"]], t)
            theirs = _interp([(e["wall_s"], e["heldout_loss"]) for e in offload["evals"]], t)
            row.update(equal_wall_time_s=t, heldout_at_equal_wall=mine, offload_heldout_at_equal_wall=theirs,
                       heldout_gap_vs_offload_equal_wall=mine - theirs)
        out["per_run"][r["name"]] = row
        if r["name"].startswith("zenflow"):
            g = out["goals"][r["name"]] = {"stall_lt_5pct": row["stall_pct"] < 5.0}
            if "steps_per_s_vs_adamw" in row:
                g["steps_per_s_ge_0p9_adamw"] = row["steps_per_s_vs_adamw"] >= 0.9
            if "heldout_gap_vs_offload_equal_wall" in row:
                g["heldout_le_offload_equal_wall"] = row["heldout_gap_vs_offload_equal_wall"] <= 0.0
    return out


class Progress:
    """A plain stderr progress bar (redrawn in place on a terminal; a line at each quarter otherwise)."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None, width: int = 28):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.last = -1.0
        self.next_mark = 0.25

    def update(self, n: int, loss: float | None = None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = n / self.total if self.total else 1.0
        if self.tty:
            if now - self.last < 0.1 and n < self.total:
                return
            self.last = now
            fill = int(self.width * frac)
            rate = n / (now - self.t0) if now > self.t0 else 0.0
            tail = f" loss {loss:.3f}" if loss is not None else ""
            self.stream.write(f"\r{self.label:<34} [{'#' * fill}{'.' * (self.width - fill)}] {n}/{self.total}"
                              f" {rate:5.2f} it/s{tail}  ")
        elif frac >= self.next_mark or n == self.total:
            while self.next_mark <= frac:
                self.next_mark += 0.25
            tail = f", loss {loss:.3f}" if loss is not None else ""
            self.stream.write(f"{self.label}: {n}/{self.total} steps, {now - self.t0:.1f} s{tail}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
