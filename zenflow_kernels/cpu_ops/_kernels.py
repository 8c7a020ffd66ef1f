"""numba kernels for the host (CPU) side: Adam, Lion, SGD, gradient accumulation, sum of squares.

Design. Every kernel is one ``prange`` pass over flat, contiguous 1-D numpy views of torch CPU
tensors (no copies). Parameters are fp32, optimizer state fp32 or bf16; gradients may be fp32, bf16 or fp16
and the optional copy-out may be fp32, bf16 or fp16. numba has no 16-bit float type, so 16-bit
tensors arrive as their bit patterns: **bf16 as ``int16``, fp16 as ``uint16``** (the launchers make
those views), and the conversions below work on bits. The element type picks the conversion at
compile time (``@overload`` on the array's dtype), ``None`` arguments compile the feature out, so
one Python kernel covers every dtype combination without a runtime branch in the loop.

All hyper-parameters arrive as precomputed ``float32`` scalars (never Python floats: a float64
anywhere in the loop halves the vector width). The loops vectorise to 8-wide AVX2 on x86 (checked
with ``inspect_asm``: ``vsqrtps``/``vdivps`` on ``ymm`` registers, see tests/test_cpu_ops.py).

fastmath. The element-wise kernels need none to vectorise and use none: strict IEEE arithmetic, with
explicit ``fma`` where ATen's vectorised Adam uses one, so results follow torch's rounding step by
step (the moments come out bit-identical to ``torch.optim.AdamW(foreach=False)``; the parameter
differs by at most an ulp or so, because ATen's CPU ``sqrt`` is not correctly rounded and ours is).
Only the reduction in ``sum_squares`` uses ``REDUCE_FASTMATH`` = {'reassoc', 'contract', 'nsz'}:
reassociation lets the float64 sum vectorise, a change of summation order, i.e. rounding only.
'nnan'/'ninf' are never used: with them LLVM may assume no inf/NaN exists and fold the
finiteness signal of ``sum_squares`` (and the inf/NaN propagation of Adam) away; 'afn'/'arcp'
(approximate or reciprocal division and sqrt) are not used either.

Caching. ``cache=True`` writes compiled code to ``__pycache__`` beside this file (or numba's user
cache directory when that is not writable). numba invalidates a cached kernel only when *the file
that defines it* changes, not when a helper it calls changes in another file: that is why every
piece of numba code lives in this one module. Keep it that way.

Threads. The kernels run on numba's threading layer with the calling thread's thread count; the
launchers (``_common.launch``) set it per call. (Calling ``numba.set_num_threads`` inside a kernel
would be cheaper still, but makes it uncacheable: numba embeds a ctypes pointer for it.)
``nogil=True``: the GIL is released for the whole kernel, so a background thread running one
overlaps with Python and torch work in the main thread.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

REDUCE_FASTMATH = {"reassoc", "contract", "nsz"}

_JIT = {"parallel": True, "nogil": True, "cache": True}

# ---------------------------------------------------------------------------------------------
# Scalar helpers written as LLVM IR. numba types integer arithmetic as 64-bit, which halves the
# vector width of bit manipulations (measured: bf16 copy-out at half the speed); in IR they stay
# 32-bit and vectorise 8-wide on AVX2.
# ---------------------------------------------------------------------------------------------

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


@intrinsic
def bf16_to_f32(typingctx, h):
    """bf16 bit pattern (int16) -> float32: the pattern becomes the float's high half. Exact."""
    if h != types.int16:
        return None

    def codegen(context, builder, signature, args):
        u = builder.shl(builder.zext(args[0], _I32), _i32(16))
        return builder.bitcast(u, _F32)

    return types.float32(types.int16), codegen


@intrinsic
def f32_to_bf16(typingctx, x):
    """float32 -> bf16 bit pattern (int16), round to nearest even.

    Overflow rounds to +-inf, subnormals are kept (bf16 has fp32's exponent range), inf stays inf,
    NaN becomes a quiet NaN keeping its sign (torch's vectorised cast writes 0xFFFF for every NaN:
    both are NaN).
    """
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        u = b.bitcast(args[0], _I32)
        lsb = b.and_(b.lshr(u, _i32(16)), _i32(1))
        rounded = b.lshr(b.add(b.add(u, _i32(0x7FFF)), lsb), _i32(16))
        quiet_nan = b.or_(b.lshr(u, _i32(16)), _i32(0x40))
        is_nan = b.icmp_unsigned(">", b.and_(u, _i32(0x7FFFFFFF)), _i32(0x7F800000))
        return b.trunc(b.select(is_nan, quiet_nan, rounded), _I16)

    return types.int16(types.float32), codegen


@intrinsic
def f16_to_f32(typingctx, h):
    """fp16 bit pattern (uint16) -> float32. Exact for every pattern (subnormals, inf, NaN payloads)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        hu = b.zext(args[0], _I32)
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

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> fp16 bit pattern (uint16), round to nearest even (the method of F. Giesen's
    ``float_to_half_fast3_rtne``): overflow -> inf, NaN -> quiet NaN 0x7E00 with its sign, subnormals
    rounded correctly by one float add.
    """
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        u = b.bitcast(args[0], _I32)
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

    return types.uint16(types.float32), codegen


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
            rounded = b.lshr(b.add(u, r), _i32(16))
            quiet_nan = b.or_(b.lshr(u, _i32(16)), _i32(0x40))
            is_nan = b.icmp_unsigned(">", b.and_(u, _i32(0x7FFFFFFF)), _i32(0x7F800000))
            return b.trunc(b.select(is_nan, quiet_nan, rounded), _I16)

        return types.int16(types.float32, types.uint32), codegen

    return f32_to_bf16_stochastic


