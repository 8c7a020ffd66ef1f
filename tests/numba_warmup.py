"""Compile and cache the numba kernels the suite uses, once, before pytest-xdist starts its workers (conftest.py).

numba's on-disk cache is not safe to create from several processes at once (numba/numba#4807: a process can load
another's half-written entry and crash with SIGSEGV). With two pytest workers and their rank processes starting
from a fresh clone, the first uses of a kernel would otherwise race. Run here, once, they are written before any
other process starts; later processes only read them."""

from __future__ import annotations

import contextlib
import tempfile
import warnings

import torch

from zenflow_kernels import ZenFlowAdamW, cpu_ops
from zenflow_kernels.config import ZenFlowWarning
from zenflow_kernels.ops import use_backend
from zenflow_kernels.testing import chaos


def warm() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings(), use_backend("numba"):  # (the CPU fast path's numba kernels too)
        warnings.simplefilter("ignore", ZenFlowWarning)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # every copy-out and gradient dtype through the host update, accumulation, the fused last gradient,
            # clipping (sum of squares), the selective CPU fast path, fingerprints on the asynchronous link
            for settings in (dict(overlap_step=False), dict(overlap_step=True), dict(device_accumulation=True)):
                for asynchronous in (False, True):
                    params = [torch.nn.Parameter(torch.randn(64, 1100).to(dtype)), torch.nn.Parameter(
                        torch.randn(64).to(dtype))]
                    zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=2, update_interval=2,
                               full_warm_up_rounds=1, **settings)
                    with chaos(seed=0, max_delay=0) if asynchronous else contextlib.nullcontext():
                        opt = ZenFlowAdamW(params, zenflow=zen, max_grad_norm=1.0)
                    with opt:
                        for _ in range(4):
                            for p in params:
                                p.grad = torch.randn_like(p)
                            opt.step()
            with tempfile.TemporaryDirectory() as folder:  # the state on disk: the streamed update
                params = [torch.nn.Parameter(torch.randn(64, 1100).to(dtype))]
                zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=2, update_interval=2,
                           offload_device="nvme", nvme_path=folder, overlap_step=True)
                with ZenFlowAdamW(params, zenflow=zen) as opt:
                    for _ in range(3):
                        params[0].grad = torch.randn_like(params[0])
                        opt.step()
            x = torch.randn(1000).to(dtype)
            cpu_ops.sum_squares(x)


if __name__ == "__main__":
    warm()
