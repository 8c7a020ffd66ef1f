"""The work one ``step()`` between boundaries does, counted: it must not grow with the number of tensors beyond
what is stated per tensor kind (docs/design.md section 5, "What a step costs the training thread").

At 10 and at 300 tensors (alternating [64, 64] matrices and [64] vectors), on the synchronous link and on the
asynchronous one (``testing.chaos(max_delay=0)``, the GPU's protocol), with the gradients set by hand (``step()``
copies them all) and made by a backward (its hooks copy them; ``step()`` checks their fingerprints):

* torch operators dispatched by the training thread in ``step()`` (a ``TorchDispatchMode``): a constant, plus
  one per vector (its gradient seen as a ``[1, n]`` row by the fused kernel) and none per matrix: views, launch
  tables and pointer arrays are made once per selection or layout;
* fingerprint launches, copy jobs to the host and numba launches by the training thread: a constant, whatever the
  tensor count.
"""

import collections
import contextlib
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zenflow_kernels import ZenFlowAdamW, ops
from zenflow_kernels.cpu_ops import _common
from zenflow_kernels.link.thread_engine import ThreadEngine
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)

ZEN = dict(topk_ratio=0.1, select_strategy="step", select_interval=1000, update_interval=1000, overlap_step=True)
CONSTANT_OPS = 16  # at most, whatever the count (measured: 6)
PER_VECTOR_OPS = 1
PER_MATRIX_OPS = 0
CONSTANT_CALLS = {"fingerprint": 1, "d2h": 1, "numba": 4}  # at most, per step


class Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted_step(n: int, link: str, backward: bool, monkeypatch) -> tuple[collections.Counter, collections.Counter]:
    """The operators and the calls of the 6th step of an optimizer over ``n`` tensors (the first builds it and the
    hooks; the next ones settle every cache)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn((64, 64) if i % 2 == 0 else (64,), generator=g)) for i in range(n)]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    calls = collections.Counter()

    training = threading.current_thread()

    def counting(name, fn):  # the training thread's calls (a worker's fold may run during the step, or not)
        def wrapped(*args, **kwargs):
            if threading.current_thread() is training:
                calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    with chaos(seed=0, max_delay=0) if link == "async" else contextlib.nullcontext():
        opt = ZenFlowAdamW(params, lr=1e-3, zenflow=ZEN)
    with opt:
        for t in range(6):
            if backward:
                opt.zero_grad()
                torch.stack([(p * q).sum() for p, q in zip(params, grads, strict=True)]).sum().backward()
            else:
                for p, q in zip(params, grads, strict=True):
                    p.grad = q
            if t < 5:
                opt.step()
                opt.link.synchronize()
                continue
            with monkeypatch.context() as m:
                m.setattr(ops, "multi_fingerprint_unchecked", counting("fingerprint", ops.multi_fingerprint_unchecked))
                m.setattr(ThreadEngine, "d2h", counting("d2h", ThreadEngine.d2h))
                m.setattr(_common, "launch", counting("numba", _common.launch))
                mode = Operators()
                with mode:
                    opt.step()
            assert (opt.selections, opt.host_updates) == (1, 0)  # (a step between boundaries)
    return mode.count, calls


@pytest.mark.parametrize("link, backward", [("sync", False), ("async", False), ("async", True)])
def test_a_steps_work_does_not_grow_with_the_tensor_count(link, backward, monkeypatch):
    small, small_calls = counted_step(10, link, backward, monkeypatch)
    large, large_calls = counted_step(300, link, backward, monkeypatch)
    vectors, matrices = 145, 145  # (300 - 10) / 2 more of each
    grown = sum(large.values()) - sum(small.values())
    assert grown == PER_VECTOR_OPS * vectors + PER_MATRIX_OPS * matrices, (small, large)
    assert large - small == collections.Counter(unsqueeze=vectors), (small, large)
    assert sum(small.values()) - 5 * PER_VECTOR_OPS <= CONSTANT_OPS, small
    assert small_calls == large_calls, (small_calls, large_calls)
    for name, most in CONSTANT_CALLS.items():
        assert large_calls[name] <= most, large_calls
    if link == "async":  # the check of every gradient is one launch; what no hook copied, one copy job
        assert large_calls["fingerprint"] == (1 if backward else 0) and large_calls["d2h"] == (0 if backward else 1)
