"""The CPU fast path of ``rules.SGD``: its step on the selected columns of many tensors in one numba launch.

The contract is ``rules.SGD.reference_fast_step_`` (its torch step on the gathered columns): per
element ``sgd_kernel``'s arithmetic, bit-identical to the torch op sequence on x86 with AVX2, and a column whose step
count is 1 (its first on the fast path) starts its momentum buffer as the gradient, as ``torch.optim.SGD``'s first
step does. Layout: ``_rule_plan``'s; a strided parameter, gradient or step
tensor is launched on a contiguous copy.
"""

from __future__ import annotations

import numpy as np

from . import _common as C
from ._rule_plan import run_plan
from .kernels.sgd import multi_selective_sgd_kernel

__all__ = ["multi_selective_sgd_items_"]

_BUFFER = np.empty(0, dtype=np.float32)


def multi_selective_sgd_items_(items, momentum: float, dampening: float, nesterov: bool, grad_scale: float) -> None:
    """``ops.fused_kernels(...).multi_selective_sgd_items_`` on CPU tensors: ``items`` are ``(param, grad,
    indices, momentum_buffer, master, step, lr, weight_decay)``, without the buffer for a rule that keeps none
    (unchecked). A param group with momentum 0 under a rule that keeps a buffer leaves the buffer alone, as torch's
    SGD does."""
    n_state = len(items[0]) - 7 if items else 0  # (param, grad, indices, [buffer], master, step, lr, weight_decay)
    buffer = _BUFFER if n_state and momentum != 0 else None

    def launch(g) -> None:
        C.launch(multi_selective_sgd_kernel, g.work, 0, g.table, g.chunk_starts, g.parts, g.lr64, g.wd64,
                 g.param_proto, g.grad_proto, g.master_proto, buffer, g.block,
                 1.0 / grad_scale, momentum, 1.0 - dampening, bool(nesterov))

    run_plan(items, n_state, launch)
