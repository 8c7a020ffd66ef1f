"""How the ranks hold gradients and host state: the seam between ZenFlow's algorithm and data parallelism
(docs/design.md, "The seam").

``optim.py`` holds the algorithm once. What differs between one process, ZeRO-1, ZeRO-2 and FSDP2 is
behind :class:`Sharding`: which parameters this rank's host shard holds, where a step's (averaged)
gradient of a parameter comes from, and how column scores, the selected columns' gradients, the
gradient norm, host state and the write-back cross ranks. One process is the base class itself.

=================  =============  ======================  ===================  ===========================
                   one process    ZeRO-1                  ZeRO-2               FSDP2 (fsdp2.py)
=================  =============  ======================  ===================  ===========================
host shard         every param    own run of params       own run of params    every param's local rows
step's gradient    ``.grad``      ``.grad`` all-reduced   owner: reduced from  FSDP2's reduce-scattered
                                  (averaged)              backward hooks       local shard
column scores      local          local (same on every    owner's, all-reduced partial (local rows),
                                  rank)                                        all-reduced (summed)
selected columns'  ``.grad``      ``.grad``               owners' summed        local rows, no collective
gradients
gradient norm      local          local                   all-reduced          all-reduced
host state         local          broadcast by its owner  broadcast by owner   local
write-back         local          owners broadcast        owners broadcast     local (FSDP2 all-gathers)
=================  =============  ======================  ===================  ===========================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import ops
from .zero import BucketReducer, ZeroContext, check_not_ddp, owners

__all__ = ["Sharding", "Zero1", "Zero2", "column_scores", "sum_of_squares"]


def column_scores(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], importances: Sequence) -> list:
    """Each gradient's column scores ([C] fp32 or the kernels' dtype) by its importance: the kernels for
    ``"l2"``/``"l1"`` (one multi-tensor call per kind), ``"random"`` scored as ``"l2"`` (the telemetry and
    the zen-auto vote read the scores; the choice itself is random), a callable as
    ``scorer(grad, param)``, checked to return C finite-or-not floats."""
    out: list = [None] * len(grads)
    by_kind: dict[str, list[int]] = {}
    for n, importance in enumerate(importances):
        if callable(importance):
            out[n] = _call_scorer(importance, grads[n], params[n])
        else:
            by_kind.setdefault("l1" if importance == "l1" else "l2", []).append(n)
    for kind, chosen in by_kind.items():
        for n, s in zip(chosen, ops.multi_column_scores([grads[n] for n in chosen], kind), strict=True):
            out[n] = s
    return out


def sum_of_squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float64 sum of the squares of every element of these gradients, as a ``[1]`` tensor on ``device``:
    non-finite exactly when one holds an inf or NaN (the skip check). CPU: one numba pass per dtype in a
    fixed order (``cpu_ops.multi_sum_squares``; torch's ``_foreach_norm`` on CPU is a norm call per tensor,
    about 2 us each); elsewhere torch's multi-tensor norm."""
    if device.type == "cpu":
        from .cpu_ops.accumulate import sum_squares_unchecked

        # (step() checked every gradient's device, dtype and layout)
        total = sum_squares_unchecked([g if g.is_contiguous() else g.contiguous() for g in grads])
        return torch.tensor([total], dtype=torch.float64)
    return _foreach_sum_of_squares(grads, device)


def _foreach_sum_of_squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """:func:`sum_of_squares` on a GPU: fp32 norms from torch's multi-tensor kernel, squared and summed in
    float64 on the device (no host sync until the caller reads it)."""
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        squares += torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32)).double().pow(2).sum()
    return squares


