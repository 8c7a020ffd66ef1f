"""The CPU fast path of ``rules.Lion``: its step on the selected columns of many tensors in one numba launch.

The contract is ``rules.Lion.reference_fast_step_`` (its torch step on the gathered columns, the reference beside
it): per element ``lion_kernel``'s arithmetic, which equals the torch op sequence bit for bit
on x86 with AVX2 (``kernels.lion`` says how that was measured), so this path equals the torch path there too
(tests/test_cpu_rules.py). The layout is ``_rule_plan``'s (one launch per combination of dtypes, laid out once
for :class:`~zenflow_kernels.launch_plan.LaunchItems`); a strided parameter or gradient is launched on a
contiguous copy.
"""

from __future__ import annotations

from . import _common as C
from ._rule_plan import run_plan
from .kernels.lion import multi_selective_lion_kernel

__all__ = ["multi_selective_lion_items_"]


def multi_selective_lion_items_(items, beta1: float, beta2: float, grad_scale: float) -> None:
    """``ops.fused_kernels(...).multi_selective_lion_items_`` on CPU tensors: ``items`` are ``(param, grad,
    indices, exp_avg, master, step, lr, weight_decay)`` (unchecked; the step is not read)."""

    def launch(g) -> None:
        C.launch(multi_selective_lion_kernel, g.work, 0, g.table, g.chunk_starts, g.parts, g.lr64, g.wd64,
                 g.param_proto, g.grad_proto, g.master_proto, g.block, 1.0 / grad_scale, 1.0 - beta1, 1.0 - beta2)

    run_plan(items, 1, launch)
