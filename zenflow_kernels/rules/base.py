"""The update rule seam: what ZenFlow needs to know of an optimizer to split it by importance.

ZenFlow applies one rule in two places: to the selected columns of each matrix (and every vector) on the device at
every step, and to the whole host master with an interval's mean gradient at update boundaries. Everything else
(selection, the interval, the links, ZeRO, FSDP2, checkpoints) moves the rule's per-element state around by its
names and never looks inside. A rule is:

* ``state_names``: its per-element state, tensors shaped like the parameter, zero at the start (AdamW:
  ``exp_avg``, ``exp_avg_sq``; Lion: ``exp_avg``; SGD with momentum: ``momentum_buffer``; torch's names, so that a
  torch state dict reads the same);
* its hyper-parameters as param-group keys (``group_defaults``, checked by ``check_group``) and the numbers the step
  reads (``numbers``: ``lr`` and the rule's own, flat floats);
* ``step_``: one step of one tensor in plain torch, at an int step count (1 for the first): the reference the kernels
  are tested against, and the implementation wherever a rule has no kernel;
* kernels where speed matters: ``host_step_`` (the host pass over flat fp32 runs of the shard, the update ZenFlow
  hides behind the device's steps) and ``fast_step_`` (the device's multi-tensor update of selected columns). Their
  defaults call ``step_``.

A rule of one's own subclasses :class:`UpdateRule` and writes ``step_`` (docs/hacking.md shows one).
"""

from __future__ import annotations

import math
import numbers as _numbers
from typing import Any, ClassVar

import torch

from ..config import check_lr

__all__ = ["UpdateRule", "check_real", "check_betas", "check_state_dtype"]

STATE_DTYPES = (torch.float32, torch.bfloat16)


