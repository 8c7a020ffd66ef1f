"""One rank of the FSDP2 tests (tests/test_fsdp2.py starts one process per rank, as torchrun would).

    python tests/fsdp2_worker.py CASES.json OUT_DIR      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Runs every case of CASES.json in order on one gloo process group: a small model wrapped with
``fully_shard`` per block and at the root, each rank training on its slice of the same global batches.
Saves, per case, the full weights after every step (gathered), every selection, stats and host bytes to
OUT_DIR/<case>-rank<r>.pt. tests/test_fsdp2.py trains one process on the whole batches and the reference
from the same start, and compares.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero_worker import zenflow_settings  # noqa: E402

from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules  # noqa: E402
from zenflow_kernels.testing import chaos  # noqa: E402

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
VOCAB, WIDTH, HIDDEN, OUT = 13, 12, 20, 5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    """Uneven row counts on purpose: 13 embedding rows, 5 head rows (2/2/1 on 3 ranks), a 2-row gate (1/1/0:
    one rank holds an empty shard of it)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.gate = torch.nn.Linear(WIDTH, 2, bias=False)
        self.head = torch.nn.Linear(WIDTH, OUT)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = x * torch.sigmoid(self.gate(x)).mean(-1, keepdim=True)
        return self.head(x).clone()  # not a view: FSDP2 hooks the root's output for backward


def make_model(seed: int = 0, dtype=torch.float32) -> Model:
    torch.manual_seed(seed)
    return Model().to(dtype)


def scorer_weight_saliency(grad, param):
    """A researcher's criterion (module level: every rank imports it): gradient-times-weight saliency. Under
    FSDP2 it sees this rank's rows; the ranks' scores are summed."""
    return (grad.float() * param.detach().float()).abs().sum(0)


def param_groups(model, case: dict):
    """With ``policy``: the embedding on the host only (topk_ratio 0), the head scored by a callable at
    topk_ratio 0.4, the rest by the optimizer's settings."""
    if not case.get("policy"):
        return model.parameters()
    named = dict(model.named_parameters())
    head = [named["head.weight"], named["head.bias"]]
    rest = [p for n, p in named.items() if n not in ("embed.weight", "head.weight", "head.bias")]
    return [dict(params=[named["embed.weight"]], topk_ratio=0.0),
            dict(params=head, importance=scorer_weight_saliency, topk_ratio=0.4), dict(params=rest)]


def freeze(model, case: dict, t: int) -> None:
    """The case's ``frozen`` parameters (names): ``names`` frozen until step ``until``, ``again`` = ``[step,
    names]`` frozen from that step on (a frozen backbone trained mid-run, a matrix frozen again)."""
    spec = case.get("frozen")
    if not spec:
        return
    frozen = set(spec["names"]) if t < spec["until"] else set()
    step, again = spec.get("again", (None, ()))
    frozen |= set(again) if step is not None and t >= step else set()
    for name, p in model.named_parameters():
        p.requires_grad_(not any(name.startswith(f) for f in frozen))


def batches(steps: int, size: int = 12, seed: int = 7):
    """Global batches (tokens [size, 6], targets [size, 6] in [0, OUT)), fixed in advance."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (size, 6), generator=g), torch.randint(0, OUT, (size, 6), generator=g))
            for _ in range(steps)]


def loss_of(model, tokens, targets):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, OUT).float(), targets.reshape(-1))


def rank_slice(batch, rank: int, world: int):
    """This rank's equal share of a global batch (the loss is a mean, so the ranks' mean gradient is the
    whole batch's)."""
    tokens, targets = batch
    n = tokens.shape[0] // world
    return tokens[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]


def backward(model, batch, rank, world, micro: int = 1, declare: bool = False, scaler=None, autocast=None):
    """``micro`` backward passes over this rank's slice; ``declare``: all but the last without FSDP2's
    gradient sync (``set_requires_gradient_sync(False)``: no reduce-scatter, so no hook fires for them);
    ``scaler``: the loss scaled by a GradScaler; ``autocast``: the forward under CPU autocast to that dtype
    (a name: "float16", "bfloat16")."""
    tokens, targets = rank_slice(batch, rank, world)
    cast = torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext()
    for m in range(micro):
        if declare:
            model.set_requires_gradient_sync(m == micro - 1)
        n = tokens.shape[0] // micro
        with cast:
            loss = loss_of(model, tokens[m * n : (m + 1) * n], targets[m * n : (m + 1) * n]) / micro
        (loss if scaler is None else scaler.scale(loss)).backward()


def grad_scaler(case: dict):
    """The case's ``torch.amp.GradScaler`` on CPU (``case["scaler"]``: its init_scale and growth_interval), or
    None."""
    spec = case.get("scaler")
    if not spec:
        return None
    return torch.amp.GradScaler("cpu", init_scale=spec["init_scale"], growth_interval=spec["growth_interval"])


