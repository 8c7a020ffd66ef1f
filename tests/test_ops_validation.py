"""Every bad input raises a clear TypeError/ValueError naming the argument, before anything is written,
with the same message from the torch path and the Triton launchers."""

from __future__ import annotations

import os
import re

import pytest
import torch

from zenflow_kernels import ops
from zenflow_kernels.triton._util import count_launches

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
# (backend, device): the torch path always; the Triton launchers interpreted on CPU and/or on CUDA
BACKENDS = [("torch", "cpu")] + ([("triton", "cpu")] if INTERPRET else []) + (
    [("triton", "cuda")] if torch.cuda.is_available() else [])

R, C, K = 6, 10, 4


def adamw_args(device):
    gen = torch.Generator().manual_seed(0)
    return dict(
        param=torch.randn(R, C, generator=gen).to(device),
        grad=torch.randn(R, C, generator=gen).to(device),
        indices=torch.tensor([1, 4, 5, 9], device=device),
        exp_avg=torch.rand(R, K, generator=gen).to(device),
        exp_avg_sq=torch.rand(R, K, generator=gen).to(device),
        step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
        master=torch.randn(R, K, generator=gen).to(device), grad_scale=1.0,
    )


def call_adamw(a):
    a = dict(a)
    ops.selective_adamw_(a.pop("param"), a.pop("grad"), a.pop("indices"), a.pop("exp_avg"), a.pop("exp_avg_sq"), **a)


def _other_device(device):
    return "meta"  # a real second device is not needed to test the device check


# (name, mutation of the valid args, exception type, regex the message must match)
ADAMW_BAD = [
    ("param 1-D", lambda a, d: a.update(param=a["param"][0]), ValueError, r"param must be 2-D, got shape \[10\]"),
    ("param int", lambda a, d: a.update(param=a["param"].long()), TypeError, r"param has dtype torch.int64"),
    ("param list", lambda a, d: a.update(param=[[1.0]]), TypeError, r"param must be a torch.Tensor, got list"),
    ("grad shape", lambda a, d: a.update(grad=torch.zeros(R, C + 1, device=d)), ValueError,
     r"grad must have shape \(same as param\) \[6, 10\], got \[6, 11\]"),
    ("grad fp64", lambda a, d: a.update(grad=a["grad"].double()), TypeError, r"grad has dtype torch.float64"),
    ("grad device", lambda a, d: a.update(grad=torch.zeros(R, C, device=_other_device(d))), ValueError,
     r"grad is on meta"),
    ("indices int32", lambda a, d: a.update(indices=a["indices"].int()), TypeError, r"indices has dtype torch.int32"),
    ("indices 2-D", lambda a, d: a.update(indices=a["indices"][None]), ValueError, r"indices must be 1-D"),
    ("indices too many", lambda a, d: a.update(indices=torch.arange(C + 1, device=d)), ValueError,
     r"indices has 11 entries but param has only C=10 columns"),
    ("index == C", lambda a, d: a.update(indices=torch.tensor([1, 4, 5, 10], device=d)), ValueError,
     r"indices holds 10 at position 3; indices must be in \[0, C\) = \[0, 10\)"),
    ("index < 0", lambda a, d: a.update(indices=torch.tensor([-1, 4, 5, 9], device=d)), ValueError,
     r"indices holds -1 at position 0"),
    ("duplicate", lambda a, d: a.update(indices=torch.tensor([1, 4, 4, 9], device=d)), ValueError,
     r"indices holds the duplicate 4 at positions 1 and 2"),
    ("unsorted", lambda a, d: a.update(indices=torch.tensor([1, 5, 4, 9], device=d)), ValueError,
     r"indices is not sorted ascending: 5 at position 1 is followed by 4"),
    ("exp_avg shape", lambda a, d: a.update(exp_avg=torch.zeros(R, K + 1, device=d)), ValueError,
     r"exp_avg must have shape \[R, k\] \(k = len\(indices\)\) \[6, 4\], got \[6, 5\]"),
    ("exp_avg bf16", lambda a, d: a.update(exp_avg=a["exp_avg"].bfloat16()), TypeError,
     r"exp_avg has dtype torch.bfloat16; allowed: float32"),
    ("exp_avg_sq strided", lambda a, d: a.update(exp_avg_sq=torch.zeros(K, R, device=d).t()), ValueError,
     r"exp_avg_sq must be contiguous"),
    ("master shape", lambda a, d: a.update(master=torch.zeros(R, C, device=d)), ValueError,
     r"master must have shape"),
    ("master fp16", lambda a, d: a.update(master=a["master"].half()), TypeError, r"master has dtype torch.float16"),
    ("aliased state", lambda a, d: a.update(exp_avg_sq=a["exp_avg"]), ValueError,
     r"exp_avg_sq shares memory with exp_avg"),
    ("step 0", lambda a, d: a.update(step=0), ValueError, r"step must satisfy 1 <= step, got 0"),
    ("step float", lambda a, d: a.update(step=1.0), TypeError, r"step must be an int, got float"),
    ("step bool", lambda a, d: a.update(step=True), TypeError, r"step must be an int, got bool"),
    ("step tensor int32", lambda a, d: a.update(step=torch.ones(K, dtype=torch.int32, device=d)), TypeError,
     r"step has dtype torch.int32"),
    ("step tensor shape", lambda a, d: a.update(step=torch.ones(K + 1, dtype=torch.int64, device=d)), ValueError,
     r"step must have shape \[k\] \(one count per selected column\) \[4\], got \[5\]"),
    ("step tensor 0", lambda a, d: a.update(step=torch.tensor([1, 2, 0, 4], device=d)), ValueError,
     r"step must hold step counts >= 1 \(1-based\), got 0 at position 2"),
    ("lr < 0", lambda a, d: a.update(lr=-1e-3), ValueError, r"lr must be finite and in \[0.0, inf\), got -0.001"),
    ("lr nan", lambda a, d: a.update(lr=float("nan")), ValueError, r"lr must be finite"),
    ("lr str", lambda a, d: a.update(lr="0.1"), TypeError, r"lr must be a Python number, got str"),
    ("beta1 = 1", lambda a, d: a.update(beta1=1.0), ValueError, r"beta1 must be finite and in \[0.0, 1.0\)"),
    ("beta2 < 0", lambda a, d: a.update(beta2=-0.1), ValueError, r"beta2 must be finite and in \[0.0, 1.0\)"),
    ("eps < 0", lambda a, d: a.update(eps=-1e-8), ValueError, r"eps must be finite"),
    ("wd < 0", lambda a, d: a.update(weight_decay=-0.1), ValueError, r"weight_decay must be finite"),
    ("grad_scale 0", lambda a, d: a.update(grad_scale=0.0), ValueError,
     r"grad_scale must be finite and in \(0.0, inf\), got 0.0"),
    ("grad_scale inf", lambda a, d: a.update(grad_scale=float("inf")), ValueError, r"grad_scale must be finite"),
]


def snapshot(args):
    """(tensor, copy) for every tensor argument: the call may not write any of them."""
    return [(t, t.clone()) for t in args.values() if isinstance(t, torch.Tensor)]


def unchanged(snap):
    return all(torch.equal(t, copy) for t, copy in snap)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_selective_adamw_bad_inputs(backend, device):
    messages = []
    for name, mutate, exc, pattern in ADAMW_BAD:
        a = adamw_args(device)
        before = snapshot(a)  # the valid tensors: a mutation replaces one, the call must write none
        mutate(a, device)
        with ops.use_backend(backend), count_launches() as n, pytest.raises(exc) as info:
            call_adamw(a)
        assert re.search(pattern, str(info.value)), (name, str(info.value))
        assert str(info.value).startswith("selective_adamw_: "), name
        assert sum(n.values()) == 0, name
        assert unchanged(before), f"{name}: a tensor was written before the error"
        messages.append(str(info.value))
    assert len(messages) == len(ADAMW_BAD)
    # and the valid arguments do run and write
    a = adamw_args(device)
    before = snapshot(a)
    with ops.use_backend(backend):
        call_adamw(a)
    assert not unchanged(before) and torch.equal(before[1][0], before[1][1])  # written; grad read only


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_scores_and_topk_bad_inputs(backend, device):
    g = torch.randn(4, 5, device=device)
    s = torch.rand(5, device=device)
    cases = [
        (lambda: ops.column_scores(g[0]), ValueError, r"column_scores: grad must be 2-D, got shape \[5\] \(1-D\)"),
        (lambda: ops.column_scores(g[None]), ValueError, r"grad must be 2-D, got shape \[1, 4, 5\]"),
        (lambda: ops.column_scores(g.long()), TypeError, r"grad has dtype torch.int64; allowed: float32, bfloat16"),
        (lambda: ops.column_scores(g.tolist()), TypeError, r"grad must be a torch.Tensor, got list"),
        (lambda: ops.column_scores(g, "l3"), ValueError, r"importance must be one of \('l2', 'l1'\), got 'l3'"),
        (lambda: ops.column_scores(g, "L2"), ValueError, r"got 'L2'"),
        (lambda: ops.column_scores(g, None), ValueError, r"got None"),
        (lambda: ops.topk_columns(g, 1), ValueError, r"topk_columns: scores must be 1-D"),
        (lambda: ops.topk_columns(s.int(), 1), TypeError, r"scores has dtype torch.int32"),
        (lambda: ops.topk_columns(s, 6), ValueError, r"k must satisfy 0 <= k <= 5, got 6"),
        (lambda: ops.topk_columns(s, -1), ValueError, r"k must satisfy 0 <= k <= 5, got -1"),
        (lambda: ops.topk_columns(s, 1.5), TypeError, r"k must be an int, got float"),
        (lambda: ops.topk_columns(s, True), TypeError, r"k must be an int, got bool"),
        (lambda: ops.multi_column_scores(g), TypeError, r"grads must be a list or tuple of tensors, got Tensor"),
        (lambda: ops.multi_column_scores([g, g, g[0]]), ValueError, r"grads\[2\] must be 2-D"),
        (lambda: ops.multi_column_scores([g, torch.zeros(2, 2, device="meta")]), ValueError,
         r"grads\[1\] is on meta"),
        (lambda: ops.multi_topk_columns([s, s], [1]), ValueError, r"len\(scores_list\)=2, len\(ks\)=1"),
        (lambda: ops.multi_topk_columns([s, s], [1, 9]), ValueError, r"k for scores_list\[1\] must satisfy"),
    ]
    for fn, exc, pattern in cases:
        with ops.use_backend(backend), count_launches() as n, pytest.raises(exc, match=pattern):
            fn()
        assert sum(n.values()) == 0


def multi_args(device, n=3):
    items = [adamw_args(device) for _ in range(n)]
    return dict(
        params=[a["param"] for a in items], grads=[a["grad"] for a in items],
        indices_list=[a["indices"] for a in items], exp_avgs=[a["exp_avg"] for a in items],
        exp_avg_sqs=[a["exp_avg_sq"] for a in items], steps=[a["step"] for a in items], lrs=[1e-2] * n, beta1=0.9,
        beta2=0.999, eps=1e-8, weight_decays=0.1, masters=[a["master"] for a in items],
    )


def call_multi(m):
    m = dict(m)
    ops.multi_selective_adamw_(m.pop("params"), m.pop("grads"), m.pop("indices_list"), m.pop("exp_avgs"),
                               m.pop("exp_avg_sqs"), **m)


