"""The CPU fast path: selective AdamW as fused numba kernels (``ops`` on CPU tensors).

The contract is ``torch_ops.selective_adamw_`` / ``multi_selective_adamw_`` (the torch reference
beside it): the same validation (shared ``_validate`` code, the same errors, raised before any write),
the same math and operation order, fp32 arithmetic. Where the torch path runs ~15 tensor ops per
parameter (gather, lerp, sqrt, ..., scatter), this reads and writes each selected element once:
gather from the parameter, update the compact state, scatter back, with the row loop threaded. The
multi-tensor form is one launch per combination of dtypes (usually one for the whole model) over a
table of tensor addresses: per-tensor Python work is a table row, not a kernel call (~100 us each).

Limits: the parameter must be contiguous and row-major; the gradient contiguous (a strided gradient
goes through the torch path, which reads any strides). Per-column step counts become per-column
float32 coefficients computed in float64 by numpy (in the multi-tensor form, one vectorised pass
for all tensors).

A caller that launches the same tensors again and again (the optimizer, at every step of a selection)
passes them as :class:`LaunchItems`: the table, work items and coefficient layout are then built once and
kept in the caller's ``launch_cache``; a call only checks that the items are still those tensors, writes
the gradients' addresses into the table and computes the coefficients of the current step counts.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import torch_ops
from ..launch_plan import PlannedFor
from . import _common as C
from .kernels.adam import T_COEF, T_GRAD, T_IDX, T_K, T_ROWS, multi_selective_adam_kernel, selective_adam_kernel

MULTI_BLOCK = 2048
"""Selected columns per work item of the multi-tensor kernel: a row of a matrix, or a block of a long
vector, so that one large vector parallelises like a tall matrix."""

PART_ELEMENTS = C.MIN_ELEMENTS_PER_THREAD // 4
MAX_PARTS = 1024

_PROTO = {torch.float32: np.empty(0, np.float32), torch.bfloat16: np.empty(0, np.int16),
          torch.float16: np.empty(0, np.uint16)}  # element types of the bit views (see _common.as_numpy)


def _coefficients(step, lr: float, beta1: float, beta2: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(-lr / (1 - beta1**s), sqrt(1 - beta2**s)) per column, float32 [k], from float64 as torch does
    (numpy: these are tiny vectors, where torch's per-op overhead would dominate)."""
    if isinstance(step, torch.Tensor):
        return _column_coefficients(step.numpy().astype(np.float64), lr, beta1, beta2)
    neg_step_size = -lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5
    return np.full(k, neg_step_size, dtype=np.float32), np.full(k, bc2_sqrt, dtype=np.float32)


def _column_coefficients(s: np.ndarray, lr, beta1: float, beta2: float) -> tuple[np.ndarray, np.ndarray]:
    """The coefficients of float64 per-column step counts ``s`` (``lr`` a number or one per column)."""
    return (-lr / (1 - beta1**s)).astype(np.float32), np.sqrt(1 - beta2**s).astype(np.float32)


def _fusable(param: torch.Tensor, grad: torch.Tensor) -> bool:
    return param.device.type == "cpu" and param.is_contiguous() and grad.is_contiguous()


def _launch(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, wd, grad_scale):
    R, Ccols = param.shape
    k = exp_avg.shape[1]
    if R * k == 0:
        return
    if not _fusable(param, grad):
        torch_ops._adamw(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps, wd,
                         grad_scale)
        return
    neg_step_size, bc2_sqrt = _coefficients(step, lr, beta1, beta2, k)
    C.launch(
        selective_adam_kernel,
        R * k,
        0,
        C.as_numpy(param),
        C.as_numpy(grad),
        None if indices is None else indices.numpy(),
        C.as_numpy(exp_avg),
        C.as_numpy(exp_avg_sq),
        None if master is None else C.as_numpy(master),
        R,
        Ccols,
        grad_scale,
        1.0 - lr * wd,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        neg_step_size,
        bc2_sqrt,
    )
    C.bump_versions(param, exp_avg, exp_avg_sq, master)


def selective_adamw_(param, grad, indices, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                     master=None, grad_scale=1.0, check_data: bool = True) -> None:
    """``ops.selective_adamw_`` for CPU tensors (see there for the contract)."""
    step, hp = torch_ops.adamw_args(param, grad, indices, exp_avg, exp_avg_sq, master, step, lr, beta1, beta2, eps,
                                    weight_decay, grad_scale, check_data)
    _launch(param, grad, indices, exp_avg, exp_avg_sq, master, step, *hp)


