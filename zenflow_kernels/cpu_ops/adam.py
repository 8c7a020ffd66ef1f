"""Host Adam/AdamW: one fused, multithreaded numba pass over fp32 master weights and moments.

Serves docs/design.md section 2 item 5 (the slow path): at an update boundary the host steps the fp32
master copy with the mean accumulated gradient. ``accumulate_adam_`` folds the last gradient of the
interval into the accumulation buffer in the same pass, and ``out=`` writes the updated parameter in
the device's dtype in the same pass, ready for the host-to-device copy. One read of p, g, m, v and
one write of p, m, v (plus the optional extras) per element: 28 bytes/param for plain fp32 AdamW,
the memory-bandwidth floor of any Adam (see bench/cpu_adam.py for the measured roofline).

Math (equal to ``torch.optim.AdamW``/``torch.optim.Adam`` with ``foreach=False`` up to rounding):

    g = grad / grad_scale                     (grad_scale folds loss scale, accumulation mean, clip)
    g = g + weight_decay * p                  (adamw=False: L2 form, DeepSpeed's adamw_mode=False)
    p = p * (1 - lr * weight_decay)           (adamw=True: decoupled decay)
    m = lerp(m, g, 1 - beta1)                 (torch's lerp, as its vectorised kernel rounds it)
    v = v * beta2 + (1 - beta2) * g * g
    p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    bc1 = 1 - beta1**step, bc2 = 1 - beta2**step; both 1 with bias_correction=False

All scalars are computed in float64 and rounded to float32 once, as torch does, and every operation
rounds like torch's single-tensor CPU path, with two exceptions that save a division each: the
gradient is multiplied by the float32 reciprocal of grad_scale (exact, hence identical, for powers of
two) and ``sqrt(v)`` by the reciprocal of ``sqrt(bc2)``. Measured over 100 steps of AdamW with
grad_scale a power of two, m and v stay bit-identical to torch 2.13's; the parameter differs by an
ulp here and there (the reciprocal, and ATen's CPU sqrt, which is not correctly rounded). With
adamw=False the L2 term carries those ulps of p into m and v. One pass costs one division and one square root per
element: compute runs at ~2 G params/s per core here, above the memory roofline.
"""

from __future__ import annotations

import math

import torch

from ..rounding import StochasticRounding
from . import _common as C
from .kernels.adam import adam_kernel


def _adam_scalars(*, step, lr, beta1, beta2, eps, weight_decay, adamw=True, bias_correction=True,
                  grad_scale=1.0) -> tuple:
    """Validate the hyper-parameters; return the kernel's scalars (float64; the kernel rounds them to
    float32 once): inv_scale, l2, decay, 1 - beta1, beta2, 1 - beta2, 1/sqrt(bc2), eps, -lr/bc1."""
    bias_correction = C.check_bool("bias_correction", bias_correction)
    adamw = C.check_bool("adamw", adamw)
    step = C.check_int("step", step, lo=1 if bias_correction else 0)
    lr = C.check_real("lr", lr, lo=0.0)
    beta1 = C.check_real("beta1", beta1, lo=0.0, hi=1.0, hi_open=True)
    beta2 = C.check_real("beta2", beta2, lo=0.0, hi=1.0, hi_open=True)
    eps = C.check_real("eps", eps, lo=0.0)
    weight_decay = C.check_real("weight_decay", weight_decay, lo=0.0)
    grad_scale = C.check_real("grad_scale", grad_scale, lo=0.0, lo_open=True)
    if bias_correction:
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
    else:
        bc1 = bc2 = 1.0
    return (
        1.0 / grad_scale,  # inv_scale
        0.0 if adamw else weight_decay,  # l2
        1.0 - lr * weight_decay if adamw else 1.0,  # decay
        1.0 - beta1,  # torch's lerp weight
        beta2,
        1.0 - beta2,
        1.0 / math.sqrt(bc2),  # inv_bc2_sqrt
        eps,
        -lr / bc1,  # neg_step_size
    )


