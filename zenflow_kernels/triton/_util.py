# Launcher plumbing shared by the kernel modules: launch counting, the device guard, autotune pruning,
# dtype maps, per-tensor tables for the multi-tensor kernels and the segment search those kernels use.
#
# Device. Triton launches on the *current* CUDA device and its current stream, not on the tensors'
# device: parameters on cuda:1 while cuda:0 is current (model.to("cuda:1"), torchrun without
# set_device) would be read through the wrong context (an illegal address) or written unordered with
# the work queued on their own device. So every launch (`launch`) and every table copy
# (`device_table`) runs under `device_guard` of its tensors' device, which must be one device.
#
# Multi-tensor pattern: a small int64 table with one row per tensor (data pointers, sizes, strides,
# the first work unit of the tensor) is copied to the device; a 1-D grid runs over all work units of
# all tensors; each program finds its tensor by a binary search over the table's unit-start column
# and loads its pointers with `tl.load(row + j).to(tl.pointer_type(DTYPE))` (the pattern of Triton's
# grouped-GEMM tutorial; it runs compiled and under TRITON_INTERPRET=1). Tensors whose element types
# differ go to separate launches (the pointer type is a constexpr).
from __future__ import annotations

import collections
import contextlib
import math
import os

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

#: kernel name -> number of launches issued by our launchers (tests count them; never reset).
LAUNCHES: collections.Counter = collections.Counter()

# Interpreter runs (CPU, TRITON_INTERPRET=1) cannot be timed meaningfully, so autotuned kernels run
# one config there (and with ZENFLOW_TRITON_AUTOTUNE=0): the first one suited to the input layout, or
# the one a test forces with `force_config`.
_FORCED_CONFIG: dict[str, int] = {}


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def autotuning() -> bool:
    """False under the interpreter, or when ZENFLOW_TRITON_AUTOTUNE=0 (GPU test runs: every test shape
    would otherwise be benchmarked over every config); then the first suited config runs untimed."""
    return not interpreting() and os.environ.get("ZENFLOW_TRITON_AUTOTUNE", "1").strip().lower() not in (
        "0", "false", "off", "no")


def device_guard(device: torch.device | None):
    """Make ``device`` the current CUDA device (and its current stream the one Triton uses) for the
    block; a no-op for CPU tensors (the interpreter)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def launch_device(name: str, args) -> torch.device | None:
    """The one device of the tensors among ``args`` (None if there is none); an error if they differ.
    The launchers validate their inputs first, naming the user's argument; this is the last guard."""
    device = None
    first = 0
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if device is None:
                device, first = a.device, i
            elif a.device != device:
                raise ValueError(f"{name}: kernel argument {i} is on {a.device}, but argument {first} is on {device}; "
                                 "a launch needs all its tensors on one device")
    return device


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)`` on its tensors' device and count it under the kernel's name."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    device = launch_device(fn.__name__, args)
    LAUNCHES[fn.__name__] += 1
    with device_guard(device):
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def count_launches():
    """Yield a Counter that, after the block, holds the launches issued inside it (by kernel name)."""
    before = LAUNCHES.copy()
    delta: collections.Counter = collections.Counter()
    try:
        yield delta
    finally:
        delta.update(LAUNCHES - before)


def config_pruner(name: str, suited):
    """``early_config_prune`` for an autotuned kernel: keep the configs ``suited(config, args)`` accepts
    (all of them if none is); under the interpreter keep only one (the first suited, or a forced one)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        if name in _FORCED_CONFIG:
            return [configs[_FORCED_CONFIG[name] % len(configs)]]
        keep = [c for c in configs if suited(c, args)] or list(configs)
        return keep if autotuning() else keep[:1]

    return prune


@contextlib.contextmanager
def force_config(kernel, index: int):
    """Run an autotuned kernel with ``kernel.configs[index]`` only (tests sweep configs)."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    name = fn.__name__
    _FORCED_CONFIG[name] = index
    kernel.cache.clear()
    try:
        yield kernel.configs[index % len(kernel.configs)]
    finally:
        _FORCED_CONFIG.pop(name, None)
        kernel.cache.clear()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a small fixed "machine" so the split paths are exercised deterministically


def search_steps(n: int) -> int:
    """Iterations of the binary search over ``n`` table rows."""
    return max(1, math.ceil(math.log2(max(n, 1))) + 1)


def device_table(rows: list[list], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small [n, width] table on ``device``; CUDA copies go through pinned memory, without a sync, on
    ``device``'s current stream (the one the launch that reads the table uses)."""
    t = torch.tensor(rows, dtype=dtype)
    with device_guard(device):
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
    return t


@triton.jit
def find_segment(starts_ptr, row_stride, n_rows, pid, n_steps):
    """Largest row ``t`` with ``starts[t * row_stride] <= pid`` (rows sorted by start, ``starts[0] == 0``).

    Rows owning no units repeat the next row's start and are never returned for a valid ``pid``.
    """
    lo = pid * 0
    hi = lo + n_rows - 1
    for _ in range(n_steps):
        mid = (lo + hi + 1) // 2
        go = tl.load(starts_ptr + mid.to(tl.int64) * row_stride) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo
