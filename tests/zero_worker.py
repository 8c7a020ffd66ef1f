"""One rank of the ZeRO tests (tests/test_zero.py starts one process per rank, as torchrun would).

    python tests/zero_worker.py CASES.json OUT_DIR      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Runs every case of CASES.json in order on one gloo process group and saves, per case, this rank's
final parameters, stats and host-shard size to OUT_DIR/<case>-rank<r>.pt. Gradients are fixed in
advance and differ per rank; tests/test_zero.py feeds their average (``mean_grads``) to one rank and
to the reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import HYPER, SHAPES, grad_sequence, make_params  # noqa: E402,F401  (the optimizer tests' model)

from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules  # noqa: E402
from zenflow_kernels.ops import use_backend  # noqa: E402
from zenflow_kernels.testing import chaos  # noqa: E402


def shared_grads(steps: int):
    """The gradients of one rank on the whole batch: the optimizer tests' (hot columns that drift)."""
    return grad_sequence(steps, seed=1)


def rank_grads(steps: int, rank: int, world: int):
    """Rank ``rank``'s gradients: the shared ones times ``rank + 1`` plus noise of its own."""
    noise = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in shared_grads(steps):
        out.append([g * (rank + 1) + torch.randn(g.shape, generator=noise) for g in step])
    return out


def mean_grads(steps: int, world: int, dtype=torch.float32):
    """What the ranks' average is: summed in rank order and in the gradients' dtype, as the all-reduce
    adds them, then divided."""
    per_rank = [rank_grads(steps, r, world) for r in range(world)]
    out = []
    for t in range(steps):
        step = []
        for j in range(len(SHAPES)):
            total = per_rank[0][t][j].to(dtype)
            for r in range(1, world):
                total += per_rank[r][t][j].to(dtype)
            step.append(total / world)
        out.append(step)
    return out


def scorer_saliency(grad, param):
    """A researcher's column criterion: gradient-times-weight saliency (module level: every rank imports it)."""
    return (grad.float() * param.detach().float()).abs().sum(0)


def param_groups(params, case: dict):
    """Two param groups with their own lr and weight decay when the case asks for them; with ``policy``, their
    own ZenFlow settings: a callable scorer at topk_ratio 0.5, and topk_ratio 0 (host only)."""
    if case.get("policy"):
        import zero_worker  # this module by its name even when it runs as __main__: a checkpoint pickles the
        # scorer by reference, and the test process can resolve zero_worker.scorer_saliency, not __main__'s

        return [{"params": params[:3], "importance": zero_worker.scorer_saliency, "topk_ratio": 0.5},
                {"params": params[3:], "topk_ratio": 0.0}]
    if not case.get("groups"):
        return params
    return [{"params": params[:3]}, {"params": params[3:], "lr": 5e-3, "weight_decay": 0.0}]


def frozen_at(case: dict, t: int) -> set[int]:
    """The case's parameters frozen at step ``t`` (``frozen``: ``params`` until step ``until``, then ``again`` =
    ``[step, params]`` from that step on): a frozen backbone unfrozen mid-run, a matrix frozen again."""
    spec = case.get("frozen")
    if not spec:
        return set()
    out = set(spec["params"]) if t < spec["until"] else set()
    step, again = spec.get("again", (None, ()))
    return out | (set(again) if step is not None and t >= step else set())


def freeze(params, case: dict, t: int) -> None:
    frozen = frozen_at(case, t)
    for j, p in enumerate(params):
        p.requires_grad_(j not in frozen)


def set_grads(params, step, t: int, case: dict, dtype) -> None:
    """The step's gradients; ``missing`` parameters have none every third step (on every rank); ``frozen`` ones
    (:func:`frozen_at`) do not require one and have none."""
    freeze(params, case, t)
    for j, (p, g) in enumerate(zip(params, step, strict=True)):
        p.grad = None if (j in case.get("missing", ()) and t % 3 == 1) or not p.requires_grad else g.to(dtype)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def batch(steps: int, size: int = 8):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, 8, generator=g)) for _ in range(steps)]