f32_to_bf16_stochastic_low = _stochastic_bf16(False)
f32_to_bf16_stochastic_high = _stochastic_bf16(True)


# ---------------------------------------------------------------------------------------------
# dtype dispatch (compile time): load as float32, store float32 into out, accumulate
# ---------------------------------------------------------------------------------------------


def load_f32(a, i):
    """``float32(a[i])`` for float32, bf16-as-int16 and fp16-as-uint16 arrays (numba only)."""
    raise NotImplementedError("numba-only helper")


@overload(load_f32, inline="always")
def _ov_load_f32(a, i):
    if not isinstance(a, types.Array):
        return None
    if a.dtype == types.float32:
        return lambda a, i: a[i]
    if a.dtype == types.int16:
        return lambda a, i: bf16_to_f32(a[i])
    if a.dtype == types.uint16:
        return lambda a, i: f16_to_f32(a[i])
    return None


def store_f32(out, i, x):
    """``out[i] = x`` converted to out's type (float32, bf16-as-int16, fp16-as-uint16); no-op for None."""
    raise NotImplementedError("numba-only helper")


@overload(store_f32, inline="always")
def _ov_store_f32(out, i, x):
    if isinstance(out, (types.NoneType, types.Omitted)):
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


def _none(t) -> bool:
    return isinstance(t, (types.NoneType, types.Omitted))


def state_hash(key, i, salt):
    """The random bits of element ``i`` of a pass whose element 0 has key ``key`` (numba only): ``rounding_hash(key
    + i, salt)``, or 0 where ``salt`` is None (round to nearest: the hash compiles away)."""
    raise NotImplementedError("numba-only helper")


@overload(state_hash, inline="always")
def _ov_state_hash(key, i, salt):
    if _none(salt):
        return lambda key, i, salt: np.uint32(0)
    return lambda key, i, salt: rounding_hash(np.int64(key + i), salt)


def store_state_low(out, i, x, h, salt):
    """Store state value ``x`` at ``out[i]``: ``store_f32`` where ``salt`` is None, else (a bf16 array) rounded
    stochastically with the low 16 bits of ``h`` (numba only). ``store_state_high``: the high 16 bits."""
    raise NotImplementedError("numba-only helper")


def store_state_high(out, i, x, h, salt):
    """``store_state_low`` with the high 16 bits of ``h``."""
    raise NotImplementedError("numba-only helper")


def _store_state(convert):
    def ov(out, i, x, h, salt):
        if _none(salt):
            return lambda out, i, x, h, salt: store_f32(out, i, x)
        if not (isinstance(out, types.Array) and out.dtype == types.int16):
            return None

        def impl(out, i, x, h, salt):
            out[i] = convert(x, h)

        return impl

    return ov


overload(store_state_low, inline="always")(_store_state(f32_to_bf16_stochastic_low))
overload(store_state_high, inline="always")(_store_state(f32_to_bf16_stochastic_high))


def take_grad(acc, grad, i, zero_acc):
    """The gradient of element i (float32) and the accumulator's update (numba only):

    * ``acc`` None: ``grad[i]``;
    * both: ``s = acc[i] + grad[i]``, stored in ``acc[i]`` (or 0 with ``zero_acc``), returns ``s``;
    * ``grad`` None: ``acc[i]`` (the accumulator is the gradient), zeroed with ``zero_acc``.
    """
    raise NotImplementedError("numba-only helper")


@overload(take_grad, inline="always")
def _ov_take_grad(acc, grad, i, zero_acc):
    no_acc = isinstance(acc, (types.NoneType, types.Omitted))
    no_grad = isinstance(grad, (types.NoneType, types.Omitted))
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
def adam_constants(one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64):
    """The loop constants every Adam kernel shares, rounded to float32 once: torch's lerp form for the
    first moment (``lerp_coeff``, ``lerp_small``), then beta2, 1 - beta2 and eps."""
    w = np.float32(one_minus_beta1_64)
    lerp_small = abs(w) < np.float32(0.5)
    lerp_coeff = w if lerp_small else w - np.float32(1.0)
    return lerp_coeff, lerp_small, np.float32(beta2_64), np.float32(one_minus_beta2_64), np.float32(eps64)


# ---------------------------------------------------------------------------------------------
# Kernels (the thread count is the calling thread's numba setting; the launchers set it per call)
# ---------------------------------------------------------------------------------------------


