"""One rank of the ZeRO checkpoint fixtures (tools/make_checkpoint_fixtures.py writes them, with ``make``;
tests/test_checkpoint_fixtures.py checks them, with ``check``). Started as torchrun starts ranks: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

    python tests/checkpoint_fixture_ranks.py make  FIXTURE_DIR      # writes zero*_rank<r>.pt
    python tests/checkpoint_fixture_ranks.py check FIXTURE_DIR OUT  # writes OUT/rank<r>.txt: "ok" or what differs

Each rank trains the same parameters on gradients of its own (stored: the optimizer averages them), saves at
``SAVE_AT`` (its own per-rank dict, or the consolidated one every rank gets) and records the weights every later
step reaches in the run that never stopped; ``check`` loads each rank's file into a fresh optimizer at the same
world size and continues on the stored gradients.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.ops import use_backend

HYPER = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, full_warm_up_rounds=1,
           overlap_step=True)
STEPS, SAVE_AT = 10, 4
SHAPES = (((16, 12), torch.float32), ((16,), torch.float32), ((8, 16), torch.float32), ((12, 8), torch.bfloat16))
CASES = {  # name: (zero_stage, consolidated, inside flushed())
    "zero1_per_rank": (1, False, False),
    "zero2_per_rank_flushed": (2, False, True),
    "zero2_consolidated": (2, True, False),
}


def inputs(rank: int):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES]
    mine = torch.Generator().manual_seed(100 + rank)
    grads = [[torch.randn(shape, generator=mine).to(dtype) for shape, dtype in SHAPES] for _ in range(STEPS)]
    return init, grads


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def steps(params, opt, grads, start, stop, after=None):
    history = []
    for t in range(start, stop):
        for p, grad in zip(params, grads[t], strict=True):
            p.grad = grad.clone()
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in params])
        if after is not None:
            after(t)
    return history


def continued(case: dict) -> list:
    """Load the case's saved dicts into a fresh optimizer and continue: the weights after each later step."""
    params = [torch.nn.Parameter(t.clone()) for t in case["model"]]
    with ZenFlowAdamW(params, **case["hyper"], zenflow=case["zenflow"], zero_stage=case["zero_stage"]) as opt:
        opt.load_state_dict(roundtrip(case["optimizer"]))
        out = steps(params, opt, case["grads"], case["save_at"] + 1, len(case["grads"]))
        opt.flush()
        out.append([p.detach().clone() for p in params])
    return out


def make_case(rank: int, stage: int, consolidated: bool, flushed: bool) -> dict:
    init, grads = inputs(rank)
    params = [torch.nn.Parameter(t.clone()) for t in init]
    saved = {}
    with ZenFlowAdamW(params, **HYPER, zenflow=ZEN, zero_stage=stage) as opt:
        def save(t):
            if t != SAVE_AT:
                return
            with opt.flushed() if flushed else contextlib.nullcontext():
                sd = opt.consolidated_state_dict() if consolidated else opt.state_dict()
                saved.update(model=[p.detach().clone() for p in params], optimizer=roundtrip(sd))

        history = steps(params, opt, grads, 0, STEPS, after=save)
        opt.flush()
        history.append([p.detach().clone() for p in params])
    return dict(version=1, hyper=HYPER, zenflow=ZEN, zero_stage=stage, consolidated=consolidated, flushed=flushed,
                save_at=SAVE_AT, rank=rank, init=init, grads=grads, model=saved["model"],
                optimizer=saved["optimizer"], expected=history[SAVE_AT + 1:])


def make(rank: int, where: Path) -> None:
    for name, (stage, consolidated, flushed) in CASES.items():
        case = make_case(rank, stage, consolidated, flushed)
        if describe(continued(case), case["expected"], SAVE_AT) != "ok":
            raise SystemExit(f"{name}: the resumed run differs here and now: no fixture written")
        torch.save(case, where / f"{name}_rank{rank}.pt")


# -- FSDP2 with torch.distributed.checkpoint ---------------------------------------------------------------------

FSDP2_SHAPES = ((16, 12), (16,), (8, 16))  # fp32: one FSDP2 unit needs one dtype
FSDP2_CASES = {"fsdp2_dcp_inflight": False, "fsdp2_dcp_flushed": True}  # name: saved inside flushed()


class Flat(torch.nn.Module):
    """The parameters only: the steps set their gradients (no forward)."""

    def __init__(self, tensors):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(t.clone()) for t in tensors)


