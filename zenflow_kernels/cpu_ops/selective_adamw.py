"""The CPU fast path: selective AdamW as fused numba kernels (``ops`` on CPU tensors).

The contract is ``torch_ops.selective_adamw_`` / ``multi_selective_adamw_`` (the torch reference
beside it): the same validation (shared ``_validate`` code, the same errors, raised before any write),
the same math and operation order, fp32 arithmetic. Where the torch path runs ~15 tensor ops per
parameter (gather, lerp, sqrt, ..., scatter), this reads and writes each selected element once:
gather from the parameter, update the compact state, scatter back, with the row loop threaded. The
multi-tensor form is one launch per combination of dtypes (usually one for the whole model) over a
table of tensor addresses: per-tensor Python work is a table row, not a kernel call (~100 us each).

Limits: the parameter must be contiguous and row-major; the gradient contiguous (a strided gradient
goes through the torch path, which reads any strides). Per-column step counts become per-column
float32 coefficients computed in float64 by numpy (in the multi-tensor form, one vectorised pass
for all tensors).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import torch_ops
from . import _common as C
from ._kernels import T_COEF, T_K, T_ROWS, multi_selective_adam_kernel, selective_adam_kernel

MULTI_BLOCK = 2048
"""Selected columns per work item of the multi-tensor kernel: a row of a matrix, or a block of a long
vector, so that one large vector parallelises like a tall matrix."""

_PROTO = {torch.float32: np.empty(0, np.float32), torch.bfloat16: np.empty(0, np.int16),
          torch.float16: np.empty(0, np.uint16)}  # element types of the bit views (see _common.as_numpy)


def _coefficients(step, lr: float, beta1: float, beta2: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(-lr / (1 - beta1**s), sqrt(1 - beta2**s)) per column, float32 [k], from float64 as torch does
    (numpy: these are tiny vectors, where torch's per-op overhead would dominate)."""
    if isinstance(step, torch.Tensor):
        return _column_coefficients(step.numpy().astype(np.float64), lr, beta1, beta2)
    neg_step_size = -lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5
    return np.full(k, neg_step_size, dtype=np.float32), np.full(k, bc2_sqrt, dtype=np.float32)


def _column_coefficients(s: np.ndarray, lr, beta1: float, beta2: float) -> tuple[np.ndarray, np.ndarray]:
    """The coefficients of float64 per-column step counts ``s`` (``lr`` a number or one per column)."""
    return (-lr / (1 - beta1**s)).astype(np.float32), np.sqrt(1 - beta2**s).astype(np.float32)


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
    """``ops.multi_selective_adamw_`` for CPU tensors: every tensor validated first, then one kernel launch
    per combination of (param dtype, grad dtype, master or not); a tensor whose parameter or gradient is
    strided goes through the torch path."""
    items, (beta1, beta2, eps, grad_scale) = torch_ops.multi_adamw_args(
        "multi_selective_adamw_", params, grads, indices_list, exp_avgs, exp_avg_sqs, steps, lrs, beta1, beta2, eps,
        weight_decays, masters, grad_scale, check_data)
    multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale)


def multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale) -> None:
    """The launches of ``multi_selective_adamw_`` for items as ``torch_ops.multi_adamw_args`` returns them."""
    groups: dict[tuple, list] = {}
    for item in items:
        p, g, idx, m, v, w, s, lr, wd = item
        if p.shape[0] * m.shape[1] == 0:
            continue
        if not _fusable(p, g):
            _launch(p, g, idx, m, v, w, s, lr, beta1, beta2, eps, wd, grad_scale)
            continue
        groups.setdefault((p.dtype, g.dtype, w is None), []).append(item)
    for group in groups.values():
        _launch_group(group, beta1, beta2, eps, grad_scale)


def _launch_group(items, beta1, beta2, eps, grad_scale) -> None:
    """One multi-tensor kernel launch for tensors of the same dtypes (all contiguous, none empty)."""
    keep = []  # contiguous copies of strided indices must outlive the launch
    rows = []
    for p, g, idx, m, v, w, *_ in items:
        if idx is not None and not idx.is_contiguous():
            idx = idx.contiguous()
            keep.append(idx)
        rows.append((p.data_ptr(), g.data_ptr(), 0 if idx is None else idx.data_ptr(), m.data_ptr(), v.data_ptr(),
                     0 if w is None else w.data_ptr(), p.shape[0], p.shape[1], m.shape[1], 0))
    table = np.array(rows, dtype=np.int64)
    ks = table[:, T_K]
    np.cumsum(ks[:-1], out=table[1:, T_COEF])
    chunk_starts = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(table[:, T_ROWS] * ((ks + MULTI_BLOCK - 1) // MULTI_BLOCK), out=chunk_starts[1:])
    neg_step_size, bc2_sqrt = _group_coefficients(items, ks, table[:, T_COEF], beta1, beta2)
    decay = np.array([1.0 - it[7] * it[8] for it in items], dtype=np.float64)
    p0, g0, w0 = items[0][0], items[0][1], items[0][5]
    C.launch(
        multi_selective_adam_kernel,
        int((table[:, T_ROWS] * ks).sum()),
        0,
        table,
        chunk_starts,
        decay,
        neg_step_size,
        bc2_sqrt,
        _PROTO[p0.dtype],
        _PROTO[g0.dtype],
        None if w0 is None else _PROTO[torch.float32],
        MULTI_BLOCK,
        grad_scale,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
    )
    C.bump_versions(*(t for p, _, _, m, v, w, *_ in items for t in (p, m, v, w)))


def _group_coefficients(items, ks, coef_base, beta1, beta2) -> tuple[np.ndarray, np.ndarray]:
    """Every tensor's per-column coefficients, concatenated (float32 [sum k]): the values of
    ``_coefficients``, with one computation per distinct (step, lr) and one vectorised pass over all
    per-column step counts."""
    scalar: dict[tuple, tuple[float, float]] = {}
    neg, bc2, per_column = [], [], []
    for t, (*_, step, lr, _) in enumerate(items):
        if isinstance(step, torch.Tensor):
            per_column.append(t)
            neg.append(0.0)
            bc2.append(0.0)
            continue
        key = (step, lr)
        if key not in scalar:
            a, b = _coefficients(step, lr, beta1, beta2, 1)
            scalar[key] = (float(a[0]), float(b[0]))
        neg.append(scalar[key][0])
        bc2.append(scalar[key][1])
    neg_step_size = np.repeat(np.array(neg, dtype=np.float32), ks)
    bc2_sqrt = np.repeat(np.array(bc2, dtype=np.float32), ks)
    if per_column:
        s = torch.cat([items[t][6] for t in per_column]).numpy().astype(np.float64)
        lr = np.repeat(np.array([items[t][7] for t in per_column], dtype=np.float64), ks[per_column])
        where = np.concatenate([np.arange(coef_base[t], coef_base[t] + ks[t]) for t in per_column])
        neg_step_size[where], bc2_sqrt[where] = _column_coefficients(s, lr, beta1, beta2)
    return neg_step_size, bc2_sqrt
