"""One rank of the sharded sweep (tests/test_sharded_sweep.py starts one process per rank, as torchrun would).

    python tests/sharded_sweep_worker.py CASES.json OUT_DIR      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Every case trains the same small model on its rank's half of fixed batches through one of the loops people write
(:data:`PATTERNS`: GradScaler fused or with ``unscale_`` and clipping, ``.data`` writes, in-place edits on one rank,
NaN repair, a dropped batch, routed clipping, a parameter frozen again, a resume) on one way of sharding
(:data:`SHARDINGS`: ZeRO-1, ZeRO-2 keeping or releasing the gradients, FSDP2), with one update rule, overlap on or
off, the synchronous or the asynchronous link. It saves this rank's full weights after the run, the GradScaler's
scale after every step, and, if the optimizer refused the loop, the step and the message. The test feeds
``ReferenceZenFlow`` the ranks' average as the loop leaves it (:func:`rank_gradients`, :func:`fed_gradients`) and
compares.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules  # noqa: E402
from zenflow_kernels.testing import chaos  # noqa: E402

SHARDINGS = ["zero1", "zero2_keep", "zero2_release", "fsdp2"]
PATTERNS = ["plain", "amp_fused", "amp_unscale_clip", "amp_inf_one_rank", "data_all", "edit_one_rank", "nan_repair",
            "dropped_batch", "routed_clip", "refrozen", "resume"]
RULES = {"AdamW": None, "Lion": ["Lion", {}], "SGD": ["SGD", {"momentum": 0.9}]}
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=1)
STEPS, BATCH, CLIP, SCALE = 10, 8, 0.5, 2.0 ** 8
EDIT_AT = {2: 1.0, 5: 0.5}  # the in-place edits' factors by step (1.0: a no-op that still moves _version)
FAULT_AT = 3  # the step whose batch holds a NaN or inf on the last rank (nan_repair, amp_inf_one_rank)
DROP_AT, RELOAD_AT = 3, 4


def make_model(case: dict) -> torch.nn.Sequential:
    """Two linear layers with a LayerNorm between; ``bare``: without biases or norm (matrices only, so nothing
    but GradScaler's protocol tells a released gradient's ``unscale_``)."""
    torch.manual_seed(0)
    if case.get("bare"):
        return torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(24, 8, bias=False))
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.LayerNorm(24),
                               torch.nn.Linear(24, 8))


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)) for _ in range(STEPS)]


def rank_batch(case: dict, t: int, rank: int, world: int):
    """Rank ``rank``'s half of batch ``t``; the last rank's holds a NaN (or an inf) at :data:`FAULT_AT`."""
    x, y = batches()[t]
    n = BATCH // world
    x, y = x[rank * n : (rank + 1) * n].clone(), y[rank * n : (rank + 1) * n]
    if t == FAULT_AT and rank == world - 1 and case["pattern"] in ("nan_repair", "amp_inf_one_rank"):
        x[0, 0] = math.nan if case["pattern"] == "nan_repair" else math.inf
    return x, y


def frozen_at(case: dict, t: int) -> set[int]:
    """refrozen: the first layer (weight, bias) frozen until step 3, the last weight frozen from step 6 on."""
    if case["pattern"] != "refrozen":
        return set()
    return ({0, 1} if t < 3 else set()) | ({4} if t >= 6 else set())


def edited(case: dict) -> list[int]:
    """The parameters the loop's edits touch: the first layer's weight and bias."""
    return [0] if case.get("bare") else [0, 1]


def stepped(case: dict, t: int) -> bool:
    return not (case["pattern"] == "dropped_batch" and t == DROP_AT)


def edit_local(case: dict, t: int, rank: int, world: int, grads: list) -> None:
    """The loop's edits between backward and ``step()`` as one rank makes them on the gradients it holds (``grads``:
    its ``.grad``s, None where it holds none)."""
    pattern = case["pattern"]
    if pattern == "data_all" and t in EDIT_AT:
        for j in edited(case):
            if grads[j] is not None:
                grads[j].data.mul_(EDIT_AT[t])  # a write that does not move _version
    if pattern == "edit_one_rank" and t in EDIT_AT and rank == world - 1:
        for j in edited(case):
            if grads[j] is not None:
                grads[j].mul_(EDIT_AT[t])
    if pattern == "nan_repair":  # the guard a loop runs every step
        for g in grads:
            if g is not None:
                g.nan_to_num_(0.0, 0.0, 0.0)


def make_optimizer(params, case: dict):
    kwargs = dict(zenflow=dict(ZEN, overlap_step=case["overlap"]), collective_timeout=60.0)
    if case["sharding"] != "fsdp2":
        kwargs.update(zero_stage=1 if case["sharding"] == "zero1" else 2,
                      release_gradients=case["sharding"] == "zero2_release" if case["sharding"] != "zero1" else None)
    ctx = chaos(seed=3) if case["link"] == "async" else contextlib.nullcontext()
    with ctx:
        if case["rule"] == "AdamW":
            return ZenFlowAdamW(params, **HYPER, **kwargs)
        name, arguments = RULES[case["rule"]]
        return ZenFlow(params, getattr(rules, name)(**arguments), lr=HYPER["lr"], **kwargs)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    if case.get("kind") == "messages":
        return run_messages_case(case, rank, world, out_dir)
    model = make_model(case)
    if case["sharding"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = list(model.parameters())
    opt = make_optimizer(params, case)
    amp = case["pattern"].startswith("amp_")
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if amp else None
    result: dict = {"scales": [], "refused": None}
    with opt:
        for t in range(STEPS):
            for j, p in enumerate(params):
                p.requires_grad_(j not in frozen_at(case, t))
            x, y = rank_batch(case, t, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (scaler.scale(loss) if amp else loss).backward()
            if not stepped(case, t):
                opt.zero_grad()
                continue
            edit_local(case, t, rank, world, [p.grad for p in params])
            if case["pattern"] == "amp_unscale_clip":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            if case["pattern"] == "routed_clip":
                opt.clip_grad_norm_(CLIP)
            try:
                if amp:
                    scaler.step(opt)
                    scaler.update()
                    result["scales"].append(scaler.get_scale())
                else:
                    opt.step()
            except ValueError as exc:  # a loop this sharding cannot honour: refused, nothing applied
                result["refused"] = (t, str(exc))
                break
            opt.zero_grad()
            if case["pattern"] == "resume" and t + 1 == RELOAD_AT:
                opt.load_state_dict(opt.state_dict())
        opt.flush()
        result["params"] = [full(p) for p in params]
    torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")


def run_messages_case(case: dict, rank: int, world: int, out_dir: Path) -> None:
    """What the ranks say when a loop goes wrong, with an optimizer other than ZenFlowAdamW: each message names
    the optimizer as built."""
    messages = {}
    model = make_model(case)
    params = list(model.parameters())
    opt = ZenFlow(params, rules.Lion(), lr=HYPER["lr"], zero_stage=2)
    for p in params:
        p.grad = torch.ones_like(p)
    if rank == world - 1:
        params[1].grad = None  # a gradient on some ranks only
    try:
        opt.step()
    except ValueError as exc:
        messages["presence"] = str(exc)
    opt.close()
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(case))
    try:
        ZenFlow(ddp.parameters(), rules.SGD(momentum=0.9), lr=HYPER["lr"], zero_stage=1)
    except ValueError as exc:
        messages["ddp"] = str(exc)
    model = make_model(case)
    opt = ZenFlow(model.parameters(), rules.Lion(), lr=HYPER["lr"], zero_stage=2)  # released gradients, unscale_
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for t in range(2):
        x, y = rank_batch(case, t, rank, world)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        try:
            scaler.step(opt)
        except ValueError as exc:
            messages["released"] = str(exc)
            break
        scaler.update()
        opt.zero_grad()
    opt.close()
    torch.save(messages, out_dir / f"{case['name']}-rank{rank}.pt")


def cases() -> list[dict]:
    """Every sharding x loop x rule; overlap and the link cycle so each sharding and rule meets all four of their
    combinations."""
    combos = [(False, "sync"), (True, "sync"), (False, "async"), (True, "async")]
    out = []
    for sharding in SHARDINGS:
        for r, rule in enumerate(RULES):
            for n, pattern in enumerate(PATTERNS):
                overlap, link = combos[(n + r) % len(combos)]
                out.append(dict(name=f"{sharding}-{pattern}-{rule}", sharding=sharding, pattern=pattern, rule=rule,
                                overlap=overlap, link=link))
    for sharding in SHARDINGS:  # a model of matrices only
        for n, pattern in enumerate(("plain", "amp_unscale_clip", "data_all")):
            out.append(dict(name=f"{sharding}-{pattern}-AdamW-bare", sharding=sharding, pattern=pattern, rule="AdamW",
                            overlap=n == 1, link="sync", bare=True))
    return out


MESSAGES = dict(name="messages", kind="messages")


if __name__ == "__main__":
    from zero_worker import main

    code = main(run_case, timeout=datetime.timedelta(seconds=60))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
