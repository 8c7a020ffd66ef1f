"""What every host-kernel launcher does around its kernel: validate, view as numpy, pick threads, launch.

Validation happens completely before the kernel runs, so an error leaves every tensor untouched.
Tensors are shared with numba without copies (``Tensor.numpy()``); bf16 is handed over as its
``int16`` bit pattern and fp16 as ``uint16`` (numba has no 16-bit float type, see ``_kernels``).

Threads. ``numba.set_num_threads`` is *thread-local*: it applies to launches from the calling
thread only, and a new thread starts at ``NUMBA_NUM_THREADS`` (the launch default, by default the
number of logical CPUs). The launchers therefore take ``num_threads=`` per call and set it in the
calling thread for the duration of the call (restoring the previous value). Below
``MIN_ELEMENTS_PER_THREAD`` elements per thread fewer threads are used: waking a thread costs more
than it saves on a small tensor (measured on a 2-core host: ~3 us for a 1-thread launch against
10-80 us for 2 threads).

Threading layer. numba picks TBB, then OpenMP, then its own ``workqueue`` layer. TBB and OpenMP are
thread-safe: two Python threads may launch kernels at the same time (the ZenFlow host worker runs
Adam in the background while the main thread accumulates the next interval). ``workqueue`` is not:
concurrent launches abort the process. When numba ends up on ``workqueue``, launches from this
package are serialised with a lock (correct, just not concurrent); install ``tbb`` or an OpenMP
runtime to avoid it. With GNU OpenMP (what numba uses here, shared with torch's OpenMP) the layer
is not fork-safe: do not launch kernels in a child forked after the parent launched any.
"""

from __future__ import annotations

import math
import numbers
import threading

import numba
import numpy as np
import torch

MIN_ELEMENTS_PER_THREAD = 1 << 15

STATE_DTYPES = (torch.float32,)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, dtypes, numel: int | None = None) -> None:
    """A contiguous, strided CPU tensor of one of ``dtypes`` (and ``numel`` elements, when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (host kernels), got a tensor on {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (the kernel makes one flat pass and never copies), "
            f"got shape {tuple(t.shape)} with strides {t.stride()}"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements (like param), got {t.numel()} (shape {tuple(t.shape)})")


def check_disjoint(written: dict, read: dict) -> None:
    """Every written tensor's memory must not overlap any other tensor's (races, wrong results)."""
    spans = {}
    for name, t in {**written, **read}.items():
        if t is not None and t.numel() > 0:
            start = t.data_ptr()
            spans[name] = (start, start + t.numel() * t.element_size())
    names = list(spans)
    for a_i, a in enumerate(names):
        for b in names[a_i + 1 :]:
            if a not in written and b not in written:
                continue
            (a0, a1), (b0, b1) = spans[a], spans[b]
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{a} and {b} overlap in memory; the tensors a kernel writes must not share storage")


def check_real(
    name: str, value, *, lo: float | None = None, hi: float | None = None, hi_open: bool = False, lo_open: bool = False
) -> float:
    """A finite real number (not bool) within [lo, hi] (open ends where asked); returned as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {value!r}")
    return v


def check_int(name: str, value, *, lo: int) -> int:
    """An integer (Python or numpy, not bool) >= lo."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_num_threads(num_threads) -> int | None:
    """None (the calling thread's numba setting) or 1 <= num_threads <= NUMBA_NUM_THREADS."""
    if num_threads is None:
        return None
    n = check_int("num_threads", num_threads, lo=1)
    limit = numba.config.NUMBA_NUM_THREADS
    if n > limit:
        raise ValueError(
            f"num_threads must be <= NUMBA_NUM_THREADS = {limit} (numba's pool size, fixed at its first "
            f"launch; set the environment variable before starting Python for more), got {num_threads!r}"
        )
    return n


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Flat numpy view of a contiguous CPU tensor, sharing memory: fp32 as float32, bf16 as int16 bits,
    fp16 as uint16 bits."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy()
    if flat.dtype == torch.float16:
        return flat.numpy().view(np.uint16)
    return flat.numpy()


def bump_versions(*tensors) -> None:
    """Tell autograd the tensors changed in place (numba writes bypass its version counters), so a
    graph that saved one of them fails loudly in backward instead of using the new value."""
    live = [t for t in tensors if t is not None and not t.is_inference()]
    if live:
        torch.autograd.graph.increment_version(live)


# numba's threading layer is only known after the first parallel launch; until it is known (and for
# good when it is "workqueue", which aborts on concurrent launches) launches hold this lock.
_LAUNCH_LOCK = threading.Lock()
_serialise: bool | None = None


def _resolve_layer() -> None:
    global _serialise
    try:
        _serialise = numba.threading_layer() == "workqueue"
    except ValueError:  # not initialised (no parallel launch happened yet)
        _serialise = None


def threads_for(n: int, num_threads: int | None) -> int:
    """Threads to use for ``n`` elements: the request (or the caller's numba setting), fewer when small."""
    k = numba.get_num_threads() if num_threads is None else num_threads
    return max(1, min(k, n // MIN_ELEMENTS_PER_THREAD))


def launch(kernel, nthreads: int, *args):
    """Run ``kernel(*args)`` on ``nthreads`` threads of the calling thread's numba pool (GIL released)."""
    prev = numba.get_num_threads()
    if nthreads != prev:
        numba.set_num_threads(nthreads)
    try:
        if _serialise is False:
            return kernel(*args)
        with _LAUNCH_LOCK:
            result = kernel(*args)
            _resolve_layer()
            return result
    finally:
        if nthreads != prev:
            numba.set_num_threads(prev)