def _call_scorer(scorer, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    columns = grad.shape[1]
    s = scorer(grad, param)
    if not torch.is_tensor(s) or tuple(s.shape) != (columns,) or s.is_complex() or s.dtype == torch.bool:
        got = f"a tensor of shape {tuple(s.shape)} and dtype {s.dtype}" if torch.is_tensor(s) else type(s).__name__
        raise ValueError(f"ZenFlowAdamW: the importance scorer {getattr(scorer, '__name__', scorer)!r} returned "
                         f"{got}: allowed a real tensor of shape ({columns},), one score per column")
    return s.detach().to(device=grad.device, dtype=torch.float32)


class Sharding:
    """One process: every gradient is the local ``.grad``, the host shard holds every parameter, nothing
    crosses ranks."""

    world = 1
    rank = 0
    stage = 0
    owned: list[int] | None = None  # the parameters this rank's host shard holds (None: all)
    reducer: BucketReducer | None = None
    consumes_hooks = False  # backward hooks feed this sharding (ZeRO-2) rather than the link
    final_at_backward = True  # a gradient is final when backward produced it (ZeRO averages it in step())
    exchanges_selected = False  # selected_gradients() does something (else the fast step reads .grad alone)

    def __init__(self):
        self.bytes: dict[str, int] = {}  # payload bytes each kind of collective carried

    @property
    def failed(self) -> bool:
        """A collective failed: the ranks are out of step and nothing may be exchanged any more."""
        return False

    def accept(self, params: Sequence[torch.Tensor]) -> None:
        """Refuse parameters this way of holding them cannot take (at construction)."""
        from .fsdp2 import is_dtensor

        if any(is_dtensor(p) for p in params):
            raise ValueError("ZenFlowAdamW: some parameters are DTensors (FSDP2) and others are not: allowed all of "
                             "one kind (a model wrapped with fully_shard throughout, or plain parameters)")

    def start(self, params: Sequence[torch.Tensor], groups: Sequence[int], device: torch.device, chaos) -> None:
        """At the first step (building may be collective: every rank builds at the same point)."""
        self.params = params
        self.device = device

    def close(self) -> None:
        """Let collectives already started complete (a reload or close while an exchange is in flight)."""

    # -- a step's gradients -----------------------------------------------------------------------

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor of parameter ``p`` the algorithm reads and writes (FSDP2: this rank's rows)."""
        return p

    def own_grad(self, i: int) -> torch.Tensor | None:
        """This rank's own gradient of parameter ``i`` as backward left it (shaped like :meth:`local`)."""
        return self.params[i].grad

    def grad_ready(self, i: int, check: Callable[[int, torch.Tensor], None], final: bool = True) -> None:
        """A backward hook (only when :attr:`consumes_hooks`): parameter ``i``'s gradient is complete for this
        backward; ``final``: no later backward adds to it before ``step()`` (declared)."""

    def active(self) -> list[int]:
        """The parameters taking part in this step (those with a gradient)."""
        return [i for i, p in enumerate(self.params) if p.grad is not None]

    def gather(self, active: list[int]) -> None:
        """Make this step's gradients what :meth:`grad` returns (averaging, reductions); every rank calls
        it with the same ``active``."""

    def grad(self, i: int) -> torch.Tensor:
        """The step's gradient of parameter ``i`` as the host path and the selection read it."""
        return self.own_grad(i)

    def grad_norm(self, active: list[int]) -> float:
        """The global L2 norm of the step's gradient (inf/NaN if any is non-finite), one device sync."""
        if not active:
            return 0.0
        return float(sum_of_squares([self.own_grad(i) for i in active], self.device).sqrt())

    def scores(self, indices: list[int], importances: list) -> list[torch.Tensor]:
        """Column scores of these matrices' step gradients, each by its importance (:func:`column_scores`);
        every rank gets the same."""
        return column_scores([self.grad(i) for i in indices], [self.local(self.params[i]) for i in indices],
                             importances)

    def selected_gradients(self, chosen: list[tuple[int, torch.Tensor]]) -> dict[int, torch.Tensor] | None:
        """The selected columns' gradients of these matrices (``(index, selected)``), as every replica's fast
        step reads them: ``{i: [R, k]}`` when they exist only in that form, None when the fast step indexes
        ``.grad`` itself."""
        return None

    # -- host state -------------------------------------------------------------------------------

    def mine(self, indices) -> list[int]:
        """Of these parameters, those whose host state this rank holds."""
        return list(indices)

    def from_host(self, i: int, make: Callable[[], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
                  kind: str = "host state") -> torch.Tensor:
        """``make()`` (a view of parameter ``i``'s host state) on every rank, on the device."""
        return make().to(device=self.device, dtype=dtype)

    def sum_over_ranks(self) -> Callable[[float], float] | None:
        """How a host update turns its shard's sum of squares into the model's (clipping), or None."""
        return None

    def start_exchange(self, host, indices: Sequence[int], dtypes: dict[int, torch.dtype]):
        """Start handing the owners' updated weights of ``indices`` to the other ranks (from the thread
        that ran the host update); None when every rank holds its own."""
        return None

    def received(self, exchange, host, indices: Sequence[int], dtypes: dict[int, torch.dtype], wait) -> dict:
        """``{i: weights}`` of the parameters other ranks own, for the write-back (``exchange``: started by
        the host update, or None: start it now). ``wait`` times the training thread's wait."""
        return {}

    def settle(self, exchange) -> None:
        """Let an exchange every rank started complete, unused (a reload while it is in flight)."""

    # -- checkpoints ------------------------------------------------------------------------------

    def export_state_dict(self, state_dict: dict, opt) -> dict:
        """The optimizer's state dict as this way of holding state saves it (one process, ZeRO: as it is)."""
        return state_dict

    def import_state_dict(self, state_dict: dict, opt) -> dict:
        """The inverse of :meth:`export_state_dict`: a dict ``load_state_dict`` reads (anything else as it is)."""
        return state_dict

    def holds(self, i: int) -> bool:
        """Whether this rank's host holds parameter ``i``'s state."""
        return True

    def will_hold(self, params: Sequence[torch.Tensor], groups: Sequence[int]) -> list[int]:
        """The parameters this rank's host will hold (before the first step: what a checkpoint must have)."""
        return list(range(len(params)))

    def checkpoint_tensor(self, i: int, make: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """Parameter ``i``'s ``make()`` (an fp32 CPU tensor its holder computes) on every rank."""
        return make()


class Zero1(Sharding):
    """ZeRO-1: every gradient averaged on every rank (one flat all-reduce per dtype); each rank's host holds
    its own run of parameters (zero.py), and owners broadcast what only they hold."""

    stage = 1
    final_at_backward = False

    def __init__(self, process_group, timeout: float):
        super().__init__()
        self._group, self._timeout = process_group, timeout
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.ctx: ZeroContext | None = None

    def accept(self, params) -> None:
        super().accept(params)
        check_not_ddp(params)

    def start(self, params, groups, device, chaos) -> None:
        super().start(params, groups, device, chaos)
        if self.ctx is None:  # once: creating its groups is collective (a reload keeps it)
            self.ctx = ZeroContext(params, groups, process_group=self._group, timeout=self._timeout,
                                   chaos=chaos if device.type == "cpu" else None)
            self.bytes = self.ctx.bytes
        self.owned = self.ctx.owned

    @property
    def failed(self) -> bool:
        return self.ctx is not None and self.ctx.failed

    def gather(self, active: list[int]) -> None:
        self.ctx.check_presence(active, len(self.params))
        self.ctx.average_([self.params[i].grad for i in active], "gradients")

    def mine(self, indices) -> list[int]:
        owned = set(self.owned)
        return [i for i in indices if i in owned]

    def from_host(self, i, make, shape, dtype, kind="host state") -> torch.Tensor:
        return self.ctx.from_owner(i, make, shape, dtype, self.device, kind)

    def sum_over_ranks(self):
        return self.ctx.sum_host

    def start_exchange(self, host, indices, dtypes):
        return self.ctx.start_exchange(host, indices, dtypes)

    def received(self, exchange, host, indices, dtypes, wait) -> dict:
        if exchange is None:  # a synchronous update: hand them over now
            exchange = self.ctx.start_exchange(host, indices, dtypes)
        return wait(exchange)

    def settle(self, exchange) -> None:
        if exchange is not None:
            exchange.wait()

    def holds(self, i: int) -> bool:
        return self.ctx.owner[i] == self.rank

    def will_hold(self, params, groups) -> list[int]:
        return [i for i, r in enumerate(owners(params, groups, self.world)) if r == self.rank]

    def checkpoint_tensor(self, i, make, shape) -> torch.Tensor:
        t = make() if self.holds(i) else torch.empty(shape, dtype=torch.float32)
        return self.ctx.broadcast_(t.to(self.device), self.ctx.owner[i], "checkpoint").to("cpu")


class Zero2(Zero1):
    """ZeRO-2: each matrix's gradient reduced to its owner only, in buckets started from backward hooks
    (``release``: its ``.grad`` let go as its bucket starts); owners score their matrices and the scores
    are all-reduced; vectors averaged on every rank; the selected columns' averaged gradients summed from
    their owners (or, keeping ``.grad``, the local selected columns averaged)."""

    stage = 2
    consumes_hooks = True
    exchanges_selected = True

    def __init__(self, process_group, timeout: float, *, release: bool, bucket_numel: int):
        super().__init__(process_group, timeout)
        self.release, self._bucket_numel = release, bucket_numel
        self._averaged: dict[int, torch.Tensor] = {}

    def start(self, params, groups, device, chaos) -> None:
        super().start(params, groups, device, chaos)
        order = [i for i in self.ctx.order if params[i].dim() == 2]
        self.reducer = BucketReducer(self.ctx, params, order[::-1], self._bucket_numel, release=self.release)

    def grad_ready(self, i, check, final=True) -> None:
        p = self.params[i]
        if p.dim() == 2:
            if self.release:  # checked now: step() will not see it
                check(i, p.grad)
            elif not final:  # declared: a later micro-batch changes it; step() reduces what no hook started
                return
            self.reducer.grad_ready(i)

    def active(self) -> list[int]:
        # released gradients: a matrix whose bucket the hooks started has .grad None
        arrived = self.reducer.arrivals
        return [i for i, p in enumerate(self.params) if p.grad is not None or i in arrived]

    def gather(self, active: list[int]) -> None:
        self.ctx.check_presence(active, len(self.params))
        self._averaged = self.reducer.finish(set(active))
        self.ctx.average_([self.params[i].grad for i in active if self.params[i].dim() != 2], "vector gradients")

    def grad(self, i: int) -> torch.Tensor:
        averaged = self._averaged.get(i)
        return averaged if averaged is not None else self.params[i].grad

    def grad_norm(self, active: list[int]) -> float:
        # owners' matrices, and the vectors once (rank 0), summed over the ranks
        grads = [self._averaged[i] for i in active if i in self._averaged]
        if self.rank == 0:
            grads += [self.params[i].grad for i in active if self.params[i].dim() != 2]
        return float(self.ctx.all_reduce_(sum_of_squares(grads, self.device), "gradient norm").sqrt())

    def scores(self, indices, importances) -> list[torch.Tensor]:
        # each owner scores its own matrices, exactly; one all-reduce hands every rank every score vector
        kind = dict(zip(indices, importances, strict=True))
        mine = [i for i in indices if i in self._averaged]
        own = dict(zip(mine, column_scores([self._averaged[i] for i in mine], [self.params[i] for i in mine],
                                           [kind[i] for i in mine]), strict=True))
        flat = torch.cat([
            own[i].float() if i in own else torch.zeros(self.params[i].shape[1], device=self.device)
            for i in indices
        ]) if indices else torch.zeros(0, device=self.device)
        self.ctx.all_reduce_(flat, "selection scores")
        return list(flat.split([self.params[i].shape[1] for i in indices]))

    def selected_gradients(self, chosen):
        chosen = [(i, sel) for i, sel in chosen if sel.numel()]
        if self.release:  # each owner's averaged columns, zeros elsewhere, summed
            compact = [
                self._averaged[i][:, sel] if i in self._averaged
                else torch.zeros(self.params[i].shape[0], sel.numel(), device=self.device,
                                 dtype=self.reducer.grad_dtype.get(i, self.params[i].dtype))
                for i, sel in chosen
            ]
            self.ctx.sum_(compact, "selected columns")
            return {i: c for (i, _), c in zip(chosen, compact, strict=True)}
        compact = [self.params[i].grad[:, sel] for i, sel in chosen]
        self.ctx.average_(compact, "selected columns")
        for (i, sel), avg in zip(chosen, compact, strict=True):
            self.params[i].grad[:, sel] = avg
        return None
