"""Host SGD: one fused, multithreaded numba pass over fp32 master weights and the momentum buffer.

The slow-path host step of docs/design.md section 2 item 5 for the SGD rule (``zenflow_kernels.rules.SGD``):
like ``cpu_adam_`` it can take the gradient from the fp32 accumulation buffer and zero it in the same pass
(``zero_grad=True``), and write the updated parameter in the device's dtype (``out=``). With momentum: one read
of p, g, buf and one write of p, buf per element (20 bytes/param in fp32; 26 with the accumulation buffer zeroed
and a bf16 copy-out, as bench/cpu_rules.py measures); without, 12 bytes/param, and no buffer.

Math: ``torch.optim.SGD(foreach=False)``'s single-tensor loop, as torch ops on fp32 tensors:

    d = grad * float32(1 / grad_scale)             (grad_scale folds loss scale, accumulation mean, clip)
    if weight_decay != 0: d = d.add(param, alpha=weight_decay)
    if momentum != 0:
        if step == 1: buf = clone(d)               (torch's first step, its buffer None: no dampening)
        else: buf.mul_(momentum).add_(d, alpha=1 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    param.add_(d, alpha=-lr)

Rounding: every scalar is computed in float64 and rounded to float32 once (as torch converts a Python
float), and every ``add`` with ``alpha`` is one fused multiply-add, as ATen's vectorised CPU kernel computes it
(measured, see ``kernels.lion``). param and momentum_buffer are therefore bit-identical to
``torch.optim.SGD(foreach=False)`` stepping with the gradient ``grad * (1 / grad_scale)`` (so with
``grad`` itself at grad_scale 1) wherever torch uses those kernels (x86 with AVX2 or AVX512; its scalar
DEFAULT kernels round product and sum separately, and differ in the last bit or two). A caller that divides,
``grad / grad_scale``, gets a g that can differ by an ulp unless grad_scale is a power of two (the reciprocal
saves a division per element).
"""

from __future__ import annotations

import torch

from . import _common as C
from .kernels.sgd import sgd_kernel


def _sgd_scalars(*, step, lr, momentum, dampening, nesterov, weight_decay, grad_scale) -> tuple:
    """Validate the hyper-parameters; return (first, nesterov, the kernel's float64 scalars: inv_scale,
    weight_decay, momentum, 1 - dampening, -lr; rounded to float32 once in the kernel)."""
    step = C.check_int("step", step, lo=1)
    lr = C.check_real("lr", lr, lo=0.0)
    momentum = C.check_real("momentum", momentum, lo=0.0)
    dampening = C.check_real("dampening", dampening, lo=0.0)
    nesterov = C.check_bool("nesterov", nesterov)
    weight_decay = C.check_real("weight_decay", weight_decay, lo=0.0)
    grad_scale = C.check_real("grad_scale", grad_scale, lo=0.0, lo_open=True)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"Nesterov momentum requires a momentum and zero dampening (torch.optim.SGD's rule), got "
                         f"momentum={momentum!r}, dampening={dampening!r}")
    return step == 1, nesterov, (1.0 / grad_scale, weight_decay, momentum, 1.0 - dampening, -lr)


@C.host_update(sgd_kernel)
def cpu_sgd_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
):
    """One SGD step on CPU tensors, in place, in one multithreaded pass (GIL released).

    Args:
        param, grad, out, zero_grad, num_threads: as ``cpu_adam_``.
        momentum_buffer: fp32 or bf16 (stored rounded to nearest even), contiguous, n elements, updated in
            place; may be None only when ``momentum == 0`` (a buffer given then is checked but neither read nor
            written).
        step: >= 1, this step's count for the buffer: 1 is its first step, which sets it to the direction
            (torch's ``buf = clone(d)``, whatever it held); later steps apply momentum and dampening.
        lr, weight_decay: >= 0; L2 decay ``d += weight_decay * param`` (torch.optim.SGD's).
        momentum, dampening: >= 0.
        nesterov: Nesterov momentum; needs momentum > 0 and dampening == 0 (torch's rule).
        grad_scale: > 0; the gradient used is ``grad * float32(1 / grad_scale)``.
        rounding: as ``cpu_adam_``'s for a bf16 momentum_buffer (state tensor 0: the low 16 bits of the hash).

    Checked completely before anything is written, as ``cpu_adam_``. Returns None.
    """

    def numbers():
        first, nest, scalars = _sgd_scalars(step=step, lr=lr, momentum=momentum, dampening=dampening,
                                            nesterov=nesterov, weight_decay=weight_decay, grad_scale=grad_scale)
        has_momentum = scalars[2] != 0.0
        if has_momentum and momentum_buffer is None:
            raise ValueError(f"momentum_buffer must be a tensor when momentum != 0, got None (momentum={momentum!r})")
        # momentum == 0 compiles the buffer out, and with it the rounding (a given buffer must still be bf16 for it)
        return (*scalars, first, nest), {"momentum_buffer": momentum_buffer if has_momentum else None}

    return param, grad, {"momentum_buffer": momentum_buffer}, numbers
