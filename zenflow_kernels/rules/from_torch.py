"""``rules.from_torch``: a ``torch.optim`` optimizer's own step as a ZenFlow update rule.

``rules.from_torch(torch.optim.RMSprop, alpha=0.99, eps=1e-8)`` makes the rule from torch itself, at construction:

* the per-element state's names, and that each starts at zero: read from the optimizer's state after its own
  initialisation (a throwaway instance over one small tensor whose ``step()`` stops at the functional call);
* the step: the optimizer's functional (``torch.optim.rmsprop.rmsprop`` with ``foreach=False``: its single-tensor
  implementation, ``_single_tensor_rmsprop``), called with the arguments ``step()`` passes it, the lists holding the
  one tensor ZenFlow steps, its state and a step count;
* the hyper-parameters: the optimizer's real-valued defaults (``alpha``, ``eps``, ``weight_decay``, ``momentum``;
  Adam's ``betas`` as ``beta1``, ``beta2``), mapped to the functional's keywords by a second probe with every value
  distinct; the flags (``centered``, ``maximize``, ``amsgrad``) are the rule's, fixed for every param group.

So ZenFlow with every column on the device (``topk_ratio=1``) is torch's optimizer (eager: its bits; compiled:
within ``rules.compiled``'s bound), and the reference runs torch's own step. Supported: optimizers whose state is
per-element tensors starting at zero, plus an optional scalar ``step`` (RMSprop, Adagrad, Adam, AdamW, Adamax,
Adadelta, RAdam); refused, with the reason: lazily made state (SGD's momentum buffer: use ``rules.SGD``), scalar
state beside ``step`` (NAdam's ``mu_product``, ASGD), state that does not start at zero (Adagrad's
``initial_accumulator_value``, Rprop), and a param group whose values change the state (RMSprop's ``momentum`` from 0
to 0.9: pass it to ``from_torch``). ``uses_step`` is measured: the functional's result at step counts 1 and 5 (Adagrad
reads its count only with ``lr_decay``).
"""

from __future__ import annotations

import inspect
import math
import numbers as _numbers
import sys
from typing import Any

import torch

from ..rounding import check_state_rounding
from .base import UpdateRule, check_real, check_state_dtype

__all__ = ["TorchRule", "from_torch"]

_FORCED = {"foreach": False, "capturable": False, "differentiable": False}  # the single-tensor path, eager or compiled
_NOT_RULE = ("lr", "foreach", "fused", "capturable", "differentiable")  # not the rule's to take


class _Stop(Exception):
    pass


class _Layout:
    """What ``step()`` passed the functional: each argument as ``("params",)``, ``("grads",)``, ``("state",
    name)``, ``("step",)``, ``("empty",)`` (an empty list) or ``("value", v)``; the state's names; the step count's
    dtype (None: no step count)."""

    def __init__(self, fn, arguments: dict, layout: dict, state_names: tuple, step_dtype):
        self.fn, self.arguments, self.layout = fn, arguments, layout
        self.state_names, self.step_dtype = state_names, step_dtype
        # passed by position as step() passes them, the rest by keyword (torch's _disable_dynamo_if_unsupported
        # reads state_steps by its position when compiling)
        self.positional = []
        for name, param in inspect.signature(fn).parameters.items():
            if param.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or name not in layout:
                break
            self.positional.append(name)

    def signature(self) -> tuple:
        return (self.fn, self.state_names, tuple((k, v[0], v[1] if v[0] == "state" else None)
                                                 for k, v in self.layout.items()))


def _real(v) -> bool:
    return isinstance(v, _numbers.Real) and not isinstance(v, bool)