def check_real(where: str, name: str, value: Any, *, lo: float = 0.0, hi: float | None = None) -> None:
    """``value`` is a finite real number in ``[lo, hi)`` (``hi`` None: no upper bound), or a ValueError naming it."""
    ok = isinstance(value, _numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= lo
    if ok and hi is not None:
        ok = value < hi
    if not ok:
        allowed = f"a finite number >= {lo:g}" if hi is None else f"a number in [{lo:g}, {hi:g})"
        raise ValueError(f"{where}: {name}={value!r} is invalid: allowed {allowed}")


def check_state_dtype(where: str, state_dtype: Any) -> torch.dtype:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{where}: state_dtype={state_dtype!r} is invalid: allowed torch.float32 or torch.bfloat16")
    return state_dtype


def check_betas(where: str, betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(
            isinstance(b, _numbers.Real) and not isinstance(b, bool) and math.isfinite(b) and 0 <= b < 1
            for b in betas):
        raise ValueError(f"{where}: betas={betas!r} is invalid: allowed a pair of numbers in [0, 1)")


class UpdateRule:
    """An optimizer's update rule, as ZenFlow applies it (module docstring). Subclasses set ``name``,
    ``state_names``, ``shared`` and write ``group_defaults``, ``check_group``, ``numbers`` and ``step_``."""

    name: ClassVar[str] = ""
    """Recorded in checkpoints: a checkpoint of another rule is refused."""
    state_names: tuple[str, ...] = ()
    """The per-element state (the parameter's shape, zero at the start)."""
    state_dtype: torch.dtype = torch.float32
    """The dtype of that state in host memory: fp32, or bf16 (half the bytes; each step computes in fp32 from the
    stored values and rounds the new state to nearest even; the parameter's update uses the unrounded values).
    The fast path's state on the device stays fp32."""
    per_tensor: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")
    """Numbers a multi-tensor launch takes per tensor (they may differ between param groups in one launch)."""
    shared: ClassVar[tuple[str, ...]] = ()
    """The other numbers: one launch per distinct set of them."""
    uses_step: ClassVar[bool] = True
    """``step_`` reads its step count (False: the columns of a matrix need not be grouped by it)."""

    # -- hyper-parameters ---------------------------------------------------------------------------

    def group_defaults(self) -> dict:
        """The rule's hyper-parameters as param-group keys (``lr`` is the optimizer's)."""
        raise NotImplementedError

    def check_group(self, group: dict, where: str) -> None:
        """A param group's numbers (``lr`` included), or a ValueError naming the key, its value and what is
        allowed."""
        check_lr(group.get("lr"), where)  # a number, or a 1-element float tensor (as torch.optim takes it)

    def numbers(self, group: dict) -> dict:
        """The floats ``step_`` and the kernels read of a (checked) param group: ``lr`` and the rule's own."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """What a checkpoint records of the rule: its name, its state's names and dtype, and its defaults."""
        return {"name": self.name, "state_names": list(self.state_names),
                "state_dtype": str(self.state_dtype).replace("torch.", ""), **self.group_defaults()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.group_defaults().items())
        if self.state_dtype != torch.float32:
            args += f", state_dtype={self.state_dtype}"
        return f"rules.{type(self).__name__}({args})"

    # -- the step -------------------------------------------------------------------------------------

    def step_(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, step: int,
              **numbers) -> None:
        """One step of ``param`` in place with ``grad`` (fp32, its shape), ``state`` its tensors by name (updated in
        place), ``step`` this step's count (1 for the first); ``numbers`` as :meth:`numbers` gives them."""
        raise NotImplementedError

    def columns_step_(self, block: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                      steps: torch.Tensor | int, **numbers) -> None:
        """:meth:`step_` on the columns of ``block`` [R, k] where column j is at its own step ``steps[j]``: columns
        sharing a step count are stepped together (a rule that does not read it: all at once)."""
        if isinstance(steps, int) or not self.uses_step:
            self.step_(block, grad, state, step=steps if isinstance(steps, int) else 0, **numbers)
            return
        values = torch.unique(steps).tolist()
        if len(values) == 1:
            self.step_(block, grad, state, step=int(values[0]), **numbers)
            return
        for s in values:
            cols = (steps == s).nonzero().flatten()
            part = block.index_select(1, cols)
            held = {name: t.index_select(1, cols) for name, t in state.items()}
            self.step_(part, grad.index_select(1, cols), held, step=int(s), **numbers)
            block.index_copy_(1, cols, part)
            for name, t in held.items():
                state[name].index_copy_(1, cols, t)

    # -- kernels (defaults: step_ in torch) ---------------------------------------------------------

    fuses_last: ClassVar[bool] = False
    """``host_accumulate_step_`` folds the interval's last gradient into the step's pass (else the host adds it to
    the sums first)."""

    def host_step_(self, param: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], *, step: int,
                   grad_scale: float, out: torch.Tensor | None = None, zero_grad: bool = False, **numbers) -> None:
        """The host pass over flat fp32 runs: ``param`` (the master) stepped with ``grad / grad_scale`` (``grad``
        the sums, fp32), ``state`` in ``state_names`` order, the result rounded into ``out`` (fp32/bf16/fp16, the
        copy-out) and ``grad`` zeroed with ``zero_grad``. The default is :meth:`step_` in torch (torch ops on the
        host worker's thread start a second OpenMP team of torch's: a rule that runs often wants a numba kernel).
        State in bf16 is stepped in fp32 copies and rounded back to nearest even, as the kernels do."""
        g = grad.float()
        g = g.clone() if grad_scale == 1.0 else g.mul(1.0 / grad_scale)  # the kernels' float32 reciprocal
        work = [t if t.dtype == torch.float32 else t.float() for t in state]
        self.step_(param, g, dict(zip(self.state_names, work, strict=True)), step=step, **numbers)
        for t, w in zip(state, work, strict=True):
            if w is not t:
                t.copy_(w)
        if out is not None:
            out.copy_(param)
        if zero_grad:
            grad.zero_()

    def host_accumulate_step_(self, param, acc, grad, state, *, step, grad_scale, out=None, zero_acc=False,
                              **numbers) -> None:
        """``acc += grad`` and :meth:`host_step_` with ``acc`` in one pass (where ``fuses_last``)."""
        acc.add_(grad.reshape(acc.shape).float())
        self.host_step_(param, acc, state, step=step, grad_scale=grad_scale, out=out, zero_grad=zero_acc, **numbers)

    def fast_step_(self, items: list[tuple], *, grad_scale: float, **shared) -> None:
        """The device's update of every item of one launch: ``(param [R, C], grad [R, C], columns [k] or None,
        *state ([R, k] each, in state_names order), master [R, k] fp32 or None, step, *per_tensor)``. ``columns``
        None: every column (a vector as [1, n]). ``master``: the fp32 values of a low-precision parameter's
        columns, stepped and rounded into it. ``step``: an int, or the columns' int64 counts [k]. The default is
        :meth:`reference_fast_step_`; the built-in rules launch fused kernels (``zenflow_kernels.ops``)."""
        self.reference_fast_step_(items, grad_scale=grad_scale, **shared)

    def reference_fast_step_(self, items: list[tuple], *, grad_scale: float, **shared) -> None:
        """:meth:`fast_step_` in plain torch: each item's gradient columns gathered, multiplied by
        ``1 / grad_scale``, and stepped with :meth:`columns_step_`; the reference the fused kernels are tested
        against, and the torch backend's implementation (``ops.use_backend("torch")``)."""
        n = len(self.state_names)
        inv = 1.0 / grad_scale
        for item in items:
            p, g, idx = item[:3]
            state, master, step = item[3 : 3 + n], item[3 + n], item[4 + n]
            numbers = dict(zip(self.per_tensor, item[5 + n :], strict=True), **shared)
            grad = g.float() if idx is None else g.index_select(1, idx).float()
            if grad_scale != 1.0:
                grad = grad.mul_(inv) if grad is not g else grad.mul(inv)
            if master is not None:
                work = master
            elif idx is None:
                work = p if p.dtype == torch.float32 else p.float()  # fp32 arithmetic, one rounding (the kernels')
            else:
                work = p.index_select(1, idx).float()
            self.columns_step_(work, grad, dict(zip(self.state_names, state, strict=True)), step, **numbers)
            if idx is None:
                if work is not p:
                    p.copy_(work)
            else:
                p.index_copy_(1, idx, work.to(p.dtype))
