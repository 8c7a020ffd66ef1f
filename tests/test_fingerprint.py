"""``ops.multi_fingerprint``: a 64-bit linear hash of each tensor's bits (docs/design.md section 5.1), the same
value on every backend (torch, numba, Triton under TRITON_INTERPRET=1), checked against an independent numpy
reference (uint64 arithmetic, defined to wrap) over dtypes, awkward shapes, strides and keys; what it must
detect (every change of one word, and the changes loops make: scaling, clamping, NaN repair, swaps, sign flips);
and the argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zenflow_kernels import multi_fingerprint, ops

BACKENDS = ["torch", "numba", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KEYS = [0, 1, 0x9E3779B97F4A7C15, (1 << 63), (1 << 64) - 1]


def reference(x: torch.Tensor, key: int) -> int:
    """The spec in numpy: words of the row-major bits (2-byte elements in pairs, low half first, a missing last
    one 0), each times fmix64(k + key) | 1, summed modulo 2**64; returned as the int64 with those bits."""
    flat = x.detach().reshape(-1).contiguous()
    if x.element_size() == 4:
        words = flat.view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
    else:
        bits = flat.view(torch.int16).numpy().view(np.uint16).astype(np.uint64)
        if bits.size % 2:
            bits = np.concatenate([bits, np.zeros(1, np.uint64)])
        words = bits[0::2] | (bits[1::2] << np.uint64(16))
    with np.errstate(over="ignore"):
        z = np.arange(words.size, dtype=np.uint64) + np.uint64(key)
        z ^= z >> np.uint64(33)
        z *= np.uint64(0xFF51AFD7ED558CCD)
        z ^= z >> np.uint64(33)
        z *= np.uint64(0xC4CEB9FE1A85EC53)
        z ^= z >> np.uint64(33)
        total = (words * (z | np.uint64(1))).sum(dtype=np.uint64)
    return int(np.array([total], dtype=np.uint64).view(np.int64)[0])


def fingerprints(tensors, key, backend):
    with ops.use_backend(backend):
        return ops.multi_fingerprint(tensors, key).tolist()


# 32771 and 65539: odd counts past the first and second work item of a 2-byte tensor (cpu_ops' FINGERPRINT_CHUNK
# words of two elements: 32768 elements an item), so an item after the first ends in half a word
SHAPES = [(0,), (1,), (2,), (3,), (17,), (33, 5), (5, 33), (128, 1), (40000,), (3, 4, 5), (32771,), (65539,)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_backend_gives_the_reference_value(backend, dtype):
    """Every shape (empty, odd counts that leave a half word, also past the first work item, tall, wide, 3-D,
    large) in one call and one by one, every key: the reference's value, the same on every backend."""
    from zenflow_kernels.cpu_ops.fingerprint import FINGERPRINT_CHUNK

    assert 2 * FINGERPRINT_CHUNK < 32771 < 4 * FINGERPRINT_CHUNK < 65539  # (the shapes' reason)
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(s, generator=g) * 3).to(dtype) for s in SHAPES]
    for key in KEYS:
        want = [reference(t, key) for t in tensors]
        assert fingerprints(tensors, key, backend) == want, key
    assert [fingerprints([t], KEYS[2], backend)[0] for t in tensors] == [reference(t, KEYS[2]) for t in tensors]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_unchecked_entry_gives_the_reference_value(backend):
    """``ops.multi_fingerprint_unchecked`` (the asynchronous link's at every step): the reference's values for every
    shape and dtype at once, empty tensors among them (0), a strided view read in row-major order."""
    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(s, generator=g) * 3).to(dt) for dt in DTYPES for s in SHAPES]
    tensors.append(torch.randn(9, 7, generator=g).t())
    with ops.use_backend(backend):
        got = ops.multi_fingerprint_unchecked(tensors, KEYS[2]).tolist()
    assert got == [reference(t.contiguous(), KEYS[2]) for t in tensors]
    assert got[0] == 0  # (shape (0,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_strided_views_and_out(backend):
    """A list mixing dtypes and strided views (a transposed matrix, a column slice, an expanded row): each is
    fingerprinted in its logical row-major order, as its contiguous copy is; ``out`` receives the values."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(9, 7, generator=g)
    tensors = [base.t(), base[:, 2:5].to(torch.bfloat16), torch.randn(3, generator=g).expand(4, 3).half(), base]
    out = torch.full((4,), 7, dtype=torch.int64)
    with ops.use_backend(backend):
        got = ops.multi_fingerprint(tensors, 5, out=out)
    assert got is out
    assert out.tolist() == [reference(t.contiguous(), 5) for t in tensors]
    assert multi_fingerprint is ops.multi_fingerprint  # the package exports it


def _changes(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What loops do to gradients, and a few adversarial edits: each must change the fingerprint."""
    flipped = x.clone()
    flipped.view(torch.int16 if x.element_size() == 2 else torch.int32)[5] ^= 1  # the lowest bit of one element
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    signs = x.clone()
    signs[[0, 7]] = -x[[0, 7]]  # two sign bits: a difference of 2**31 (or 2**15) in two words
    nan = x.clone()
    nan[9] = float("nan")
    far_swap = x.clone()
    far_swap[[0, -1]] = x[[-1, 0]]
    return {"one bit": flipped, "swap of neighbours": swapped, "two sign flips": signs, "halved": x * 0.5,
            "clamped": x.clamp(-0.5, 0.5), "zeroed": torch.zeros_like(x), "a NaN": nan,
            "a NaN repaired": torch.nan_to_num(nan, nan=0.0), "far swap": far_swap, "negated": -x}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_changes_loops_make_are_seen(backend, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(257, generator=g).to(dtype)
    base = fingerprints([x], KEYS[2], backend)[0]
    for what, changed in _changes(x).items():
        if torch.equal(changed.view(torch.uint8), x.view(torch.uint8)):
            continue  # (an edit that leaves the bits alone: nothing to see)
        assert fingerprints([changed], KEYS[2], backend)[0] != base, what
    assert fingerprints([x.clone()], KEYS[2], backend)[0] == base  # the same bits elsewhere: the same value


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), positions=st.lists(st.integers(0, 299), min_size=1, max_size=6),
       deltas=st.lists(st.integers(-(1 << 31), (1 << 31) - 1).filter(bool), min_size=6, max_size=6),
       key=st.integers(0, (1 << 64) - 1))