MULTI_BAD = [
    ("bad index in the last tensor", lambda m, d: m["indices_list"].__setitem__(2, torch.tensor([0, 1, 2, 10],
                                                                                                 device=d)),
     ValueError, r"indices_list\[2\] holds 10 at position 3"),
    ("bad step tensor", lambda m, d: m["steps"].__setitem__(1, torch.tensor([1, 0, 1, 1], device=d)), ValueError,
     r"steps\[1\] must hold step counts >= 1"),
    ("bad state shape", lambda m, d: m["exp_avgs"].__setitem__(2, torch.zeros(R, K + 1, device=d)), ValueError,
     r"exp_avgs\[2\] must have shape"),
    ("bad lr entry", lambda m, d: m.update(lrs=[1e-2, -1.0, 1e-2]), ValueError, r"lrs\[1\] must be finite"),
    ("bad wd entry", lambda m, d: m.update(weight_decays=[0.0, 0.0, -1.0]), ValueError,
     r"weight_decays\[2\] must be finite"),
    ("steps length", lambda m, d: m.update(steps=[1, 2]), ValueError,
     r"steps must be a scalar or have one entry per tensor \(3\), got 2"),
    ("masters length", lambda m, d: m.update(masters=m["masters"][:2]), ValueError, r"len\(masters\)=2"),
    ("list lengths", lambda m, d: m.update(grads=m["grads"][:2]), ValueError, r"len\(grads\)=2"),
    ("not a list", lambda m, d: m.update(params=m["params"][0]), TypeError, r"params must be a list or tuple"),
    ("mixed devices", lambda m, d: m["params"].__setitem__(1, torch.zeros(R, C, device="meta")), ValueError,
     r"params\[1\] is on meta"),
    ("bad grad dtype", lambda m, d: m["grads"].__setitem__(2, m["grads"][2].double()), TypeError,
     r"grads\[2\] has dtype torch.float64"),
]


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_multi_adamw_validates_everything_before_writing(backend, device):
    for name, mutate, exc, pattern in MULTI_BAD:
        m = multi_args(device)
        originals = [(t, t.clone()) for key in ("params", "exp_avgs", "exp_avg_sqs", "masters") for t in m[key]]
        mutate(m, device)
        with ops.use_backend(backend), count_launches() as n, pytest.raises(exc) as info:
            call_multi(m)
        assert re.search(pattern, str(info.value)), (name, str(info.value))
        assert str(info.value).startswith("multi_selective_adamw_: "), name
        assert sum(n.values()) == 0, name
        # every valid tensor of the call (in particular those before the bad one) is untouched
        assert all(torch.equal(t, copy) for t, copy in originals), name
    m = multi_args(device)
    originals = [(t, t.clone()) for t in m["params"]]
    with ops.use_backend(backend):
        call_multi(m)  # the valid call writes every tensor
    assert not any(torch.equal(t, copy) for t, copy in originals)


@pytest.mark.parametrize(("backend", "device"), [b for b in BACKENDS if b[0] == "triton"])
def test_same_messages_on_both_backends(backend, device):
    """The message text does not depend on the backend (shared validation)."""
    for name, mutate, exc, _ in ADAMW_BAD:
        msgs = []
        for b, dev in (("torch", device), (backend, device)):
            a = adamw_args(dev)
            mutate(a, dev)
            with ops.use_backend(b), pytest.raises(exc) as info:
                call_adamw(a)
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1], name


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_check_data_false_skips_only_the_data_checks(backend, device):
    a = adamw_args(device)
    a["step"] = torch.tensor([1, 2, 3, 4], device=device)
    with ops.use_backend(backend):
        ops.selective_adamw_(a["param"], a["grad"], a["indices"], a["exp_avg"], a["exp_avg_sq"], step=a["step"],
                             lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, check_data=False)
        with pytest.raises(ValueError, match="exp_avg must have shape"):  # metadata is still checked
            ops.selective_adamw_(a["param"], a["grad"], a["indices"][:2], a["exp_avg"], a["exp_avg_sq"], step=1,
                                 lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, check_data=False)