@njit(**_JIT)
def adam_kernel(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    acc,
    out,
    zero_acc,
    inv_scale64,
    l2_64,
    decay64,
    one_minus_beta1_64,
    beta2_64,
    one_minus_beta2_64,
    inv_bc2_sqrt64,
    eps64,
    neg_step_size64,
    key,
    salt,
):
    """One fused pass of Adam/AdamW over n elements (all arrays 1-D, length n, contiguous).

    The float64 hyper-parameters are rounded to float32 once, here; the loop is all float32. The
    operations and their rounding follow torch's single-tensor Adam on CPU (fma where ATen's
    vectorised kernels use one), so m and v come out bit-identical to torch whenever g does:

    g = take_grad(acc, grad, i, zero_acc) * inv_scale    (grad[i], acc[i] + grad[i], or acc[i] when grad is None)
    g = fma(p, l2, g)                              if l2 != 0 (Adam's L2 decay; AdamW passes l2 = 0)
    m = lerp(m, g, w): fma(w, g - m, m) if |w| < 0.5 else fma(w - 1, g - m, g)    (w = 1 - beta1, torch's)
    v = fma(one_minus_beta2 * g, g, v * beta2)             (v.mul_(beta2).addcmul_(g, g, 1 - beta2))
    p = p * decay + (neg_step_size * m) / (sqrt(v) * inv_bc2_sqrt + eps)   (decay = 1 - lr*wd for AdamW)
    out[i] = p (converted), when out is not None; acc[i] = the sum (or 0 with zero_acc).

    ``salt`` None: bf16 moments stored rounded to nearest even; else (uint32) rounded stochastically, m with the
    low and v with the high 16 bits of ``rounding_hash(key + i, salt)`` (``key``: int64, element 0's key).
    """
    inv_scale = np.float32(inv_scale64)
    l2 = np.float32(l2_64)
    decay = np.float32(decay64)
    lerp_coeff, lerp_small, beta2, one_minus_beta2, eps = adam_constants(
        one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64
    )
    inv_bc2_sqrt = np.float32(inv_bc2_sqrt64)
    neg_step_size = np.float32(neg_step_size64)
    for i in prange(param.size):
        p = param[i]
        g = take_grad(acc, grad, i, zero_acc) * inv_scale
        # l2 == 0 (AdamW, or no decay) must leave g untouched even when p is inf/NaN
        g = g if l2 == np.float32(0.0) else fma(p, l2, g)
        m = load_f32(exp_avg, i)
        m = fma(lerp_coeff, g - m, m if lerp_small else g)
        v = fma(one_minus_beta2 * g, g, load_f32(exp_avg_sq, i) * beta2)
        h = state_hash(key, i, salt)
        store_state_low(exp_avg, i, m, h, salt)  # (bf16 moments: stored rounded; p below uses m and v)
        store_state_high(exp_avg_sq, i, v, h, salt)
        p = p * decay + (neg_step_size * m) / (np.sqrt(v) * inv_bc2_sqrt + eps)
        param[i] = p
        store_f32(out, i, p)


@njit(**_JIT)
def accumulate_kernel(acc, grad):
    """acc[i] += float32(grad[i]) over n elements."""
    for i in prange(acc.size):
        acc[i] = acc[i] + load_f32(grad, i)


@njit(**_JIT)
def multi_accumulate_kernel(acc_addrs, grad_addrs, numels, chunk_starts, chunk, grad_proto, scale):
    """``acc_t[i] += float32(grad_t[i]) * scale`` for every tensor pair t (``numels[t]`` elements at
    ``acc_addrs[t]``, float32, and at ``grad_addrs[t]``, of ``grad_proto``'s type; ``scale`` float32, the product
    rounded before the addition, so ``scale == 1`` gives the bits of ``acc + grad``); work item ``c`` is chunk
    ``j`` of tensor t (items ``chunk_starts[t]`` to ``chunk_starts[t + 1] - 1``), indexed from 0 in slices (see
    ``multi_sum_squares_kernel``)."""
    state_proto = np.empty(0, dtype=np.float32)
    for c in prange(chunk_starts[chunk_starts.size - 1]):
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        lo = (c - chunk_starts[t]) * chunk
        hi = min(numels[t], lo + chunk)
        acc = carray(pointer_at(acc_addrs[t], state_proto), numels[t])[lo:hi]
        grad = carray(pointer_at(grad_addrs[t], grad_proto), numels[t])[lo:hi]
        for i in range(acc.size):
            acc[i] = acc[i] + load_f32(grad, i) * scale


@njit(fastmath=REDUCE_FASTMATH, **_JIT)
def sum_squares_kernel(x):
    """sum(float64(x[i])**2) with float64 accumulation; inf/NaN in x give a non-finite sum
    (no finite float32 squared in float64 can overflow it: 2^40 * 1.2e77 << 1.8e308)."""
    s = 0.0
    for i in prange(x.size):
        v = np.float64(load_f32(x, i))
        s += v * v
    return s


@njit(fastmath=REDUCE_FASTMATH, **_JIT)
def multi_sum_squares_kernel(addrs, numels, chunk_starts, chunk, proto, out):
    """``out[c]`` = the float64 sum of squares of work item ``c``: elements ``chunk * j`` to
    ``chunk * (j + 1) - 1`` of tensor t (its ``j``-th chunk; tensor t owns items ``chunk_starts[t]`` to
    ``chunk_starts[t + 1] - 1``), each tensor ``numels[t]`` elements of ``proto``'s type at ``addrs[t]``.
    An item's sum has the compiled loop's order (the reassociation ``REDUCE_FASTMATH`` allows), the same
    whatever the thread count. The loop runs over a slice from 0: ``range(lo, hi)`` indexing would keep
    numba's negative-index wraparound check in the loop, which stops it vectorising (5x slower)."""
    for c in prange(chunk_starts[chunk_starts.size - 1]):
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        lo = (c - chunk_starts[t]) * chunk
        x = carray(pointer_at(addrs[t], proto), numels[t])[lo : min(numels[t], lo + chunk)]
        s = 0.0
        for i in range(x.size):
            v = np.float64(load_f32(x, i))
            s += v * v
        out[c] = s


# Gradient fingerprints (docs/design.md section 5.1): a linear hash of a tensor's bits over the integers modulo
# 2**64. Word k of a tensor is its element k's bits (4-byte dtypes), or elements 2k and 2k + 1 in the low and high
# half (2-byte dtypes; a missing last element is 0); its weight is murmur3's 64-bit finalizer of (k + key), made
# odd. Every backend (this one, Triton, torch) computes the same value: wrapping sums are order-free.
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)
_HALF = np.uint64(16)
_ONE = np.uint64(1)


@njit(inline="always")
def fingerprint_weight(k, key):
    """The odd weight of word ``k`` (uint64 arithmetic throughout: an int64 operand would make numba compute
    in float64)."""
    z = np.uint64(k) + key
    z ^= z >> _SHIFT
    z *= _FMIX_1
    z ^= z >> _SHIFT
    z *= _FMIX_2
    z ^= z >> _SHIFT
    return z | _ONE