def multi_selective_adamw_(params, grads, indices_list, exp_avgs, exp_avg_sqs, *, steps, lrs, beta1, beta2, eps,
                           weight_decays, masters=None, grad_scale=1.0, check_data: bool = True) -> None:
    """``ops.multi_selective_adamw_`` for CPU tensors: every tensor validated first, then one kernel launch
    per combination of (param dtype, grad dtype, master or not); a tensor whose parameter or gradient is
    strided goes through the torch path."""
    items, (beta1, beta2, eps, grad_scale) = torch_ops.multi_adamw_args(
        "multi_selective_adamw_", params, grads, indices_list, exp_avgs, exp_avg_sqs, steps, lrs, beta1, beta2, eps,
        weight_decays, masters, grad_scale, check_data)
    multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale)


def multi_selective_adamw_items_(items, beta1, beta2, eps, grad_scale, decoupled: bool = True) -> None:
    """The launches of ``multi_selective_adamw_`` for items as ``torch_ops.multi_adamw_args`` returns them
    (or as :class:`LaunchItems`: planned once, see there). ``decoupled=False``: Adam (``torch.optim.Adam``'s
    coupled L2 decay, the fast path of ``rules.Adam``) instead of AdamW."""
    cache = getattr(items, "launch_cache", None)
    plan = None if cache is None else cache.get("numba")
    if plan is None or not plan.fits(items):
        plan = _Plan(items)  # laid out for this call (kept when the caller keeps a cache)
        if cache is not None:
            cache["numba"] = plan
    plan.run(items, beta1, beta2, eps, grad_scale, decoupled)


def run_contiguous(items, launch) -> None:
    """``launch`` on copies of ``items`` whose parameter, gradient and step counts are contiguous, the parameters
    copied back after (the rules' few strided tensors; the AdamW path has ``_launch``'s torch fallback)."""
    copies = [(it[0].contiguous(), it[1].contiguous(), *it[2:]) for it in items]
    copies = [(*it[:-3], it[-3].contiguous() if isinstance(it[-3], torch.Tensor) else it[-3], *it[-2:])
              for it in copies]
    launch(copies)
    for it, copy in zip(items, copies, strict=True):
        if copy[0] is not it[0]:
            it[0].copy_(copy[0])


