"""Argument checks shared by every backend of the device ops (``torch_ops`` and ``triton``).

Both backends call these functions first, so a bad input raises the same ``TypeError``/``ValueError``
with the same message whichever implementation runs, and always before anything is written.

Two kinds of checks:

* metadata (types, ranks, shapes, dtypes, devices, contiguity, hyper-parameter ranges): free,
  always run;
* data (indices sorted/unique/in range, per-column step counts >= 1, no NaN scores): these read
  device memory and therefore synchronise with the device once per call. They are batched so that a
  multi-tensor call costs a constant number of small torch launches and one synchronisation, and
  callers that produced the data themselves may skip them (``check_data=False``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPORTANCES = ("l2", "l1")


def _dtypes(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _shape(x: torch.Tensor) -> list[int]:
    return list(x.shape)


def tensor(
    op: str,
    name: str,
    x,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: Sequence[int] | None = None,
    contiguous: bool = False,
    what: str = "",
) -> torch.Tensor:
    """Check one tensor argument; ``what`` explains an expected shape (e.g. ``"[R, k]"``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {x.dtype}; allowed: {_dtypes(dtypes)}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {_shape(x)} ({x.dim()}-D)")
    if shape is not None and tuple(x.shape) != tuple(shape):
        hint = f" {what}" if what else ""
        raise ValueError(f"{op}: {name} must have shape{hint} {list(shape)}, got {_shape(x)}")
    if device is not None and x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device}, but must be on {device} like the other tensors")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (compact state), got strides {list(x.stride())}")
    return x


def importance(op: str, value) -> bool:
    """Return True for "l1", False for "l2"."""
    if not isinstance(value, str) or value not in IMPORTANCES:
        raise ValueError(f"{op}: importance must be one of {IMPORTANCES}, got {value!r}")
    return value == "l1"


