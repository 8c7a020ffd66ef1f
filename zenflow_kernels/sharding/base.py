"""The seam's base: :class:`Sharding` is one process (every gradient the local ``.grad``, the host shard every
parameter, nothing crossing ranks); ZeRO (zero.py) and FSDP2 (fsdp2.py) override what differs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import ops

__all__ = ["Sharding", "column_scores", "is_dtensor", "sum_of_squares"]


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return isinstance(t, DTensor)


def column_scores(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], importances: Sequence,
                  name: str) -> list:
    """Each gradient's column scores ([C] fp32 or the kernels' dtype) by its importance: the kernels for
    ``"l2"``/``"l1"`` (one multi-tensor call per kind), ``"random"`` scored as ``"l2"`` (the telemetry and
    the zen-auto vote read the scores; the choice itself is random), a callable as
    ``scorer(grad, param)``, checked to return C finite-or-not floats (``name``: the optimizer, for the message)."""
    out: list = [None] * len(grads)
    by_kind: dict[str, list[int]] = {}
    for n, importance in enumerate(importances):
        if callable(importance):
            out[n] = _call_scorer(importance, grads[n], params[n], name)
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
        from ..cpu_ops.accumulate import sum_squares_unchecked

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


def _call_scorer(scorer, grad: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    columns = grad.shape[1]
    s = scorer(grad, param)
    if not torch.is_tensor(s) or tuple(s.shape) != (columns,) or s.is_complex() or s.dtype == torch.bool:
        got = f"a tensor of shape {tuple(s.shape)} and dtype {s.dtype}" if torch.is_tensor(s) else type(s).__name__
        raise ValueError(f"{name}: the importance scorer {getattr(scorer, '__name__', scorer)!r} returned "
                         f"{got}: allowed a real tensor of shape ({columns},), one score per column")
    return s.detach().to(device=grad.device, dtype=torch.float32)


class Sharding:
    """One process: every gradient is the local ``.grad``, the host shard holds every parameter, nothing
    crosses ranks."""

    world = 1
    rank = 0
    stage = 0
    owned: list[int] | None = None  # the parameters this rank's host shard holds (None: all)
    reducer = None  # ZeRO-2: the BucketReducer its hooks feed
    consumes_hooks = False  # backward hooks feed this sharding (ZeRO-2) rather than the link
    final_at_backward = True  # a gradient is final when backward produced it (ZeRO averages it in step())
    exchanges_selected = False  # selected_gradients() does something (else the fast step reads .grad alone)
    name = "ZenFlow"  # the optimizer as built, for messages (build.choose_sharding sets it: ZenFlowAdamW, ...)
    user_unscaled = False  # this step's gradients were unscaled by the user's GradScaler.unscale_ (read_step sets it)

    def __init__(self):
        self.bytes: dict[str, int] = {}  # payload bytes each kind of collective carried

    @property
    def failed(self) -> bool:
        """A collective failed: the ranks are out of step and nothing may be exchanged any more."""
        return False

    def accept(self, params: Sequence[torch.Tensor]) -> None:
        """Refuse parameters this way of holding them cannot take (at construction)."""
        if any(is_dtensor(p) for p in params):
            raise ValueError(f"{self.name}: some parameters are DTensors (FSDP2) and others are not: allowed all of "
                             "one kind (a model wrapped with fully_shard throughout, or plain parameters)")

    def start(self, params: Sequence[torch.Tensor], groups: Sequence[int], device: torch.device, chaos) -> None:
        """At the first step (building may be collective: every rank builds at the same point)."""
        self.params = params
        self.device = device

    def hold(self, host_params: set[int]) -> None:
        """The parameters with host state (frozen ones have none: ``build.trained``), on the rank that owns each;
        called at every build, before the host shard is laid out (one process: nothing to do)."""

    def element_keys(self, groups: Sequence[int], host_params: set[int]) -> dict[int, int]:
        """Stochastic rounding's key of element 0 of each parameter's :meth:`local` tensor
        (``zenflow_kernels.rounding``): its offset in the host layout of every parameter with host state, whole
        (``host.layout`` of the parameters as the user holds them), so one process and every rank key an element
        alike."""
        from ..host import layout

        slots = layout(self.params, groups, sorted(host_params))[1]
        return {i: s.offset for i, s in slots.items()}

    def close(self) -> None:
        """Let collectives already started complete (a reload or close while an exchange is in flight)."""

    def use_host_memory(self, alloc: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        """Host buffers this way of holding gradients keeps for device copies come from ``alloc`` (the link's:
        page-locked on a GPU); called with each new link (one process: none)."""

    def host_bytes(self) -> int:
        """Bytes of the host buffers it keeps (:meth:`use_host_memory`)."""
        return 0

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

    def drop_step(self) -> None:
        """``zero_grad()``: a batch dropped before ``step()`` leaves nothing behind (one process: nothing held)."""

    def active(self) -> list[int]:
        """The parameters taking part in this step (those with a gradient)."""
        return [i for i, p in enumerate(self.params) if p.grad is not None]

    def gather(self, active: list[int]) -> None:
        """Make this step's gradients what :meth:`grad` returns (averaging, reductions); every rank calls
        it with the same ``active``."""

    def grad(self, i: int) -> torch.Tensor:
        """The step's gradient of parameter ``i`` as the host path and the selection read it."""
        return self.own_grad(i)

    def grad_norm(self, active: list[int], own: list[torch.Tensor] | None = None) -> float:
        """The global L2 norm of the step's gradient (inf/NaN if any is non-finite), one device sync. ``own``: the
        step's own gradients of ``active`` as :meth:`own_grad` gives them, read already (after :meth:`gather`,
        which averages in place), or None."""
        if not active:
            return 0.0
        grads = own if own is not None else [self.own_grad(i) for i in active]
        return float(sum_of_squares(grads, self.device).sqrt())

    def scores(self, indices: list[int], importances: list) -> list[torch.Tensor]:
        """Column scores of these matrices' step gradients, each by its importance (:func:`column_scores`);
        every rank gets the same."""
        return column_scores([self.grad(i) for i in indices], [self.local(self.params[i]) for i in indices],
                             importances, self.name)

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

    def export_state_dict(self, state_dict: dict, local, topk) -> dict:
        """The optimizer's state dict as this way of holding state saves it (one process, ZeRO: as it is).
        ``local``: the tensors the optimizer updates (None before its first step); ``topk(i)``: matrix ``i``'s
        number of selected columns."""
        return state_dict

    def import_state_dict(self, state_dict: dict) -> dict:
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