def _probe(cls, values: dict, where: str, *, zero_start: bool = True) -> _Layout:
    """Run ``cls``'s ``step()`` over one tensor up to its functional call: the call's arguments and the state
    (``zero_start``: refuse state that does not start at zero)."""
    p = torch.zeros(4, requires_grad=True)
    try:
        opt = cls([p], **values)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    p.grad = torch.zeros(4)
    step = getattr(cls.step, "__wrapped__", cls.step)
    module = sys.modules[step.__module__]
    names = [n for n in getattr(module, "__all__", ()) if inspect.isfunction(getattr(module, n, None))]
    captured: dict[str, Any] = {}
    originals = {n: getattr(module, n) for n in names}

    def stub(name):
        def call(*args, **kwargs):
            fn = originals[name]
            bound = inspect.signature(fn).bind(*args, **kwargs)
            captured.update(fn=fn, arguments=dict(bound.arguments),
                            state={k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)})
            raise _Stop

        return call

    try:
        for n in names:
            setattr(module, n, stub(n))
        opt.step()
    except _Stop:
        pass
    finally:
        for n, fn in originals.items():
            setattr(module, n, fn)
    if not captured:
        raise ValueError(f"{where}: {cls.__name__}.step() calls no functional of {module.__name__} "
                         "(allowed: a torch.optim optimizer with a functional form, e.g. RMSprop, Adagrad, Adam)")
    state = opt.state[p]
    at_call = captured["state"]
    step_t = state.get("step")
    per_element = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape}
    other = [k for k in state if k not in per_element and k != "step"]
    if other:
        raise ValueError(f"{where}: {cls.__name__} keeps {', '.join(map(repr, other))} beside its per-element state "
                         "and step count: allowed per-element state (tensors shaped like the parameter) only")
    if step_t is not None and not (torch.is_tensor(step_t) and step_t.dim() == 0):
        raise ValueError(f"{where}: {cls.__name__}'s step count is not a scalar tensor")
    for k, v in per_element.items():
        start = at_call.get(k, v)
        if v.dtype != torch.float32 or (zero_start and torch.count_nonzero(start)):
            raise ValueError(
                f"{where}: {cls.__name__}'s state {k!r} starts at {float(start.reshape(-1)[0])!r} ({start.dtype}): "
                "allowed float32 state starting at zero (ZenFlow starts every column's state at zero)")
    by_id = {id(v): k for k, v in per_element.items()}
    layout, seen = {}, []
    for arg, value in captured["arguments"].items():
        if isinstance(value, (list, tuple)):
            if not value:
                layout[arg] = ("empty",)
            elif len(value) != 1:
                raise ValueError(f"{where}: {cls.__name__}'s functional got {arg}={value!r}: not understood")
            elif value[0] is p:
                layout[arg] = ("params",)
            elif value[0] is p.grad:
                layout[arg] = ("grads",)
            elif value[0] is not None and id(value[0]) in by_id:
                layout[arg] = ("state", by_id[id(value[0])])
                seen.append(by_id[id(value[0])])
            elif step_t is not None and value[0] is step_t:
                layout[arg] = ("step",)
            elif value[0] is None:
                raise ValueError(f"{where}: {cls.__name__} makes its state {arg!r} lazily, in its step (allowed: "
                                 "state its initialisation makes; rules.SGD is SGD's)")
            else:
                raise ValueError(f"{where}: {cls.__name__}'s functional got {arg}={value!r}: not understood")
        else:
            layout[arg] = ("value", value)
    missing = [k for k in per_element if k not in seen]
    if missing:
        raise ValueError(f"{where}: {cls.__name__}'s state {', '.join(map(repr, missing))} is not passed to its "
                         "functional: not understood")
    return _Layout(captured["fn"], captured["arguments"], layout, tuple(seen),
                   None if step_t is None else step_t.dtype)


def _distinct(defaults: dict) -> dict:
    """The real-valued defaults, each (each element of a tuple) replaced by a value no other has."""
    out, n = {}, 0
    for k, v in defaults.items():
        if _real(v):
            n += 1
            out[k] = 0.0123 * n + 0.00017
        elif isinstance(v, tuple) and v and all(_real(x) for x in v):
            vals = []
            for _ in v:
                n += 1
                vals.append(0.0123 * n + 0.00017)
            out[k] = tuple(vals)
    return out


