"""The CPU fast path (numba selective AdamW) against the torch implementation of the same contract."""

import os

import pytest
import torch

from zenflow_kernels import ops, torch_ops
from zenflow_kernels.cpu_ops import selective_adamw as numba_ops
from zenflow_kernels.launch_plan import LaunchItems

SHAPES = [(1, 1), (1, 37), (29, 1), (7, 33), (64, 130)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_case(shape, dtype, dense, per_column, with_master, seed=0):
    g = torch.Generator().manual_seed(seed)
    R, C = shape
    param = (torch.randn(R, C, generator=g) * 0.5).to(dtype)
    idx = None if dense else torch.randperm(C, generator=g)[: max(1, C // 3)].sort().values
    k = C if dense else idx.numel()
    cols = slice(None) if dense else idx
    state = dict(
        exp_avg=torch.randn(R, k, generator=g) * 0.1,
        exp_avg_sq=torch.rand(R, k, generator=g) * 0.01,
        master=param[:, cols].float().clone() if with_master else None,
    )
    step = torch.randint(1, 50, (k,), generator=g) if per_column else 7
    grads = [torch.randn(R, C, generator=g).to(dtype) for _ in range(4)]
    return param, idx, state, step, grads


def run(impl, param, idx, state, step, grads, grad_scale):
    param = param.clone()
    st = {k: (None if v is None else v.clone()) for k, v in state.items()}
    for n, g in enumerate(grads):
        s = step + n if isinstance(step, torch.Tensor) else step + n
        impl.selective_adamw_(param, g, idx, st["exp_avg"], st["exp_avg_sq"], step=s, lr=3e-2, beta1=0.9,
                              beta2=0.99, eps=1e-8, weight_decay=0.05, master=st["master"], grad_scale=grad_scale)
    return param, st


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_torch_path(shape, dtype):
    failures = []
    for dense in (False, True):
        for per_column in (False, True):
            for with_master in ((False, True) if dtype != torch.float32 else (False,)):
                for grad_scale in (1.0, 3.0):
                    case = make_case(shape, dtype, dense, per_column, with_master)
                    p_ref, s_ref = run(torch_ops, *case, grad_scale)
                    p_new, s_new = run(numba_ops, *case, grad_scale)
                    tag = (dense, per_column, with_master, grad_scale)
                    # moments: the same fp32 operations in the same order; the master is a weight (an ulp)
                    for key, atol in (("exp_avg", 1e-9), ("exp_avg_sq", 1e-9), ("master", 1e-7)):
                        if s_ref[key] is not None and not torch.allclose(s_new[key], s_ref[key], rtol=1e-6,
                                                                         atol=atol):
                            failures.append((tag, key, float((s_new[key] - s_ref[key]).abs().max())))
                    # parameters: within an ulp of the parameter's dtype (ATen's sqrt is not correctly rounded)
                    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
                    if not torch.allclose(p_new.float(), p_ref.float(), rtol=tol, atol=1e-6):
                        failures.append((tag, "param", float((p_new.float() - p_ref.float()).abs().max())))
                    if not dense:  # columns that are not selected are never touched
                        rest = torch.ones(shape[1], dtype=torch.bool)
                        rest[case[1]] = False
                        if not torch.equal(p_new[:, rest], case[0][:, rest]):
                            failures.append((tag, "unselected columns changed", None))
    assert not failures, failures


def test_topk_one_on_the_numba_path_is_torch_adamw():
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(6, 9, generator=g))
    q = p.detach().clone()
    m, v = torch.zeros(6, 9), torch.zeros(6, 9)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, foreach=False)
    for step in range(1, 11):
        grad = torch.randn(6, 9, generator=g)
        p.grad = grad.clone()
        opt.step()
        numba_ops.selective_adamw_(q, grad, torch.arange(9), m, v, step=torch.full((9,), step), lr=1e-2, beta1=0.9,
                                   beta2=0.999, eps=1e-8, weight_decay=0.1)
        torch.testing.assert_close(q, p.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, opt.state[p]["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(v, opt.state[p]["exp_avg_sq"], rtol=0, atol=0)


def test_strided_gradient_falls_back_and_agrees():
    case = make_case((12, 20), torch.float32, False, True, False)
    param, idx, state, step, grads = case
    grads_t = [g.t().contiguous().t() for g in grads]  # same values, column-major strides
    assert not grads_t[0].is_contiguous()
    p_ref, _ = run(torch_ops, param, idx, state, step, grads, 1.0)
    p_new, _ = run(numba_ops, param, idx, state, step, grads_t, 1.0)
    torch.testing.assert_close(p_new, p_ref, rtol=1e-6, atol=1e-7)


def _assert_multi_equals_singles(spec) -> None:
    """Four multi-tensor calls over the cases ``(shape, dtype, dense, per-column steps)`` give the bits of four
    single calls per case."""
    cases = [make_case(shape, d, dense, pc, d != torch.float32, seed=n) for n, (shape, d, dense, pc) in enumerate(spec)]
    singles = [run(numba_ops, *c, 2.0) for c in cases]
    params = [c[0].clone() for c in cases]
    states = [{k: (None if v is None else v.clone()) for k, v in c[2].items()} for c in cases]
    for n in range(4):
        numba_ops.multi_selective_adamw_(
            params, [c[4][n] for c in cases], [c[1] for c in cases], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], steps=[c[3] + n for c in cases], lrs=3e-2, beta1=0.9, beta2=0.99,
            eps=1e-8, weight_decays=[0.05] * len(cases), masters=[s["master"] for s in states], grad_scale=2.0)
    for j, ((p_single, s_single), p_multi, s_multi) in enumerate(zip(singles, params, states, strict=True)):
        assert torch.equal(p_single, p_multi), j
        assert torch.equal(s_single["exp_avg"], s_multi["exp_avg"]), j
        assert torch.equal(s_single["exp_avg_sq"], s_multi["exp_avg_sq"]), j


def test_multi_form_equals_single_calls():
    _assert_multi_equals_singles([((7, 33), torch.float32, False, True), ((1, 50), torch.bfloat16, True, False),
                                  ((20, 8), torch.float16, False, False)])


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 64, None])
def test_multi_form_is_the_same_whatever_the_work_ranges(monkeypatch, parts):
    """The multi-tensor kernel walks its work items in ``parts`` contiguous ranges (a tensor's row looked up
    once per range): ranges that start and end inside a tensor, inside a matrix's rows and inside a long
    vector's blocks, one range per item, and the launcher's own choice (None) all give the single calls' bits."""
    if parts is not None:
        monkeypatch.setattr(numba_ops, "_parts", lambda work, chunks: min(parts, chunks))
    _assert_multi_equals_singles([((37, 50), torch.float32, False, True),
                                  ((1, 3 * numba_ops.MULTI_BLOCK + 11), torch.float32, True, False),
                                  ((5, 9), torch.float32, False, False), ((64, 130), torch.float32, True, True)])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (dict(indices=torch.tensor([3, 1])), "not sorted ascending"),
        (dict(indices=torch.tensor([1, 40])), "must be in"),
        (dict(step=0), "step"),
        (dict(exp_avg=torch.zeros(7, 3)), "exp_avg"),
        (dict(lr=-1.0), "lr"),
        (dict(grad=torch.zeros(7, 32)), "grad"),
    ],
)
def test_errors_match_the_torch_path_and_write_nothing(mutate, match):
    def call(impl):
        param = torch.ones(7, 33)
        args = dict(grad=torch.ones(7, 33), indices=torch.tensor([1, 3]), exp_avg=torch.zeros(7, 2),
                    exp_avg_sq=torch.zeros(7, 2), step=1, lr=1e-2) | mutate
        with pytest.raises((ValueError, TypeError), match=match) as info:
            impl.selective_adamw_(param, args["grad"], args["indices"], args["exp_avg"], args["exp_avg_sq"],
                                  step=args["step"], lr=args["lr"], beta1=0.9, beta2=0.99, eps=1e-8,
                                  weight_decay=0.0)
        assert torch.equal(param, torch.ones(7, 33)) and not args["exp_avg"].any()
        return type(info.value), str(info.value)

    assert call(numba_ops) == call(torch_ops)


