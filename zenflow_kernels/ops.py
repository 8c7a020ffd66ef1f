"""The device ops of ZenFlow's fast path: column scores, top-k column selection, selective AdamW, and the other
update rules' fused steps (``fused_kernels``: Adam, Lion and SGD on the selected columns, for
``zenflow_kernels.rules``).

This module is the single dispatch point; callers never branch on the implementation:

* CUDA tensors                                  -> Triton kernels (``zenflow_kernels.triton``)
* CPU tensors                                   -> "numba": the AdamW ops as fused numba kernels,
                                                   the multi-tensor form in one launch
                                                   (``cpu_ops.selective_adamw``), scores and top-k
                                                   in vectorised torch
* CPU tensors with ``TRITON_INTERPRET=1`` set   -> the Triton kernels, interpreted (tests)
* any other device                              -> torch

``use_backend("torch" | "numba" | "triton" | "auto")`` overrides that choice; "torch" is the plain
torch implementation of every op (``zenflow_kernels.torch_ops``, the reference beside the fast
paths). ``triton`` is imported lazily, on the first call that needs it, so this module imports where
triton is missing (then "auto" uses numba/torch and "triton" raises a ``RuntimeError`` saying why).

Every implementation validates with the same code (``zenflow_kernels._validate``): the same
``TypeError``/``ValueError`` for the same bad input, always raised before anything is written; the
multi-tensor forms validate every tensor before launching anything. Checks that read device data
(index order and range, per-column step counts, NaN scores) synchronise with the device once per call;
``check_data=False`` skips them for callers that produced the data themselves.
"""

from __future__ import annotations

import contextvars
import inspect
import os
from types import SimpleNamespace

import torch

from . import torch_ops

__all__ = [
    "column_scores",
    "topk_columns",
    "selective_adamw_",
    "multi_column_scores",
    "multi_topk_columns",
    "multi_selective_adamw_",
    "multi_fingerprint",
    "use_backend",
]

BACKENDS = ("auto", "torch", "numba", "triton")
_backend: contextvars.ContextVar[str] = contextvars.ContextVar("zenflow_kernels_backend", default="auto")
_triton_impl: SimpleNamespace | None = None
_numba_impl: SimpleNamespace | None = None
_triton_error: BaseException | None = None


class use_backend:
    """Force the implementation of every op in ``zenflow_kernels.ops``: "torch", "numba", "triton" or "auto".

    As a context manager the choice holds for the block and the previous one is restored on exit::

        with use_backend("torch"):
            scores = column_scores(grad)      # torch, whatever the device

    As a plain call, ``use_backend("triton")`` sets the choice until it is changed again (like
    ``torch.set_grad_enabled``). The setting lives in a ``contextvars.ContextVar``: it is per thread
    (a new thread starts at "auto") and per asyncio task. "auto" is the device rule of this module;
    "triton" on CPU tensors requires ``TRITON_INTERPRET=1`` before triton is first imported.
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or name not in BACKENDS:
            raise ValueError(f"use_backend: name must be one of {BACKENDS}, got {name!r}")
        self.name = name
        self._previous = _backend.get()
        self._token = _backend.set(name)

    def __enter__(self) -> use_backend:
        return self

    def __exit__(self, *exc) -> None:
        try:
            _backend.reset(self._token)
        except ValueError:  # exited in another context than it was entered: restore by value
            _backend.set(self._previous)

    def __repr__(self) -> str:
        return f"use_backend({self.name!r})"


def current_backend() -> str:
    """The forced backend name in effect here ("auto" unless ``use_backend`` changed it)."""
    return _backend.get()


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _load_triton() -> SimpleNamespace | None:
    """The Triton launchers, or None (with the reason kept) where triton cannot be imported."""
    global _triton_impl, _triton_error
    if _triton_impl is None and _triton_error is None:
        try:
            from .triton import column_scores as cs
            from .triton import fingerprint as fp
            from .triton import selective_adamw as sa
            from .triton import selective_lion as sl
            from .triton import selective_sgd as ss
            from .triton import topk_columns as tk
        except ImportError as exc:  # triton missing or broken on this machine
            _triton_error = exc
        else:
            _triton_impl = _implementation(cs, tk, sa, fp, sl, ss)
    return _triton_impl


def _load_numba() -> SimpleNamespace:
    """The CPU fast path: numba AdamW, torch scores and top-k (numba is a dependency, imported late)."""
    global _numba_impl
    if _numba_impl is None:
        from .cpu_ops import fingerprint as fp
        from .cpu_ops import selective_adamw as sa
        from .cpu_ops import selective_lion as sl
        from .cpu_ops import selective_sgd as ss

        _numba_impl = _implementation(torch_ops, torch_ops, sa, fp, sl, ss)
    return _numba_impl


def _implementation(scores, topk, adamw, fingerprint, lion, sgd) -> SimpleNamespace:
    """The ops of one backend, taken from the modules that implement its scores, top-k, AdamW, fingerprints and the
    other rules' fast paths."""
    return SimpleNamespace(
        multi_fingerprint=fingerprint.multi_fingerprint,
        multi_fingerprint_unchecked=fingerprint.multi_fingerprint_unchecked,
        column_scores=scores.column_scores,
        multi_column_scores=scores.multi_column_scores,
        topk_columns=topk.topk_columns,
        multi_topk_columns=topk.multi_topk_columns,
        selective_adamw_=adamw.selective_adamw_,
        multi_selective_adamw_items_=adamw.multi_selective_adamw_items_,
        multi_selective_lion_items_=lion.multi_selective_lion_items_,
        multi_selective_sgd_items_=sgd.multi_selective_sgd_items_,
    )