def test_any_change_of_any_words_changes_it_numba(n, positions, deltas, key):
    """Random fp32 tensors with arbitrary bit changes in a few words (wrapping 32-bit differences): the numba
    fingerprint changes, and agrees with the reference. (Not a proof: the bound is probabilistic; docs/design.md
    section 5.1.)"""
    x = torch.arange(n, dtype=torch.float32) * 0.37 - 11
    y = x.clone()
    words = y.view(torch.int32)
    for pos, delta in zip(positions, deltas, strict=False):
        p = pos % n
        words[p] = int(np.int32(np.int64(words[p].item()) + delta))
    got = fingerprints([x, y], key, "numba")
    assert got == [reference(x, key), reference(y, key)]
    if not torch.equal(x.view(torch.int32), y.view(torch.int32)):
        assert got[0] != got[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("args, error, match", [
    (([torch.zeros(3)], -1), ValueError, r"key=-1 is invalid: allowed an integer in \[0, 2\*\*64\)"),
    (([torch.zeros(3)], 1 << 64), ValueError, "key=18446744073709551616 is invalid"),
    (([torch.zeros(3)], True), ValueError, "key=True is invalid"),
    (([torch.zeros(3)], 1.0), ValueError, "key=1.0 is invalid"),
    (([torch.zeros(3, dtype=torch.int32)], 1), TypeError, r"tensors\[0\] has dtype torch.int32"),
    ((torch.zeros(3), 1), TypeError, "tensors must be a list or tuple of tensors"),
    (([torch.zeros(3), "x"], 1), TypeError, r"tensors\[1\] must be a torch.Tensor"),
])
def test_bad_arguments_are_named(backend, args, error, match):
    with ops.use_backend(backend), pytest.raises(error, match=match):
        ops.multi_fingerprint(*args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_out_is_named_and_left_untouched(backend):
    for out, match in ((torch.zeros(2, dtype=torch.int32), "out has dtype torch.int32"),
                       (torch.zeros(3, dtype=torch.int64), r"out must have shape \[len\(tensors\)\] \[2\]"),
                       (torch.zeros(4, dtype=torch.int64)[::2], "out must be contiguous")):
        before = out.clone()
        with ops.use_backend(backend), pytest.raises((TypeError, ValueError), match=match):
            ops.multi_fingerprint([torch.ones(3), torch.ones(2)], 1, out=out)
        assert torch.equal(out, before)
    with ops.use_backend(backend):
        assert ops.multi_fingerprint([], 3).shape == (0,)
