"""dtype dispatch at compile time (``@overload`` on the array's dtype; a None argument compiles the feature out):
load as float32, store float32 into out's dtype, state stores rounded to nearest or stochastically, the gradient
with or without an accumulator, arrays at raw addresses."""

from __future__ import annotations

import functools

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from ._ir import (
    bf16_to_f32,
    f16_to_f32,
    f32_to_bf16,
    f32_to_bf16_stochastic_high,
    f32_to_bf16_stochastic_low,
    f32_to_f16,
    fma,
    pointer_at,
    rounding_hash,
)


def is_none(t) -> bool:
    """A numba argument type that is None or left out (the feature it carries compiles out)."""
    return isinstance(t, (types.NoneType, types.Omitted))


def numba_only(typer):
    """A helper that numba code calls, inlined, declared by its ``@overload`` typing function ``typer`` (the argument
    types in, the implementation or None out): returns the Python stand-in, named and documented as ``typer``, which
    numba compiles the calls of and which raises when Python calls it."""

    @functools.wraps(typer)
    def helper(*args):
        raise NotImplementedError("numba-only helper")

    overload(helper, inline="always")(typer)
    return helper


@numba_only
def load_f32(a, i):
    """``float32(a[i])`` for float32, bf16-as-int16 and fp16-as-uint16 arrays (numba only)."""
    if not isinstance(a, types.Array):
        return None
    if a.dtype == types.float32:
        return lambda a, i: a[i]
    if a.dtype == types.int16:
        return lambda a, i: bf16_to_f32(a[i])
    if a.dtype == types.uint16:
        return lambda a, i: f16_to_f32(a[i])
    return None


@numba_only
def store_f32(out, i, x):
    """``out[i] = x`` converted to out's type (float32, bf16-as-int16, fp16-as-uint16); no-op for None."""
    if is_none(out):
        return lambda out, i, x: None
    if not isinstance(out, types.Array):
        return None
    if out.dtype == types.float32:

        def impl(out, i, x):
            out[i] = x

        return impl
    if out.dtype == types.int16:

        def impl(out, i, x):
            out[i] = f32_to_bf16(x)

        return impl
    if out.dtype == types.uint16:

        def impl(out, i, x):
            out[i] = f32_to_f16(x)

        return impl
    return None


@numba_only
def state_hash(key, i, salt):
    """The random bits of element ``i`` of a pass whose element 0 has key ``key`` (numba only): ``rounding_hash(key
    + i, salt)``, or 0 where ``salt`` is None (round to nearest: the hash compiles away)."""
    if is_none(salt):
        return lambda key, i, salt: np.uint32(0)
    return lambda key, i, salt: rounding_hash(np.int64(key + i), salt)


def _store_state(convert, name: str, doc: str):
    """``store_state_low`` / ``_high``'s typing: ``store_f32`` where ``salt`` is None, else ``convert(x, h)``."""

    def typer(out, i, x, h, salt):
        if is_none(salt):
            return lambda out, i, x, h, salt: store_f32(out, i, x)
        if not (isinstance(out, types.Array) and out.dtype == types.int16):
            return None

        def impl(out, i, x, h, salt):
            out[i] = convert(x, h)

        return impl

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return numba_only(typer)


store_state_low = _store_state(
    f32_to_bf16_stochastic_low, "store_state_low",
    """Store state value ``x`` at ``out[i]``: ``store_f32`` where ``salt`` is None, else (a bf16 array) rounded
    stochastically with the low 16 bits of ``h`` (numba only). ``store_state_high``: the high 16 bits.""")
store_state_high = _store_state(f32_to_bf16_stochastic_high, "store_state_high",
                                """``store_state_low`` with the high 16 bits of ``h``.""")


@numba_only
def take_grad(acc, grad, i, zero_acc):
    """The gradient of element i (float32) and the accumulator's update (numba only):

    * ``acc`` None: ``grad[i]``;
    * both: ``s = acc[i] + grad[i]``, stored in ``acc[i]`` (or 0 with ``zero_acc``), returns ``s``;
    * ``grad`` None: ``acc[i]`` (the accumulator is the gradient), zeroed with ``zero_acc``.
    """
    no_acc = is_none(acc)
    no_grad = is_none(grad)
    if no_acc and not no_grad:
        return lambda acc, grad, i, zero_acc: load_f32(grad, i)
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
        return None
    if no_grad:

        def impl(acc, grad, i, zero_acc):
            s = acc[i]
            if zero_acc:
                acc[i] = np.float32(0.0)
            return s

        return impl

    def impl(acc, grad, i, zero_acc):
        s = acc[i] + load_f32(grad, i)
        acc[i] = np.float32(0.0) if zero_acc else s
        return s

    return impl


@njit(inline="always")
def coupled_grad(acc, grad, i, zero_acc, inv_scale, p, l2):
    """``take_grad(acc, grad, i, zero_acc) * inv_scale`` with the coupled (L2) decay of param value ``p``: ``fma(p,
    l2, g)`` (torch's ``g.add(p, alpha=l2)``), skipped where l2 == 0 so an inf/NaN ``p`` leaves g untouched (fma(inf,
    0, g) is NaN)."""
    g = take_grad(acc, grad, i, zero_acc) * inv_scale
    return g if l2 == np.float32(0.0) else fma(p, l2, g)


@numba_only
def array_at(addr, n, proto):
    """``n`` elements of ``proto``'s type at address ``addr`` as a 1-D array; None when proto is None
    (numba only)."""
    if is_none(proto):
        return lambda addr, n, proto: None
    if isinstance(proto, types.Array):
        return lambda addr, n, proto: carray(pointer_at(addr, proto), n)
    return None