def _first_tensor(x) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _impl(sample):
    """The implementation (module-like) for an op whose first tensor argument is ``sample``."""
    choice = _backend.get()
    t = _first_tensor(sample)
    if choice == "torch":
        return torch_ops
    if choice == "numba":
        if t is not None and t.device.type != "cpu":
            raise RuntimeError(f'zenflow_kernels: backend "numba" runs on CPU tensors only, got {t.device.type}')
        return _load_numba()
    if choice == "triton":
        impl = _load_triton()
        if impl is None:
            raise RuntimeError(f'zenflow_kernels: backend "triton" was forced but triton cannot be imported '
                               f"({_triton_error!r}); install triton or use_backend(\"torch\")")
        if t is not None and t.device.type == "cpu" and not _interpret_requested():
            raise RuntimeError('zenflow_kernels: backend "triton" on CPU tensors needs TRITON_INTERPRET=1 in the '
                               "environment before triton is first imported")
        if t is not None and t.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f'zenflow_kernels: backend "triton" does not support {t.device.type} tensors')
        return impl
    if t is not None and (t.device.type == "cuda" or (t.device.type == "cpu" and _interpret_requested())):
        impl = _load_triton()
        if impl is not None:
            return impl
    if t is not None and t.device.type == "cpu":
        return _load_numba()
    return torch_ops  # also for non-tensor input: its validation raises the TypeError


def column_scores(grad: torch.Tensor, importance: str = "l2") -> torch.Tensor:
    """Per-column importance of a 2-D gradient.

    Args:
        grad: ``[R, C]`` float32, bfloat16 or float16; any strides (transposed views are read in place).
        importance: ``"l2"`` (sum of squares, default) or ``"l1"`` (sum of absolute values).

    Returns:
        A new float32 tensor ``[C]`` on ``grad``'s device: ``s[c] = sum_r g[r, c]**2`` (or ``|g[r, c]|``),
        accumulated in float32. ``grad`` is not modified.
    """
    if torch.compiler.is_compiling() and isinstance(grad, torch.Tensor) and isinstance(importance, str):
        return torch.ops.zenflow_kernels.column_scores(grad, importance)
    return _impl(grad).column_scores(grad, importance)


def topk_columns(scores: torch.Tensor, k: int, *, check_data: bool = True) -> torch.Tensor:
    """Indices of the ``k`` highest scores.

    Args:
        scores: ``[C]`` float32 (bfloat16/float16 accepted), any stride; must not hold NaN (-0.0 and +0.0
            count as equal; +-inf are ordinary values).
        k: ``0 <= k <= C``.
        check_data: check for NaN (one device synchronisation); False skips it (NaN then gives an
            unspecified selection).

    Returns:
        A new int64 tensor ``[k]``: the selected column numbers, sorted ascending; among equal scores the
        lower index wins. ``k == 0`` gives an empty tensor, ``k == C`` every column.
    """
    compiling = torch.compiler.is_compiling()
    if compiling and isinstance(scores, torch.Tensor) and _is_python_int(k) and isinstance(check_data, bool):
        return torch.ops.zenflow_kernels.topk_columns(scores, k, check_data)
    return _impl(scores).topk_columns(scores, k, check_data=check_data)


def selective_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    master: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    check_data: bool = True,
) -> None:
    """In-place AdamW on the selected columns ``param[:, indices]`` (``torch.optim.AdamW(foreach=False)`` math).

    With ``g = grad[:, indices] / grad_scale``, ``p`` the selected columns (or ``master``), ``t = step``:
    ``p *= 1 - lr*weight_decay``; ``m.lerp_(g, 1 - beta1)``; ``v = beta2*v + (1 - beta2)*g*g``;
    ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``. One pass: gathered, updated
    and scattered back without column copies (Triton); all math in float32.

    Args:
        param: ``[R, C]`` float32/bfloat16/float16, any strides. Columns ``indices`` are overwritten; every
            other column is left bit-identical.
        grad: ``[R, C]`` float32/bfloat16/float16 (any strides), read only.
        indices: int64 ``[k]``, unique, sorted ascending, in ``[0, C)``; or None for all columns (a dense
            update, ``k = C``; vector parameters go through here viewed as ``[1, n]``).
        exp_avg, exp_avg_sq: contiguous float32 ``[R, k]`` compact Adam moments of the selected columns
            (column ``j`` belongs to ``indices[j]``); updated in place.
        step: the 1-based step number: a Python int, or an int64 tensor ``[k]`` with each column's own
            count (per-column bias correction).
        lr, beta1, beta2, eps, weight_decay: AdamW hyper-parameters (``0 <= beta < 1``, others ``>= 0``).
        master: optional contiguous float32 ``[R, k]`` master copy of the selected columns. When given the
            math runs on it (updated in place) and the param columns receive it rounded to param's dtype
            (round to nearest even); otherwise the math runs on the loaded param value in float32.
        grad_scale: the gradient is divided by this (``> 0``): loss-scale unscaling and clipping folded in.
        check_data: check ``indices`` and a ``step`` tensor (one device synchronisation); False skips it.
    """
    if torch.compiler.is_compiling() and _fits_selective_adamw_schema(
            param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, weight_decay,
            grad_scale, check_data):
        per_col = isinstance(step, torch.Tensor)
        torch.ops.zenflow_kernels.selective_adamw_(
            param, grad, indices, exp_avg, exp_avg_sq, step if per_col else None, 0 if per_col else step, lr, beta1,
            beta2, eps, weight_decay, master, grad_scale, check_data)
        return
    _impl(param).selective_adamw_(
        param, grad, indices, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, master=master, grad_scale=grad_scale, check_data=check_data)


def multi_column_scores(grads, importance: str = "l2") -> list[torch.Tensor]:
    """``column_scores`` for a list of gradients at once (one device, dtypes may differ).

    Triton: a constant number of launches (one per gradient dtype, plus one when a tall matrix needs a
    second reduction pass), whatever the number of tensors. Returns float32 ``[C_i]`` tensors; with
    Triton they are views into one new flat buffer.
    """
    return _impl(grads).multi_column_scores(grads, importance)


def multi_topk_columns(scores_list, ks, *, check_data: bool = True) -> list[torch.Tensor]:
    """``topk_columns`` for a list of score vectors; ``ks`` has one int per vector.

    Triton: one launch per score dtype (one program per vector). Returns int64 ``[k_i]`` tensors, sorted
    ascending; with Triton they are views into one new flat buffer.
    """
    return _impl(scores_list).multi_topk_columns(scores_list, ks, check_data=check_data)


