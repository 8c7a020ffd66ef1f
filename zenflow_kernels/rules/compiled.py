"""Compiled kernels for an update rule written only in plain torch (docs/DESIGN.md section 13).

A rule whose author wrote ``step_`` and no kernel (``host_step_`` and ``fast_step_`` not overridden) runs that
``step_`` through ``torch.compile`` in both places ZenFlow applies it:

* the host pass over flat fp32 runs (``UpdateRule.host_step_``; on the host worker's thread when the update
  overlaps): one function of ``(param, grad, *state, out)`` that divides the sums by ``grad_scale``, steps fp32
  copies of bf16 state and rounds them back, writes the copy-out and zeroes the sums, compiled by Inductor into one
  C++ loop at the calling thread's numba thread count (the host worker's own core budget, ``cpu_ops/cores.py``),
  fewer for a small call as the numba kernels launch (Inductor bakes the count into the kernel: a compile per
  power of two). Built with Inductor's C++ wrapper (``CPP_WRAPPER``), whose entry releases the GIL for the call, like
  the numba kernels, so the training thread's Python runs beside it.
* the fast path over the selected columns (``UpdateRule.fast_step_``): every item's selected columns packed into
  flat fp32 buffers (``rules.packing``: one numba launch on the CPU, where the state can live in the packed buffer
  between steps; torch ops on a device), the same compiled flat step over each run of columns that share their
  hyper-parameters (param groups) and, for a rule that reads its step count (``uses_step``), their count (the
  reference's grouping, ``UpdateRule.columns_step_``), and unpacked back into the parameters, masters and state: a few
  calls per launch whatever the number of tensors. Inductor's C++ on the CPU, Triton on a CUDA device.

Compiled once per rule class, device type and thread count; Dynamo's guards add one compile per dtype combination it
meets (fp32 or bf16 state, the copy-out's dtype, a low-precision parameter's master) and per branch a ``step_``
takes on a number (``if weight_decay != 0``). Lengths are dynamic (a new selection or another run length does not
recompile), and the hyper-parameters (``lr``, the rule's own, ``grad_scale``, the step count) are graph inputs, not
constants: the step count an int (a symbolic integer: ``math.sqrt(1 - beta2 ** step)`` stays symbolic), each Python
float a 0-dim tensor, and the decompositions below rewrite the ops that take a number as a Scalar argument
(``add_(x, alpha=-lr)``, ``addcmul_(.., value=)``, ``addcdiv_``, ``lerp_(.., weight)``, ``pow``, ``clamp``) into
tensor arithmetic, so an LR schedule does not recompile. An op outside that list that takes a changing number makes
Dynamo recompile when it changes: after ``MAX_COMPILES`` compiles of one place the rule runs eager there, with a
warning. Inductor's caches (``TORCHINDUCTOR_CACHE_DIR``) make a second process's compile cheap.

Known cost: values a ``step_`` derives from its hyper-parameters (``1 - beta1 ** step``, ``lr / bias_correction1``) are
scalar computations that Inductor fuses into the elementwise loop, recomputed once per vector of elements; a ``pow``
there costs more than the bytes (bench/results/cpu_rules.json: the AdEMAMix of bench/custom_rules.py, three state
tensors and two bias corrections, runs at a fraction of RMSprop's share of the memory roofline, where RMSprop, whose
``step_`` reads no step-dependent number, comes near the built-in kernels).

The compiled step is not bit-identical to the eager one: Inductor's C++ contracts multiply-adds that ATen rounds
twice (``add_(x, alpha=a)``: ATen ``fmadd``, compiled ``x * a`` then ``+``, or the reverse), evaluates the number
arithmetic in float64 tensors rounded to fp32 as ATen does for Python scalars, and vectorises reductions in another
order (measured on x86 AVX2: at most 2 ulps of the largest of an element's value before, after and its update;
tests/test_compiled_rules.py asserts 4). Every path of one run is deterministic, so the synchronous and the
asynchronous link give the same bits; the reference (``ReferenceZenFlow``) runs the eager ``step_``. A rule with a
kernel of its own (the built-ins) is never compiled: a call of the base class's default on it (a test's torch
reference) is its eager step.

``compile`` on the rule chooses (``UpdateRule.compile``): True, False, or ``"auto"`` (the default): compiled where a
call is large enough to repay a compile (a host run of ``HOST_MIN_NUMEL`` elements, a fast step of
``FAST_MIN_ITEMS`` tensors or ``FAST_MIN_NUMEL`` elements), eager below (a test model's few small tensors). Where
compiling is impossible (no C++ compiler, a ``step_`` Dynamo cannot trace, too many recompiles) the eager path runs
with one :class:`RuleCompileWarning` that says why, and :func:`paths` (``stats()["rule_paths"]``) says which path
each place of the rule runs, how many calls ran compiled and eager, and the compiles' count and seconds.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..rounding import stochastic_bf16

__all__ = ["FAST_MIN_ITEMS", "FAST_MIN_NUMEL", "HOST_MIN_NUMEL", "MAX_COMPILES", "RuleCompileWarning",
           "compiled_fast_step_", "compiled_host_step_", "compiling", "paths", "reset"]

HOST_MIN_NUMEL = 1 << 16
"""``compile="auto"``: a host run of at least this many elements runs compiled (eager below: microseconds)."""
FAST_MIN_ITEMS = 8
"""``compile="auto"``: a fast step of at least this many tensors runs compiled (eager: several launches each)."""
FAST_MIN_NUMEL = 1 << 16
"""``compile="auto"``: ... or of at least this many elements."""
MAX_COMPILES = 8
"""Compiles of one place's function (Dynamo's recompiles included) after which the rule runs eager there."""
CPP_WRAPPER = True
"""On the CPU, Inductor's C++ wrapper: its entry releases the GIL for the whole call (Inductor's default Python
wrapper calls each kernel through a binding that holds it: the training thread's Python would stop for the host
pass's length)."""

log = logging.getLogger(__name__)


class RuleCompileWarning(RuntimeWarning):
    """A rule's ``step_`` could not be compiled for one place: it runs eager there (the message says why)."""


# -- decompositions: numbers passed as Scalar arguments become tensor arithmetic --------------------------------------
#
# Dynamo hands each Python float to the graph as a 0-dim float64 tensor and reads it back as a SymFloat; AOTAutograd's
# tensorify pass (torch.fx.passes._tensorify_python_scalars) turns a SymFloat into tensor arithmetic only where it is
# a positional argument of mul/add/sub/div/pow. Elsewhere (alpha=, value=, lerp's weight, ...) it specializes the
# float: a guard on its value, a recompile when it changes. These rewrite those ops, where the argument is a SymFloat,
# into the supported forms (the number as ``ones(()) * s``, a 0-dim tensor of the op's dtype).


def _sym(x) -> bool:
    return isinstance(x, torch.SymFloat)


def _scalar_tensor(like: torch.Tensor, s) -> torch.Tensor:
    return torch.ones((), dtype=like.dtype, device=like.device) * s


def _decompositions() -> dict:
    aten, prims = torch.ops.aten, torch.ops.prims
    from torch._inductor.decomposition import select_decomp_table

    table, inductors = {}, select_decomp_table()

    def register(op):
        def deco(fn):
            base = inductors.get(op)

            def decomposed(*args, **kwargs):  # (not a changing number: Inductor's own decomposition, where it has
                out = fn(*args, **kwargs)  # one; an op it decomposes has no lowering to fall back to)
                return base(*args, **kwargs) if out is NotImplemented and base is not None else out

            table[op] = decomposed
            return fn

        return deco

    @register(aten.add.Tensor)
    def _add(self, other, *, alpha=1):
        if not _sym(alpha):
            return NotImplemented
        return torch.add(self, torch.mul(other, alpha))

    @register(aten.sub.Tensor)
    def _sub(self, other, *, alpha=1):
        if not _sym(alpha):
            return NotImplemented
        return torch.sub(self, torch.mul(other, alpha))

    @register(aten.addcmul.default)
    def _addcmul(self, t1, t2, *, value=1):
        if not _sym(value):
            return NotImplemented
        return torch.add(self, torch.mul(torch.mul(t1, value), t2))

    @register(aten.addcdiv.default)
    def _addcdiv(self, t1, t2, *, value=1):
        if not _sym(value):
            return NotImplemented
        return torch.add(self, torch.mul(torch.div(t1, t2), value))

    @register(prims.fma.default)  # addcmul's own decomposition: fma(t1 * t2, value, self)
    def _fma(a, b, c):
        if not (_sym(a) or _sym(b) or _sym(c)):
            return NotImplemented
        like = next(x for x in (a, b, c) if isinstance(x, torch.Tensor))
        a, b, c = (_scalar_tensor(like, x) if _sym(x) else x for x in (a, b, c))
        return prims.fma.default(a, b, c)

    @register(aten.lerp.Scalar)
    def _lerp(self, end, weight):
        if not _sym(weight):
            return NotImplemented
        return torch.lerp(self, end, _scalar_tensor(self, weight))

    @register(aten.pow.Tensor_Scalar)
    def _pow(self, exponent):
        if not _sym(exponent):
            return NotImplemented
        return torch.pow(self, _scalar_tensor(self, exponent))

    @register(aten.clamp.default)
    def _clamp(self, min=None, max=None):  # noqa: A002 (aten's names)
        if not (_sym(min) or _sym(max)):
            return NotImplemented
        return torch.clamp(self, _scalar_tensor(self, min) if _sym(min) else min,
                           _scalar_tensor(self, max) if _sym(max) else max)

    return {**inductors, **table}


