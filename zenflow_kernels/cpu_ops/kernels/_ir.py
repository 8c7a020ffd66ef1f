"""Scalar helpers written as LLVM IR: fused multiply-add, bf16/fp16 conversions on bit patterns, the stochastic
rounding hash, typed pointers. numba types integer arithmetic as 64-bit, which halves the vector width of bit
manipulations (measured: bf16 copy-out at half the speed); in IR they stay 32-bit and vectorise 8-wide on AVX2."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _i32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


@intrinsic
def fma(typingctx, a, b, c):
    """Fused multiply-add a * b + c with one rounding (llvm.fma: an FMA instruction where the CPU has one)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


def _conversion(arg, result):
    """An ``@intrinsic`` taking one ``arg`` (None for any other type) and returning a ``result``, its IR
    ``body(builder, value)``; named and documented as ``body``."""

    def make(body):
        def typer(typingctx, x):
            if x != arg:
                return None
            return result(arg), lambda context, builder, signature, args: body(builder, args[0])

        typer.__name__, typer.__qualname__, typer.__doc__ = body.__name__, body.__qualname__, body.__doc__
        return intrinsic(typer)

    return make


@_conversion(types.int16, types.float32)
def bf16_to_f32(b, h):
    """bf16 bit pattern (int16) -> float32: the pattern becomes the float's high half. Exact."""
    return b.bitcast(b.shl(b.zext(h, _I32), _i32(16)), _F32)


def _bf16_or_quiet_nan(b, u, rounded):
    """The bf16 bits (i16) of float bits ``u`` (i32): ``rounded`` (the high half, rounded), or for a NaN the quiet NaN
    ``(u >> 16) | 0x40``, keeping its sign (rounding could carry a NaN's mantissa into an infinity)."""
    quiet_nan = b.or_(b.lshr(u, _i32(16)), _i32(0x40))
    is_nan = b.icmp_unsigned(">", b.and_(u, _i32(0x7FFFFFFF)), _i32(0x7F800000))
    return b.trunc(b.select(is_nan, quiet_nan, rounded), _I16)


@_conversion(types.float32, types.int16)
def f32_to_bf16(b, x):
    """float32 -> bf16 bit pattern (int16), round to nearest even.

    Overflow rounds to +-inf, subnormals are kept (bf16 has fp32's exponent range), inf stays inf,
    NaN becomes a quiet NaN keeping its sign (torch's vectorised cast writes 0xFFFF for every NaN:
    both are NaN).
    """
    u = b.bitcast(x, _I32)
    lsb = b.and_(b.lshr(u, _i32(16)), _i32(1))
    return _bf16_or_quiet_nan(b, u, b.lshr(b.add(b.add(u, _i32(0x7FFF)), lsb), _i32(16)))


@_conversion(types.uint16, types.float32)
def f16_to_f32(b, h):
    """fp16 bit pattern (uint16) -> float32. Exact for every pattern (subnormals, inf, NaN payloads)."""
    hu = b.zext(h, _I32)
    sign = b.shl(b.and_(hu, _i32(0x8000)), _i32(16))
    body = b.shl(b.and_(hu, _i32(0x7FFF)), _i32(13))  # exponent and mantissa in fp32 position
    exp = b.and_(body, _i32(0x7C00 << 13))
    normal = b.add(body, _i32((127 - 15) << 23))  # re-bias the exponent
    infnan = b.add(normal, _i32((128 - 16) << 23))  # exponent all ones
    # subnormal or zero: mantissa * 2^-24, both factors exact in float32
    mant = b.uitofp(b.and_(hu, _i32(0x3FF)), _F32)
    sub = b.bitcast(b.fmul(mant, ir.Constant(_F32, 2.0**-24)), _I32)
    is_infnan = b.icmp_unsigned("==", exp, _i32(0x7C00 << 13))
    is_sub = b.icmp_unsigned("==", exp, _i32(0))
    bits = b.select(is_infnan, infnan, b.select(is_sub, sub, normal))
    return b.bitcast(b.or_(bits, sign), _F32)