def fsdp2_inputs():
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(shape, generator=g) for shape in FSDP2_SHAPES]
    grads = [[torch.randn(shape, generator=g) for shape in FSDP2_SHAPES] for _ in range(STEPS)]
    return init, grads


def fsdp2_model(tensors):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Flat(tensors)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def fsdp2_steps(model, opt, grads, start, stop, after=None):
    """Steps on stored whole gradients: each rank sets its rows of each (FSDP2's Shard(0) placement)."""
    from torch.distributed.tensor import distribute_tensor

    history = []
    for t in range(start, stop):
        for p, grad in zip(model.parameters(), grads[t], strict=True):
            p.grad = distribute_tensor(grad.clone(), p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()
        history.append([p.full_tensor().detach().clone() for p in model.parameters()])
        if after is not None:
            after(t)
    return history


def fsdp2_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def fsdp2_continued(name: str, where: Path, grads) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model = fsdp2_model([torch.zeros(shape) for shape in FSDP2_SHAPES])  # other weights: the load overwrites them
    with ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZEN) as opt:
        state = fsdp2_state(model, opt)
        dcp.load(state, checkpoint_id=where / name)
        set_model_state_dict(model, state["model"])  # the model first, then the optimizer
        set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])
        out = fsdp2_steps(model, opt, grads, SAVE_AT + 1, STEPS)
        opt.flush()
        out.append([p.full_tensor().detach().clone() for p in model.parameters()])
    return out


def fsdp2_train_and_save(name: str, flushed: bool, where: Path, init, grads) -> list:
    """The run that saves at ``SAVE_AT`` (with torch.distributed.checkpoint) and never stops: its weights."""
    import torch.distributed.checkpoint as dcp

    model = fsdp2_model(init)
    with ZenFlowAdamW(model.parameters(), **HYPER, zenflow=ZEN) as opt:
        def save(t):
            if t == SAVE_AT:
                with opt.flushed() if flushed else contextlib.nullcontext():
                    dcp.save(fsdp2_state(model, opt), checkpoint_id=where / name)

        history = fsdp2_steps(model, opt, grads, 0, STEPS, after=save)
        opt.flush()
        history.append([p.full_tensor().detach().clone() for p in model.parameters()])
    return history


def fsdp2_make(rank: int, where: Path) -> None:
    for name, flushed in FSDP2_CASES.items():
        init, grads = fsdp2_inputs()
        expected = fsdp2_train_and_save(name, flushed, where, init, grads)[SAVE_AT + 1:]
        if describe(fsdp2_continued(name, where, grads), expected, SAVE_AT) != "ok":
            raise SystemExit(f"{name}: the resumed run differs here and now: no fixture written")
        if rank == 0:  # the inputs and expectations are every rank's: one file beside the checkpoint's
            torch.save(dict(version=1, hyper=HYPER, zenflow=ZEN, flushed=flushed, save_at=SAVE_AT, grads=grads,
                            expected=expected), where / name / "case.pt")


def fsdp2_check(where: Path) -> list[str]:
    lines = []
    for name in FSDP2_CASES:
        case = torch.load(where / name / "case.pt", weights_only=False)
        lines.append(f"{name}: {describe(fsdp2_continued(name, where, case['grads']), case['expected'], SAVE_AT)}")
    return lines


def describe(got: list, want: list, save_at: int) -> str:
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        for n, (x, y) in enumerate(zip(a, b, strict=True)):
            if not torch.equal(x, y):
                return f"step {save_at + 1 + k}, parameter {n}: {(x.float() - y.float()).abs().max().item():.3g}"
    return "ok"


def check(rank: int, where: Path, out: Path) -> None:
    lines = []
    for name in CASES:
        case = torch.load(where / f"{name}_rank{rank}.pt", weights_only=False)
        lines.append(f"{name}: {describe(continued(case), case['expected'], case['save_at'])}")
    lines += fsdp2_check(where)
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")


def launch(*args: str, world: int = 2, timeout: float = 300.0) -> None:
    """Run this script on ``world`` gloo ranks with ``args``; a failing rank raises with its stderr."""
    from zenflow_kernels.testing import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, __file__, *args], cwd=root, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        errors = [err for p in procs for _, err in [p.communicate(timeout=timeout)] if p.returncode]
    finally:
        for p in procs:
            p.kill()
    if errors:
        raise RuntimeError(f"a rank failed:\n{errors[0][-3000:]}")


def main() -> int:
    mode, where = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with use_backend("numba"):
        if mode == "make":
            make(rank, where)
            fsdp2_make(rank, where)
        else:
            check(rank, where, Path(sys.argv[3]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