class TorchRule(UpdateRule):
    """A rule made by :func:`from_torch` (one subclass per torch optimizer and state layout): torch's functional
    step, its state and its hyper-parameters."""

    torch_class: type = torch.optim.Optimizer
    _layout: _Layout

    def __init__(self, torch_kwargs: dict, defaults: dict, mapping: dict, layout: _Layout, state_dtype: torch.dtype,
                 uses_step: bool, state_rounding: str = "nearest", rounding_seed: int = 0):
        self.torch_kwargs = dict(torch_kwargs)  # what from_torch was given (repr)
        self._defaults = defaults  # group key -> value (the hyper-parameters' keys)
        self._mapping = mapping  # functional keyword -> (group key, element or None)
        self._layout = layout
        self._fixed = {k: v[1] for k, v in layout.layout.items() if v[0] == "value" and k not in mapping}
        self._fixed.update({k: v for k, v in _FORCED.items() if k in layout.layout})
        self.state_dtype, self.state_rounding, self.rounding_seed = state_dtype, state_rounding, rounding_seed
        self.uses_step = uses_step
        self._checked: dict[tuple, bool] = {}  # group values -> whether they read the step count

    # -- hyper-parameters -------------------------------------------------------------------------------------------

    def group_defaults(self) -> dict:
        return dict(self._defaults)

    def check_group(self, group: dict, where: str) -> None:
        super().check_group(group, where)
        for key, default in self._defaults.items():
            value = group.get(key)
            if isinstance(default, tuple):
                if not isinstance(value, (tuple, list)) or len(value) != len(default) or not all(
                        _real(x) and math.isfinite(x) for x in value):
                    raise ValueError(f"{where}: {key}={value!r} is invalid: allowed {len(default)} finite numbers")
            else:
                check_real(where, key, value, lo=-math.inf)
        values = tuple((k, tuple(group[k]) if isinstance(group[k], list) else group[k]) for k in self._defaults)
        if values not in self._checked:  # (a scheduler's new lr is not a new check)
            self._checked[values] = self._check_values(dict(values), where)
        if self._checked[values]:
            self.uses_step = True

    def _check_values(self, values: dict, where: str) -> bool:
        """torch's own checks of a group's values, the same state layout as the rule's, and whether the step reads its
        step count at them."""
        layout = _probe(self.torch_class, {**self.torch_kwargs, **values, "lr": 1e-3}, where)
        if layout.signature() != self._layout.signature():
            raise ValueError(
                f"{where}: {', '.join(f'{k}={v!r}' for k, v in values.items())} needs torch's state "
                f"{layout.state_names} and call {layout.signature()[2]}, not the rule's {self._layout.state_names} "
                f"({self!r}): pass such values to rules.from_torch")
        return _reads_step(self, values)

    def hyperparams(self, group: dict) -> dict:
        out = {}
        for kw, (key, element) in self._mapping.items():
            value = group[key]
            out[kw] = float(value) if element is None else float(value[element])
        return out

    @property
    def tensor_hyperparams(self) -> tuple[str, ...]:
        return ("lr", "weight_decay") if "weight_decay" in self._mapping else ("lr",)

    @property
    def launch_hyperparams(self) -> tuple[str, ...]:
        return tuple(k for k in self._mapping if k not in ("lr", "weight_decay"))

    def to_dict(self) -> dict:
        return {**super().to_dict(), "torch": f"torch.optim.{self.torch_class.__name__}",
                "flags": {k: v for k, v in self._fixed.items() if isinstance(v, (bool, int, float, str, type(None)))}}

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.torch_kwargs.items()) + self.storage_args()
        return f"rules.from_torch(torch.optim.{self.torch_class.__name__}{args})"

    # -- the step ---------------------------------------------------------------------------------------------------

    def step_(self, param, grad, state, *, step, **hyperparams) -> None:
        """torch's functional step of ``param`` (its single-tensor implementation), at step count ``step``."""
        args = {}
        for arg, how in self._layout.layout.items():
            kind = how[0]
            if kind == "params":
                args[arg] = [param]
            elif kind == "grads":
                args[arg] = [grad]
            elif kind == "state":
                args[arg] = [state[how[1]]]
            elif kind == "step":  # (the functional adds one; a CPU scalar, as torch keeps it)
                args[arg] = [torch.zeros((), dtype=self._layout.step_dtype) + (step - 1)]
            elif kind == "empty":
                args[arg] = []
        args.update(self._fixed)
        args.update(hyperparams)
        positional = [args.pop(name) for name in self._layout.positional]
        self._layout.fn(*positional, **args)


def _reads_step(rule: TorchRule, values: dict) -> bool:
    """Whether two steps from zero state at step counts 1, 2 and at 5, 6 differ (the rule reads its step count at
    these values)."""
    g = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(64, generator=g), [torch.randn(64, generator=g) for _ in range(2)]
    hyperparams = rule.hyperparams(dict(values, lr=1e-2))
    outs = []
    with torch.no_grad():
        for first in (1, 5):
            p, st = p0.clone(), {n: torch.zeros(64) for n in rule.state_names}
            for n, grad in enumerate(grads):
                rule.step_(p, grad.clone(), st, step=first + n, **hyperparams)
            outs.append((p, *st.values()))
    return not all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