@njit(**_JIT)
def multi_fingerprint_kernel(addrs, numels, chunk_starts, chunk, proto, key, out):
    """``out[c]`` = the wrapping uint64 sum of ``word_k * weight(k)`` over work item ``c``: words ``chunk * j`` to
    ``chunk * (j + 1) - 1`` of tensor t (its ``j``-th chunk; tensor t owns items ``chunk_starts[t]`` to
    ``chunk_starts[t + 1] - 1``), each tensor ``numels[t]`` elements of ``proto``'s type (uint32, or uint16: two
    elements a word) at ``addrs[t]``."""
    wide = proto.itemsize == 4
    for c in prange(chunk_starts[chunk_starts.size - 1]):
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        lo = (c - chunk_starts[t]) * chunk
        n = numels[t]
        s = np.uint64(0)
        if wide:
            x = carray(pointer_at(addrs[t], proto), n)[lo : min(n, lo + chunk)]
            for k in range(x.size):
                s += np.uint64(x[k]) * fingerprint_weight(lo + k, key)
        else:
            x = carray(pointer_at(addrs[t], proto), n)[2 * lo : min(n, 2 * (lo + chunk))]
            full = x.size // 2
            for k in range(full):
                word = np.uint64(x[2 * k]) | (np.uint64(x[2 * k + 1]) << _HALF)
                s += word * fingerprint_weight(lo + k, key)
            if x.size % 2:
                s += np.uint64(x[x.size - 1]) * fingerprint_weight(lo + full, key)
        out[c] = s


@njit(**_JIT)
def convert_kernel(src, out):
    """out[i] = src[i] converted (src float32, bf16-as-int16 or fp16-as-uint16; out likewise)."""
    for i in prange(src.size):
        store_f32(out, i, load_f32(src, i))


# ---------------------------------------------------------------------------------------------
# The CPU fast path: AdamW on selected columns (compact state), also the dense vector update
# ---------------------------------------------------------------------------------------------

def column_of(idx, j):
    """``idx[j]`` as an unsigned index, or ``j`` when idx is None (a dense update) (numba only). Unsigned:
    numba then indexes without its negative-index wraparound check."""
    raise NotImplementedError("numba-only helper")


@overload(column_of, inline="always")
def _ov_column_of(idx, j):
    if isinstance(idx, (types.NoneType, types.Omitted)):
        return lambda idx, j: j
    if isinstance(idx, types.Array):
        return lambda idx, j: np.uint64(idx[j])
    return None


def row_of(a, base, j0, idx):
    """The part of a flat parameter or gradient that ``column_of(idx, j)`` indexes for columns from ``j0``
    of the row at ``base``: from the row's start with indices, from column ``j0`` without (numba only)."""
    raise NotImplementedError("numba-only helper")


@overload(row_of, inline="always")
def _ov_row_of(a, base, j0, idx):
    if isinstance(idx, (types.NoneType, types.Omitted)):
        return lambda a, base, j0, idx: a[base + j0 :]
    return lambda a, base, j0, idx: a[base:]


def part_of(a, lo, hi):
    """``a[lo:hi]``, or None for None (numba only)."""
    raise NotImplementedError("numba-only helper")


@overload(part_of, inline="always")
def _ov_part_of(a, lo, hi):
    if isinstance(a, (types.NoneType, types.Omitted)):
        return lambda a, lo, hi: None
    return lambda a, lo, hi: a[lo:hi]


def load_master(master, s, param, i):
    """``master[s]`` when a master is given, else ``float32(param[i])`` (numba only)."""
    raise NotImplementedError("numba-only helper")


@overload(load_master, inline="always")
def _ov_load_master(master, s, param, i):
    if isinstance(master, (types.NoneType, types.Omitted)):
        return lambda master, s, param, i: load_f32(param, i)
    if isinstance(master, types.Array) and master.dtype == types.float32:
        return lambda master, s, param, i: master[s]
    return None

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


def array_at(addr, n, proto):
    """``n`` elements of ``proto``'s type at address ``addr`` as a 1-D array; None when proto is None
    (numba only)."""
    raise NotImplementedError("numba-only helper")


@overload(array_at, inline="always")
def _ov_array_at(addr, n, proto):
    if isinstance(proto, (types.NoneType, types.Omitted)):
        return lambda addr, n, proto: None
    if isinstance(proto, types.Array):
        return lambda addr, n, proto: carray(pointer_at(addr, proto), n)
    return None


@njit(inline="always")
def _adam_columns(param, grad, idx, exp_avg, exp_avg_sq, master, base, sbase, j0, j1, neg_step_size, bc2_sqrt,
                  coef_base, grad_scale, decay, l2, lerp_coeff, lerp_small, beta2, one_minus_beta2, eps):
    """AdamW on selected columns j0..j1-1 of one row: ``base`` is the row's offset in param/grad,
    ``sbase`` in the compact state, ``coef_base`` the tensor's offset in the per-column coefficients.
    ``l2`` != 0: Adam's coupled decay, ``g = fma(w, l2, g)`` (``grad.add(param, alpha=wd)``; decay is then 1).
    Everything is indexed from 0 in slices (a loop index numba knows to be non-negative needs no
    wraparound check, and a dense row then vectorises)."""
    p = row_of(param, base, j0, idx)
    g_row = row_of(grad, base, j0, idx)
    cols = part_of(idx, j0, j1)
    m_row = exp_avg[sbase + j0 : sbase + j1]
    v_row = exp_avg_sq[sbase + j0 : sbase + j1]
    w_row = part_of(master, sbase + j0, sbase + j1)
    step_size = neg_step_size[coef_base + j0 : coef_base + j1]
    bc2 = bc2_sqrt[coef_base + j0 : coef_base + j1]
    for j in range(j1 - j0):
        c = column_of(cols, j)
        g = load_f32(g_row, c) / grad_scale
        w = load_master(w_row, j, p, c) * decay
        # (l2 == 0 must leave g untouched even when w is inf/NaN)
        g = g if l2 == np.float32(0.0) else fma(w, l2, g)
        m = m_row[j]
        m = fma(lerp_coeff, g - m, m if lerp_small else g)
        v = fma(one_minus_beta2 * g, g, v_row[j] * beta2)
        m_row[j] = m
        v_row[j] = v
        w = w + (step_size[j] * m) / (np.sqrt(v) / bc2[j] + eps)
        store_f32(w_row, j, w)
        store_f32(p, c, w)