def train_model(model, opt, batches, part: slice, micro: int, held: list | None = None, declare: bool = False,
                case: dict | None = None) -> None:
    """Backward on ``part`` of each batch in ``micro`` micro-batches (mean loss over the part), then step
    (``declare``: all but the last inside ``opt.no_sync()``; ``case``'s ``frozen`` parameters frozen first).
    ``held``: gets, after each step's backward, the gradient elements the rank then holds: in ``.grad``
    (matrices, vectors) and in ZeRO-2's reductions (its own sums, inputs still in flight)."""
    for t, (x, y) in enumerate(batches):
        freeze(list(model.parameters()), case or {}, t)
        xs, ys = x[part].chunk(micro), y[part].chunk(micro)
        for k, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            with opt.no_sync() if declare and k < micro - 1 else contextlib.nullcontext():
                (torch.nn.functional.mse_loss(model(xm), ym) / micro).backward()
        if held is not None:
            grads = [p.grad for p in model.parameters()]
            reducer = opt.sharding.reducer
            held.append(dict(
                matrices=sum(g.numel() for g in grads if g is not None and g.dim() == 2),
                vectors=sum(g.numel() for g in grads if g is not None and g.dim() != 2),
                reducer=sum(reducer.held_numel().values()) if reducer is not None else 0,
            ))
        opt.step()
        opt.zero_grad()


