"""DeepSpeed as a baseline in the GPU end-to-end benchmark (optional: used only when it imports).

:class:`Engine` wraps ``deepspeed.initialize`` (ZeRO stage 2 with the optimizer offloaded to the CPU,
with or without DeepSpeed's own ZenFlow block) behind what ``bench.e2e_core.train_run`` calls of an
optimizer: ``backward(loss)``, ``step()``, ``zero_grad()``, ``close()``. One process, world size 1.
DeepSpeed is never a dependency of the library: nothing under ``zenflow_kernels`` imports it.
"""

from __future__ import annotations

import os

import torch

from zenflow_kernels.testing import free_port


def unavailable() -> str | None:
    """None when deepspeed imports here, else why not (one line)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or its own start-up failing (no compiler, no CUDA toolkit)
        return f"deepspeed does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def ds_config(*, batch: int, lr: float, weight_decay: float, zenflow: dict | None) -> dict:
    """ZeRO-2, optimizer state on the CPU (pinned), fp32 parameters (the benchmark's forward runs under
    torch's bf16 autocast, as for every other run), AdamW with the benchmark's numbers, no clipping;
    ``zenflow``: DeepSpeed's ``zero_optimization.zenflow`` block, or None for plain ZeRO-Offload."""
    zero = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if zenflow is not None:
        zero["zenflow"] = dict(zenflow)
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": weight_decay}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Engine:
    """A DeepSpeed engine driven like a torch optimizer by ``train_run``."""

    def __init__(self, model: torch.nn.Module, config: dict, prep):
        import deepspeed
        import torch.distributed as dist

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
