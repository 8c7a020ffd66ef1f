"""Launches laid out once: the items of ``ops.multi_selective_adamw_items_`` with a cache for their layout.

The optimizer launches the same tensors at every step of a selection; only the gradients (new tensors after
every backward), the step counts and the hyper-parameters change. A launcher that gets :class:`LaunchItems`
keeps its layout (address tables, work items, coefficient layout) in ``launch_cache`` under its backend's
name and, at a later call, checks with :class:`PlannedFor` that the items are still the tensors it was laid
out for: then it writes only what changes. The numba launcher (``cpu_ops.selective_adamw``) and the Triton
launcher (``triton.selective_adamw``) both do this; the torch path sees a plain list.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["LaunchItems", "PlannedFor"]


class LaunchItems(list):
    """Items of ``multi_selective_adamw_items_`` (a list of the same tuples) with a cache for their launch,
    for a caller that launches the same tensors again and again (the optimizer: every step of a selection).

    ``launch_cache`` is a dict the caller keeps with the tensors it was made for. After the first call a
    launcher keeps its layout there, and at every later call checks that the items are the same tensors
    (the same parameter, indices, moment, master and step-tensor objects in the same order, the parameters
    at the same addresses, the gradients of the same dtypes and layout): then it only writes the gradients'
    addresses, the coefficients of the current step counts and the decay of the current lr and weight
    decay. Anything else is laid out again. The state tensors must not be re-pointed (``.data =``,
    ``set_``) while the cache is kept. Other backends see a plain list.

    ``same_tensors=True`` is the caller's promise that every call with this ``launch_cache`` passes the same
    parameter, indices, moment, master and step-tensor objects in the same order (the optimizer: its cache
    lives and dies with its per-selection plan); the check then skips comparing them one by one and only
    checks what the caller cannot promise (the parameters' addresses, the gradients' layout).
    """

    __slots__ = ("launch_cache", "same_tensors")

    def __init__(self, items=(), launch_cache: dict | None = None, *, same_tensors: bool = False):
        super().__init__(items)
        self.launch_cache = {} if launch_cache is None else launch_cache
        self.same_tensors = same_tensors


class PlannedFor:
    """The tensors a layout was made for, and the check that later items are still those (``fits``).

    ``grad_layout(grad)`` is what of a gradient the layout depends on (its dtype and contiguity for the
    numba tables, its dtype and strides for Triton's): the gradients themselves may be new tensors.
    ``n_state``: the state tensors per item (the rule's ``state_names``: AdamW 2, Lion 1, SGD 0 or 1)."""

    def __init__(self, items, grad_layout: Callable[[torch.Tensor], tuple], *, n_state: int = 2):
        # an item is (param, grad, indices, *state (n_state tensors), master, step, *hyperparams)
        self.n, self.n_state = len(items), n_state
        # kept alive: the tables hold their addresses
        self.static = [(it[0], it[2], *it[3 : 4 + n_state],
                        it[4 + n_state] if isinstance(it[4 + n_state], torch.Tensor) else None) for it in items]
        self.param_ptrs = [it[0].data_ptr() for it in items]
        self.grad_layout = grad_layout
        self.grad_sig = [grad_layout(it[1]) for it in items]

    def fits(self, items) -> bool:
        """Whether ``items`` are the tensors the layout was made for."""
        if len(items) != self.n:
            return False
        held = 4 + self.n_state  # the fixed tensors: param, indices, state, master (then the step)
        for it, fixed in ([] if getattr(items, "same_tensors", False) else zip(items, self.static, strict=True)):
            if it[0] is not fixed[0] or any(a is not b for a, b in zip(it[2:held], fixed[1:-1], strict=True)):
                return False
            s = fixed[-1]
            if (it[held] is not s) if s is not None else isinstance(it[held], torch.Tensor):
                return False
        layout = self.grad_layout
        return ([it[0].data_ptr() for it in items] == self.param_ptrs
                and [layout(it[1]) for it in items] == self.grad_sig)