# -- the compiled functions -------------------------------------------------------------------------------------------


def _flat_body(rule, param, grad, state, out, zero_grad, step, inv, names, values, rounding):
    g = grad * inv  # (inv: 1 / grad_scale; a new tensor: step_ may not write the sums; x * 1.0 is exact)
    work = [t if t.dtype == torch.float32 else t.float() for t in state]
    rule.step_(param, g, dict(zip(rule.state_names, work, strict=True)), step=step,
               **dict(zip(names, values, strict=True)))
    for k, (t, w) in enumerate(zip(state, work, strict=True)):
        if w is not t:  # bf16 state: rounded to nearest even, or stochastically (rounding: key, then each salt)
            t.copy_(w if rounding is None else stochastic_bf16(w, rounding[0], rounding[1 + k], k % 2 == 1))
    if out is not None:
        out.copy_(param)
    if zero_grad:  # zero whatever grad holds (nan, inf) in the same loop (Inductor gives zero_() a loop of its own)
        grad.copy_(torch.where(grad == grad, 0.0, 0.0))


@dataclass
class _Entry:
    """One compiled function: a rule class at one place, device type and thread count."""

    label: str
    rule_type: type = object
    fn: Any = None
    failed: str | None = None
    compiles: int = 0  # the backend's runs
    compiled_calls: int = 0  # calls that compiled (Dynamo's recompiles: one each)


@dataclass
class _Place:
    """What one rule instance ran at one place (``paths``)."""

    compiled_calls: int = 0
    eager_calls: int = 0
    why_eager: str | None = None
    compiles: int = 0
    compile_s: float = 0.0


_entries: dict[tuple, _Entry] = {}
_lock = threading.Lock()
_warned: set[type] = set()
_compiling = [0]  # compiles in progress, on any thread (``compiling``)


def compiling() -> bool:
    """A compile is in progress: a wait for the host worker does not count it against ``host_timeout`` (a first
    compile takes seconds to tens of seconds on a loaded machine; ``link.worker.HostWorker.wait``)."""
    return _compiling[0] > 0


@contextlib.contextmanager
def _compile_clock():
    with _lock:
        _compiling[0] += 1
    try:
        yield
    finally:
        with _lock:
            _compiling[0] -= 1


def reset() -> None:
    """Forget every compiled function and failure (a test's fresh start; Dynamo's own caches stay)."""
    with _lock:
        _entries.clear()
        _warned.clear()


def _entry(rule, place: str, device: str, threads: int) -> _Entry:
    key = (type(rule), place, device, threads)
    entry = _entries.get(key)
    if entry is None:
        with _lock:
            entry = _entries.get(key)
            if entry is None:
                label = f"{getattr(rule, 'name', '') or type(rule).__name__}.step_ (flat, {device}, {threads} threads)"
                entry = _entries[key] = _Entry(label, type(rule))
                entry.fn = _make(rule, place, device, threads, entry)
    return entry


def _make(rule, place: str, device: str, threads: int, entry: _Entry):
    body = _flat_body
    # a code object of its own per key: Dynamo caches compiled code per code object (and does not guard on the
    # Inductor thread count), so each key has its own cache and its own recompile budget
    tag = re.sub(r"\W", "_", f"{body.__name__}_{type(rule).__name__}_{device}_{threads}")
    code = body.__code__.replace(co_name=tag, co_qualname=tag)
    fn = types.FunctionType(code, body.__globals__, tag)

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        entry.compiles += 1
        patches = {"cpp.threads": threads, "cpp_wrapper": CPP_WRAPPER} if device == "cpu" and threads > 0 else None
        with _compile_clock():  # (a recompile: Dynamo traced already, Inductor's part is most of it)
            return compile_fx(gm, example_inputs, decompositions=_decompositions(), config_patches=patches)

    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)