def inject_inf(model, case: dict, t: int) -> bool:
    """``case["inf"]`` = ``[step, name, row, col]``: after that step's backward, that element of parameter
    ``name``'s (averaged) gradient becomes inf. Under FSDP2 only the rank holding that row writes it: the
    gradient of one rank is non-finite, the others' are not. Whether this process wrote it."""
    spec = case.get("inf")
    if not spec or spec[0] != t:
        return False
    _, name, row, col = spec
    from torch.distributed.tensor import DTensor

    p = dict(model.named_parameters())[name]
    with torch.no_grad():
        if isinstance(p, DTensor):
            local, first = p.grad.to_local(), _row_offset(p)
            if not first <= row < first + local.shape[0]:
                return False
            local[row - first, col] = math.inf
        else:
            p.grad[row, col] = math.inf
    return True


def scaler_step(model, opt, scaler, case: dict) -> None:
    """``opt.step()``, or under a GradScaler its recipe: ``scaler.step(opt)`` (the optimizer unscales inside,
    the fused-optimizer protocol) or, with ``case["scaler"]["unscale"]``, the user's ``scaler.unscale_(opt)``
    and ``clip_grad_norm_`` (``clip``) first; then ``scaler.update()``."""
    if scaler is None:
        opt.step()
        return
    spec = case["scaler"]
    if spec.get("unscale"):
        scaler.unscale_(opt)
        if spec.get("clip") is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
    scaler.step(opt)
    scaler.update()