@njit(**_JIT)
def selective_adam_kernel(
    param,
    grad,
    idx,
    exp_avg,
    exp_avg_sq,
    master,
    rows,
    cols,
    grad_scale64,
    decay64,
    one_minus_beta1_64,
    beta2_64,
    one_minus_beta2_64,
    eps64,
    neg_step_size,
    bc2_sqrt,
):
    """AdamW on the columns ``idx`` (or all columns when ``idx`` is None) of a row-major
    ``[rows, cols]`` parameter, with compact ``[rows, k]`` state; the CPU fast path of docs/design.md
    section 2 item 4. ``neg_step_size`` and ``bc2_sqrt`` are float32 ``[k]`` arrays (per-column bias
    correction; all equal for a single step count).

    The operation order is ``torch_ops._adamw``'s (torch.optim.AdamW's): ``g = grad / grad_scale``,
    ``w *= decay``, ``m = lerp(m, g, 1 - beta1)``, ``v = v * beta2 + (1 - beta2) * g * g``,
    ``w += neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)``; ``w`` is the fp32 master when given (the
    parameter then receives it rounded), else the parameter's value in float32.
    """
    k = exp_avg.size // rows if rows > 0 else 0
    grad_scale = np.float32(grad_scale64)
    decay = np.float32(decay64)
    lerp_coeff, lerp_small, beta2, one_minus_beta2, eps = adam_constants(
        one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64
    )
    for r in prange(rows):
        _adam_columns(param, grad, idx, exp_avg, exp_avg_sq, master, r * cols, r * k, 0, k, neg_step_size, bc2_sqrt,
                      0, grad_scale, decay, np.float32(0.0), lerp_coeff, lerp_small, beta2, one_minus_beta2, eps)


# Columns of the address table of ``multi_selective_adam_kernel``.
T_PARAM, T_GRAD, T_IDX, T_EXP_AVG, T_EXP_AVG_SQ, T_MASTER, T_ROWS, T_COLS, T_K, T_COEF = range(10)


@njit(**_JIT)
def multi_selective_adam_kernel(
    table,
    chunk_starts,
    parts,
    decay64,
    l2_64,
    neg_step_size,
    bc2_sqrt,
    param_proto,
    grad_proto,
    master_proto,
    block,
    grad_scale64,
    one_minus_beta1_64,
    beta2_64,
    one_minus_beta2_64,
    eps64,
):
    """``selective_adam_kernel`` over many tensors in one launch (the CPU multi-tensor form).

    ``table`` is int64 ``[n, 10]``, one row per tensor (columns ``T_*``): the addresses of param,
    grad, indices (0: dense, every column), exp_avg, exp_avg_sq and master (ignored when
    ``master_proto`` is None), then rows, cols, k and the tensor's offset into the float32 per-column
    coefficients ``neg_step_size`` / ``bc2_sqrt``; ``decay64[t]`` is 1 - lr*wd of tensor t (AdamW; 1 for Adam),
    ``l2_64[t]`` its coupled decay (Adam's weight_decay; 0 for AdamW). Every tensor
    of a launch has param_proto's, grad_proto's and master_proto's element types (the launcher groups
    them), and all memory is contiguous. The work items are (tensor, row, block of ``block`` selected
    columns); tensor t owns items ``chunk_starts[t]`` to ``chunk_starts[t + 1] - 1``, so one long
    vector is split as finely as a tall matrix. The items are dealt out in ``parts`` contiguous ranges,
    one ``prange`` iteration each, walked in order: a tensor's row is found once per range, not per item
    (a tiny item, a row of a few selected columns, costs little more than its arithmetic).
    """
    grad_scale = np.float32(grad_scale64)
    lerp_coeff, lerp_small, beta2, one_minus_beta2, eps = adam_constants(
        one_minus_beta1_64, beta2_64, one_minus_beta2_64, eps64
    )
    state_proto = np.empty(0, dtype=np.float32)
    idx_proto = np.empty(0, dtype=np.int64)
    total = chunk_starts[chunk_starts.size - 1]
    for q in prange(parts):
        c = q * total // parts
        stop = (q + 1) * total // parts
        t = np.searchsorted(chunk_starts, c, side="right") - 1
        while c < stop:
            end = min(stop, chunk_starts[t + 1])
            rows, cols, k = table[t, T_ROWS], table[t, T_COLS], table[t, T_K]
            blocks = (k + block - 1) // block
            param = carray(pointer_at(table[t, T_PARAM], param_proto), rows * cols)
            grad = carray(pointer_at(table[t, T_GRAD], grad_proto), rows * cols)
            exp_avg = carray(pointer_at(table[t, T_EXP_AVG], state_proto), rows * k)
            exp_avg_sq = carray(pointer_at(table[t, T_EXP_AVG_SQ], state_proto), rows * k)
            master = array_at(table[t, T_MASTER], rows * k, master_proto)
            decay = np.float32(decay64[t])
            l2 = np.float32(l2_64[t])
            coef = table[t, T_COEF]
            dense = table[t, T_IDX] == 0
            idx = carray(pointer_at(table[t, T_IDX], idx_proto), 0 if dense else k)
            for local in range(c - chunk_starts[t], end - chunk_starts[t]):
                r = local // blocks
                j0 = (local - r * blocks) * block
                j1 = min(k, j0 + block)
                if dense:
                    _adam_columns(param, grad, None, exp_avg, exp_avg_sq, master, r * cols, r * k, j0, j1,
                                  neg_step_size, bc2_sqrt, coef, grad_scale, decay, l2, lerp_coeff, lerp_small, beta2,
                                  one_minus_beta2, eps)
                else:
                    _adam_columns(param, grad, idx, exp_avg, exp_avg_sq, master, r * cols, r * k, j0, j1,
                                  neg_step_size, bc2_sqrt, coef, grad_scale, decay, l2, lerp_coeff, lerp_small, beta2,
                                  one_minus_beta2, eps)
            c = end
            t += 1