def integer(op: str, name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "" if lo is None else f"{lo} <= "
        hi_s = "" if hi is None else f" <= {hi}"
        raise ValueError(f"{op}: {name} must satisfy {lo_s}{name}{hi_s}, got {value}")
    return value


def real(op: str, name: str, value, *, lo: float, hi: float | None = None, lo_open=False, hi_open=True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a Python number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
    if hi is not None:
        ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open or hi is None else "]"
        raise ValueError(f"{op}: {name} must be finite and in {left}{lo}, {'inf' if hi is None else hi}{right}, "
                         f"got {value!r}")
    return value


def same_length(op: str, **lists) -> int:
    lengths = {}
    for name, seq in lists.items():
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
            raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got {type(seq).__name__}")
        lengths[name] = len(seq)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{op}: list arguments must have equal lengths, got "
                         + ", ".join(f"len({n})={v}" for n, v in lengths.items()))
    return next(iter(lengths.values()), 0)


def per_tensor(op: str, name: str, value, n: int) -> list:
    """A scalar broadcast to ``n`` entries, or a list/tuple that must have ``n`` entries."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{op}: {name} must be a scalar or have one entry per tensor ({n}), got {len(value)}")
        return list(value)
    return [value] * n


def common_device(op: str, name: str, tensors: Sequence[torch.Tensor]) -> torch.device | None:
    dev = None
    for i, t in enumerate(tensors):
        tensor(op, f"{name}[{i}]", t)
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise ValueError(f"{op}: {name}[{i}] is on {t.device}, but {name}[0] is on {dev}; "
                             "a multi-tensor call needs all tensors on one device")
    return dev


# ----------------------------------------------------------------------------------------------------
# Per-op metadata checks. Each returns what the launchers need, already normalised.


def fingerprint_args(op: str, tensors, key, out) -> tuple[list, int, torch.Tensor]:
    """``(tensors, key, out)`` of a fingerprint call: fp32/bf16/fp16 tensors on one device (any strides), ``key``
    an integer in ``[0, 2**64)``, ``out`` None (a new int64 ``[n]`` on their device, CPU for an empty list) or an
    int64 contiguous ``[n]`` tensor there."""
    n = same_length(op, tensors=tensors)
    dev = common_device(op, "tensors", tensors)
    for i, t in enumerate(tensors):
        tensor(op, f"tensors[{i}]", t, dtypes=FLOAT_DTYPES)
    if isinstance(key, bool) or not isinstance(key, numbers.Integral) or not 0 <= int(key) < 1 << 64:
        raise ValueError(f"{op}: key={key!r} is invalid: allowed an integer in [0, 2**64)")
    if out is None:
        out = torch.zeros(n, dtype=torch.int64, device=dev if dev is not None else "cpu")
    else:
        tensor(op, "out", out, dtypes=(torch.int64,), shape=(n,), device=dev, contiguous=True, what="[len(tensors)]")
    return list(tensors), int(key), out


def scores_input(op: str, name: str, grad, imp) -> bool:
    tensor(op, name, grad, ndim=2, dtypes=FLOAT_DTYPES)
    return importance(op, imp)


def topk_input(op: str, name: str, scores, k) -> int:
    tensor(op, name, scores, ndim=1, dtypes=FLOAT_DTYPES)
    return integer(op, "k" if name == "scores" else f"k for {name}", k, lo=0, hi=scores.shape[0])


def hyper(op: str, *, lr, beta1, beta2, eps, weight_decay, grad_scale, i: int | None = None) -> tuple[float, ...]:
    """AdamW hyper-parameters; ``i`` names the per-tensor entries of a multi call (``lrs[i]``, ...)."""
    lr_name = "lr" if i is None else f"lrs[{i}]"
    wd_name = "weight_decay" if i is None else f"weight_decays[{i}]"
    return (
        real(op, lr_name, lr, lo=0.0, hi=None),
        real(op, "beta1", beta1, lo=0.0, hi=1.0),
        real(op, "beta2", beta2, lo=0.0, hi=1.0),
        real(op, "eps", eps, lo=0.0, hi=None),
        real(op, wd_name, weight_decay, lo=0.0, hi=None),
        real(op, "grad_scale", grad_scale, lo=0.0, hi=None, lo_open=True),
    )


_SINGLE_NAMES = ("param", "grad", "indices", "exp_avg", "exp_avg_sq", "master", "step")
_MULTI_NAMES = ("params", "grads", "indices_list", "exp_avgs", "exp_avg_sqs", "masters", "steps")


def adamw_input(op: str, i: int | None, param, grad, indices, exp_avg, exp_avg_sq, master, step):
    """Check one tensor's selective-AdamW arguments; ``i`` is None, or the position in a multi call
    (errors then name the list entry, e.g. ``exp_avgs[3]``).

    Returns ``(k, step)`` where ``step`` is an int or the validated int64 tensor.
    """
    n_p, n_g, n_i, n_m, n_v, n_w, n_s = _SINGLE_NAMES if i is None else (f"{n}[{i}]" for n in _MULTI_NAMES)
    p = tensor(op, n_p, param, ndim=2, dtypes=FLOAT_DTYPES)
    R, C = p.shape
    dev = p.device
    tensor(op, n_g, grad, dtypes=FLOAT_DTYPES, device=dev, shape=(R, C), what="(same as param)")
    if indices is None:
        k = C
    else:
        tensor(op, n_i, indices, ndim=1, dtypes=(torch.int64,), device=dev)
        k = indices.shape[0]
        if k > C:
            raise ValueError(f"{op}: {n_i} has {k} entries but {n_p} has only C={C} columns; "
                             "indices must be unique column numbers in [0, C)")
    what = "[R, C] (dense update, indices=None)" if indices is None else "[R, k] (k = len(indices))"
    for name, t in ((n_m, exp_avg), (n_v, exp_avg_sq)):
        tensor(op, name, t, dtypes=(torch.float32,), device=dev, shape=(R, k), contiguous=True, what=what)
    if master is not None:
        tensor(op, n_w, master, dtypes=(torch.float32,), device=dev, shape=(R, k), contiguous=True, what=what)
    if isinstance(step, torch.Tensor):
        tensor(op, n_s, step, ndim=1, dtypes=(torch.int64,), device=dev, shape=(k,),
               what="[k] (one count per selected column)")
    else:
        step = integer(op, n_s, step, lo=1)
    _no_alias(op, {n_p: param, n_m: exp_avg, n_v: exp_avg_sq, n_w: master})
    return k, step


def _no_alias(op: str, tensors: dict) -> None:
    seen: dict[int, str] = {}
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            raise ValueError(f"{op}: {name} shares memory with {seen[ptr]}; each must be its own tensor")
        seen[ptr] = name


# ----------------------------------------------------------------------------------------------------
# Data checks: one batched device round trip for any number of tensors.


def data(
    op: str,
    *,
    indices: Sequence[tuple[str, torch.Tensor, int]] = (),
    steps: Sequence[tuple[str, torch.Tensor]] = (),
    scores: Sequence[tuple[str, torch.Tensor]] = (),
) -> None:
    """Raise if any index tensor is not strictly increasing in [0, C), any step tensor holds a count < 1,
    or any score is NaN. ``indices`` entries are ``(name, tensor, C)``.

    A constant number of torch launches and a single synchronisation, whatever the number of tensors;
    on failure a slow per-tensor pass finds the first offender and names it.
    """
    flags = []
    idx = [(n, t, c) for n, t, c in indices if t.numel() > 0]
    if idx:
        dev = idx[0][1].device
        flat = torch.cat([t for _, t, _ in idx])
        ks = [t.numel() for _, t, _ in idx]
        bound = torch.repeat_interleave(
            torch.tensor([c for _, _, c in idx], dtype=torch.int64, device=dev),
            torch.tensor(ks, dtype=torch.int64, device=dev),
            output_size=flat.numel(),
        )
        bad = ((flat < 0) | (flat >= bound)).any()
        if flat.numel() > 1:
            starts = torch.zeros(flat.numel() - 1, dtype=torch.bool, device=dev)
            # pair i compares flat[i + 1] with flat[i]; the pairs that cross a tensor boundary are exempt
            offs = torch.tensor(ks[:-1], dtype=torch.int64, device=dev).cumsum(0) - 1
            starts[offs] = True
            bad = bad | ((flat[1:] <= flat[:-1]) & ~starts).any()
        flags.append(bad)
    st = [(n, t) for n, t in steps if t.numel() > 0]
    if st:
        flags.append((torch.cat([t for _, t in st]) < 1).any())
    sc = [(n, t) for n, t in scores if t.numel() > 0]
    if sc:
        flags.append(torch.cat([t.reshape(-1) for _, t in sc]).isnan().any())
    if not flags or not bool(torch.stack(flags).any()):
        return
    for name, t, c in idx:
        _explain_indices(op, name, t, c)
    for name, t in st:
        if bool((t < 1).any()):
            pos = int(torch.nonzero(t < 1)[0, 0])
            raise ValueError(f"{op}: {name} must hold step counts >= 1 (1-based), got {int(t[pos])} at position {pos}")
    for name, t in sc:
        if bool(t.isnan().any()):
            pos = int(torch.nonzero(t.isnan())[0, 0])
            raise ValueError(f"{op}: {name} holds NaN (first at column {pos}); scores must not be NaN "
                             "(skip non-finite steps before selecting)")
    raise AssertionError(f"{op}: a data check failed but no offender was found")  # pragma: no cover


def _explain_indices(op: str, name: str, t: torch.Tensor, C: int) -> None:
    out = (t < 0) | (t >= C)
    if bool(out.any()):
        pos = int(torch.nonzero(out)[0, 0])
        raise ValueError(f"{op}: {name} holds {int(t[pos])} at position {pos}; indices must be in [0, C) = [0, {C})")
    if t.numel() > 1:
        d = t[1:] - t[:-1]
        if bool((d == 0).any()):
            pos = int(torch.nonzero(d == 0)[0, 0])
            raise ValueError(f"{op}: {name} holds the duplicate {int(t[pos])} at positions {pos} and {pos + 1}; "
                             "indices must be unique and sorted ascending")
        if bool((d < 0).any()):
            pos = int(torch.nonzero(d < 0)[0, 0])
            raise ValueError(f"{op}: {name} is not sorted ascending: {int(t[pos])} at position {pos} is followed "
                             f"by {int(t[pos + 1])}")
