"""The layout of one multi-tensor launch of a rule's CPU fast path (``selective_lion``, ``selective_sgd``).

``selective_adamw``'s ``_Plan`` without AdamW's per-column bias corrections: an int64 address table per group of
tensors sharing (param dtype, grad dtype, master or not), one row per tensor (columns ``kernels._columns.R_*``), the
work items (tensor, row, block of columns) and their ranges, and the per-tensor lr and weight decay. Laid out once for
:class:`~zenflow_kernels.launch_plan.LaunchItems` (kept in ``launch_cache["numba"]``); a call then writes only
the gradients' addresses, the integer steps' first-step flags and, when they changed, the per-tensor hyper-parameters
(lr, weight decay). A strided parameter, gradient or step tensor is launched on contiguous copies (``run_contiguous``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..launch_plan import PlannedFor
from .kernels._columns import R_FIRST, R_GRAD, R_IDX, R_K, R_ROWS
from .selective_adamw import (
    _PROTO,
    MULTI_BLOCK,
    _numba_grad_layout,
    point_at_copies,
    run_contiguous,
    strided_indices,
    work_items,
)


def _fusable(p: torch.Tensor, g: torch.Tensor, step) -> bool:
    return (p.device.type == "cpu" and p.is_contiguous() and g.is_contiguous()
            and (not isinstance(step, torch.Tensor) or step.is_contiguous()))


class RulePlan:
    """The launches of one list of items ``(param, grad, indices, *state (n_state), master, step, lr,
    weight_decay)``; ``run`` calls ``launch(group)`` for each :class:`RuleGroup`."""

    def __init__(self, items, n_state: int):
        self.n_state = n_state
        self.made_for = PlannedFor(items, _numba_grad_layout, n_state=n_state)
        self.slow: list[int] = []
        by_key: dict[tuple, list[int]] = {}
        for t, item in enumerate(items):
            p, g, idx = item[:3]
            master, step = item[3 + n_state], item[4 + n_state]
            k = p.shape[1] if idx is None else idx.numel()
            if p.shape[0] * k == 0:
                continue
            if not _fusable(p, g, step):
                self.slow.append(t)
                continue
            by_key.setdefault((p.dtype, g.dtype, master is None), []).append(t)
        self.groups = [RuleGroup(items, positions, n_state) for positions in by_key.values()]
        self.tensor_hyperparams = None

    def fits(self, items) -> bool:
        return self.made_for.fits(items)

    def run(self, items, launch) -> None:
        if self.slow:
            run_contiguous([items[t] for t in self.slow],
                           lambda copies: RulePlan(copies, self.n_state).run(copies, launch))
        if not self.groups:
            return
        at = 5 + self.n_state
        tensor_hyperparams = [it[at : at + 2] for it in items]
        if tensor_hyperparams != self.tensor_hyperparams:  # a scheduler changes lr at every step
            self.tensor_hyperparams = tensor_hyperparams
            for group in self.groups:
                group.set_tensor_hyperparams(tensor_hyperparams)
        grad_ptrs = np.array([it[1].data_ptr() for it in items], dtype=np.int64)
        for group in self.groups:
            group.prepare(items, grad_ptrs)
            launch(group)
            if group.live:  # see C.bump_versions
                torch.autograd.graph.increment_version(group.live)


class RuleGroup:
    """One launch: the table (every address but the gradients'), ``chunk_starts``, ``parts``, the per-tensor
    ``lr64`` / ``wd64`` (float64) and the element-type prototypes ``param_proto``, ``grad_proto``, ``master_proto``
    (None: no master)."""

    def __init__(self, items, positions: list[int], n_state: int):
        chosen = [items[t] for t in positions]
        self.positions, self.n_state = positions, n_state
        self.take = None if positions == list(range(len(items))) else np.array(positions, dtype=np.int64)
        rows = []
        for it in chosen:
            p, _, idx = it[:3]
            state, master, step = it[3 : 3 + n_state], it[3 + n_state], it[4 + n_state]
            k = p.shape[1] if idx is None else idx.numel()
            rows.append((p.data_ptr(), 0, 0 if idx is None else idx.data_ptr(), state[0].data_ptr() if state else 0,
                         0 if master is None else master.data_ptr(), p.shape[0], p.shape[1], k,
                         step.data_ptr() if isinstance(step, torch.Tensor) else 0, 0))
        self.table = table = np.array(rows, dtype=np.int64)
        self.strided_idx = strided_indices(chosen)
        self.int_steps = [j for j, it in enumerate(chosen) if not isinstance(it[4 + n_state], torch.Tensor)]
        self.chunk_starts, self.work, self.parts = work_items(table[:, R_ROWS], table[:, R_K])
        p0, g0, master0 = chosen[0][0], chosen[0][1], chosen[0][3 + n_state]
        self.param_proto, self.grad_proto = _PROTO[p0.dtype], _PROTO[g0.dtype]
        self.master_proto = None if master0 is None else _PROTO[torch.float32]
        self.block = MULTI_BLOCK
        self.live = [t for it in chosen for t in (it[0], *it[3 : 4 + n_state])
                     if t is not None and not t.is_inference()]
        self.lr64 = self.wd64 = None
        self._keep: list[torch.Tensor] = []

    def set_tensor_hyperparams(self, tensor_hyperparams: list) -> None:
        chosen = tensor_hyperparams if self.take is None else [tensor_hyperparams[t] for t in self.positions]
        self.lr64 = np.array([n[0] for n in chosen], dtype=np.float64)
        self.wd64 = np.array([n[1] for n in chosen], dtype=np.float64)

    def prepare(self, items, grad_ptrs) -> None:
        """Write what changes between calls: the gradients' addresses, strided indices' copies, and each integer
        step's first-step flag."""
        table = self.table
        table[:, R_GRAD] = grad_ptrs if self.take is None else grad_ptrs[self.take]
        self._keep = point_at_copies(table, R_IDX, self.strided_idx)  # (kept until the next call: past the launch)
        if self.int_steps:
            at = 4 + self.n_state
            for j in self.int_steps:
                table[j, R_FIRST] = items[self.positions[j]][at] == 1


def run_plan(items, n_state: int, launch) -> None:
    """Lay ``items`` out (or reuse the layout kept in their ``launch_cache``) and run it."""
    cache = getattr(items, "launch_cache", None)
    plan = None if cache is None else cache.get("numba")
    if plan is None or not plan.fits(items):
        plan = RulePlan(items, n_state)
        if cache is not None:
            cache["numba"] = plan
    plan.run(items, launch)