def test_cpu_dispatch_picks_numba_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    param = torch.zeros(3, 4)
    assert ops._impl(param).selective_adamw_ is numba_ops.selective_adamw_
    with ops.use_backend("torch"):
        assert ops._impl(param) is torch_ops
    with ops.use_backend("numba"):
        assert ops._impl(param).multi_selective_adamw_items_ is numba_ops.multi_selective_adamw_items_
        assert ops._impl(param).column_scores is torch_ops.column_scores


def _planned_case(seed=5, strided_indices=True):
    """Tensors like the optimizer's: matrices whose per-column steps are views of one flat tensor (one of them
    through strided indices), vectors with integer steps, three dtype groups, a strided gradient, an empty
    tensor and a vector longer than a work block."""
    g = torch.Generator().manual_seed(seed)
    spec = [  # (shape, dtype, dense, master, strided gradient)
        ((12, 40), torch.float32, False, False, False),
        ((1, 37), torch.float32, True, False, False),
        ((9, 31), torch.bfloat16, False, True, False),
        ((1, 2 * numba_ops.MULTI_BLOCK + 3), torch.float32, True, False, False),
        ((6, 20), torch.float16, False, False, False),
        ((1, 9), torch.bfloat16, True, True, False),
        ((5, 16), torch.float32, False, False, True),
        ((0, 8), torch.float32, False, False, False),
        ((8, 24), torch.float32, False, False, False),
    ]
    rows, widths = [], []
    for n, ((R, C), dtype, dense, with_master, strided) in enumerate(spec):
        param = (torch.randn(R, C, generator=g) * 0.5).to(dtype)
        idx = None if dense else torch.randperm(C, generator=g)[: max(1, C // 4)].sort().values
        if n == 0 and strided_indices:
            idx = torch.stack([idx, idx], dim=1)[:, 0]  # strided indices
        k = C if dense else idx.numel()
        state = [torch.randn(R, k, generator=g) * 0.1, torch.rand(R, k, generator=g) * 0.01,
                 param[:, slice(None) if dense else idx].float().clone() if with_master else None]
        rows.append((param, idx, state, dense, strided))
        widths.append(0 if dense else k)
    flat = torch.randint(1, 30, (sum(widths),), generator=g)
    grads = [[torch.randn(r[0].shape, generator=g).to(r[0].dtype) for r in rows] for _ in range(6)]
    for step_grads, r in zip(zip(*grads, strict=True), rows, strict=True):
        if r[4]:
            for x in step_grads:
                x.data = x.t().contiguous().t()
    return rows, widths, flat, grads


def _on(device: str, rows, flat, grads):
    """The case's tensors on ``device`` (their strides kept)."""
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ([(dev(r[0]), dev(r[1]), [dev(t) for t in r[2]], *r[3:]) for r in rows], dev(flat),
            [[dev(x) for x in step] for step in grads])


def _run_planned(planned: bool, events=(), impl=numba_ops, same_tensors=False, device="cpu"):
    """Six calls, with the events ``{call: what}`` the cache must notice; returns every tensor at the end.
    (Triton reads indices as contiguous: its case has no strided ones.)"""
    rows, widths, flat, grads = _planned_case(strided_indices=impl is numba_ops)
    rows, flat, grads = _on(device, rows, flat, grads)
    params = [r[0].clone() for r in rows]
    states = [[None if t is None else t.clone() for t in r[2]] for r in rows]
    flat = flat.clone()
    offsets = [sum(widths[:j]) for j in range(len(widths))]
    steps = [None if r[3] else flat[o : o + w] for r, o, w in zip(rows, offsets, widths, strict=True)]
    ints = [3] * len(rows)
    cache = {}
    for n in range(6):
        events_now = dict(events).get(n, ())
        if "steps_replaced" in events_now:  # new step tensors (another flat tensor), the same values
            flat = flat.clone()
            steps = [None if st is None else flat[o : o + st.numel()] for st, o in zip(steps, offsets, strict=True)]
        flat.add_(1)
        ints = [s + 1 for s in ints]
        now = [s + j for j, s in enumerate(ints)] if "int_steps_differ" in events_now else ints
        if "state_replaced" in events_now:
            states[2] = [t.clone() for t in states[2]]
        if "param_moved" in events_now:
            params[4].data = params[4].clone()
        step_grads = list(grads[n])
        if "grad_dtype" in events_now:
            step_grads[0] = step_grads[0].to(torch.bfloat16)
        if "grad_strided" in events_now:
            step_grads[8] = step_grads[8].t().contiguous().t()
        lr = 1e-2 * (1 + n % 3)
        items = [
            (p, gr, r[1], s[0], s[1], s[2], now[j] if st is None else st, lr * (1 + (j in (3, 8) and n == 2)),
             0.1 if j % 2 else 0.0)
            for j, (p, gr, r, s, st) in enumerate(zip(params, step_grads, rows, states, steps, strict=True))
        ]
        if planned:
            items = LaunchItems(items, cache, same_tensors=same_tensors)
        impl.multi_selective_adamw_items_(items, 0.9, 0.99, 1e-8, 1.0 + 0.5 * n)
    return params, states, cache


def _planned_matches_unplanned(impl, event, same_tensors=False, device="cpu") -> dict:
    """Six calls laid out once (``event`` at the third) against six laid out each time: every tensor's
    bits; returns the plan's cache."""
    events = {} if event is None else {2: (event,)}
    p_ref, s_ref, _ = _run_planned(False, events, impl=impl, device=device)
    p_new, s_new, cache = _run_planned(True, events, impl=impl, same_tensors=same_tensors, device=device)
    for j, (a, b) in enumerate(zip(p_ref, p_new, strict=True)):
        assert torch.equal(a, b), (j, float((a.float() - b.float()).abs().max()))
    for j, (sa, sb) in enumerate(zip(s_ref, s_new, strict=True)):
        for x, y in zip(sa, sb, strict=True):
            assert (x is None and y is None) or torch.equal(x, y), j
    return cache


_EVENTS = [None, "int_steps_differ", "state_replaced", "param_moved", "grad_dtype", "grad_strided", "steps_replaced"]


@pytest.mark.parametrize("event, same_tensors", [(e, False) for e in _EVENTS] + [
    (e, True) for e in _EVENTS if e not in ("state_replaced", "steps_replaced")])  # (those break the promise)
def test_planned_launch_is_bit_identical(event, same_tensors):
    """LaunchItems (the launch laid out once, only gradients, step coefficients and decay written per call)
    gives the same bits as laying it out at every call, also when what the plan was made for changes (at
    the third call; at the same call a vector's and a matrix's lr differ, and the integer steps' regions split and
    join). With ``same_tensors`` (the caller promises the state tensors stay the same objects) the parameters'
    addresses and the gradients' layout are still checked."""
    assert "numba" in _planned_matches_unplanned(numba_ops, event, same_tensors)


_INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
_TRITON_DEVICES = (["cpu"] if _INTERPRET else []) + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.skipif(not _TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or a CUDA device")
@pytest.mark.parametrize("device", _TRITON_DEVICES)
@pytest.mark.parametrize("event", _EVENTS)
def test_planned_triton_launch_is_bit_identical(event, device):
    """The Triton launcher's plan (its tables laid out once per LaunchItems; on CPU under the interpreter, on
    a GPU in bench/gpu_suite.sh): the same bits as laying them out at every call, through the same events
    as the numba plan's test; laid out again when the items change (a gradient with other strides is
    another table: its strides are in it)."""
    sa = pytest.importorskip("zenflow_kernels.triton.selective_adamw")
    assert "triton" in _planned_matches_unplanned(sa, event, device=device)
    rows, _, flat, grads = _planned_case(strided_indices=False)
    rows, flat, grads = _on(device, rows, flat, grads)
    items = [(r[0].clone(), grads[0][j], r[1], *[None if t is None else t.clone() for t in r[2]], 4, 1e-2, 0.0)
             for j, r in enumerate(rows)]
    cache = {}
    sa.multi_selective_adamw_items_(LaunchItems(items, cache), 0.9, 0.99, 1e-8, 1.0)
    first = cache["triton"]
    again = [(*it[:1], grads[1][j], *it[2:]) for j, it in enumerate(items)]  # new gradients, same layout
    sa.multi_selective_adamw_items_(LaunchItems(again, cache), 0.9, 0.99, 1e-8, 1.0)
    assert cache["triton"] is first
    again[0] = (again[0][0], again[0][1].t().contiguous().t(), *again[0][2:])  # other strides: laid out again
    sa.multi_selective_adamw_items_(LaunchItems(again, cache), 0.9, 0.99, 1e-8, 1.0)
    assert cache["triton"] is not first


def test_planned_launch_is_laid_out_once():
    rows, widths, flat, grads = _planned_case()
    params = [r[0].clone() for r in rows]
    states = [[None if t is None else t.clone() for t in r[2]] for r in rows]
    cache = {}
    plans = []
    for n in range(3):
        items = LaunchItems(
            [(p, gr, r[1], s[0], s[1], s[2], 4 + n, 1e-2, 0.0)
             for p, gr, r, s in zip(params, grads[n], rows, states, strict=True)], cache)
        numba_ops.multi_selective_adamw_items_(items, 0.9, 0.99, 1e-8, 1.0)
        plans.append(cache["numba"])
    assert plans[0] is plans[1] is plans[2]
    params[1].data = params[1].clone()  # a parameter at another address: laid out again
    items = LaunchItems(
        [(p, gr, r[1], s[0], s[1], s[2], 9, 1e-2, 0.0) for p, gr, r, s in zip(params, grads[3], rows, states,
                                                                             strict=True)], cache)
    numba_ops.multi_selective_adamw_items_(items, 0.9, 0.99, 1e-8, 1.0)
    assert cache["numba"] is not plans[0]