def _place(rule, place: str) -> _Place:
    record = rule.__dict__.setdefault("_zenflow_compiled", {})
    if place not in record:
        record[place] = _Place()
    return record[place]


def _eager(rule, place: str, why: str) -> bool:
    st = _place(rule, place)
    st.eager_calls += 1
    st.why_eager = why
    return False


def _call(rule, place: str, entry: _Entry, args: tuple) -> bool:
    """Run ``entry``'s function on ``args``: True if it ran compiled; False (the caller runs eager) if it is failed
    or fails now (one warning per rule class and place)."""
    st = _place(rule, place)
    if entry.failed is not None:
        return _eager(rule, place, entry.failed)
    before, t0 = entry.compiles, time.perf_counter()
    try:  # (the first call compiles: Dynamo's trace and Inductor's compile)
        with torch.no_grad(), _compile_clock() if before == 0 else contextlib.nullcontext():
            entry.fn(*args)
    except Exception as exc:  # Dynamo cannot trace step_, no C++ compiler, ...: eager from now on
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        entry.failed = f"compiling failed: {type(exc).__name__}: {first}"[:400]
        _warn(entry)
        return _eager(rule, place, entry.failed)
    if entry.compiles != before:  # (the backend may run more than once in one compile: Dynamo restarts its analysis)
        seconds = time.perf_counter() - t0
        entry.compiled_calls += 1
        st.compiles += 1
        st.compile_s += seconds
        log.info("zenflow: compiled %s in %.1f s", entry.label, seconds)
        if entry.compiled_calls >= MAX_COMPILES:  # a number Inductor reads as a constant changes: a compile per value
            entry.failed = (f"recompiled {entry.compiled_calls} times (a number the compiled step reads as a constant "
                            "changes, or too many dtype combinations): eager from now on")
            _warn(entry)
    st.compiled_calls += 1
    st.why_eager = None
    return True


def _warn(entry: _Entry) -> None:
    if entry.rule_type not in _warned:  # (one warning per rule class)
        _warned.add(entry.rule_type)
        warnings.warn(f"zenflow: {entry.label} runs eager: {entry.failed}", RuleCompileWarning, stacklevel=4)


def _wants(rule, place: str, large: bool) -> str | None:
    """Why this call runs eager (None: compiled)."""
    mode = getattr(rule, "compile", "auto")
    if mode is False:
        return "compile=False"
    if mode == "auto" and not large:
        return "compile='auto' and the call is small"
    return None