def wrap(model, case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if case.get("mesh"):  # HSDP: (replicas, shards), parameters placed (Replicate(), Shard(0))
        mesh = init_device_mesh("cpu", tuple(case["mesh"]), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    extra = {}
    if case.get("mixed_precision"):
        extra["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    return model


def make_rule(case: dict):
    """``case["rule"]`` (``[name, arguments]`` of ``zenflow_kernels.rules``) made, or None (AdamW at ``HYPER``)."""
    if not case.get("rule"):
        return None
    name, arguments = case["rule"]
    if "state_dtype" in arguments:  # (by name: cases cross to the workers as JSON)
        arguments = dict(arguments, state_dtype=getattr(torch, arguments["state_dtype"]))
    return getattr(rules, name)(**arguments)


def optimizer(groups, case: dict, **kwargs):
    """ZenFlowAdamW at ``HYPER``, or ZenFlow with ``case["rule"]`` at ``HYPER``'s lr."""
    rule = make_rule(case)
    return ZenFlowAdamW(groups, **HYPER, **kwargs) if rule is None else ZenFlow(groups, rule, lr=HYPER["lr"], **kwargs)


def run_checkpoint_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    """``save``: train ``save_at`` steps, save model and optimizer with torch.distributed.checkpoint, train on
    to ``steps``; ``load``: a fresh model and optimizer load that checkpoint (at this world size) and train
    from ``save_at`` to ``steps``. Saves the live weights after each step. ``frozen`` (:func:`freeze`) applies to
    both; a load's ``load_frozen`` replaces it; ``expect_error``: a load that is refused saves its error and whether
    the optimizer is as it was, and trains no further."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = wrap(make_model(seed=1 if case["kind"] == "load" else 0), case)  # load: other weights, overwritten
    params = list(model.parameters())
    data = batches(case["steps"])
    ctx = chaos(seed=case["chaos"]) if case.get("chaos") is not None else contextlib.nullcontext()
    with ctx:
        opt = optimizer(param_groups(model, case), case, zenflow=zenflow_settings(case, out_dir),
                        max_grad_norm=case.get("max_grad_norm"))
    checkpoint = Path(case["checkpoint"])
    result: dict = {"weights": {}}
    start = 0
    # the frozen parameters (``frozen``; a load's ``load_frozen``: another set than the save's)
    frozen = dict(case, frozen=case.get("load_frozen", case.get("frozen"))) if case["kind"] == "load" else case
    if case["kind"] == "load":
        freeze(model, frozen, case["save_at"])  # (those of the step the run resumes at)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        before = (opt.t, opt.state_dict())
        try:
            dcp.load(state, checkpoint_id=checkpoint)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])
        except (Exception, CheckpointException) as exc:  # a refused load (``expect_error``): its message, and
            # whether it changed the optimizer
            if not case.get("expect_error"):
                raise
            after = (opt.t, opt.state_dict())
            result.update(error=f"{type(exc).__name__}: {exc}", unchanged=_same_state(before, after))
            opt.close()
            torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")
            return
        start = case["save_at"]
        result["loaded_t"] = opt.t
    with opt:
        for t in range(start, case["steps"]):
            freeze(model, frozen, t)
            backward(model, data[t], rank, world)
            opt.step()
            opt.zero_grad()
            result["weights"][t] = [p.full_tensor().detach().clone() for p in params]
            if case["kind"] == "save" and t + 1 == case["save_at"]:
                result["pending_at_save"] = opt.host_update_in_flight  # a host update in flight
                # flushed: save (and evaluate) the flushed weights inside opt.flushed(), training unchanged
                with opt.flushed() if case.get("flushed") else contextlib.nullcontext():
                    result["saved_weights"] = [p.full_tensor().detach().clone() for p in params]
                    with torch.no_grad():
                        model(data[0][0])  # an evaluation forward (FSDP2 all-gathers what the ranks hold)
                    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                             checkpoint_id=checkpoint)
            if case["kind"] == "flush" and t + 1 == case["save_at"]:  # what a save inside flushed() should hold
                opt.flush()
                result["saved_weights"] = [p.full_tensor().detach().clone() for p in params]
                break
        opt.flush()
        result["flushed"] = [p.full_tensor().detach().clone() for p in params]
        result["host_bytes"] = opt.host_bytes()
        folder = opt.host_shard.disk.folder if opt.host_shard.disk is not None else None
    if folder is not None:  # leaving `with opt` closed it: this rank's private folder is gone
        result["nvme_folder"] = (str(Path(folder).parent), os.path.exists(folder))
    torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")


def _same_state(a, b) -> bool:
    """Two optimizer state dicts (and step counts) hold the same values, DTensors by their local shards
    ("unflushed" aside: outside ``flushed()`` a copy of the live weights, which loading the model changes)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same_state(a[k], b[k]) for k in a
                                                                if k != "unflushed")
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_state, a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(_local(a), _local(b))
    return a == b


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _row_offset(p) -> int:
    """The first global row of this rank's shard of DTensor ``p``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0])


def run_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    if case.get("kind") in ("save", "load", "flush"):
        return run_checkpoint_case(case, rank, world, out_dir)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model = wrap(make_model(dtype=dtype), case)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    data = batches(case["steps"])
    ctx = chaos(seed=case["chaos"]) if case.get("chaos") is not None else contextlib.nullcontext()
    result: dict = {"weights": [], "selections": []}
    with ctx:
        opt = optimizer(param_groups(model, case), case, zenflow=zenflow_settings(case, out_dir),
                        max_grad_norm=case.get("max_grad_norm"), collective_timeout=case.get("timeout", 60.0))
    scaler = grad_scaler(case)
    with opt:
        for t, batch in enumerate(data):
            freeze(model, case, t)
            backward(model, batch, rank, world, micro=case.get("micro", 1), declare=case.get("declare", False),
                     scaler=scaler, autocast=case.get("autocast"))
            if inject_inf(model, case, t):
                result["wrote_inf"] = t
            # the asynchronous link starts each gradient's copy from the hook FSDP2 calls after its
            # reduce-scatter: how many are staged before step() runs
            result.setdefault("staged_by_hooks", []).append(len(getattr(opt.link, "_staged", {})) if t else None)
            if case.get("fail_rank") == rank and t == case.get("fail_at"):
                if case.get("hang_s"):  # alive but not stepping: the others must time out, not wait
                    time.sleep(case["hang_s"])
                    os._exit(3)
                raise RuntimeError(f"rank {rank} fails at step {t} on purpose")
            scaler_step(model, opt, scaler, case)
            if scaler is not None:
                result.setdefault("scales", []).append(scaler.get_scale())
            opt.zero_grad()
            result["selections"].append([None if (s := opt.selected_columns(p)) is None else s.tolist()
                                         for p in params])
            result["weights"].append([p.full_tensor().detach().clone() for p in params])  # live, as trained on
        opt.flush()
        result["flushed"] = [p.full_tensor().detach().clone() for p in params]
        result.update(stats=opt.stats(), host_bytes=opt.host_bytes(), names=names,
                      local_rows=[p.to_local().shape[0] for p in params],
                      row_offsets=[_row_offset(p) for p in params],
                      collective_world=opt.sharding.ctx.world if opt.sharding.ctx is not None else None)
        folder = opt.host_shard.disk.folder if opt.host_shard.disk is not None else None
    if folder is not None:  # leaving `with opt` closed it: this rank's private folder is gone
        result["nvme_folder"] = (str(Path(folder).parent), os.path.exists(folder))
    torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")


if __name__ == "__main__":
    from zero_worker import main

    # FSDP2's own collectives wait the process group's timeout: short, so a failure case cannot hang the suite
    code = main(run_case, timeout=datetime.timedelta(seconds=60))
    # results are saved: leave without the interpreter's teardown, where gloo's threads sometimes abort an
    # exiting process ("terminate called without an active exception") after its work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
