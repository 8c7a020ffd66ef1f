"""Every Triton launcher runs on its tensors' device: each kernel launch (and each table copy) happens
inside the device guard of the tensors' device, and a call whose tensors sit on several devices is an
error naming the argument. The CPU half, under TRITON_INTERPRET=1 (where the guard is a no-op: what is
checked is that it is entered, and with which device); tests/test_gpu_devices.py runs the ops with
parameters on a second GPU."""

from __future__ import annotations

import os
import re

import pytest
import torch

from zenflow_kernels import ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (Triton launchers on CPU tensors)")

_util = pytest.importorskip("zenflow_kernels.triton._util")
from device_ops import OP_CALLS  # noqa: E402

from zenflow_kernels.triton import column_scores as cs  # noqa: E402
from zenflow_kernels.triton import selective_adamw as sa  # noqa: E402
from zenflow_kernels.triton import topk_columns as tk  # noqa: E402

KERNELS = {name: obj for mod in (cs, tk, sa) for name, obj in vars(mod).items()
           if name.endswith("_kernel") and hasattr(obj, "run")}


@pytest.fixture
def guarded(monkeypatch):
    """Records ``entered``: the device of every guard entered (launches and table copies), and
    ``launched``: (kernel, the device of the innermost guard open at that moment, or None) per launch."""
    real = _util.device_guard
    open_guards: list = []
    entered: list = []
    launched: list = []

    class Recording:
        def __init__(self, device):
            self.device, self.inner = device, real(device)

        def __enter__(self):
            entered.append(self.device)
            open_guards.append(self.device)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_guards.pop()
            return self.inner.__exit__(*exc)

    def recording_run(name, run):
        def run_in_guard(*args, **kwargs):
            launched.append((name, open_guards[-1] if open_guards else None))
            return run(*args, **kwargs)
        return run_in_guard

    monkeypatch.setattr(_util, "device_guard", Recording)
    for name, kernel in KERNELS.items():
        monkeypatch.setattr(kernel, "run", recording_run(name, kernel.run))
    return entered, launched


def test_every_launch_runs_in_its_tensors_device_guard(guarded):
    entered, launched = guarded
    cpu = torch.device("cpu")
    with ops.use_backend("triton"):
        for name, call in OP_CALLS.items():
            before = len(launched)
            with _util.count_launches() as n:
                call("cpu")
            mine = launched[before:]
            assert mine and len(mine) == sum(n.values()), name
            assert all(device == cpu for _, device in mine), (name, mine)
    assert {k for k, _ in launched} == set(KERNELS)  # the calls cover every kernel
    assert len(entered) > len(launched)  # the table copies of the multi-tensor launchers too
    assert all(d == cpu for d in entered)


def test_device_table_copies_under_the_guard(guarded):
    entered, _ = guarded
    t = _util.device_table([[1, 2], [3, 4]], torch.device("cpu"))
    assert t.tolist() == [[1, 2], [3, 4]] and entered == [torch.device("cpu")]


def test_guard_of_a_cuda_device_selects_it():
    """The guard for cuda:1 makes cuda:1 current (built without touching CUDA: none is needed here)."""
    guard = _util.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(_util.device_guard(torch.device("cpu")), torch.cuda.device)


def test_launch_refuses_tensors_on_two_devices():
    with _util.count_launches() as n, pytest.raises(ValueError, match=re.escape(
            "_sum_partials_kernel: kernel argument 1 is on meta, but argument 0 is on cpu; a launch needs all its "
            "tensors on one device")):
        _util.launch(cs._sum_partials_kernel, (1,), torch.zeros(2, 2), torch.zeros(2, device="meta"), 2, 2,
                     BLOCK_C=16)
    assert sum(n.values()) == 0


def _adamw(device, **on_meta):
    """Valid selective_adamw_ arguments on ``device``, the named ones moved to the meta device."""
    R, C, k = 4, 8, 3
    a = dict(param=torch.randn(R, C, device=device), grad=torch.randn(R, C, device=device),
             indices=torch.tensor([0, 2, 5], device=device), exp_avg=torch.zeros(R, k, device=device),
             exp_avg_sq=torch.zeros(R, k, device=device), master=torch.zeros(R, k, device=device),
             step=torch.ones(k, dtype=torch.int64, device=device))
    for name in on_meta:
        a[name] = a[name].to("meta")
    return a


ADAMW_TENSORS = ["grad", "indices", "exp_avg", "exp_avg_sq", "master", "step"]


@pytest.mark.parametrize("name", ADAMW_TENSORS)
def test_selective_adamw_on_two_devices_is_an_error(name):
    a = _adamw("cpu", **{name: True})
    with ops.use_backend("triton"), _util.count_launches() as n, pytest.raises(ValueError, match=re.escape(
            f"selective_adamw_: {name} is on meta, but must be on cpu like the other tensors")):
        ops.selective_adamw_(a.pop("param"), a.pop("grad"), a.pop("indices"), a.pop("exp_avg"), a.pop("exp_avg_sq"),
                             lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, **a)
    assert sum(n.values()) == 0


@pytest.mark.parametrize("name", ["params", *ADAMW_TENSORS])
def test_multi_selective_adamw_on_two_devices_is_an_error(name):
    """The second tensor's entry on another device: named with its list index."""
    items = [_adamw("cpu"), _adamw("cpu", **({} if name == "params" else {name: True}))]
    if name == "params":
        items[1]["param"] = items[1]["param"].to("meta")
    lists = {key: [it[single] for it in items] for key, single in [
        ("params", "param"), ("grads", "grad"), ("indices_list", "indices"), ("exp_avgs", "exp_avg"),
        ("exp_avg_sqs", "exp_avg_sq"), ("masters", "master"), ("steps", "step")]}
    listed = {"grad": "grads", "indices": "indices_list", "exp_avg": "exp_avgs", "exp_avg_sq": "exp_avg_sqs",
              "master": "masters", "step": "steps"}.get(name, name)
    expected = ("params[1] is on meta, but params[0] is on cpu; a multi-tensor call needs all tensors on one device"
                if name == "params" else f"{listed}[1] is on meta, but must be on cpu like the other tensors")
    with ops.use_backend("triton"), _util.count_launches() as n, pytest.raises(ValueError, match=re.escape(
            "multi_selective_adamw_: " + expected)):
        ops.multi_selective_adamw_(lists.pop("params"), lists.pop("grads"), lists.pop("indices_list"),
                                   lists.pop("exp_avgs"), lists.pop("exp_avg_sqs"), lrs=1e-2, beta1=0.9,
                                   beta2=0.999, eps=1e-8, weight_decays=0.0, **lists)
    assert sum(n.values()) == 0


def test_multi_scores_and_topk_on_two_devices_are_errors():
    g, s = torch.randn(4, 5), torch.rand(5)
    cases = [
        (lambda: ops.multi_column_scores([g, g.to("meta")]),
         "multi_column_scores: grads[1] is on meta, but grads[0] is on cpu; a multi-tensor call needs all tensors "
         "on one device"),
        (lambda: ops.multi_topk_columns([s, s.to("meta")], [1, 1]),
         "multi_topk_columns: scores_list[1] is on meta, but scores_list[0] is on cpu; a multi-tensor call needs "
         "all tensors on one device"),
    ]
    for call, message in cases:
        with ops.use_backend("triton"), _util.count_launches() as n, pytest.raises(ValueError,
                                                                                  match=re.escape(message)):
            call()
        assert sum(n.values()) == 0