# ---------------------------------------------------------------------------------------------
# Lion and SGD (launchers: lion.py, sgd.py). Measured on torch 2.13 with its AVX512 and AVX2 kernels (random
# fp32 data, sizes 1 to 10^6 + 3, so the scalar tail loops too): ``x.add(y, alpha=a)`` and ``x.add_(y,
# alpha=a)`` equal ``fma(y, float32(a), x)`` bit for bit and differ from ``x + float32(a) * y`` in up to 28% of
# elements; ``x.mul(s)`` is one rounded multiply; ``lerp`` with a scalar weight is the two-form fma of
# ``adam_constants``. So every ``add`` with ``alpha`` below is an ``fma``, which makes the results bit-identical
# to the torch op sequences lion.py and sgd.py state, wherever torch runs those kernels (x86 with AVX2); torch's
# scalar DEFAULT kernels (``ATEN_CPU_CAPABILITY=default``) round product and sum separately (the last bit or two;
# tests/test_cpu_rules.py measures it). ``torch.sign`` on CPU is ``(0 < x) - (x < 0)``: +0.0 for +-0.0 *and NaN*
# (pytorch/pytorch#41245); ``torch_sign`` does the same, so a NaN momentum moves nothing through the sign, as
# torch's Lion does (the NaN still shows in ``exp_avg``). State may be fp32 or bf16 (``load_f32``/``store_f32``).
# ---------------------------------------------------------------------------------------------


@njit(inline="always")
def lerp_constants(weight64):
    """torch's scalar-weight lerp as ``fma(coeff, end - start, start if small else end)``: (coeff, small),
    with the weight rounded to float32 once (as ``_kernels.adam_constants`` does for Adam's first moment)."""
    w = np.float32(weight64)
    small = abs(w) < np.float32(0.5)
    return (w if small else w - np.float32(1.0)), small


@njit(inline="always")
def lerp(start, end, coeff, small):
    """``torch.lerp(start, end, w)`` for the constants of ``lerp_constants(w)``: ATen's vectorised form."""
    return fma(coeff, end - start, start if small else end)


@njit(inline="always")
def torch_sign(x):
    """``torch.sign`` of a float32: 1, -1, or +0.0 for +-0.0 and NaN (ATen's ``(0 < x) - (x < 0)``)."""
    return np.float32(1.0) if x > np.float32(0.0) else (np.float32(-1.0) if x < np.float32(0.0) else np.float32(0.0))


