"""Host Lion: one fused, multithreaded numba pass over fp32 master weights and the one moment.

The slow-path host step of docs/design.md section 2 item 5 for the Lion rule (``zenflow_kernels.rules.Lion``):
like ``cpu_adam_`` it can take the gradient from the fp32 accumulation buffer and zero it in the same pass
(``zero_grad=True``), and write the updated parameter in the device's dtype (``out=``). One read of p, g, m and
one write of p, m per element: 20 bytes/param for plain fp32 Lion; 26 with the accumulation buffer zeroed and a
bf16 copy-out (bench/cpu_rules.py measures it against the memory roofline).

Math (Chen et al. 2023, Algorithm 2; the op order of ``rules.Lion.step_``), as torch ops on fp32 tensors:

    g = grad * float32(1 / grad_scale)            (grad_scale folds loss scale, accumulation mean, clip)
    update = exp_avg.lerp(g, 1 - beta1).sign_()
    param.mul_(1 - lr * weight_decay)             (skipped when weight_decay == 0)
    param.add_(update, alpha=-lr)
    exp_avg.lerp_(g, 1 - beta2)

Rounding: every scalar is computed in float64 and rounded to float32 once (as torch converts a Python
float), and every operation rounds as ATen's vectorised CPU kernels do (``kernels.lion`` says how that was
measured), so param, exp_avg and out are bit-identical to those torch ops for every grad_scale wherever torch
uses those kernels (x86 with AVX2 or AVX512; its scalar DEFAULT kernels differ in the last bit or two).
Against a caller that divides, ``grad / grad_scale``, g can differ by an ulp unless grad_scale is a power of
two (the reciprocal saves a division per element). ``torch.sign`` maps NaN to 0 (pytorch/pytorch#41245), and
so does this op: a NaN gradient turns exp_avg into NaN but does not move the parameter.
"""

from __future__ import annotations

import torch

from . import _common as C
from .kernels.lion import lion_kernel


def _lion_scalars(*, lr, beta1, beta2, weight_decay, grad_scale) -> tuple:
    """Validate the hyper-parameters; return the kernel's float64 scalars (rounded to float32 once in the
    kernel): inv_scale, decay = 1 - lr*wd, -lr, 1 - beta1, 1 - beta2."""
    lr = C.check_real("lr", lr, lo=0.0)
    beta1 = C.check_real("beta1", beta1, lo=0.0, hi=1.0)
    beta2 = C.check_real("beta2", beta2, lo=0.0, hi=1.0)
    weight_decay = C.check_real("weight_decay", weight_decay, lo=0.0)
    grad_scale = C.check_real("grad_scale", grad_scale, lo=0.0, lo_open=True)
    return 1.0 / grad_scale, 1.0 - lr * weight_decay, -lr, 1.0 - beta1, 1.0 - beta2


@C.host_update(lion_kernel)
def cpu_lion_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
):
    """One Lion step on CPU tensors, in place, in one multithreaded pass (GIL released).

    Args:
        param, grad, out, zero_grad, num_threads: as ``cpu_adam_``.
        exp_avg: fp32 or bf16 (stored rounded to nearest even), contiguous, n elements: the moment, updated in place.
        lr, weight_decay: >= 0; decoupled decay ``p *= 1 - lr * weight_decay``.
        beta1, beta2: in [0, 1]: the interpolation of the update's sign and of the moment.
        grad_scale: > 0; the gradient used is ``grad * float32(1 / grad_scale)``.
        rounding: as ``cpu_adam_``'s for a bf16 exp_avg (state tensor 0: the low 16 bits of the hash).

    Checked completely before anything is written, as ``cpu_adam_``. Returns None.
    """
    numbers = {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay, "grad_scale": grad_scale}
    return param, grad, {"exp_avg": exp_avg}, lambda: (_lion_scalars(**numbers), None)
