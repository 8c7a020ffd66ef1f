"""The CPU fast path: selective AdamW in one fused numba pass per tensor (``ops`` on CPU tensors).

The contract is ``torch_ops.selective_adamw_`` / ``multi_selective_adamw_`` (the torch reference
beside it): the same validation (shared ``_validate`` code, the same errors, raised before any write),
the same math and operation order, fp32 arithmetic. Where the torch path runs ~15 tensor ops per
parameter (gather, lerp, sqrt, ..., scatter), this reads and writes each selected element once:
gather from the parameter, update the compact state, scatter back, with the row loop threaded.

Limits: the parameter must be contiguous and row-major; the gradient contiguous (a strided gradient
goes through the torch path, which reads any strides). Per-column step counts become per-column
float32 coefficients computed in float64 by torch (one small vector op per tensor).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import torch_ops
from . import _common as C
from ._kernels import selective_adam_kernel


def _coefficients(step, lr: float, beta1: float, beta2: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(-lr / (1 - beta1**s), sqrt(1 - beta2**s)) per column, float32 [k], from float64 as torch does
    (numpy: these are tiny vectors, where torch's per-op overhead would dominate)."""
    if isinstance(step, torch.Tensor):
        s = step.numpy().astype(np.float64)
        return (-lr / (1 - beta1**s)).astype(np.float32), np.sqrt(1 - beta2**s).astype(np.float32)
    neg_step_size = -lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5
    return np.full(k, neg_step_size, dtype=np.float32), np.full(k, bc2_sqrt, dtype=np.float32)


def _fusable(param: torch.Tensor, grad: torch.Tensor) -> bool:
    return param.device.type == "cpu" and param.is_contiguous() and grad.is_contiguous()


def _launch(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, wd, grad_scale):
    R, Ccols = param.shape
    k = exp_avg.shape[1]
    if R * k == 0:
        return
    if not _fusable(param, grad):
        torch_ops._adamw(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, wd,
                         grad_scale)
        return
    neg_step_size, bc2_sqrt = _coefficients(step, lr, beta1, beta2, k)
    C.launch(
        selective_adam_kernel,
        R * k,
        0,
        C.as_numpy(param),
        C.as_numpy(grad),
        None if indices is None else indices.numpy(),
        C.as_numpy(exp_avg),
        C.as_numpy(exp_avg_sq),
        None if master is None else C.as_numpy(master),
        R,
        Ccols,
        grad_scale,
        1.0 - lr * wd,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        neg_step_size,
        bc2_sqrt,
    )
    C.bump_versions(param, exp_avg, exp_avg_sq, master)


def selective_adamw_(param, grad, indices, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                     master=None, grad_scale=1.0, check_data: bool = True) -> None:
    """``ops.selective_adamw_`` for CPU tensors (see there for the contract)."""
    step, hp = torch_ops.adamw_args(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps,
                                    weight_decay, grad_scale, check_data)
    _launch(param, grad, indices, exp_avg, exp_avg_sq, master, step, *hp)


def multi_selective_adamw_(params, grads, indices_list, exp_avgs, exp_avg_sqs, *, steps, lrs, beta1, beta2, eps,
                           weight_decays, masters=None, grad_scale=1.0, check_data: bool = True) -> None:
    """``ops.multi_selective_adamw_`` for CPU tensors: every tensor validated first, then one fused pass
    each."""
    items, (beta1, beta2, eps, grad_scale) = torch_ops.multi_adamw_args(
        "multi_selective_adamw_", params, grads, indices_list, exp_avgs, exp_avg_sqs, steps, lrs, beta1, beta2, eps,
        weight_decays, masters, grad_scale, check_data)
    for p, g, idx, m, v, w, s, lr, wd in items:
        _launch(p, g, idx, m, v, w, s, lr, beta1, beta2, eps, wd, grad_scale)
