"""Triton kernels and their launchers (no policy: ``zenflow_kernels.ops`` decides when they run).

One module per op; each holds the ``@triton.jit`` kernels, the single- and multi-tensor launchers:

    column_scores     column_scores(grad, importance), multi_column_scores(grads, importance)
    topk_columns      topk_columns(scores, k), multi_topk_columns(scores_list, ks)
    selective_adamw   selective_adamw_(...), multi_selective_adamw_(...)

Importing this package imports ``triton``. Every launcher validates with ``zenflow_kernels._validate``
(the checks and messages of ``zenflow_kernels.torch_ops``) before launching anything.
``LAUNCHES`` / ``count_launches`` (from ``_util``) count the kernel launches the launchers issue.
"""

from ._util import LAUNCHES, count_launches

__all__ = ["LAUNCHES", "count_launches"]