def _parts(work: int, chunks: int) -> int:
    """How many contiguous ranges of work items ``multi_selective_adam_kernel`` walks: about PART_ELEMENTS
    elements each, so that a launch on several threads has a few ranges per thread to balance."""
    return min(chunks, max(1, work // PART_ELEMENTS), MAX_PARTS)


def work_items(rows: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The work items of a multi-tensor launch over tensors of ``rows`` rows and ``ks`` selected columns:
    ``chunk_starts`` (tensor t owns items ``chunk_starts[t]`` to ``chunk_starts[t + 1] - 1``: a row or a block of
    ``MULTI_BLOCK`` columns of one), the elements in all, and the ranges to deal them out in (``_parts``)."""
    chunk_starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(rows * ((ks + MULTI_BLOCK - 1) // MULTI_BLOCK), out=chunk_starts[1:])
    work = int((rows * ks).sum())
    return chunk_starts, work, _parts(work, int(chunk_starts[-1]))


def strided_indices(items) -> list[tuple[int, torch.Tensor]]:
    """``(position, indices)`` of the items whose column indices are strided: copied at every call, their values
    read then, as an address is (:func:`point_at_copies`)."""
    return [(j, it[2]) for j, it in enumerate(items) if it[2] is not None and not it[2].is_contiguous()]


def point_at_copies(table: np.ndarray, column: int, strided: list) -> list[torch.Tensor]:
    """Point ``table[:, column]`` of the strided indices at contiguous copies; returns the copies, which must
    outlive the launch."""
    keep = [idx.contiguous() for _, idx in strided]
    for (j, _), copy in zip(strided, keep, strict=True):
        table[j, column] = copy.data_ptr()
    return keep


def _numba_grad_layout(g: torch.Tensor) -> tuple:
    return g.dtype, g.is_contiguous()


class _Plan:
    """``multi_selective_adamw_items_`` of one list of tensors, laid out once (see :class:`LaunchItems`)."""

    def __init__(self, items):
        self.made_for = PlannedFor(items, _numba_grad_layout)
        self.slow: list[int] = []  # positions launched one by one (a strided parameter or gradient)
        by_key: dict[tuple, list[int]] = {}
        for t, (p, g, _, m, _, w, *_) in enumerate(items):
            if p.shape[0] * m.shape[1] == 0:
                continue
            if not _fusable(p, g):
                self.slow.append(t)
                continue
            by_key.setdefault((p.dtype, g.dtype, w is None), []).append(t)
        self.groups = [_Group(items, positions) for positions in by_key.values()]
        self.lrs = self.wds = self.decoupled = None

    def fits(self, items) -> bool:
        """Whether ``items`` are the tensors this plan was laid out for."""
        return self.made_for.fits(items)

    def run(self, items, beta1, beta2, eps, grad_scale, decoupled=True) -> None:
        if self.slow and not decoupled:  # Adam's strided tensors: the kernel on contiguous copies
            run_contiguous([items[t] for t in self.slow], lambda copies: _Plan(copies).run(
                copies, beta1, beta2, eps, grad_scale, decoupled))
        for t in self.slow if decoupled else ():
            p, g, idx, m, v, w, s, lr, wd = items[t]
            _launch(p, g, idx, m, v, w, s, lr, beta1, beta2, eps, wd, grad_scale)
        if not self.groups:
            return
        grad_ptrs = np.array([it[1].data_ptr() for it in items], dtype=np.int64)
        lrs, wds = [it[7] for it in items], [it[8] for it in items]
        if lrs != self.lrs or wds != self.wds or decoupled != self.decoupled:  # a scheduler changes lr every step
            self.lrs, self.wds, self.decoupled = lrs, wds, decoupled
            for group in self.groups:
                group.set_hyper(lrs, wds, decoupled)
        for group in self.groups:
            group.run(items, grad_ptrs, beta1, beta2, eps, grad_scale)


class _Group:
    """One launch of a :class:`_Plan` (tensors of the same dtypes, all contiguous, none empty): the address
    table with every address but the gradients' filled in, the work items, and the coefficient layout. The
    coefficients of the tensors with per-column step counts come first, computed in one vectorised pass over
    one gather of their step tensors' storage (the optimizer's flat step counts: a slice); the tensors with
    an integer step point into one shared region per distinct (step, lr), usually one."""

    def __init__(self, items, positions: list[int]):
        chosen = [items[t] for t in positions]
        self.positions = positions
        self.take = None if positions == list(range(len(items))) else np.array(positions, dtype=np.int64)
        self.table = table = np.array(
            [(p.data_ptr(), 0, 0 if idx is None else idx.data_ptr(), m.data_ptr(), v.data_ptr(),
              0 if w is None else w.data_ptr(), p.shape[0], p.shape[1], m.shape[1], 0)
             for p, g, idx, m, v, w, *_ in chosen], dtype=np.int64)
        self.strided_idx = strided_indices(chosen)
        ks = table[:, T_K]
        self.chunk_starts, self.work, self.parts = work_items(table[:, T_ROWS], ks)
        self.per_column = [j for j, it in enumerate(chosen) if isinstance(it[6], torch.Tensor)]
        self.scalar = [j for j, it in enumerate(chosen) if not isinstance(it[6], torch.Tensor)]
        self.scalar_rows = np.array(self.scalar, dtype=np.int64)
        self.scalar_positions = [positions[j] for j in self.scalar]
        self.pc_ks = ks[self.per_column]
        self.M = int(self.pc_ks.sum())
        table[self.per_column, T_COEF] = np.cumsum(self.pc_ks) - self.pc_ks
        self.region = int(ks[self.scalar].max()) if self.scalar else 0
        table[self.scalar, T_COEF] = self.M  # one region until the integer steps differ
        self.regions = 1
        self.neg_step_size = np.empty(self.M + self.region, dtype=np.float32)
        self.bc2_sqrt = np.empty(self.M + self.region, dtype=np.float32)
        self.gather = _step_gather([chosen[j][6] for j in self.per_column])
        p0, g0, w0 = chosen[0][0], chosen[0][1], chosen[0][5]
        self.protos = (_PROTO[p0.dtype], _PROTO[g0.dtype], None if w0 is None else _PROTO[torch.float32])
        self.live = [t for p, _, _, m, v, w, *_ in chosen for t in (p, m, v, w)
                     if t is not None and not t.is_inference()]
        self.decay = self.l2 = self.lr_columns = self.scalar_lrs = None

    def set_hyper(self, lrs: list, wds: list, decoupled: bool = True) -> None:
        """Per-tensor decay (AdamW: 1 - lr * wd; Adam: 1), coupled decay (Adam: wd; AdamW: 0) and the
        per-column lr of the per-column tensors (float64)."""
        if self.take is not None:
            lrs, wds = [lrs[t] for t in self.positions], [wds[t] for t in self.positions]
        self.scalar_lrs = [lrs[j] for j in self.scalar]
        wd = np.array(wds, dtype=np.float64)
        if decoupled:
            self.decay, self.l2 = 1.0 - np.array(lrs, dtype=np.float64) * wd, np.zeros_like(wd)
        else:
            self.decay, self.l2 = np.ones_like(wd), wd
        pc = np.array([lrs[j] for j in self.per_column], dtype=np.float64)
        self.lr_columns = pc[0] if pc.size and (pc == pc[0]).all() else np.repeat(pc, self.pc_ks)

    def run(self, items, grad_ptrs, beta1, beta2, eps, grad_scale) -> None:
        table = self.table
        table[:, T_GRAD] = grad_ptrs if self.take is None else grad_ptrs[self.take]
        keep = point_at_copies(table, T_IDX, self.strided_idx)
        if self.scalar:  # first: it may grow the coefficient arrays
            self._scalar_coefficients(items, beta1, beta2)
        M = self.M
        if M:
            self.neg_step_size[:M], self.bc2_sqrt[:M] = _column_coefficients(self.gather(), self.lr_columns, beta1,
                                                                               beta2)
        C.launch(
            multi_selective_adam_kernel,
            self.work,
            0,
            table,
            self.chunk_starts,
            self.parts,
            self.decay,
            self.l2,
            self.neg_step_size,
            self.bc2_sqrt,
            *self.protos,
            MULTI_BLOCK,
            grad_scale,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            eps,
        )
        del keep  # the strided indices' copies: alive until the launch has read them
        if self.live:  # see C.bump_versions
            torch.autograd.graph.increment_version(self.live)

    def _scalar_coefficients(self, items, beta1, beta2) -> None:
        """The regions of the tensors with an integer step: one per distinct (step, lr), each filled with
        ``_coefficients``' values (the tensor's row points at its region)."""
        keys = list(zip([items[t][6] for t in self.scalar_positions], self.scalar_lrs, strict=True))
        distinct = dict.fromkeys(keys)
        M, size = self.M, self.region
        if len(distinct) != 1 or self.regions != 1:
            region = {key: r for r, key in enumerate(distinct)}
            self.table[self.scalar_rows, T_COEF] = [M + region[key] * size for key in keys]
            self.regions = len(distinct)
            if self.neg_step_size.size < M + len(distinct) * size:  # (before the per-column ones are written)
                self.neg_step_size = np.empty(M + len(distinct) * size, dtype=np.float32)
                self.bc2_sqrt = np.empty(M + len(distinct) * size, dtype=np.float32)
        for r, (step, lr) in enumerate(distinct):
            neg, bc2 = _coefficients(step, lr, beta1, beta2, 1)
            lo = M + r * size
            self.neg_step_size[lo : lo + size] = neg[0]
            self.bc2_sqrt[lo : lo + size] = bc2[0]


def _step_gather(tensors: list[torch.Tensor]):
    """A function returning the per-column step counts of ``tensors``, concatenated, as float64: a slice or
    one gather of their common storage when they are contiguous int64 views of one tensor (the optimizer's
    flat step counts), a concatenation otherwise."""
    if not tensors:
        return None
    base = tensors[0]._base if tensors[0]._base is not None else tensors[0]
    if (base.dtype == torch.int64 and base.dim() == 1 and base.is_contiguous() and base.device.type == "cpu"
            and all((t._base is base or t is base) and t.dtype == torch.int64 and t.dim() == 1
                    and t.is_contiguous() for t in tensors)):
        whole = base.numpy()
        start = base.data_ptr()
        offsets = [(t.data_ptr() - start) // 8 for t in tensors]
        ends = [o + t.numel() for o, t in zip(offsets, tensors, strict=True)]
        if all(e == o for e, o in zip(ends[:-1], offsets[1:], strict=True)):
            view = whole[offsets[0] : ends[-1]]
            return lambda: view.astype(np.float64)
        where = np.concatenate([np.arange(o, e) for o, e in zip(offsets, ends, strict=True)])
        return lambda: whole[where].astype(np.float64)
    return lambda: torch.cat(tensors).numpy().astype(np.float64)