@_conversion(types.float32, types.uint16)
def f32_to_f16(b, x):
    """float32 -> fp16 bit pattern (uint16), round to nearest even (the method of F. Giesen's
    ``float_to_half_fast3_rtne``): overflow -> inf, NaN -> quiet NaN 0x7E00 with its sign, subnormals
    rounded correctly by one float add.
    """
    u = b.bitcast(x, _I32)
    sign = b.and_(b.lshr(u, _i32(16)), _i32(0x8000))
    a = b.and_(u, _i32(0x7FFFFFFF))
    is_nan = b.icmp_unsigned(">", a, _i32(0x7F800000))
    special = b.select(is_nan, _i32(0x7E00), _i32(0x7C00))
    # |x| < 2^-14: adding 0.5 leaves the fp16 subnormal mantissa, rounded to nearest even, in the low bits
    half = ir.Constant(_F32, 0.5)
    sub = b.sub(b.bitcast(b.fadd(b.bitcast(a, _F32), half), _I32), _i32(126 << 23))
    mant_odd = b.and_(b.lshr(a, _i32(13)), _i32(1))
    bias = _i32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # re-bias exponent, round half (wraps mod 2^32)
    normal = b.lshr(b.add(b.add(a, bias), mant_odd), _i32(13))
    overflow = b.icmp_unsigned(">=", a, _i32((127 + 16) << 23))  # |x| >= 65536 (or inf/NaN)
    small = b.icmp_unsigned("<", a, _i32(113 << 23))
    body = b.select(overflow, special, b.select(small, sub, normal))
    return b.trunc(b.or_(body, sign), _I16)


def _fmix32_ir(b, x):
    """murmur3's 32-bit finalizer in IR (zenflow_kernels.rounding.fmix32)."""
    x = b.xor(x, b.lshr(x, _i32(16)))
    x = b.mul(x, _i32(0x85EBCA6B))
    x = b.xor(x, b.lshr(x, _i32(13)))
    x = b.mul(x, _i32(0xC2B2AE35))
    return b.xor(x, b.lshr(x, _i32(16)))


@intrinsic
def rounding_hash(typingctx, key, salt):
    """The 32 random bits ``h`` of element key ``key`` (int64) under ``salt`` (uint32) for stochastic rounding:
    ``fmix32(((key mod 2^32) ^ salt) + (key >> 32) * 0x85EBCA6B)`` in 32-bit arithmetic (zenflow_kernels.rounding,
    whose torch reference gives the same bits)."""
    if key != types.int64 or salt != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        k, sa = args
        lo = b.trunc(k, _I32)
        hi = b.trunc(b.lshr(k, ir.Constant(ir.IntType(64), 32)), _I32)
        return _fmix32_ir(b, b.add(b.xor(lo, sa), b.mul(hi, _i32(0x85EBCA6B))))

    return types.uint32(types.int64, types.uint32), codegen


def _stochastic_bf16(high: bool):
    @intrinsic
    def f32_to_bf16_stochastic(typingctx, x, h):
        """float32 -> bf16 bit pattern (int16), rounded stochastically with 16 bits of ``h`` (the low half, or the
        high half): ``(u + r) >> 16`` of the float's bits ``u``, a NaN the quiet NaN ``(u >> 16) | 0x40``."""
        if x != types.float32 or h != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            b = builder
            u = b.bitcast(args[0], _I32)
            r = b.lshr(args[1], _i32(16)) if high else b.and_(args[1], _i32(0xFFFF))
            return _bf16_or_quiet_nan(b, u, b.lshr(b.add(u, r), _i32(16)))

        return types.int16(types.float32, types.uint32), codegen

    return f32_to_bf16_stochastic


f32_to_bf16_stochastic_low = _stochastic_bf16(False)
f32_to_bf16_stochastic_high = _stochastic_bf16(True)


@intrinsic
def pointer_at(typingctx, addr, proto):
    """A typed pointer to the address ``addr`` (an integer), of ``proto``'s element type:
    ``numba.carray(pointer_at(addr, proto), n)`` is an array over that memory."""
    if not (isinstance(addr, types.Integer) and isinstance(proto, types.Array)):
        return None
    ptr = types.CPointer(proto.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, proto), codegen