@C.host_update(adam_kernel)
def cpu_adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
):
    """One Adam/AdamW step on CPU tensors, in place, in one multithreaded pass (GIL released).

    Args:
        param: fp32, contiguous, any shape with n elements; updated in place.
        grad: fp32, bf16 or fp16, contiguous, n elements; read only. Divided by ``grad_scale``.
        exp_avg, exp_avg_sq: fp32 or bf16, contiguous, n elements; the moments, updated in place (bf16: read
            exactly, stored rounded to nearest even; the parameter's update uses the unrounded new values).
        step: this step's number (1 for the first step); must be >= 1 when ``bias_correction``.
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW`` (0 <= beta < 1, others >= 0).
        adamw: True: decoupled decay ``p *= 1 - lr*wd`` (``torch.optim.AdamW``); False: L2 decay
            ``g += wd*p`` (``torch.optim.Adam``, DeepSpeed's ``adamw_mode=False``).
        bias_correction: False drops both bias corrections (DeepSpeed's option).
        grad_scale: > 0; the gradient used is ``grad / grad_scale`` (loss scale, accumulation count
            and clip factor folded into one number).
        out: optional fp32/bf16/fp16 tensor with n elements, contiguous; receives the updated
            parameter, rounded to nearest even (inf/NaN preserved), equal to ``param.to(out.dtype)``.
        zero_grad: True zeroes ``grad`` in the same pass, after reading it: for an accumulation buffer
            this step consumes (saves a separate zeroing pass; ``grad`` must then be fp32). The host
            worker relies on it: a large torch op in a second thread would start a second OpenMP team
            in torch's runtime, and its idle threads then slow every parallel op of the training thread.
        num_threads: threads for this call (1..NUMBA_NUM_THREADS); None uses the calling thread's
            ``numba.get_num_threads()``. Small tensors use fewer.
        rounding: None (bf16 moments rounded to nearest even), or a ``zenflow_kernels.rounding.StochasticRounding``
            (both moments bf16): rounded stochastically, element i with key ``rounding.key + i``, ``exp_avg`` with
            the low and ``exp_avg_sq`` with the high 16 bits of one hash (state tensors 0 and 1 of
            ``zenflow_kernels.rounding``), bit-identical to ``rounding.round_to_bf16``.

    Tensors must not overlap in memory (except that grad may be any read-only tensor not written
    here). Every argument is checked before anything is written: a ``TypeError``/``ValueError``
    leaves all tensors unchanged. n = 0 is a no-op. Returns None.
    """
    numbers = {"step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
               "adamw": adamw, "bias_correction": bias_correction, "grad_scale": grad_scale}
    return param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, lambda: (_adam_scalars(**numbers), None)


def accumulate_adam_(
    param: torch.Tensor,
    acc: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    zero_acc: bool = False,
    num_threads: int | None = None,
    rounding: StochasticRounding | None = None,
    **hyper,
) -> None:
    """Add the last gradient of an interval into ``acc`` and take the Adam step with
    ``(acc + grad) / grad_scale``, in the same pass (the update-boundary case of docs/design.md 2.5).

    Same as ``accumulate_(acc, grad)`` followed by ``cpu_adam_(param, acc, exp_avg, exp_avg_sq, ...,
    grad_scale=grad_scale, out=out)``, reading and writing ``acc`` once instead of three times.

    Args:
        param, exp_avg, exp_avg_sq, out, num_threads, rounding: as ``cpu_adam_``.
        hyper: ``cpu_adam_``'s numbers by keyword (step, lr, beta1, beta2, eps, weight_decay, adamw,
            bias_correction, grad_scale), checked by the same function.
        acc: fp32, contiguous, n elements: the accumulated gradient of the interval so far.
            Afterwards it holds the full sum ``acc + grad`` (unscaled), so a caller can still read it
            (checkpoint, norm, debugging); the caller zeroes or swaps it before the next interval.
            With ``zero_acc=True`` it holds 0 instead, saving that separate zeroing pass.
        grad: fp32, bf16 or fp16, n elements: the interval's last gradient; read only.
            (grad_scale: e.g. ``loss_scale * interval_length / clip_coef``.)

    Tensors must not overlap. Everything is checked before anything is written. n = 0 is a no-op.
    """
    state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    n = C.check_host_pass(param, grad, state, out, acc=acc)
    scalars = _adam_scalars(**hyper)
    zero_acc = C.check_bool("zero_acc", zero_acc)
    C.launch_update(adam_kernel, n, num_threads, rounding, param, grad, state, out, scalars, acc=acc, zero_acc=zero_acc)