_classes: dict[tuple, type] = {}


def from_torch(optimizer_class: type, *, state_dtype: torch.dtype = torch.float32, state_rounding: str = "nearest",
               rounding_seed: int = 0, **torch_kwargs) -> TorchRule:
    """The update rule of ``optimizer_class`` (a ``torch.optim`` optimizer with per-element state) with its
    hyper-parameters ``torch_kwargs`` (its keyword arguments but ``lr``, ZenFlow's, and ``foreach``, ``fused``,
    ``capturable``, ``differentiable``, ZenFlow's choice: the single-tensor step); ``state_dtype`` as the built-in
    rules' (bf16 host state), ``state_rounding`` and ``rounding_seed`` too (``UpdateRule``). The module docstring
    says what is read from torch and what is refused, with a ValueError that says why."""
    where = f"rules.from_torch({getattr(optimizer_class, '__name__', optimizer_class)!s})"
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"{where}: {optimizer_class!r} is invalid: allowed a torch.optim.Optimizer subclass")
    taken = [k for k in _NOT_RULE if k in torch_kwargs]
    if taken:
        raise ValueError(f"{where}: {', '.join(f'{k}=' for k in taken)} is not the rule's: lr is ZenFlow's "
                         "(ZenFlow(params, rule, lr=...)); the step is torch's single-tensor one")
    check_state_dtype(where, state_dtype)
    check_state_rounding(where, state_rounding, state_dtype, rounding_seed)
    layout = _probe(optimizer_class, dict(torch_kwargs, lr=1e-3), where)
    probe_opt = optimizer_class([torch.zeros(1, requires_grad=True)], lr=1e-3, **torch_kwargs)
    defaults = {k: v for k, v in probe_opt.defaults.items() if k not in _NOT_RULE}
    # which functional keyword reads which group value: a probe with every real value distinct
    distinct = _distinct({"lr": 1e-3, **defaults})
    mapping: dict[str, tuple] = {}
    try:
        second = _probe(optimizer_class, {**torch_kwargs, **distinct}, where, zero_start=False)
    except ValueError:  # (values torch refuses: match the first probe's values, where they are unique)
        second, distinct = layout, {"lr": 1e-3, **{k: v for k, v in defaults.items()}}
    where_is: dict[float, list] = {}
    for key, v in distinct.items():
        for e, x in ([(None, v)] if not isinstance(v, tuple) else list(enumerate(v))):
            if _real(x):
                where_is.setdefault(float(x), []).append((key, e))
    for arg, how in second.layout.items():
        if how[0] != "value" or not _real(how[1]) or arg in _FORCED:
            continue
        found = where_is.get(float(how[1]), [])
        first_value = layout.layout.get(arg, ("value", None))[1]
        if len(found) == 1:
            mapping[arg] = found[0]
        elif _real(first_value) and first_value != how[1]:
            raise ValueError(f"{where}: the functional's {arg}= is computed from the hyper-parameters: not supported")
    if mapping.get("lr") != ("lr", None):
        raise ValueError(f"{where}: the functional does not take the learning rate as lr=: not supported")
    used = {key for key, _ in mapping.values()}
    group_keys = {k: (tuple(v) if isinstance(v, list) else v) for k, v in defaults.items() if k in used}
    key = (optimizer_class, layout.signature(), tuple(sorted(mapping.items())),
           tuple(sorted((k, repr(v)) for k, v in layout.layout.items() if v[0] == "value" and k not in mapping)))
    cls = _classes.get(key)
    if cls is None:
        name = optimizer_class.__name__
        cls = _classes[key] = type(name, (TorchRule,), {
            "name": name, "state_names": layout.state_names, "torch_class": optimizer_class,
            "__module__": __name__, "__doc__": f"torch.optim.{name}'s step as a ZenFlow rule (rules.from_torch)."})
    rule = cls(torch_kwargs, group_keys, mapping, layout, state_dtype, uses_step=False, state_rounding=state_rounding,
               rounding_seed=int(rounding_seed))
    rule.uses_step = _reads_step(rule, group_keys)
    rule._checked[tuple(group_keys.items())] = rule.uses_step
    return rule
