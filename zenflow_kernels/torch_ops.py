"""The torch implementation of the device ops: the library's reference beside the Triton fast path.

Same contract, same validation (``_validate``) and same errors as ``zenflow_kernels.triton``; used
as the CPU path by ``ops`` and as the oracle the kernels are tested against. Vectorised torch, no
Python loops over elements; the multi-tensor forms loop over tensors (one op per tensor) after
validating all of them. Docstrings with shapes and effects live on the public wrappers in ``ops``.
"""

from __future__ import annotations

import torch

from . import _validate as V
from ._memory import transient_empty

__all__ = [  # ops' contract, but multi_selective_adamw_: ops validates with multi_adamw_args, then runs the items
    "column_scores", "topk_columns", "selective_adamw_", "multi_column_scores", "multi_topk_columns",
    "multi_adamw_args", "multi_selective_adamw_items_", "multi_fingerprint", "multi_fingerprint_unchecked",
]


def _scores(grad: torch.Tensor, l1: bool) -> torch.Tensor:
    if grad.device.type == "cpu" and grad.is_contiguous():
        # the fp32 values and the contiguous sum below, in one transient temporary instead of two heap ones
        g = transient_empty(grad.numel(), torch.float32).view(grad.shape).copy_(grad)
        return (g.abs_() if l1 else g.mul_(g)).sum(dim=0, dtype=torch.float32)
    g = grad.float()
    return (g.abs() if l1 else g * g).sum(dim=0, dtype=torch.float32)


def column_scores(grad: torch.Tensor, importance: str = "l2") -> torch.Tensor:
    l1 = V.scores_input("column_scores", "grad", grad, importance)
    return _scores(grad, l1)


def multi_column_scores(grads, importance: str = "l2") -> list[torch.Tensor]:
    op = "multi_column_scores"
    V.same_length(op, grads=grads)
    V.common_device(op, "grads", grads)
    l1 = V.importance(op, importance)
    for i, g in enumerate(grads):
        V.scores_input(op, f"grads[{i}]", g, importance)
    return [_scores(g, l1) for g in grads]


def _topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Threshold selection: the k-th largest value T, every score > T, then the lowest-index ties."""
    C = scores.shape[0]
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    if k == C:
        return torch.arange(C, dtype=torch.int64, device=scores.device)
    s = scores.float()  # -0.0 == +0.0 under IEEE comparisons, as required
    thresh = torch.topk(s, k, sorted=False).values.min()
    gt = s > thresh
    eq = s == thresh
    need = k - gt.sum()
    take = gt | (eq & (eq.cumsum(0) <= need))
    return torch.nonzero(take).reshape(-1)


def topk_columns(scores: torch.Tensor, k: int, *, check_data: bool = True) -> torch.Tensor:
    k = V.topk_input("topk_columns", "scores", scores, k)
    if check_data:
        V.data("topk_columns", scores=[("scores", scores)])
    return _topk(scores, k)


def multi_topk_columns(scores_list, ks, *, check_data: bool = True) -> list[torch.Tensor]:
    op = "multi_topk_columns"
    V.same_length(op, scores_list=scores_list, ks=ks)
    V.common_device(op, "scores_list", scores_list)
    ks = [V.topk_input(op, f"scores_list[{i}]", s, k) for i, (s, k) in enumerate(zip(scores_list, ks, strict=True))]
    if check_data:
        V.data(op, scores=[(f"scores_list[{i}]", s) for i, s in enumerate(scores_list)])
    return [_topk(s, k) for s, k in zip(scores_list, ks, strict=True)]


def _adamw(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, wd, grad_scale):
    """The step of torch.optim.AdamW(foreach=False) on the selected columns, fp32 math."""
    if exp_avg.numel() == 0:
        return
    if indices is None:
        g = grad.float()
        p_sel = param
    else:
        g = grad.index_select(1, indices).float()
        p_sel = param.index_select(1, indices)
    g = g / grad_scale
    if master is not None:
        w = master
    elif p_sel.dtype == torch.float32 and indices is None:
        w = param  # dense fp32: update the parameter itself
    else:
        w = p_sel.float()
    if wd != 0:
        w.mul_(1 - lr * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if isinstance(step, torch.Tensor):
        s = step.double()
        step_size = (lr / (1 - beta1**s)).float()
        bc2_sqrt = (1 - beta2**s).sqrt().float()
        denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
        w.add_(-step_size * exp_avg / denom)
    else:
        step_size = lr / (1 - beta1**step)
        bc2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
        w.addcdiv_(exp_avg, denom, value=-step_size)
    if w is param:
        return
    if indices is None:
        param.copy_(w)
    else:
        param.index_copy_(1, indices, w.to(param.dtype))


def selective_adamw_(
    param,
    grad,
    indices,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    master=None,
    grad_scale=1.0,
    check_data: bool = True,
) -> None:
    step, hp = adamw_args(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps,
                          weight_decay, grad_scale, check_data)
    _adamw(param, grad, indices, exp_avg, exp_avg_sq, master, step, *hp)


def adamw_args(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, weight_decay,
               grad_scale, check_data):
    """Validate a single-tensor selective AdamW call (shared with the numba launcher).

    Returns ``(step, (lr, beta1, beta2, eps, weight_decay, grad_scale))``, step an int or the validated tensor.
    """
    op = "selective_adamw_"
    hp = V.hyper(op, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    _, step = V.adamw_input(op, None, param, grad, indices, exp_avg, exp_avg_sq, master, step)
    if check_data:
        V.data(
            op,
            indices=[] if indices is None else [("indices", indices, param.shape[1])],
            steps=[("step", step)] if isinstance(step, torch.Tensor) else [],
        )
    return step, hp


def multi_adamw_args(op, params, grads, indices_list, exp_avgs, exp_avg_sqs, steps, lrs, beta1, beta2, eps,
                     weight_decays, masters, grad_scale, check_data):
    """Validate every tensor of a multi-tensor AdamW call (shared with the Triton launcher).

    Returns ``(items, (beta1, beta2, eps, grad_scale))`` with one tuple per tensor:
    ``(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, weight_decay)``.
    """
    n = V.same_length(op, params=params, grads=grads, indices_list=indices_list, exp_avgs=exp_avgs,
                      exp_avg_sqs=exp_avg_sqs)
    masters = [None] * n if masters is None else masters
    V.same_length(op, params=params, masters=masters)
    steps = V.per_tensor(op, "steps", steps, n)
    lrs = V.per_tensor(op, "lrs", lrs, n)
    wds = V.per_tensor(op, "weight_decays", weight_decays, n)
    V.common_device(op, "params", params)
    items = []
    common = None
    for i in range(n):
        hp = V.hyper(op, lr=lrs[i], beta1=beta1, beta2=beta2, eps=eps, weight_decay=wds[i], grad_scale=grad_scale,
                     i=i)
        common = (hp[1], hp[2], hp[3], hp[5])
        _, step = V.adamw_input(op, i, params[i], grads[i], indices_list[i], exp_avgs[i], exp_avg_sqs[i],
                                masters[i], steps[i])
        items.append((params[i], grads[i], indices_list[i], exp_avgs[i], exp_avg_sqs[i], masters[i], step, hp[0],
                      hp[4]))
    if common is None:
        common = V.hyper(op, lr=0.0, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0, grad_scale=grad_scale)
        common = (common[1], common[2], common[3], common[5])
    if check_data:
        V.data(
            op,
            indices=[(f"indices_list[{i}]", it[2], it[0].shape[1]) for i, it in enumerate(items) if it[2] is not None],
            steps=[(f"steps[{i}]", it[6]) for i, it in enumerate(items) if isinstance(it[6], torch.Tensor)],
        )
    return items, common


def multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale) -> None:
    """The work of ``ops.multi_selective_adamw_`` on items as :func:`multi_adamw_args` (its validation, every
    backend's) returns them."""
    for p, g, idx, m, v, w, step, lr, wd in items:
        _adamw(p, g, idx, m, v, w, step, lr, beta1, beta2, eps, wd, grad_scale)


# -- fingerprints (docs/design.md section 5.1) ----------------------------------------------------------------
# int64 arithmetic wraps modulo 2**64 like uint64; only the right shifts differ (arithmetic on int64), so each is
# masked to the bits a logical shift keeps.

FMIX_1 = 0xFF51AFD7ED558CCD - (1 << 64)  # murmur3's fmix64 multipliers, as the int64 with their bits
FMIX_2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_LOW31 = (1 << 31) - 1  # what survives a logical right shift by 33


def _words(x: torch.Tensor) -> torch.Tensor:
    """The tensor's 32-bit words (row-major; 2-byte elements in pairs, low half first), as int64 in [0, 2**32)."""
    flat = x.reshape(-1)
    if x.element_size() == 4:
        return flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = flat.view(torch.int16).to(torch.int64) & 0xFFFF
    if bits.numel() % 2:
        bits = torch.cat([bits, bits.new_zeros(1)])
    return bits[0::2] | (bits[1::2] << 16)


def _fingerprint(x: torch.Tensor, key: int) -> torch.Tensor:
    words = _words(x)
    z = torch.arange(words.numel(), dtype=torch.int64, device=x.device) + (key - (1 << 64) if key >> 63 else key)
    z = z ^ ((z >> 33) & _LOW31)
    z = z * FMIX_1
    z = z ^ ((z >> 33) & _LOW31)
    z = z * FMIX_2
    z = z ^ ((z >> 33) & _LOW31)
    return (words * (z | 1)).sum()


def multi_fingerprint(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    tensors, key, out = V.fingerprint_args("multi_fingerprint", tensors, key, out)
    return multi_fingerprint_unchecked(tensors, key, out=out)


def multi_fingerprint_unchecked(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`multi_fingerprint` for a caller that checked its arguments (a non-empty list when ``out`` is None)."""
    if out is None:
        out = torch.zeros(len(tensors), dtype=torch.int64, device=tensors[0].device)
    for n, x in enumerate(tensors):
        out[n] = _fingerprint(x, key)
    return out
