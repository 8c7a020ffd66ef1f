"""What every host-kernel launcher does around its kernel: validate, view as numpy, launch.

Validation happens completely before the kernel runs, so an error leaves every tensor untouched.
Tensors are shared with numba without copies (``Tensor.numpy()``); bf16 is handed over as its
``int16`` bit pattern and fp16 as ``uint16`` (numba has no 16-bit float type, see ``kernels``).
The whole launcher costs ~15-25 us per call on this 2-core host (checks, views, numba dispatch): it
is written for that (no ABC isinstance on the fast path, numba's thread count switched through its
ctypes entry points rather than the public functions, which take two process-wide locks per call).

Threads. ``numba.set_num_threads`` is *thread-local*: it applies to launches from the calling
thread only, and a new thread starts at ``NUMBA_NUM_THREADS`` (the launch default, by default the
number of logical CPUs). The launchers therefore take ``num_threads=`` per call, set it for the
launch and restore the caller's value. Below ``MIN_ELEMENTS_PER_THREAD`` (2^16) elements per thread
fewer threads are used: waking a thread costs more than it saves on a small tensor (measured on a
2-core host: Adam on 2^16 params takes ~48 us on one thread and ~50 us on two).

Threading layer. numba picks TBB, then OpenMP, then its own ``workqueue`` layer. TBB and OpenMP are
thread-safe: two Python threads may launch kernels at the same time (the ZenFlow host worker runs
Adam in the background while another thread accumulates the next interval). ``workqueue`` is not:
concurrent launches abort the process. When numba ends up on ``workqueue``, launches from this
package are serialised with a lock (correct, just not concurrent); install ``tbb`` or an OpenMP
runtime to avoid it. With GNU OpenMP (what numba uses here: the system libgomp, a separate runtime
from torch's bundled copy) the layer is not fork-safe: do not launch kernels in a child forked after
the parent launched any.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import threading

import numba
import numpy as np
import torch

from ..rounding import StochasticRounding

STATE_DTYPES = (torch.float32,)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)  # optimizer state: bf16 stored rounded to nearest even
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, dtypes, numel: int | None = None) -> None:
    """A contiguous, strided CPU tensor of one of ``dtypes`` (and ``numel`` elements, when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
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


def check_disjoint(tensors: dict) -> None:
    """No two of the tensors (None entries skipped) share memory. Every launcher writes all of its
    tensors but one (the gradient), so any overlap is a race or a wrong result."""
    spans = []
    for name, t in tensors.items():
        if t is not None:
            n = t.numel()
            if n:
                start = t.data_ptr()
                spans.append((start, start + n * t.element_size(), name))
    spans.sort()
    reach, owner = -1, None
    for start, end, name in spans:
        if start < reach:
            raise ValueError(f"{owner} and {name} overlap in memory; the tensors of one call must not share storage")
        if end > reach:
            reach, owner = end, name


def check_host_pass(param, grad, state: dict, out, acc=None) -> int:
    """The tensors of one host update (``cpu_adam_``, ``cpu_lion_``, ``cpu_sgd_``): ``param`` fp32, ``acc`` (if
    given) fp32, ``grad`` fp32/bf16/fp16, each of ``state`` (name -> tensor; None entries skipped) fp32 or bf16,
    ``out`` (if given) fp32/bf16/fp16, all with param's element count and no two sharing memory. Returns it."""
    check_tensor("param", param, STATE_DTYPES)
    n = param.numel()
    if acc is not None:
        check_tensor("acc", acc, STATE_DTYPES, n)
    check_tensor("grad", grad, GRAD_DTYPES, n)
    for name, t in state.items():
        if t is not None:
            check_tensor(name, t, MOMENT_DTYPES, n)
    if out is not None:
        check_tensor("out", out, OUT_DTYPES, n)
    check_disjoint({"param": param, "acc": acc, "grad": grad, **state, "out": out})
    return n


def launch_update(kernel, n: int, num_threads, rounding, param, grad, state: dict, out, scalars, *, acc=None,
                  zero_acc: bool = False, zero_grad: bool = False, kernel_state: dict | None = None) -> None:
    """The end of every host update (``cpu_adam_``, ``accumulate_adam_``, ``cpu_lion_``, ``cpu_sgd_``), its tensors and
    numbers checked: check ``num_threads`` and ``rounding`` (against ``state``), then run ``kernel(param, grad,
    *kernel_state, acc, out, zero_acc, *scalars, key, salt)`` on the tensors' views (``kernel_state``: ``state``
    unless given; a None entry is compiled out, and with no state tensor nothing is rounded: salt None).
    ``zero_grad``: ``grad`` is an accumulation buffer the pass consumes, the kernel's accumulator path (g = acc[i],
    then acc[i] = 0)."""
    num_threads = check_num_threads(num_threads)
    key, salt = rounding_args(rounding, state)
    if n == 0:
        return
    if zero_grad:
        grad, acc, zero_acc = None, grad, True
    tensors = list((state if kernel_state is None else kernel_state).values())
    if all(t is None for t in tensors):
        salt = None
    launch(kernel, n, num_threads, as_numpy_or_none(param), as_numpy_or_none(grad), *map(as_numpy_or_none, tensors),
           as_numpy_or_none(acc), as_numpy_or_none(out), zero_acc, *scalars, key, salt)
    bump_versions(param, *tensors, acc, out)


# the options every host update takes, after its own parameters (``host_update``): name, default, annotation
_PASS_OPTIONS = tuple(
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    for name, default, annotation in (
        ("out", None, "torch.Tensor | None"),
        ("zero_grad", False, "bool"),
        ("num_threads", None, "int | None"),
        ("rounding", None, "StochasticRounding | None"),
    )
)


def host_update(kernel):
    """Make the public launcher of a host update (``cpu_adam_``, ``cpu_lion_``, ``cpu_sgd_``) from its declaration
    ``rule(param, grad, *state tensors, *, its numbers)``, which returns ``(param, grad, state, numbers)``: ``state``
    the state tensors by name, ``numbers()`` the check of the numbers, returning the kernel's ``(scalars,
    kernel_state)`` (``launch_update``'s; kernel_state None: ``state``). The launcher takes the declaration's
    parameters and then the options every host update takes (``out``, ``zero_grad``, ``num_threads``, ``rounding``:
    ``cpu_adam_`` documents them). It checks the tensors, ``zero_grad``, the numbers, then ``num_threads`` and
    ``rounding``, and only then runs ``kernel``: an error leaves every tensor unchanged."""

    def make(rule):
        @functools.wraps(rule)
        def launcher(*args, out=None, zero_grad=False, num_threads=None, rounding=None, **numbers):
            param, grad, state, check_numbers = rule(*args, **numbers)  # Python's own errors for the call's shape
            n = check_host_pass(param, grad, state, out)
            zero_grad = check_zero_grad(zero_grad, grad)
            scalars, kernel_state = check_numbers()
            launch_update(kernel, n, num_threads, rounding, param, grad, state, out, scalars, zero_grad=zero_grad,
                          kernel_state=kernel_state)

        del launcher.__wrapped__  # its annotations name StochasticRounding, which this module's globals hold
        own = inspect.signature(rule)
        launcher.__signature__ = own.replace(parameters=[*own.parameters.values(), *_PASS_OPTIONS],
                                             return_annotation="None")
        launcher.__annotations__ = {**rule.__annotations__, **{p.name: p.annotation for p in _PASS_OPTIONS},
                                    "return": "None"}
        return launcher

    return make


def rounding_args(rounding, state: dict) -> tuple:
    """The kernel's ``(key, salt)`` for ``rounding`` (None: round to nearest; or a
    ``zenflow_kernels.rounding.StochasticRounding``, which needs every given state tensor in bf16): ``(int64 key,
    None)`` or ``(int64 key, uint32 salt)``; the one salt of state tensors 0 and 1 (``StochasticRounding.salt``)."""
    if rounding is None:
        return np.int64(0), None
    if not isinstance(rounding, StochasticRounding):
        raise TypeError(f"rounding must be None or a zenflow_kernels.rounding.StochasticRounding, got "
                        f"{type(rounding).__name__} {rounding!r}")
    for name, t in state.items():
        if t is not None and t.dtype != torch.bfloat16:
            raise ValueError(f"rounding={rounding!r} rounds bf16 state, but {name} has dtype "
                             f"{str(t.dtype).replace('torch.', '')}: allowed bfloat16 state with stochastic rounding")
    return np.int64(rounding.key), np.uint32(rounding.salt(0))


def check_zero_grad(zero_grad, grad) -> bool:
    """``zero_grad`` a bool, and then ``grad`` fp32 (it is an accumulation buffer the pass zeroes)."""
    zero_grad = check_bool("zero_grad", zero_grad)
    if zero_grad and grad.dtype != torch.float32:
        raise TypeError(f"grad must have dtype float32 when zero_grad=True (it is zeroed in place), got "
                        f"{str(grad.dtype).replace('torch.', '')}")
    return zero_grad


def check_real(
    name: str, value, *, lo: float | None = None, hi: float | None = None, hi_open: bool = False, lo_open: bool = False
) -> float:
    """A finite real number (not bool) within [lo, hi] (open ends where asked); returned as float."""
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
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
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if type(value) is not bool and not isinstance(value, np.bool_):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_num_threads(num_threads) -> int:
    """None -> 0 (the calling thread's numba setting), else 1 <= num_threads <= NUMBA_NUM_THREADS."""
    if num_threads is None:
        return 0
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
    if t.requires_grad:
        t = t.detach()
    dtype = t.dtype
    if dtype is torch.bfloat16:
        a = t.view(torch.int16).numpy()
    elif dtype is torch.float16:
        a = t.numpy().view(np.uint16)
    else:
        a = t.numpy()
    return a if a.ndim == 1 else a.reshape(-1)


def as_numpy_or_none(t: torch.Tensor | None) -> np.ndarray | None:
    """``as_numpy(t)``; None for None (a kernel argument compiled out)."""
    return None if t is None else as_numpy(t)


def bump_versions(*tensors) -> None:
    """Tell autograd the tensors changed in place (numba writes bypass its version counters), so a
    graph that saved one of them fails loudly in backward instead of using the new value."""
    live = [t for t in tensors if t is not None and not t.is_inference()]
    if live:
        torch.autograd.graph.increment_version(live)


MIN_ELEMENTS_PER_THREAD = 1 << 16

# numba's threading layer is only known after the first parallel launch; until it is known (and for
# good when it is "workqueue", which aborts on concurrent launches) launches hold this lock.
_LAUNCH_LOCK = threading.Lock()
_serialise: bool | None = None
_thread_fns = None


def _get_thread_fns():
    """(get, set) of the calling thread's numba thread count. numba's public functions take two
    process-wide locks per call (~4 us each); once the layer is up, its ctypes entry points do the
    same in well under a microsecond. Falls back to the public functions if numba moves them."""
    global _thread_fns
    if _thread_fns is None:
        # Starting numba's OpenMP layer resets the calling thread's OpenMP thread count, which is
        # what torch.get_num_threads() reads: a trainer's torch.set_num_threads(1) would silently
        # become one thread per core. Put it back.
        torch_threads = torch.get_num_threads()
        numba.get_num_threads()  # starts the threading layer
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        try:
            from numba.np.ufunc import parallel

            get, set_ = parallel._get_num_threads, parallel._set_num_threads
            if not (callable(get) and callable(set_)) or get() != numba.get_num_threads():
                raise AttributeError("unexpected numba internals")
            _thread_fns = (get, set_)
        except (ImportError, AttributeError):
            _thread_fns = (numba.get_num_threads, numba.set_num_threads)
    return _thread_fns


def _resolve_layer() -> None:
    global _serialise
    try:
        _serialise = numba.threading_layer() == "workqueue"
    except ValueError:  # not initialised (no parallel launch happened yet)
        _serialise = None


def launch(kernel, n: int, nthreads: int, *args):
    """Run ``kernel(*args)`` over ``n`` elements (GIL released while it runs) on ``nthreads`` threads
    (0: the calling thread's numba setting), fewer when n is small; restores the caller's setting.
    Serialised only on numba's workqueue layer."""
    get, set_ = _get_thread_fns()
    prev = get()
    k = max(1, min(nthreads or prev, n // MIN_ELEMENTS_PER_THREAD))
    if k != prev:
        set_(k)
    try:
        if _serialise is False:
            return kernel(*args)
        with _LAUNCH_LOCK:
            result = kernel(*args)
            _resolve_layer()
            return result
    finally:
        if k != prev:
            set_(prev)
