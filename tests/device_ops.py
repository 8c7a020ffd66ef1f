"""Every public op, as a call on tensors made on a given device from fixed seeds (shared by
tests/test_triton_devices.py and tests/test_gpu_devices.py). Each call returns the tensors it produced
or updated, on their device, so the same call on two devices can be compared."""

from __future__ import annotations

import torch

from zenflow_kernels import ops


def _randn(shape, seed, device, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _adamw_state(R, C, k, seed, device, dtype):
    """(param, grad, indices, exp_avg, exp_avg_sq, master, per-column steps) of one selective update."""
    return (_randn((R, C), seed, device, dtype), _randn((R, C), seed + 1, device, dtype),
            torch.arange(0, C, C // k, device=device)[:k].contiguous(), _randn((R, k), seed + 2, device).abs(),
            _randn((R, k), seed + 3, device).abs(), _randn((R, k), seed + 4, device),
            torch.arange(1, k + 1, device=device))


HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _column_scores(device):
    tall = _randn((1100, 45), 0, device)  # tall enough to split over rows: two launches
    return [ops.column_scores(tall), ops.column_scores(_randn((40, 9), 1, device).t(), "l1")]


def _multi_column_scores(device):
    return ops.multi_column_scores([_randn((1100, 20), 2, device), _randn((5, 300), 3, device, torch.bfloat16)])


def _topk_columns(device):
    return [ops.topk_columns(_randn((300,), 4, device), 17)]


def _multi_topk_columns(device):
    return ops.multi_topk_columns([_randn((300,), 5, device), _randn((70,), 6, device, torch.bfloat16)], [17, 3])


def _selective_adamw(device):
    p, g, idx, m, v, w, steps = _adamw_state(24, 40, 5, 7, device, torch.bfloat16)
    ops.selective_adamw_(p, g, idx, m, v, step=steps, weight_decay=0.1, master=w, **HYPER)
    return [p, m, v, w]


def _multi_selective_adamw(device):
    a = _adamw_state(24, 40, 5, 8, device, torch.bfloat16)
    b = _adamw_state(1, 64, 64, 9, device, torch.float32)[:5]  # a vector viewed as [1, n], dense
    ops.multi_selective_adamw_([a[0], b[0]], [a[1], b[1]], [a[2], None], [a[3], b[3]], [a[4], b[4]],
                               steps=[a[6], 3], lrs=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"],
                               eps=HYPER["eps"], weight_decays=[0.1, 0.0], masters=[a[5], None])
    return [a[0], a[3], a[4], a[5], b[0], b[3], b[4]]


def _multi_selective_adamw_items(device):
    p, g, idx, m, v, w, steps = _adamw_state(12, 30, 3, 10, device, torch.float32)
    ops.multi_selective_adamw_items_([(p, g, idx, m, v, None, 4, HYPER["lr"], 0.05)], beta1=HYPER["beta1"],
                                     beta2=HYPER["beta2"], eps=HYPER["eps"], grad_scale=2.0)
    return [p, m, v]


#: name -> call(device) -> list of tensors; together they launch every Triton kernel of the package
OP_CALLS = {
    "column_scores": _column_scores,
    "multi_column_scores": _multi_column_scores,
    "topk_columns": _topk_columns,
    "multi_topk_columns": _multi_topk_columns,
    "selective_adamw_": _selective_adamw,
    "multi_selective_adamw_": _multi_selective_adamw,
    "multi_selective_adamw_items_": _multi_selective_adamw_items,
}
