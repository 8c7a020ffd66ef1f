"""Stochastic rounding of host state to bf16, deterministic: the reference in plain torch.

A rule with ``state_dtype=torch.bfloat16, state_rounding="stochastic"`` stores each new state value rounded up or
down to a neighbouring bf16 with the probabilities that make the stored value's expectation the fp32 value (a value
that moves by less than half a bf16 ulp per step still moves on average; round-to-nearest freezes it). The
random bits are a counter-based hash, not a generator's stream: element ``e`` of state tensor ``k`` at host step
``t`` under seed ``s`` always gets the same 16 bits, so the numba kernels, this reference, both links, a ZeRO shard
and a resumed run round alike, bit for bit. ``e`` is the element's key: its offset in the host layout of every
parameter with host state (``host.layout``), which one process and every ZeRO rank compute alike.

The bits (all arithmetic modulo 2^32; ``fmix32`` is murmur3's 32-bit finalizer, a bijection with full avalanche):

    salt_j = fmix32(fmix32(s ^ (0x9E3779B9 * (j + 1))) + t)        j = k // 2 (two state tensors share a hash)
    h      = fmix32(((e mod 2^32) ^ salt_j) + (e // 2^32) * 0x85EBCA6B)
    r      = h mod 2^16 for even k, h // 2^16 for odd k

and the rounding of a float32 ``x`` with bits ``u``: NaN -> the quiet NaN ``(u >> 16) | 0x40`` (sign kept, as the
round-to-nearest kernels do), else ``(u + r) >> 16``: the 16 dropped bits ``d`` round the magnitude up with
probability ``d / 2^16`` (infinities stay, a value within an ulp of the largest bf16 may round to infinity).
For fixed ``s``, ``t`` and ``k`` the map ``e -> h`` is a bijection on each 2^32 block of keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["STATE_ROUNDINGS", "StochasticRounding", "check_state_rounding", "fmix32", "random_bits", "round_to_bf16",
           "stochastic_bf16"]

STATE_ROUNDINGS = ("nearest", "stochastic")
MASK = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
KEY_HI_MUL = 0x85EBCA6B


def fmix32(x: int) -> int:
    """murmur3's 32-bit finalizer of a Python int (taken modulo 2^32)."""
    x &= MASK
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK
    return x ^ (x >> 16)


@dataclass(frozen=True)
class StochasticRounding:
    """Where a host pass's random bits come from: ``seed`` (the rule's ``rounding_seed``), ``step`` (the host step
    of this pass) and ``key`` (the key of the pass's element 0; element ``i`` has key ``key + i``)."""

    seed: int
    step: int
    key: int = 0

    def __post_init__(self):
        for name, lo, hi in (("seed", 0, MASK), ("step", 0, MASK), ("key", 0, 2**62)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"StochasticRounding: {name}={value!r} is invalid: allowed an integer in "
                                 f"[{lo}, {hi}]")

    def salt(self, state_index: int) -> int:
        """``salt_j`` of state tensor ``state_index`` (module docstring)."""
        j = state_index // 2
        return fmix32(fmix32(self.seed ^ ((GOLDEN * (j + 1)) & MASK)) + self.step)


def check_state_rounding(where: str, state_rounding, state_dtype: torch.dtype, rounding_seed) -> str:
    """``state_rounding`` is ``"nearest"`` or ``"stochastic"`` (the latter with bf16 state only) and
    ``rounding_seed`` an integer in [0, 2^32), or a ValueError naming them."""
    if state_rounding not in STATE_ROUNDINGS:
        raise ValueError(f"{where}: state_rounding={state_rounding!r} is invalid: allowed 'nearest' or 'stochastic'")
    if state_rounding == "stochastic" and state_dtype != torch.bfloat16:
        raise ValueError(f"{where}: state_rounding='stochastic' with state_dtype={state_dtype} is invalid: allowed "
                         "with state_dtype=torch.bfloat16 only (fp32 state is stored exactly)")
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int) or not 0 <= rounding_seed <= MASK:
        raise ValueError(f"{where}: rounding_seed={rounding_seed!r} is invalid: allowed an integer in [0, 2**32)")
    return state_rounding


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow (two 48-bit products)."""
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & MASK


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _random16(numel: int, key, salt, high: bool, device=None) -> torch.Tensor:
    """The 16 random bits (int64, [0, 2^16)) of elements ``0 .. numel - 1`` keyed from ``key`` under ``salt``: the
    low (``high`` False) or high half of each element's hash (module docstring)."""
    keys = torch.arange(numel, dtype=torch.int64, device=device) + key
    h = _fmix32((((keys & MASK) ^ salt) + _mul32(keys >> 32, KEY_HI_MUL)) & MASK)
    return h >> 16 if high else h & 0xFFFF


def stochastic_bf16(x: torch.Tensor, key, salt, high: bool) -> torch.Tensor:
    """Flat float32 ``x`` rounded stochastically to bf16, element i with key ``key + i``, ``salt`` and the low
    (``high`` False) or high 16 bits of its hash. ``key`` and ``salt`` are ints or 0-d int64 tensors (a compiled
    step takes them as tensors: a changing number is then no recompile)."""
    r = _random16(x.numel(), key, salt, high, x.device)
    u = x.view(torch.int32).to(torch.int64) & MASK
    bits = torch.where(torch.isnan(x), (u >> 16) | 0x40, (u + r) >> 16) & 0xFFFF
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # int16's two's complement
    return bits.to(torch.int16).view(torch.bfloat16)


def random_bits(numel: int, rounding: StochasticRounding, state_index: int) -> torch.Tensor:
    """The 16 random bits ``r`` (int64, [0, 2^16)) of elements ``0 .. numel - 1`` of one pass (module docstring):
    those ``round_to_bf16`` adds."""
    return _random16(numel, rounding.key, rounding.salt(state_index), state_index % 2 == 1)


def round_to_bf16(x: torch.Tensor, rounding: StochasticRounding, state_index: int) -> torch.Tensor:
    """``x`` (float32) rounded stochastically to bf16 (a new tensor of x's shape), element ``i`` of
    ``x.reshape(-1)`` with key ``rounding.key + i`` and state tensor ``state_index``'s bits: the reference the host
    kernels are tested against."""
    if x.dtype != torch.float32:
        raise ValueError(f"round_to_bf16: x.dtype={x.dtype} is invalid: allowed torch.float32")
    flat = x.reshape(-1)
    return stochastic_bf16(flat, rounding.key, rounding.salt(state_index), state_index % 2 == 1).reshape(x.shape)