def run_model_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    """A model trained by backward (the ZeRO-2 reductions start from the hooks): each rank on its part
    of every batch."""
    model = make_model()
    opt = ZenFlowAdamW(model.parameters(), **HYPER, zenflow=case["zenflow"], zero_stage=case["zero_stage"],
                       release_gradients=case.get("release_gradients"))
    size = 8
    part = slice(rank * size // world, (rank + 1) * size // world)
    held: list[dict] = []
    train_model(model, opt, batch(case["steps"], size), part, case.get("micro", 1), held, case.get("declare", False),
                case)
    opt.flush()
    reducer = opt.sharding.reducer
    params = list(model.parameters())
    result = dict(params=[p.detach().clone() for p in params], stats=opt.stats(),
                  started_in_backward=reducer.started_in_backward if reducer else 0,
                  restarted=reducer.restarted if reducer else 0, buckets=len(reducer.buckets) if reducer else 0,
                  held=held,
                  owned_matrix_numel=sum(params[i].numel() for i in opt.host_shard.slots if params[i].dim() == 2))
    opt.close()
    torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")


def run_error_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    """What a user gets wrong under torchrun: no stage, or a DDP-wrapped model."""
    errors = {}
    params = make_params()
    # a gradient on one rank only: every rank stops with the same error, before any collective mismatches
    opt = ZenFlowAdamW(params, zero_stage=2)
    for p, g in zip(params, shared_grads(1)[0], strict=True):
        p.grad = g
    if rank == world - 1:
        params[1].grad = None
    try:
        opt.step()
    except ValueError as exc:
        errors["presence"] = str(exc)
    opt.close()
    try:
        ZenFlowAdamW(params)
    except ValueError as exc:
        errors["stage0"] = str(exc)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    try:
        ZenFlowAdamW(ddp.parameters(), zero_stage=1)
    except ValueError as exc:
        errors["ddp"] = str(exc)
    torch.save(errors, out_dir / f"{case['name']}-rank{rank}.pt")


def zenflow_settings(case: dict, out_dir: Path) -> dict:
    """The case's zenflow settings; ``nvme``: the host state in files under ``out_dir/nvme-<case>`` (every rank
    makes its own private folder there)."""
    if not case.get("nvme"):
        return case["zenflow"]
    where = out_dir / f"nvme-{case['name']}"
    where.mkdir(exist_ok=True)
    return dict(case["zenflow"], offload_device="nvme", nvme_path=str(where))


def optimizer(groups, case: dict, **kwargs):
    """ZenFlowAdamW at ``HYPER``, or with ``case["rule"]`` (``[name, arguments]`` of ``zenflow_kernels.rules``)
    ZenFlow with that rule at ``HYPER``'s lr (``opt_kwargs`` as for ZenFlowAdamW: zenflow=, max_grad_norm=, ...)."""
    if not case.get("rule"):
        return ZenFlowAdamW(groups, **HYPER, **kwargs)
    return ZenFlow(groups, make_rule(case), lr=HYPER["lr"], **kwargs)


def make_rule(case: dict):
    """``case["rule"]``: ``[name, arguments]`` of ``zenflow_kernels.rules``, a ``state_dtype`` given by name (cases
    cross to the workers as JSON)."""
    name, arguments = case["rule"]
    if "state_dtype" in arguments:
        arguments = dict(arguments, state_dtype=getattr(torch, arguments["state_dtype"]))
    return getattr(rules, name)(**arguments)


def run_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    if case.get("kind") == "model":
        return run_model_case(case, rank, world, out_dir)
    if case.get("kind") == "errors":
        return run_error_case(case, rank, world, out_dir)
    dtype = getattr(torch, case.get("dtype", "float32"))
    params = make_params(dtype)
    grads = rank_grads(case["steps"], rank, world)
    kwargs = dict(zenflow=zenflow_settings(case, out_dir), max_grad_norm=case.get("max_grad_norm"),
                  zero_stage=case.get("zero_stage", 1), collective_timeout=case.get("timeout", 60.0),
                  release_gradients=case.get("release_gradients"))
    ctx = chaos(seed=case["chaos"]) if case.get("chaos") is not None else contextlib.nullcontext()
    result: dict = {}
    hooks: dict[str, list] = {}  # post-accumulate-grad hooks per parameter (the worker sets none), by moment

    def count_hooks(when: str) -> None:
        hooks.setdefault(when, []).append([len(p._post_accumulate_grad_hooks or {}) for p in params])

    with ctx:
        opt = optimizer(param_groups(params, case), case, **kwargs)
        save_at = case.get("save_at")
        for t, step in enumerate(grads):
            if case.get("fail_rank") == rank and t == case.get("fail_at"):
                if case.get("hang_s"):  # alive but not stepping: the others must time out, not wait
                    (out_dir / "hang-start").write_text(str(time.time()))
                    time.sleep(case["hang_s"])
                    os._exit(3)
                raise RuntimeError(f"rank {rank} fails at step {t} on purpose")
            set_grads(params, step, t, case, dtype)
            opt.step()
            if t == 0:
                count_hooks("first step")
            for _ in range(case.get("reload_at", []).count(t + 1)):  # this rank's own checkpoint, loaded back
                opt.load_state_dict(opt.state_dict())
                count_hooks("reload")
            if t + 1 in case.get("flushed_at", ()):  # save inside opt.flushed(), then resume from that save
                before = [p.detach().clone() for p in params]
                with opt.flushed():
                    inside = [p.detach().clone() for p in params]
                    sd = opt.state_dict()
                result.setdefault("flushed", {})[t + 1] = (before, inside)
                if t + 1 in case.get("resume_at", ()):
                    with torch.no_grad():  # the model loaded from that checkpoint holds the flushed weights ...
                        for p, w in zip(params, inside, strict=True):
                            p.copy_(w)
                    opt.load_state_dict(sd)  # ... the optimizer's state gives back the ones training continues from
            if save_at is not None and t + 1 == save_at:
                result["consolidated"] = opt.consolidated_state_dict()
                result["per_rank"] = opt.state_dict()
                result["params_at_save"] = [p.detach().clone() for p in params]
        opt.flush()
        host = opt.host_shard
        result.update(
            params=[p.detach().clone() for p in params],
            stats=opt.stats(),
            host_numel=host.numel,
            host_bytes=sum(t.numel() * t.element_size()
                           for t in [*host.fields.values(), *host.acc] if t is not None),
            owned=sorted(host.slots),
        )
        folder = host.disk.folder if host.disk is not None else None  # the ranks share nvme_path, not a folder
        opt.close()
        if folder is not None:
            result["nvme_folder"] = (str(Path(folder).parent), os.path.exists(folder))  # close() removed it
        count_hooks("closed")
        result["hooks"] = hooks
    torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")


def main(run=None, **init) -> int:
    """Run every case of CASES.json with ``run(case, rank, world, out_dir)`` (default: this module's
    ``run_case``) on one gloo process group (``init``: more ``init_process_group`` arguments)."""
    run = run or run_case
    cases = json.loads(Path(sys.argv[1]).read_text())

    def every_case(rank: int, world: int, out_dir: Path) -> None:
        with use_backend("numba"):
            for case in cases:
                run(case, rank, world, out_dir)

    return run_rank(every_case, Path(sys.argv[2]), **init)


def run_rank(body, out_dir: Path, **init) -> int:
    """One rank's process: one torch thread, a gloo process group (``init``: more ``init_process_group``
    arguments), ``body(rank, world, out_dir)``; a failure's traceback goes to ``error-rank<r>.txt`` for the
    test to show, then the process fails."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", **init)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        body(rank, world, out_dir)
    except Exception:
        (out_dir / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