def multi_selective_adamw_(
    params,
    grads,
    indices_list,
    exp_avgs,
    exp_avg_sqs,
    *,
    steps,
    lrs,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decays,
    masters=None,
    grad_scale: float = 1.0,
    check_data: bool = True,
) -> None:
    """``selective_adamw_`` for a whole model at once, in place; all tensors on one device.

    ``indices_list`` entries may be None (dense); ``steps`` is an int for all or a list of ints / int64
    ``[k_i]`` tensors; ``lrs`` and ``weight_decays`` are a number for all or one per tensor (param groups);
    ``masters`` is None or a list whose entries may be None. Every tensor is validated before anything
    is written. Triton: one launch per group of tensors sharing (param dtype, grad dtype, dense or not,
    master or not, int or tensor steps, tile shape) -- a constant number, not one per layer.
    """
    impl = _impl(params)  # (the backend first: its errors before the arguments')
    items, (beta1, beta2, eps, grad_scale) = torch_ops.multi_adamw_args(
        "multi_selective_adamw_", params, grads, indices_list, exp_avgs, exp_avg_sqs, steps, lrs, beta1, beta2, eps,
        weight_decays, masters, grad_scale, check_data)
    impl.multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale)


def multi_fingerprint(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """A fingerprint of each tensor's bits, to tell cheaply whether a tensor changed (docs/design.md section 5.1).

    ``fp(x) = sum_k word_k * (fmix64(k + key) | 1) mod 2**64``: ``word_k`` is the tensor's k-th 32-bit word in
    row-major order (a 4-byte element; or 2-byte elements 2k and 2k + 1 as low and high half, a missing last one
    0), ``fmix64`` murmur3's 64-bit finalizer. A change of one word always changes it; were the weights random,
    any change would keep it with probability at most 2**-32.

    Args:
        tensors: fp32, bf16 or fp16 tensors on one device, any shapes and strides (a strided one is read through
            a contiguous copy); read only.
        key: the weights' key, an integer in ``[0, 2**64)``.
        out: optional int64 ``[len(tensors)]`` contiguous tensor on their device, overwritten.

    Returns:
        int64 ``[len(tensors)]`` on their device (``out`` when given): each fingerprint's 64 bits. One launch per
        element width on a GPU (Triton), one numba pass on CPU; every backend gives the same values.
    """
    return _impl(tensors).multi_fingerprint(tensors, key, out=out)


def multi_fingerprint_unchecked(tensors, key: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`multi_fingerprint` without validation, for a caller that checked the tensors (a non-empty list of
    fp32/bf16/fp16 tensors on one device, ``key`` in range, ``out`` None or int64 ``[n]`` contiguous there): the
    asynchronous link at every ``step()``, whose gradients the step checked. Wrong input is undefined behaviour."""
    return _impl(tensors).multi_fingerprint_unchecked(tensors, key, out=out)


def multi_selective_adamw_items_(items, *, beta1: float, beta2: float, eps: float, grad_scale: float) -> None:
    """``multi_selective_adamw_`` without validation, for a caller that built every tensor itself (the
    optimizer, whose state is made to the contract and whose gradients it checked): ``items`` are
    ``(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, weight_decay)`` tuples, ``step`` an
    int or an int64 ``[k]`` tensor, the hyper-parameters floats already in range. Saves the per-tensor Python
    checks (about 60 us a tensor) on every step; wrong input here is undefined behaviour."""
    if items:
        _impl(items[0][0]).multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale)


def fused_kernels(sample: torch.Tensor) -> SimpleNamespace | None:
    """The fused fast-path kernels for tensors like ``sample`` under the backend in effect (numba on CPU, Triton on
    CUDA or interpreted), or None where the backend is "torch" (or the device has no kernels). The update rules
    (``zenflow_kernels.rules``) launch their multi-tensor steps from it and take their plain torch step where it
    is None: ``multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale, decoupled)`` (``decoupled=False``:
    Adam's L2 decay), ``multi_selective_lion_items_(items, beta1, beta2, grad_scale)`` and
    ``multi_selective_sgd_items_(items, momentum, dampening, nesterov, grad_scale)``, items as
    ``UpdateRule.fast_step_`` documents them, unchecked."""
    impl = _impl(sample)
    return None if impl is torch_ops else impl


# -- torch.library custom ops ----------------------------------------------------------------------------
#
# torch.ops.zenflow_kernels.{column_scores, topk_columns, selective_adamw_}: the single-tensor ops as
# opaque nodes for torch.compile (a fake implementation gives the output's shape; selective_adamw_
# declares what it writes), so a compiled function that calls the public ops traces without a graph
# break: the public functions route to these while dynamo traces them, and call the implementation
# directly in eager mode (the custom-op dispatch costs ~0.1 ms a call in Python). Validation and the
# device dispatch run inside, when the op runs, with the same errors as eager.


def _is_python_int(x) -> bool:
    # the custom ops' schema ``int``: a Python int (not a bool; numpy integers are config.is_int's, not this)
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fits_selective_adamw_schema(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps,
                                 weight_decay, grad_scale, check_data) -> bool:
    """Whether the arguments have the custom op's types (otherwise the eager path raises the usual error)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    optional = (indices, master)
    return (all(isinstance(t, torch.Tensor) for t in tensors)
            and all(t is None or isinstance(t, torch.Tensor) for t in optional)
            and (isinstance(step, torch.Tensor) or _is_python_int(step))
            and all(_is_real(x) for x in (lr, beta1, beta2, eps, weight_decay, grad_scale))
            and isinstance(check_data, bool))


@torch.library.custom_op("zenflow_kernels::column_scores", mutates_args=())
def _column_scores_op(grad: torch.Tensor, importance: str) -> torch.Tensor:
    return _impl(grad).column_scores(grad, importance)


@_column_scores_op.register_fake
def _(grad, importance):
    return grad.new_empty((grad.shape[1],), dtype=torch.float32)


@torch.library.custom_op("zenflow_kernels::topk_columns", mutates_args=())
def _topk_columns_op(scores: torch.Tensor, k: int, check_data: bool) -> torch.Tensor:
    return _impl(scores).topk_columns(scores, k, check_data=check_data)


@_topk_columns_op.register_fake
def _(scores, k, check_data):
    return scores.new_empty((k,), dtype=torch.int64)


def _selective_adamw_op_signature() -> inspect.Signature:
    """The custom op's parameters, from which torch infers its schema: ``selective_adamw_``'s in its order, all
    positional, with its ``step`` (a Python int or an int64 tensor, which no schema type is) split in two:
    ``step_per_column`` (the tensor, or None) and ``step`` (the int; 0 beside a tensor)."""
    P = inspect.Parameter
    params = []
    for p in inspect.signature(selective_adamw_).parameters.values():
        if p.name == "step":
            params += [P("step_per_column", P.POSITIONAL_OR_KEYWORD, annotation="torch.Tensor | None"),
                       P("step", P.POSITIONAL_OR_KEYWORD, annotation="int")]
        else:
            params.append(p.replace(kind=P.POSITIONAL_OR_KEYWORD, default=P.empty))
    return inspect.Signature(params, return_annotation="None")


def _selective_adamw_op_kernel(*args) -> None:
    kw = dict(zip(_selective_adamw_op_kernel.__signature__.parameters, args, strict=True))
    step_per_column = kw.pop("step_per_column")
    if step_per_column is not None:
        kw["step"] = step_per_column
    _impl(kw["param"]).selective_adamw_(**kw)


_selective_adamw_op_kernel.__signature__ = _selective_adamw_op_signature()
_selective_adamw_op = torch.library.custom_op(
    "zenflow_kernels::selective_adamw_", mutates_args=("param", "exp_avg", "exp_avg_sq", "master"))(
    _selective_adamw_op_kernel)
_selective_adamw_op.register_fake(lambda *args: None)
