"""The update rule seam: what ZenFlow needs to know of an optimizer to split it by importance.

ZenFlow applies one rule in two places: to the selected columns of each matrix (and every vector) on the device at
every step, and to the whole host master with an interval's mean gradient at update boundaries. Everything else
(selection, the interval, the links, ZeRO, FSDP2, checkpoints) moves the rule's per-element state around by its
names and never looks inside. A rule is:

* ``state_names``: its per-element state, tensors shaped like the parameter, zero at the start (AdamW:
  ``exp_avg``, ``exp_avg_sq``; Lion: ``exp_avg``; SGD with momentum: ``momentum_buffer``; torch's names, so that a
  torch state dict reads the same);
* its hyper-parameters as param-group keys (``group_defaults``, checked by ``check_group``) and as the step
  reads them (``hyperparams``: ``lr`` and the rule's own, flat floats), split into those each tensor of a launch
  carries (``tensor_hyperparams``) and those one launch shares (``launch_hyperparams``);
* ``step_``: one step of one tensor in plain torch, at an int step count (1 for the first): the reference the kernels
  are tested against, and the implementation wherever a rule has no kernel;
* kernels where speed matters: ``host_step_`` (the host pass over flat fp32 runs of the shard, the update ZenFlow
  hides behind the device's steps) and ``fast_step_`` (the device's multi-tensor update of selected columns). Their
  defaults run ``step_`` compiled (``rules/compiled.py``: Inductor's C++ on the host, Triton on a GPU; ``compile``),
  or eager where compiling is off, impossible or not worth it (``eager_host_step_``, ``reference_fast_step_``).

A rule of one's own subclasses :class:`UpdateRule` and writes ``step_`` (docs/hacking.md shows one); ``check_rule``
checks its contract when an optimizer is made.
"""

from __future__ import annotations

import inspect
import math
import numbers as _numbers
import warnings
from typing import Any, ClassVar, NamedTuple

import torch

from ..config import check_lr
from ..rounding import StochasticRounding, check_state_rounding, round_to_bf16

__all__ = ["FastItem", "UpdateRule", "check_betas", "check_real", "check_rule", "check_state_dtype", "unpack_item"]

STATE_DTYPES = (torch.float32, torch.bfloat16)
RESERVED_STATE_NAMES = ("step", "selected", "master")  # the fast path's own entries beside the rule's state


def check_real(where: str, name: str, value: Any, *, lo: float = 0.0, hi: float | None = None) -> None:
    """``value`` is a finite real number in ``[lo, hi)`` (``hi`` None: no upper bound), or a ValueError naming it."""
    ok = isinstance(value, _numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= lo
    if ok and hi is not None:
        ok = value < hi
    if not ok:
        allowed = f"a finite number >= {lo:g}" if hi is None else f"a number in [{lo:g}, {hi:g})"
        raise ValueError(f"{where}: {name}={value!r} is invalid: allowed {allowed}")


def check_state_dtype(where: str, state_dtype: Any) -> torch.dtype:
    """``state_dtype`` is torch.float32 or torch.bfloat16 (the host state's dtype), or a ValueError naming it."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{where}: state_dtype={state_dtype!r} is invalid: allowed torch.float32 or torch.bfloat16")
    return state_dtype


def check_betas(where: str, betas: Any) -> None:
    """``betas`` is a pair of numbers in [0, 1), or a ValueError naming it."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(
            isinstance(b, _numbers.Real) and not isinstance(b, bool) and math.isfinite(b) and 0 <= b < 1
            for b in betas):
        raise ValueError(f"{where}: betas={betas!r} is invalid: allowed a pair of numbers in [0, 1)")


def _hyperparam_names(rule) -> frozenset | None:
    """The names of ``rule.hyperparams`` at the rule's defaults (None where they cannot be read so)."""
    try:
        return frozenset(rule.hyperparams(dict(rule.group_defaults(), lr=1e-3)))
    except Exception:
        return None


class _DefaultTensorHyperparams:
    """``UpdateRule.tensor_hyperparams``'s default: ``("lr", "weight_decay")``, or ``("lr",)`` for a rule whose
    hyper-parameters have no ``weight_decay`` (a rule without weight decay need not say so). A subclass that sets
    ``tensor_hyperparams`` replaces it."""

    def __get__(self, obj, cls=None) -> tuple[str, ...]:
        if obj is None:
            return ("lr", "weight_decay")
        names = obj.__dict__.get("_zenflow_hyperparam_names", False)
        if names is False:
            names = obj.__dict__["_zenflow_hyperparam_names"] = _hyperparam_names(obj)
        return ("lr", "weight_decay") if names is None or "weight_decay" in names else ("lr",)