def momentum_step(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
    """SGD's momentum for element i (numba only): the direction to step along; ``buf[i]`` updated (a bf16 buffer:
    rounded to nearest, or stochastically with the low bits of ``h`` where ``salt`` is not None).

    * ``buf`` None (momentum == 0): ``d`` unchanged;
    * else ``b = d`` on the buffer's first step, ``fma(d, 1 - dampening, buf[i] * momentum)`` after it;
      ``buf[i] = b``; returns ``fma(b, momentum, d)`` with Nesterov, ``b`` without.
    """
    raise NotImplementedError("numba-only helper")


@overload(momentum_step, inline="always")
def _ov_momentum_step(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
    if isinstance(buf, (types.NoneType, types.Omitted)):
        return lambda buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None: d
    if not (isinstance(buf, types.Array) and buf.dtype in (types.float32, types.int16)):
        return None

    def impl(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
        # torch.optim.SGD's first step clones d (its buffer is None): no dampening, the old buffer unread
        b = d if first else fma(d, one_minus_dampening, load_f32(buf, i) * momentum)
        store_state_low(buf, i, b, h, salt)  # (a bf16 buffer keeps b rounded; the step below uses b itself)
        return fma(b, momentum, d) if nesterov else b

    return impl


def column_momentum(buf, i, d, first, momentum, one_minus_dampening, nesterov, h=0, salt=None):
    """``momentum_step`` for the fast path's kernel (numba only), inlined by LLVM rather than numba's IR inliner,
    whose SSA pass warns (NumbaIRAssumptionWarning) on the helper inlined into that kernel's branches."""
    raise NotImplementedError("numba-only helper")


overload(column_momentum)(_ov_momentum_step)


@njit(**_JIT)
def lion_kernel(param, grad, exp_avg, acc, out, zero_acc, inv_scale64, decay64, neg_lr64, one_minus_beta1_64,
                one_minus_beta2_64, key, salt):
    """One fused pass of Lion over n elements (all arrays 1-D, length n, contiguous):

    g = take_grad(acc, grad, i, zero_acc) * inv_scale   (grad[i], acc[i] + grad[i], or acc[i] when grad is None)
    u = torch_sign(lerp(m, g, 1 - beta1))
    p = p * decay                                        (decay = 1 - lr*wd; skipped when it is 1)
    p = fma(u, -lr, p)                                   (u is +-1 or 0: the product is exact)
    m = lerp(m, g, 1 - beta2)                            (stored in exp_avg's dtype: fp32, or bf16 rounded:
                                                          as adam_kernel's m, with key and salt)
    out[i] = p (converted), when out is not None.
    """
    inv_scale = np.float32(inv_scale64)
    decay = np.float32(decay64)
    neg_lr = np.float32(neg_lr64)
    coeff1, small1 = lerp_constants(one_minus_beta1_64)
    coeff2, small2 = lerp_constants(one_minus_beta2_64)
    for i in prange(param.size):
        g = take_grad(acc, grad, i, zero_acc) * inv_scale
        m = load_f32(exp_avg, i)
        u = torch_sign(lerp(m, g, coeff1, small1))
        p = param[i]
        # weight_decay == 0 skips torch's mul_ (a multiply by exactly 1 would only quiet a signalling NaN)
        p = p if decay == np.float32(1.0) else p * decay
        p = fma(u, neg_lr, p)
        param[i] = p
        store_state_low(exp_avg, i, lerp(m, g, coeff2, small2), state_hash(key, i, salt), salt)
        store_f32(out, i, p)


@njit(**_JIT)
def sgd_kernel(param, grad, momentum_buffer, acc, out, zero_acc, inv_scale64, weight_decay64, momentum64,
               one_minus_dampening64, neg_lr64, first, nesterov, key, salt):
    """One fused pass of SGD over n elements, ``torch.optim.SGD``'s single-tensor step:

    d = take_grad(acc, grad, i, zero_acc) * inv_scale
    d = fma(p, weight_decay, d)                          if weight_decay != 0   (d.add(p, alpha=wd))
    b = d if first else fma(d, 1 - dampening, b * momentum)   momentum_buffer[i] = b   (buffer not None)
    d = fma(b, momentum, d) if nesterov else b           (buffer not None)
    p = fma(d, -lr, p)                                   (p.add_(d, alpha=-lr))
    out[i] = p (converted), when out is not None.
    """
    inv_scale = np.float32(inv_scale64)
    weight_decay = np.float32(weight_decay64)
    momentum = np.float32(momentum64)
    one_minus_dampening = np.float32(one_minus_dampening64)
    neg_lr = np.float32(neg_lr64)
    for i in prange(param.size):
        p = param[i]
        d = take_grad(acc, grad, i, zero_acc) * inv_scale
        # weight_decay == 0 must leave d untouched even when p is inf/NaN (fma(inf, 0, d) is NaN)
        d = d if weight_decay == np.float32(0.0) else fma(p, weight_decay, d)
        d = momentum_step(momentum_buffer, i, d, first, momentum, one_minus_dampening, nesterov,
                          state_hash(key, i, salt), salt)
        p = fma(d, neg_lr, p)
        param[i] = p
        store_f32(out, i, p)


# ---------------------------------------------------------------------------------------------
# The CPU fast path of Lion and SGD: the rule's step on selected columns (launchers: selective_lion.py,
# selective_sgd.py, laid out by _rule_plan.py). The per-element arithmetic is the host kernels' above, so the
# results equal ``rules.Lion.step_`` / ``rules.SGD.step_`` on the gathered columns as those do; the work walk is
# ``multi_selective_adam_kernel``'s (work items (tensor, row, block of columns), dealt out in ``parts`` ranges).
# ---------------------------------------------------------------------------------------------

# Columns of the address table of the rules' multi-tensor kernels: the addresses of param, grad, indices (0: dense,
# every column), the state tensor (0: none), master (0: none), then rows, cols, k, the address of the tensor's
# per-column int64 step counts (0: an int step for the whole tensor) and whether that int step is its first (1/0).
R_PARAM, R_GRAD, R_IDX, R_STATE, R_MASTER, R_ROWS, R_COLS, R_K, R_STEPS, R_FIRST = range(10)


@njit(inline="always")
def part_start(q, parts, chunk_starts):
    """Range ``q`` of ``parts`` over the work items: its first item, its end, and the tensor owning the first."""
    total = chunk_starts[chunk_starts.size - 1]
    c = q * total // parts
    return c, (q + 1) * total // parts, np.searchsorted(chunk_starts, c, side="right") - 1


@njit(inline="always")
def rule_tensor(table, t, param_proto, grad_proto, state_proto, master_proto, idx_proto):
    """Tensor ``t`` of a rules' table (columns ``R_*``): rows, cols, k, and its param, grad, state and master
    (None for a None proto) and indices (empty when ``dense``) as flat arrays, and ``dense``."""
    rows, cols, k = table[t, R_ROWS], table[t, R_COLS], table[t, R_K]
    dense = table[t, R_IDX] == 0
    return (rows, cols, k, carray(pointer_at(table[t, R_PARAM], param_proto), rows * cols),
            carray(pointer_at(table[t, R_GRAD], grad_proto), rows * cols),
            array_at(table[t, R_STATE], rows * k, state_proto), array_at(table[t, R_MASTER], rows * k, master_proto),
            carray(pointer_at(table[t, R_IDX], idx_proto), 0 if dense else k), dense)


@njit(inline="always")
def _lion_columns(param, grad, idx, exp_avg, master, base, sbase, j0, j1, inv_scale, decay, neg_lr, coeff1, small1,
                  coeff2, small2):
    """Lion (``lion_kernel``'s element step) on selected columns j0..j1-1 of one row (``_adam_columns``' layout)."""
    p = row_of(param, base, j0, idx)
    g_row = row_of(grad, base, j0, idx)
    cols = part_of(idx, j0, j1)
    m_row = exp_avg[sbase + j0 : sbase + j1]
    w_row = part_of(master, sbase + j0, sbase + j1)
    for j in range(j1 - j0):
        c = column_of(cols, j)
        g = load_f32(g_row, c) * inv_scale
        m = m_row[j]
        u = torch_sign(lerp(m, g, coeff1, small1))
        w = load_master(w_row, j, p, c)
        w = w if decay == np.float32(1.0) else w * decay
        w = fma(u, neg_lr, w)
        m_row[j] = lerp(m, g, coeff2, small2)
        store_f32(w_row, j, w)
        store_f32(p, c, w)


@njit(**_JIT)
def multi_selective_lion_kernel(table, chunk_starts, parts, lr64, wd64, param_proto, grad_proto, master_proto, block,
                                inv_scale64, one_minus_beta1_64, one_minus_beta2_64):
    """Lion on the selected columns of many tensors in one launch: ``table`` int64 ``[n, 10]`` (columns ``R_*``),
    ``lr64[t]``, ``wd64[t]`` tensor t's numbers (decay ``1 - lr * wd`` in float64, rounded once, as torch's
    ``mul_`` of a Python float); the walk of ``multi_selective_adam_kernel``."""
    inv_scale = np.float32(inv_scale64)
    coeff1, small1 = lerp_constants(one_minus_beta1_64)
    coeff2, small2 = lerp_constants(one_minus_beta2_64)
    state_proto = np.empty(0, dtype=np.float32)
    idx_proto = np.empty(0, dtype=np.int64)
    for q in prange(parts):
        c, stop, t = part_start(q, parts, chunk_starts)
        while c < stop:
            end = min(stop, chunk_starts[t + 1])
            rows, cols, k, param, grad, exp_avg, master, idx, dense = rule_tensor(
                table, t, param_proto, grad_proto, state_proto, master_proto, idx_proto)
            blocks = (k + block - 1) // block
            decay = np.float32(1.0 - lr64[t] * wd64[t])
            neg_lr = np.float32(-lr64[t])
            for local in range(c - chunk_starts[t], end - chunk_starts[t]):
                r = local // blocks
                j0 = (local - r * blocks) * block
                j1 = min(k, j0 + block)
                if dense:
                    _lion_columns(param, grad, None, exp_avg, master, r * cols, r * k, j0, j1, inv_scale, decay,
                                  neg_lr, coeff1, small1, coeff2, small2)
                else:
                    _lion_columns(param, grad, idx, exp_avg, master, r * cols, r * k, j0, j1, inv_scale, decay,
                                  neg_lr, coeff1, small1, coeff2, small2)
            c = end
            t += 1


@njit(inline="always")
def _sgd_columns(param, grad, idx, buf, master, steps, per_column, first, base, sbase, j0, j1, inv_scale,
                 weight_decay, neg_lr, momentum, one_minus_dampening, nesterov):
    """SGD (``sgd_kernel``'s element step) on selected columns j0..j1-1 of one row; ``steps`` the tensor's
    per-column step counts when ``per_column`` (else ``first`` for every column)."""
    p = row_of(param, base, j0, idx)
    g_row = row_of(grad, base, j0, idx)
    cols = part_of(idx, j0, j1)
    b_row = part_of(buf, sbase + j0, sbase + j1)
    w_row = part_of(master, sbase + j0, sbase + j1)
    s_row = steps[j0:j1] if per_column else steps
    for j in range(j1 - j0):
        c = column_of(cols, j)
        w = load_master(w_row, j, p, c)
        d = load_f32(g_row, c) * inv_scale
        d = d if weight_decay == np.float32(0.0) else fma(w, weight_decay, d)
        starts = s_row[j] == 1 if per_column else first
        d = column_momentum(b_row, j, d, starts, momentum, one_minus_dampening, nesterov)
        w = fma(d, neg_lr, w)
        store_f32(w_row, j, w)
        store_f32(p, c, w)


@njit(**_JIT)
def multi_selective_sgd_kernel(table, chunk_starts, parts, lr64, wd64, param_proto, grad_proto, master_proto,
                               buf_proto, block, inv_scale64, momentum64, one_minus_dampening64, nesterov):
    """SGD on the selected columns of many tensors in one launch (``multi_selective_lion_kernel``'s table and walk);
    ``buf_proto`` None: no momentum buffer (momentum 0). A column's first step (its count 1, or ``R_FIRST``) starts
    its buffer as torch's does."""
    inv_scale = np.float32(inv_scale64)
    momentum = np.float32(momentum64)
    one_minus_dampening = np.float32(one_minus_dampening64)
    idx_proto = np.empty(0, dtype=np.int64)
    step_proto = np.empty(0, dtype=np.int64)
    for q in prange(parts):
        c, stop, t = part_start(q, parts, chunk_starts)
        while c < stop:
            end = min(stop, chunk_starts[t + 1])
            rows, cols, k, param, grad, buf, master, idx, dense = rule_tensor(
                table, t, param_proto, grad_proto, buf_proto, master_proto, idx_proto)
            blocks = (k + block - 1) // block
            weight_decay = np.float32(wd64[t])
            neg_lr = np.float32(-lr64[t])
            per_column = table[t, R_STEPS] != 0
            steps = carray(pointer_at(table[t, R_STEPS], step_proto), k if per_column else 0)
            first = table[t, R_FIRST] != 0
            for local in range(c - chunk_starts[t], end - chunk_starts[t]):
                r = local // blocks
                j0 = (local - r * blocks) * block
                j1 = min(k, j0 + block)
                if dense:
                    _sgd_columns(param, grad, None, buf, master, steps, per_column, first, r * cols, r * k, j0, j1,
                                 inv_scale, weight_decay, neg_lr, momentum, one_minus_dampening, nesterov)
                else:
                    _sgd_columns(param, grad, idx, buf, master, steps, per_column, first, r * cols, r * k, j0, j1,
                                 inv_scale, weight_decay, neg_lr, momentum, one_minus_dampening, nesterov)
            c = end
            t += 1