def _threads(device: torch.device, numel: int) -> int:
    """The compiled step's threads (a compile each): on the CPU the calling thread's numba setting (the host worker's
    own budget), fewer below ``cpu_ops``' 2^16 elements per thread, as the numba kernels launch (waking a thread costs
    more than it saves, and an OpenMP team waits for its slowest thread: on a shared machine, one another process
    holds); elsewhere 0 (not a CPU kernel's)."""
    if device.type != "cpu":
        return 0
    import numba

    from ..cpu_ops._common import MIN_ELEMENTS_PER_THREAD

    most, wanted = numba.get_num_threads(), max(1, numel // MIN_ELEMENTS_PER_THREAD)
    if wanted >= most:
        return most
    return 1 << (wanted.bit_length() - 1)  # (a power of two: a few compiles, not one per count)


def _own(rule, method: str) -> bool:
    """The rule has a kernel of its own for ``method``: a call of the base class's default (a test's torch reference,
    ``UpdateRule.fast_step_(rule, ...)``) is its eager step, as before."""
    return type(rule).own_kernel(method)


def _step_input(step) -> int:
    """The step count as the compiled function takes it: an int, a symbolic integer to Dynamo (Python math on it,
    ``math.sqrt(1 - beta2 ** step)``, stays symbolic; a float would be specialized where torch code makes a tensor of
    it, as ``rules.from_torch``'s step does: a recompile per count)."""
    return int(step)


def compiled_host_step_(rule, param, grad, state, *, step, grad_scale, out, zero_grad, hyperparams: dict,
                        rounding=None) -> bool:
    """``UpdateRule.host_step_`` compiled (the module docstring); False where the call runs eager instead.
    ``rounding`` (stochastic rounding of bf16 state) enters as 0-d int64 tensors: the key, then each state tensor's
    salt (hyper-parameters that change every call: as tensors no recompile)."""
    if _own(rule, "host_step_"):
        return False
    why = _wants(rule, "host", param.numel() >= HOST_MIN_NUMEL)
    if why is not None:
        return _eager(rule, "host", why)
    entry = _entry(rule, "flat", param.device.type, _threads(param.device, param.numel()))
    names = tuple(hyperparams)
    rounded = None if rounding is None else (torch.tensor(rounding.key), *(
        torch.tensor(rounding.salt(k)) for k in range(len(state))))
    return _call(rule, "host", entry, (rule, param, grad, tuple(state), out, bool(zero_grad), _step_input(step),
                                       1.0 / grad_scale, names, tuple(hyperparams[n] for n in names), rounded))


def _item_steps(steps: list) -> list:
    """Each item's step count: a float (an int count, or one count for all its columns) or its columns' counts (a
    numpy array); one transfer for all of them (from a device: one copy, whatever the number of items)."""
    tensors = [s.reshape(-1) for s in steps if torch.is_tensor(s)]
    host = torch.cat(tensors).cpu().numpy() if tensors else None
    out, offset = [], 0
    for s in steps:
        if not torch.is_tensor(s):
            out.append(float(s))
            continue
        a = host[offset : offset + s.numel()]
        offset += s.numel()
        out.append(float(a[0]) if a.size and a.min() == a.max() else a)
    return out


def compiled_fast_step_(rule, items: list, *, grad_scale: float, launch_hyperparams: dict) -> bool:
    """``UpdateRule.fast_step_`` compiled (the module docstring): the items' selected columns packed into flat
    buffers (``rules.packing``), the compiled flat step over each run of columns that share their hyper-parameters (and
    step count), unpacked back. False where the call runs eager instead."""
    if _own(rule, "fast_step_"):
        return False
    if not items:
        return True
    n = len(rule.state_names)
    numel = sum(it[0].shape[0] * (it[0].shape[1] if it[2] is None else it[2].numel()) for it in items)
    why = _wants(rule, "fast", len(items) >= FAST_MIN_ITEMS or numel >= FAST_MIN_NUMEL)
    if why is not None:
        return _eager(rule, "fast", why)
    from .packing import dtype_parts, packed_for

    device = items[0][0].device
    entry = _entry(rule, "flat", device.type, _threads(device, numel))  # (the host pass's function)
    if entry.failed is not None:
        return _eager(rule, "fast", entry.failed)
    inv, names, first = 1.0 / grad_scale, (*rule.tensor_hyperparams, *launch_hyperparams), True
    for part in dtype_parts(items, n):  # (the numba packing takes one combination of dtypes per launch)
        packed = packed_for(part, n)
        if packed.numel == 0:
            continue
        keys: dict[tuple, int] = {}
        groups = [keys.setdefault(tuple(it[5 + n :]), len(keys)) for it in part]
        tensor_values = list(keys)
        runs = packed.runs(part, groups, _item_steps([it[4 + n] for it in part]) if rule.uses_step else None)
        for lo, hi, g, step in runs:
            args = (rule, packed.P[lo:hi], packed.G[lo:hi], tuple(packed.S[i, lo:hi] for i in range(n)), None, False,
                    _step_input(step), inv, names, (*tensor_values[g], *launch_hyperparams.values()),
                    None)  # (fp32 state: no rounding)
            if not _call(rule, "fast", entry, args):
                if first:
                    return False  # (nothing was written: the caller runs the launch eager)
                with torch.no_grad():  # (given up during this launch: the rest of it eager, on the packed columns)
                    _flat_body(*args)
            first = False
        packed.unpack()
    return True


def paths(rule) -> dict:
    """Which path each place of ``rule`` runs (``stats()["rule_paths"]``): ``{"host": ..., "fast": ...}``, each
    ``{"path": "kernel" | "compiled" | "eager" | "compiled and eager" | "not run yet", ...}``: ``kernel`` where the
    rule has its own (the built-ins' numba and Triton kernels); otherwise the calls that ran compiled and eager so
    far, why the last eager one did (``compile=False``, a small call under ``"auto"``, a failed compile), and the
    compiles' count and seconds."""
    out = {}
    record = getattr(rule, "__dict__", {}).get("_zenflow_compiled", {})
    for place, method in (("host", "host_step_"), ("fast", "fast_step_")):
        if _own(rule, method):
            out[place] = {"path": "kernel"}
            continue
        st = record.get(place, _Place())
        path = ("compiled and eager" if st.compiled_calls and st.eager_calls else "compiled" if st.compiled_calls
                else "eager" if st.eager_calls else "not run yet")
        out[place] = {"path": path, "compiled_calls": st.compiled_calls, "eager_calls": st.eager_calls,
                      "why_eager": st.why_eager, "compiles": st.compiles, "compile_s": round(st.compile_s, 3)}
    return out