class FastItem(NamedTuple):
    """One item of :meth:`UpdateRule.fast_step_`, by name (:func:`unpack_item`)."""

    param: torch.Tensor  # [R, C] (a vector as [1, n])
    grad: torch.Tensor  # [R, C], the parameter's dtype, not yet divided by grad_scale
    columns: torch.Tensor | None  # [k] int64, or None: every column
    state: tuple[torch.Tensor, ...]  # [R, k] each, in state_names order (fp32)
    master: torch.Tensor | None  # [R, k] fp32 values of a low-precision parameter's columns, or None
    step: Any  # an int, or the columns' int64 step counts [k]
    tensor_hyperparams: dict  # the item's tensor_hyperparams by name


def unpack_item(rule: UpdateRule, item: tuple) -> FastItem:
    """A fast-path item (the positional tuple :meth:`UpdateRule.fast_step_` receives) by name."""
    n = len(rule.state_names)
    return FastItem(item[0], item[1], item[2], tuple(item[3 : 3 + n]), item[3 + n], item[4 + n],
                    dict(zip(rule.tensor_hyperparams, item[5 + n :], strict=True)))


def check_rule(rule: UpdateRule, group: dict, where: str) -> None:
    """The rule contract, checked when an optimizer is made (``group``: the rule's defaults with ``lr``): distinct
    ``state_names`` (identifiers, none of the fast path's own ``step``, ``selected``, ``master``); every name the
    parts read (``tensor_hyperparams``: per tensor, ``launch_hyperparams``: per launch) a key of ``hyperparams(group)``,
    and every key of it named by one of them (the device's step receives only those); ``step_`` takes ``step`` and every
    hyper-parameter by keyword. A ValueError (TypeError for ``step_``'s signature) names what is wrong."""
    label = f"{where}: {rule!r}"
    names = rule.state_names
    if not isinstance(names, tuple) or not all(isinstance(n, str) and n.isidentifier() for n in names) or len(
            set(names)) != len(names) or set(names) & set(RESERVED_STATE_NAMES):
        raise ValueError(f"{label}: state_names={names!r} is invalid: allowed a tuple of distinct identifiers, none "
                         f"of {', '.join(RESERVED_STATE_NAMES)} (the fast path's own entries)")
    hyperparams = rule.hyperparams(group)
    if not isinstance(hyperparams, dict) or not all(isinstance(k, str) for k in hyperparams):
        raise ValueError(f"{label}: hyperparams() returned {type(hyperparams).__name__}: allowed a dict of floats by "
                         "name")
    tensor_hyperparams, launch_hyperparams = tuple(rule.tensor_hyperparams), tuple(rule.launch_hyperparams)
    given = ", ".join(map(repr, hyperparams)) or "nothing"
    for part, read in (("tensor_hyperparams", tensor_hyperparams), ("launch_hyperparams", launch_hyperparams)):
        missing = [n for n in read if n not in hyperparams]
        if missing:
            raise ValueError(f"{label}: {part} names {', '.join(map(repr, missing))}, which hyperparams() does not "
                             f"give (it gives {given}): every name the parts read must be a key of hyperparams()")
    both = sorted(set(tensor_hyperparams) & set(launch_hyperparams))
    if both:
        raise ValueError(f"{label}: {', '.join(map(repr, both))} is in both tensor_hyperparams and launch_hyperparams: "
                         "allowed in one")
    unread = [n for n in hyperparams if n not in tensor_hyperparams and n not in launch_hyperparams]
    if unread:
        raise ValueError(f"{label}: hyperparams() gives {', '.join(map(repr, unread))}, which neither "
                         f"tensor_hyperparams {tensor_hyperparams!r} nor launch_hyperparams {launch_hyperparams!r} "
                         "names: the device's step would not receive it")
    try:
        params = inspect.signature(rule.step_).parameters
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to read
        return
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        takes = {n for n, p in params.items()
                 if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
        missing = [n for n in ("step", *hyperparams) if n not in takes]
        if missing:
            raise TypeError(f"{label}: step_ does not take {', '.join(map(repr, missing))} by keyword: it is called "
                            f"as step_(param, grad, state, step=..., {', '.join(f'{n}=...' for n in hyperparams)})")


RENAMED = {"numbers": "hyperparams", "per_tensor": "tensor_hyperparams", "shared": "launch_hyperparams"}
"""The names a rule of one's own wrote before 0.1's renaming (old -> new); a subclass that still writes one gets it
under the new name, with a DeprecationWarning."""


class UpdateRule:
    """An optimizer's update rule, as ZenFlow applies it (module docstring). Subclasses set ``name``,
    ``state_names``, ``launch_hyperparams`` and write ``group_defaults``, ``check_group``, ``hyperparams`` and
    ``step_``."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for old, new in RENAMED.items():
            if old in cls.__dict__ and new not in cls.__dict__:
                warnings.warn(f"{cls.__name__}.{old} is now called {new}: rename it (the old name stops working in a "
                              "later release)", DeprecationWarning, stacklevel=2)
                setattr(cls, new, cls.__dict__[old])

    name: ClassVar[str] = ""
    """Recorded in checkpoints: a checkpoint of another rule is refused."""
    state_names: tuple[str, ...] = ()
    """The per-element state (the parameter's shape, zero at the start)."""
    state_dtype: torch.dtype = torch.float32
    """The dtype of that state in host memory: fp32, or bf16 (half the bytes; each step computes in fp32 from the
    stored values and rounds the new state as ``state_rounding`` says; the parameter's update uses the unrounded
    values). The fast path's state on the device stays fp32."""
    state_rounding: str = "nearest"
    """How a host step rounds new bf16 state: ``"nearest"`` (even), or ``"stochastic"`` (unbiased, with bits of a
    counter-based hash of ``rounding_seed``, the host step and the element: ``zenflow_kernels.rounding``)."""
    rounding_seed: int = 0
    """The seed of stochastic rounding (an integer in [0, 2^32))."""
    tensor_hyperparams: ClassVar[tuple[str, ...]] = _DefaultTensorHyperparams()
    """Hyper-parameters a multi-tensor launch takes per tensor (they may differ between param groups in one launch); by
    default ``("lr", "weight_decay")``, or ``("lr",)`` where ``hyperparams`` gives no ``weight_decay``."""
    launch_hyperparams: ClassVar[tuple[str, ...]] = ()
    """The other hyper-parameters: one launch per distinct set of them."""
    uses_step: ClassVar[bool] = True
    """``step_`` reads its step count (False: the columns of a matrix need not be grouped by it)."""
    compile: bool | str = "auto"
    """Where the rule has no kernel of its own (``host_step_``, ``fast_step_`` not overridden), run ``step_``
    compiled (``zenflow_kernels.rules.compiled``): True always, False never (eager), ``"auto"`` where a call is large
    enough to repay a compile (a host run of ``compiled.HOST_MIN_NUMEL`` elements; a fast step of
    ``compiled.FAST_MIN_ITEMS`` tensors or ``compiled.FAST_MIN_NUMEL`` elements). An instance may set its own."""

    @classmethod
    def own_kernel(cls, method: str) -> bool:
        """The rule writes ``method`` (``"host_step_"`` or ``"fast_step_"``) itself, a kernel of its own, rather than
        running ``step_`` compiled or eager."""
        return getattr(cls, method) is not getattr(UpdateRule, method)

    def set_state_storage(self, where: str, state_dtype: Any, state_rounding: Any = "nearest",
                          rounding_seed: Any = 0) -> None:
        """Check and set ``state_dtype``, ``state_rounding`` and ``rounding_seed`` (the built-in rules' keywords),
        or a ValueError naming the one that is invalid."""
        self.state_dtype = check_state_dtype(where, state_dtype)
        self.state_rounding = check_state_rounding(where, state_rounding, state_dtype, rounding_seed)
        self.rounding_seed = int(rounding_seed)

    def rounding(self, step: int, key: int) -> StochasticRounding | None:
        """What a host pass at host step ``step`` over elements keyed from ``key`` rounds with: None (to nearest),
        or a :class:`~zenflow_kernels.rounding.StochasticRounding`."""
        if self.state_rounding != "stochastic":
            return None
        return StochasticRounding(self.rounding_seed, int(step), int(key))

    def storage_args(self) -> str:
        """The repr's state keywords that differ from the defaults (``""`` when none does)."""
        args = ""
        if self.state_dtype != torch.float32:
            args += f", state_dtype={self.state_dtype}"
        if self.state_rounding != "nearest":
            args += f", state_rounding={self.state_rounding!r}"
        if self.rounding_seed != 0:
            args += f", rounding_seed={self.rounding_seed}"
        return args

    # -- hyper-parameters ---------------------------------------------------------------------------

    def group_defaults(self) -> dict:
        """The rule's hyper-parameters as param-group keys (``lr`` is the optimizer's)."""
        raise NotImplementedError

    def check_group(self, group: dict, where: str) -> None:
        """A param group's hyper-parameters (``lr`` included), or a ValueError naming the key, its value and what is
        allowed."""
        check_lr(group.get("lr"), where)  # a number, or a 1-element float tensor (as torch.optim takes it)

    def hyperparams(self, group: dict) -> dict:
        """The floats ``step_`` and the kernels read of a (checked) param group: ``lr`` and the rule's own."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """What a checkpoint records of the rule: its name, its state's names and dtype, and its defaults."""
        record = {"name": self.name, "state_names": list(self.state_names),
                  "state_dtype": str(self.state_dtype).replace("torch.", ""), **self.group_defaults()}
        if self.state_rounding != "nearest":  # (absent: a checkpoint from before the option, or round to nearest)
            record.update(state_rounding=self.state_rounding, rounding_seed=self.rounding_seed)
        return record

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.group_defaults().items())
        return f"rules.{type(self).__name__}({args}{self.storage_args()})"

    # -- the step -------------------------------------------------------------------------------------

    def step_(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, step: int,
              **hyperparams) -> None:
        """One step of ``param`` in place with ``grad`` (fp32, its shape), ``state`` its tensors by name (updated in
        place), ``step`` this step's count (1 for the first); ``hyperparams`` as :meth:`hyperparams` gives them."""
        raise NotImplementedError

    def columns_step_(self, block: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                      steps: torch.Tensor | int, **hyperparams) -> None:
        """:meth:`step_` on the columns of ``block`` [R, k] where column j is at its own step ``steps[j]``: columns
        sharing a step count are stepped together (a rule that does not read it: all at once)."""
        if isinstance(steps, int) or not self.uses_step:
            self.step_(block, grad, state, step=steps if isinstance(steps, int) else 0, **hyperparams)
            return
        values = torch.unique(steps).tolist()
        if len(values) == 1:
            self.step_(block, grad, state, step=int(values[0]), **hyperparams)
            return
        for s in values:
            cols = (steps == s).nonzero().flatten()
            part = block.index_select(1, cols)
            held = {name: t.index_select(1, cols) for name, t in state.items()}
            self.step_(part, grad.index_select(1, cols), held, step=int(s), **hyperparams)
            block.index_copy_(1, cols, part)
            for name, t in held.items():
                state[name].index_copy_(1, cols, t)

    # -- kernels (defaults: step_ in torch) ---------------------------------------------------------

    fuses_last: ClassVar[bool] = False
    """``host_accumulate_step_`` folds the interval's last gradient into the step's pass (else the host adds it to
    the sums first)."""

    def host_step_(self, param: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], *, step: int,
                   grad_scale: float, out: torch.Tensor | None = None, zero_grad: bool = False,
                   rounding: StochasticRounding | None = None, **hyperparams) -> None:
        """The host pass over flat fp32 runs: ``param`` (the master) stepped with ``grad / grad_scale`` (``grad``
        the sums, fp32), ``state`` in ``state_names`` order, the result rounded into ``out`` (fp32/bf16/fp16, the
        copy-out) and ``grad`` zeroed with ``zero_grad``. ``rounding`` (passed only where ``state_rounding`` is
        ``"stochastic"``: :meth:`rounding`) rounds the new bf16 state, element i with key ``rounding.key + i`` and
        state tensor k's bits (``zenflow_kernels.rounding``). The default is :meth:`step_` compiled into one pass
        (``rules.compiled``, with the calling thread's numba thread count), or :meth:`eager_host_step_` where it
        is not compiled (``compile``)."""
        from .compiled import compiled_host_step_

        if not compiled_host_step_(self, param, grad, state, step=step, grad_scale=grad_scale, out=out,
                                   zero_grad=zero_grad, hyperparams=hyperparams, rounding=rounding):
            self.eager_host_step_(param, grad, state, step=step, grad_scale=grad_scale, out=out, zero_grad=zero_grad,
                                  rounding=rounding, **hyperparams)

    def eager_host_step_(self, param: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], *, step: int,
                         grad_scale: float, out: torch.Tensor | None = None, zero_grad: bool = False,
                         rounding: StochasticRounding | None = None, **hyperparams) -> None:
        """:meth:`host_step_` as :meth:`step_` in eager torch (torch ops on the host worker's thread use torch's
        thread count and start a second OpenMP team of torch's). State in bf16 is stepped in fp32 copies and
        rounded back, to nearest even or (``rounding``) stochastically, as the kernels do."""
        g = grad.float()
        g = g.clone() if grad_scale == 1.0 else g.mul(1.0 / grad_scale)  # the kernels' float32 reciprocal
        work = [t if t.dtype == torch.float32 else t.float() for t in state]
        self.step_(param, g, dict(zip(self.state_names, work, strict=True)), step=step, **hyperparams)
        for k, (t, w) in enumerate(zip(state, work, strict=True)):
            if w is not t:
                t.copy_(w if rounding is None else round_to_bf16(w, rounding, k))
        if out is not None:
            out.copy_(param)
        if zero_grad:
            grad.zero_()

    def host_accumulate_step_(self, param, acc, grad, state, *, step, grad_scale, out=None, zero_acc=False,
                              **hyperparams) -> None:
        """``acc += grad`` and :meth:`host_step_` with ``acc`` in one pass (where ``fuses_last``; ``rounding``
        passed on in ``hyperparams`` as to :meth:`host_step_`)."""
        acc.add_(grad.reshape(acc.shape).float())
        self.host_step_(param, acc, state, step=step, grad_scale=grad_scale, out=out, zero_grad=zero_acc, **hyperparams)

    def fast_step_(self, items: list[tuple], *, grad_scale: float, **launch_hyperparams) -> None:
        """The device's update of every item of one launch: ``(param [R, C], grad [R, C], columns [k] or None,
        *state ([R, k] each, in state_names order), master [R, k] fp32 or None, step, *tensor_hyperparams)``.
        ``columns`` None: every column (a vector as [1, n]). ``master``: the fp32 values of a low-precision parameter's
        columns, stepped and rounded into it. ``step``: an int, or the columns' int64 counts [k]
        (:func:`unpack_item` names the parts). The default is :meth:`step_` compiled over every item in one call
        (``rules.compiled``), or :meth:`reference_fast_step_` where it is not compiled (``compile``); the
        built-in rules launch fused kernels (``zenflow_kernels.ops``)."""
        from .compiled import compiled_fast_step_

        if not compiled_fast_step_(self, items, grad_scale=grad_scale, launch_hyperparams=launch_hyperparams):
            self.reference_fast_step_(items, grad_scale=grad_scale, **launch_hyperparams)

    def reference_fast_step_(self, items: list[tuple], *, grad_scale: float, **launch_hyperparams) -> None:
        """:meth:`fast_step_` in plain torch: each item's gradient columns gathered, multiplied by
        ``1 / grad_scale``, and stepped with :meth:`columns_step_`; the reference the fused kernels are tested
        against, and the torch backend's implementation (``ops.use_backend("torch")``)."""
        n = len(self.state_names)
        inv = 1.0 / grad_scale
        for item in items:
            p, g, idx = item[:3]
            state, master, step = item[3 : 3 + n], item[3 + n], item[4 + n]
            hyperparams = dict(zip(self.tensor_hyperparams, item[5 + n :], strict=True), **launch_hyperparams)
            grad = g.float() if idx is None else g.index_select(1, idx).float()
            if grad_scale != 1.0:
                grad = grad.mul_(inv) if grad is not g else grad.mul(inv)
            if master is not None:
                work = master
            elif idx is None:
                work = p if p.dtype == torch.float32 else p.float()  # fp32 arithmetic, one rounding (the kernels')
            else:
                work = p.index_select(1, idx).float()
            self.columns_step_(work, grad, dict(zip(self.state_names, state, strict=True)), step, **hyperparams)
            if idx is None:
                if work is not p:
                    p.copy_(work)
            else:
                p.index_copy_(1, idx, work.to(p.dtype))
