"""Compiled rules (``zenflow_kernels.rules.compiled``), rules from torch (``rules.from_torch``) and the rule contract
(``rules.check_rule``), against independent references: torch's own optimizers and ``ReferenceZenFlow`` (the eager
``step_``), never one of the compiled paths against another.

Compiling costs seconds: each rule class here is compiled once per session (Dynamo keeps it per class, place and
thread count; Inductor's on-disk cache makes the next session's cheap), and the runs keep to one host thread count
(``overlap_step=False``: the host update on the training thread) except where the worker's is the point.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from support import drive, grad_sequence, make_params, params_at, snapshot
from tolerance import assert_within_stated_bound

from bench.custom_rules import RMSprop as PlainRMSprop
from zenflow_kernels import ZenFlow, rules
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.rules import compiled
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")

LR = 1e-2
# compiled against eager, one step: Inductor's C++ contracts a * b + c into one FMA where ATen's kernel rounds the
# product first and the reverse (ATen's CPU add_(x, alpha=a) is an fmadd, Inductor's x * a then + is not; addcmul_
# decomposes into an FMA), and vectorises in another order: an element's terms each differ by an ulp or so, which
# the terms that follow carry on. Measured on x86 AVX2 (RMSprop, 2^20 elements): at most 2 ulps of the largest of
# the element's value before, after and its update; asserted: 4
ULPS = 4


class RMSprop(PlainRMSprop):
    """RMSprop written as a researcher would (``bench.custom_rules``: state, hyper-parameters and a plain-torch
    ``step_``, no kernel), with a user's default ``compile="auto"``."""

    def __init__(self, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0, compile="auto"):
        super().__init__(alpha=alpha, eps=eps, weight_decay=weight_decay, compile=compile)


def rmsprop_oracle(params, grads, *, lr=LR, alpha=0.99, eps=1e-8, weight_decay=0.0):
    return drive(torch.optim.RMSprop(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, foreach=False),
                 params, grads)


def ulps(x: torch.Tensor, y: torch.Tensor, before: torch.Tensor) -> float:
    """The largest difference of ``x`` and ``y`` in units of fp32's last place at the largest of the element's
    magnitude before (``before``), after, and its update (a rounding of the update is an ulp of the update, which may
    be larger than the value it leaves)."""
    scale = torch.maximum(torch.maximum(x.abs(), y.abs()), before.abs()).double()
    scale = torch.maximum(scale, (y.double() - before.double()).abs()).clamp_min(1e-30)
    return float(((x.double() - y.double()).abs() / (torch.finfo(torch.float32).eps * scale)).max())


def make(params, rule, zen, mode):
    if mode == "reference":
        return ReferenceZenFlow(params, lr=LR, zenflow=zen, rule=rule)
    with chaos(seed=int(mode[5:]), max_delay=0.001) if mode.startswith("chaos") else contextlib.nullcontext():
        return ZenFlow(params, rule, lr=LR, zenflow=zen)


DEVICE_ONLY = dict(topk_ratio=1.0, update_interval=2, select_strategy="step", select_interval=4, overlap_step=False)
MIXED = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=3, overlap_step=False,
             full_warm_up_rounds=1)


# -- the compiled passes against the eager step ------------------------------------------------------------------------


def test_the_compiled_host_pass_is_the_eager_one_within_the_bound_and_an_lr_schedule_does_not_recompile():
    rule = RMSprop(weight_decay=0.01, compile=True)
    g = torch.Generator().manual_seed(0)
    n = 3000
    p0, s0, g0 = torch.randn(n, generator=g), torch.rand(n, generator=g), torch.randn(n, generator=g)
    worst = 0.0
    for t, (lr, scale) in enumerate([(1e-2, 4.0), (7e-3, 1.0), (3e-3, 2.5)]):
        runs = []
        for kernel in (rule.host_step_, rule.eager_host_step_):
            p, s, acc, out = p0.clone(), s0.clone(), g0.clone(), torch.empty(n)
            kernel(p, acc, [s], step=t + 1, grad_scale=scale, out=out, zero_grad=True, lr=lr, alpha=0.99, eps=1e-8,
                   weight_decay=0.01)
            assert torch.equal(acc, torch.zeros(n)) and torch.equal(out, p)
            runs.append((p, s))
        for x, y, before in zip(*runs, (p0, s0), strict=True):
            worst = max(worst, ulps(x, y, before))
        if t == 0:
            compiles = compiled.paths(rule)["host"]["compiles"]
    host = compiled.paths(rule)["host"]
    assert worst <= ULPS, worst
    assert host["path"] == "compiled" and host["compiled_calls"] == 3 and host["compiles"] == compiles  # no recompile


def test_the_packing_work_items_cover_every_row_of_every_block_once():
    """Whole rows of one block per work item, about ROW_BLOCK_ELEMENTS elements each (one row at least): every row of
    every block exactly once, blocks of no column included."""
    import numpy as np

    from zenflow_kernels.cpu_ops.column_packing import ROW_BLOCK_ELEMENTS, row_blocks

    b_rows = np.array([1, 128, 4096, 7, 300, 2, 5000], dtype=np.int64)
    b_len = np.array([13, 13, 400, 0, 2049, 1, 3], dtype=np.int64)
    w_block, w_row, w_nrows = row_blocks(b_rows, b_len)
    covered = [np.zeros(r, dtype=np.int64) for r in b_rows]
    for b, r0, n in zip(w_block, w_row, w_nrows, strict=True):
        assert n >= 1 and (n == 1 or n * b_len[b] <= ROW_BLOCK_ELEMENTS), (b, r0, n)
        covered[b][r0 : r0 + n] += 1
    assert all((c == 1).all() for c in covered)


class LrOnly(rules.UpdateRule):
    """A test rule whose only hyper-parameter is the learning rate (no group defaults, no step count)."""

    uses_step = False

    def group_defaults(self):
        return {}

    def hyperparams(self, group):
        return dict(lr=float(group["lr"]))


class Literals(LrOnly):
    """Every op the compiled path rewrites (a number as a Scalar argument), each with a literal number, not a graph
    input: Inductor's own decomposition there."""

    name = "Literals"
    state_names = ("avg", "sq")
    compile = True

    def step_(self, param, grad, state, *, step, lr):
        avg, sq = state["avg"], state["sq"]
        avg.lerp_(grad, 0.1)
        sq.mul_(0.9).addcmul_(grad, grad, value=0.1)
        update = avg.addcdiv(avg, sq.sqrt().add(1e-8), value=0.5).sub(avg, alpha=0.5).clamp(-1.0, 1.0)
        param.add_(update.pow(3.0), alpha=-lr).add_(param, alpha=-0.001)


def test_the_ops_rewritten_for_changing_numbers_compile_with_literal_numbers_too():
    """A literal number where the rewrites expect a changing one (lerp's weight, alpha=, value=, pow, clamp): Inductor's
    own decomposition of the op, compiled once, within the bound of the eager step (before the fix: 'both a fallback
    and a decomp for same op', eager)."""
    rule = Literals()
    g = torch.Generator().manual_seed(9)
    n = 2048
    p0, g0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    s0 = [torch.rand(n, generator=g) for _ in range(2)]
    runs = []
    for kernel in (rule.host_step_, rule.eager_host_step_):
        p, state = p0.clone(), [s.clone() for s in s0]
        kernel(p, g0.clone(), state, step=1, grad_scale=1.0, lr=LR)
        runs.append((p, *state))
    for x, y, before in zip(*runs, (p0, *s0), strict=True):
        assert ulps(x, y, before) <= ULPS, ulps(x, y, before)
    host = compiled.paths(rule)["host"]
    assert host["path"] == "compiled" and host["compiles"] == 1, host


@pytest.mark.parametrize("name", ["AdamW", "Lion"])
def test_a_builtins_step_compiled_is_its_hand_written_kernel_within_the_bound_and_compiles_once(name):
    """A built-in with its kernels taken away runs its plain-torch ``step_`` compiled:
    within the bound of the numba kernel (an independent implementation) at steps 1..5 (AdamW's bias
    corrections read the count: a graph input, one compile), state and copy-out included."""
    base = getattr(rules, name)
    stripped = type(f"{name}Stripped", (base,), {"host_step_": rules.UpdateRule.host_step_, "compile": True})
    kernel, rule = base(weight_decay=0.1), stripped(weight_decay=0.1)
    hyperparams = rule.hyperparams(dict(rule.group_defaults(), lr=LR))
    g = torch.Generator().manual_seed(6)
    n = 4099
    p0, g0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    s0 = [torch.rand(n, generator=g) for _ in rule.state_names]
    for step in range(1, 6):
        runs = []
        for r in (rule, kernel):
            p, state, out = p0.clone(), [s.clone() for s in s0], torch.empty(n, dtype=torch.bfloat16)
            r.host_step_(p, g0.clone(), state, step=step, grad_scale=2.0, out=out, zero_grad=True, **hyperparams)
            assert torch.equal(out, p.bfloat16())
            runs.append((p, *state))
        for x, y, before in zip(*runs, (p0, *s0), strict=True):
            assert ulps(x, y, before) <= ULPS, (step, ulps(x, y, before))
    host = compiled.paths(rule)["host"]
    assert host["path"] == "compiled" and host["compiled_calls"] == 5 and host["compiles"] == 1, host


@pytest.mark.parametrize("name, hyper", [("RMSprop", {}), ("Adagrad", dict(lr_decay=0.05))])
def test_a_rule_from_torch_does_not_recompile_as_its_step_count_grows(name, hyper):
    """torch's functional reads its step count (Adagrad's ``lr_decay``) or not (RMSprop): one compile either way over
    steps 2..6 (the count a symbolic integer, which torch's step makes a tensor of), within the bound of the eager
    step at each."""
    rule = rules.from_torch(getattr(torch.optim, name), **hyper)
    rule.compile = True
    hyperparams = rule.hyperparams(dict(rule.group_defaults(), lr=LR))
    g = torch.Generator().manual_seed(5)
    n = 2000
    p0, s0, g0 = torch.randn(n, generator=g), torch.rand(n, generator=g), torch.randn(n, generator=g)
    for step in range(2, 7):
        runs = []
        for kernel in (rule.host_step_, rule.eager_host_step_):
            p, s = p0.clone(), s0.clone()
            kernel(p, g0.clone(), [s], step=step, grad_scale=1.0, **hyperparams)
            runs.append((p, s))
        for x, y, before in zip(*runs, (p0, s0), strict=True):
            assert ulps(x, y, before) <= ULPS, (step, ulps(x, y, before))
    host = compiled.paths(rule)["host"]
    assert host["path"] == "compiled" and host["compiled_calls"] == 5 and host["compiles"] == 1, host


@pytest.mark.parametrize("packing", ["numba", "torch"])
def test_the_compiled_fast_path_is_the_reference_within_the_bound_with_several_step_counts(packing, monkeypatch):
    """Matrices with selected columns (a rule that reads its step count: columns at several counts), a vector, a bf16
    matrix with its fp32 master: the packed, compiled launch against ``reference_fast_step_``; packed by the numba
    kernels (the CPU's) or by torch ops (a device's, a strided tensor's)."""
    from zenflow_kernels.rules import packing as layout

    if packing == "torch":
        monkeypatch.setattr(layout, "MAX_STATE", 0)
    rule = rules.from_torch(torch.optim.Adagrad, lr_decay=0.05)
    assert rule.uses_step
    rule.compile = True

    def items():
        out = []
        for rows, cols, k, dtype in [(16, 12, 5, torch.float32), (8, 20, 7, torch.float32), (1, 9, None, torch.float32),
                                     (6, 10, 4, torch.bfloat16)]:
            gen = torch.Generator().manual_seed(rows * 100 + cols)
            p = torch.randn(rows, cols, generator=gen).to(dtype)
            grad = torch.randn(rows, cols, generator=gen).to(dtype)
            idx = None if k is None else torch.sort(torch.randperm(cols, generator=gen)[:k]).values
            kk = cols if k is None else k
            state = torch.rand(rows, kk, generator=gen)
            master = None if dtype == torch.float32 else p[:, idx].float() + 0.001
            step = 3 if k is None else torch.tensor([1 + (j % 3) * 4 for j in range(kk)], dtype=torch.int64)
            out.append((p, grad, idx, state, master, step, 1e-2, 0.01 if rows != 1 else 0.0))
        return out

    a, b, before = items(), items(), items()
    rule.fast_step_(a, grad_scale=2.0, lr_decay=0.05, eps=1e-10)
    rule.reference_fast_step_(b, grad_scale=2.0, lr_decay=0.05, eps=1e-10)
    for x, y, z in zip(a, b, before, strict=True):
        for at in (0, 3, 4):  # the parameter, its state, its master
            if x[at] is not None:  # (a bf16 parameter: its master's rounding, within 1 bf16 ulp)
                bound = ULPS if x[at].dtype == torch.float32 else 2 ** 16
                assert ulps(x[at].float(), y[at].float(), z[at].float()) <= bound, (at, x[at], y[at])
    assert compiled.paths(rule)["fast"]["path"] == "compiled"
    parts = layout.dtype_parts(a, 1)  # fp32 items, the bf16 one: two launches
    assert [len(part) for part in parts] == [3, 1]
    assert all(layout.packed_for(part, 1).numba == (packing == "numba") for part in parts)


# -- rules from torch: torch's own step --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "chaos0"])
@pytest.mark.parametrize("name", ["RMSprop", "Adagrad"])
def test_from_torch_is_the_torch_optimizer_with_every_column_on_the_device(name, mode):
    """``topk_ratio=1``: compiled, within the stated bound of torch's optimizer on both links; eager (``compile=False``)
    and the reference: torch's bits."""
    cls = getattr(torch.optim, name)
    hyper = dict(alpha=0.9, weight_decay=0.01) if name == "RMSprop" else dict(weight_decay=0.01)
    grads = grad_sequence(8)
    params = make_params()
    want = drive(cls(params, lr=LR, foreach=False, **hyper), params, grads)
    for how in ("compiled", "eager", "reference"):
        rule = rules.from_torch(cls, **hyper)
        rule.compile = how == "compiled"
        params = make_params()
        opt = make(params, rule, DEVICE_ONLY, "reference" if how == "reference" else mode)
        got = drive(opt, params, grads)
        if how != "reference":
            paths = opt.stats()["rule_paths"]
            opt.close()
            assert paths["fast"]["path"] == ("compiled" if how == "compiled" else "eager"), paths
        for t, (a, b) in enumerate(zip(got, want, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if how == "compiled":
                    assert_within_stated_bound(x, y, lr=LR, steps=t + 1, what=f"{name} step {t} param {i}")
                else:
                    assert torch.equal(x, y), (how, name, t, i, float((x - y).abs().max()))


def test_a_compiled_rule_gives_the_same_bits_on_both_links_and_agrees_with_the_reference():
    """Columns on both paths, re-selections, host updates: the asynchronous link gives the synchronous one's bits; both
    within the stated bound of the reference (which runs the eager ``step_``)."""
    grads = grad_sequence(12)
    runs = {}
    for mode in ("sync", "chaos1", "reference"):
        params = make_params()
        opt = make(params, RMSprop(weight_decay=0.01, compile=True), MIXED, mode)
        runs[mode] = drive(opt, params, grads)
        if mode != "reference":
            paths = opt.stats()["rule_paths"]
            opt.close()
            assert paths["host"]["path"] == paths["fast"]["path"] == "compiled", paths
    for t, (a, b, c) in enumerate(zip(runs["sync"], runs["chaos1"], runs["reference"], strict=True)):
        for i, (x, y, z) in enumerate(zip(a, b, c, strict=True)):
            assert torch.equal(x, y), f"step {t} param {i}: the links differ"
            assert_within_stated_bound(x, z, lr=LR, steps=t + 1, what=f"step {t} param {i}")


def test_the_overlapped_host_update_runs_compiled_on_the_worker():
    """The host update on the worker (its own thread count: its own compile), both links the same bits, within the
    stated bound of the reference."""
    zen = dict(MIXED, overlap_step=True)
    grads = grad_sequence(8)
    runs = {}
    for mode in ("sync", "chaos2"):
        params = make_params()
        with make(params, RMSprop(compile=True), zen, mode) as opt:
            runs[mode] = drive(opt, params, grads)
            paths = opt.stats()["rule_paths"]
        assert paths["host"]["path"] == "compiled" and paths["host"]["compiled_calls"] >= 3, paths
    params = make_params()
    want = drive(make(params, RMSprop(), zen, "reference"), params, grads)
    for t, (a, b, c) in enumerate(zip(runs["sync"], runs["chaos2"], want, strict=True)):
        for x, y, z in zip(a, b, c, strict=True):
            assert torch.equal(x, y), f"step {t}: the links differ"
            assert_within_stated_bound(x, z, lr=LR, steps=t + 1)


def test_from_torch_reads_state_and_numbers_from_torch_and_refuses_what_zenflow_cannot_split():
    rms = rules.from_torch(torch.optim.RMSprop, alpha=0.9, momentum=0.5, centered=True)
    assert rms.name == "RMSprop" and rms.state_names == ("square_avg", "grad_avg", "momentum_buffer")
    assert rms.group_defaults() == dict(alpha=0.9, eps=1e-8, weight_decay=0, momentum=0.5)
    assert rms.hyperparams(dict(rms.group_defaults(), lr=0.1)) == dict(lr=0.1, alpha=0.9, eps=1e-8, weight_decay=0.0,
                                                                 momentum=0.5)
    assert rms.tensor_hyperparams == ("lr", "weight_decay") and not rms.uses_step
    assert repr(rms) == "rules.from_torch(torch.optim.RMSprop, alpha=0.9, momentum=0.5, centered=True)"
    adam = rules.from_torch(torch.optim.Adam, betas=(0.8, 0.95))
    assert adam.hyperparams(dict(adam.group_defaults(), lr=0.1))["beta2"] == 0.95 and adam.uses_step
    assert not rules.from_torch(torch.optim.Adagrad).uses_step  # (its step count only scales lr_decay)
    for cls, kw, match in [(torch.optim.SGD, dict(momentum=0.9), "lazily"), (torch.optim.NAdam, {}, "mu_product"),
                           (torch.optim.Adagrad, dict(initial_accumulator_value=0.1), "starts at 0.1"),
                           (torch.optim.RMSprop, dict(lr=0.1), "lr is ZenFlow's"),
                           (torch.optim.RMSprop, dict(alpha=-1.0), "Invalid alpha")]:
        with pytest.raises(ValueError, match=match):
            rules.from_torch(cls, **kw)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        rules.from_torch(rules.AdamW)
    params = make_params()
    with pytest.raises(ValueError, match="needs torch's state"):  # momentum > 0 makes a momentum buffer
        ZenFlow([{"params": params[:2]}, {"params": params[2:], "momentum": 0.9}],
                rules.from_torch(torch.optim.RMSprop), lr=LR)


# -- where compiling is impossible -------------------------------------------------------------------------------------


class Untraceable(RMSprop):
    """A ``step_`` Dynamo cannot trace (it reads a value into Python)."""

    name = "Untraceable"

    def step_(self, param, grad, state, *, step, lr, alpha, eps, weight_decay):
        if float(grad.abs().max()) > 1e30:  # (a data-dependent branch: a graph break)
            raise ValueError("huge gradient")
        super().step_(param, grad, state, step=step, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay)


def test_a_step_dynamo_cannot_trace_runs_eager_with_one_warning_and_stats_say_why():
    grads = grad_sequence(6)
    params = make_params()
    with pytest.warns(rules.RuleCompileWarning, match="Untraceable.step_ .* runs eager: compiling failed") as seen, \
            make(params, Untraceable(compile=True), DEVICE_ONLY, "sync") as opt:
        got = drive(opt, params, grads)
        paths = opt.stats()["rule_paths"]
    assert len([w for w in seen if issubclass(w.category, rules.RuleCompileWarning)]) == 1
    assert paths["fast"]["path"] == "eager" and "compiling failed" in paths["fast"]["why_eager"], paths
    params = make_params()
    want = drive(make(params, Untraceable(), DEVICE_ONLY, "reference"), params, grads)
    assert all(torch.equal(x, y) for a, b in zip(got, want, strict=True) for x, y in zip(a, b, strict=True))


def test_without_a_cxx_compiler_the_rule_runs_eager_with_a_warning():
    import torch._inductor.config as inductor

    class NoCompiler(RMSprop):
        name = "NoCompiler"

    # config.patch, not monkeypatch.setattr: undoing a setattr on inductor's config deletes the entry, which then
    # reads as missing ("fx_graph_cache does not exist") and breaks every later compile in the process
    with inductor.patch({"fx_graph_cache": False, "cpp.cxx": ("/nonexistent/c++",)}):
        _run_without_a_compiler(NoCompiler)
    assert inductor.fx_graph_cache is not None  # still readable: the next compile in this process needs it


def _run_without_a_compiler(rule_class):
    rule = rule_class(compile=True)
    n = 64
    p, acc, s = torch.randn(n), torch.randn(n), torch.rand(n)
    want = p.clone(), s.clone()
    rule.eager_host_step_(want[0], acc.clone(), [want[1]], step=1, grad_scale=1.0, lr=LR, alpha=0.99, eps=1e-8,
                          weight_decay=0.0)
    with pytest.warns(rules.RuleCompileWarning, match="NoCompiler.step_ .* runs eager"):
        rule.host_step_(p, acc, [s], step=1, grad_scale=1.0, lr=LR, alpha=0.99, eps=1e-8, weight_decay=0.0)
    assert torch.equal(p, want[0]) and torch.equal(s, want[1])
    assert compiled.paths(rule)["host"]["path"] == "eager"


def test_stats_say_which_path_each_place_of_the_rule_runs():
    grads = grad_sequence(4)
    for rule, host, fast in [(rules.Lion(), "kernel", "kernel"), (RMSprop(), "eager", "eager"),
                             (RMSprop(compile=False), "eager", "eager")]:
        params = make_params()
        with make(params, rule, MIXED, "sync") as opt:
            drive(opt, params, grads)
            paths = opt.stats()["rule_paths"]
        assert paths["host"]["path"] == host and paths["fast"]["path"] == fast, (rule, paths)
        if host == "eager":  # the test model is small: compile="auto" leaves it eager, and says so
            assert paths["host"]["why_eager"] == ("compile=False" if rule.compile is False else
                                                  "compile='auto' and the call is small")


# -- the rule contract -------------------------------------------------------------------------------------------------


class NoDecay(LrOnly):
    """Sign descent without weight decay: no ``weight_decay`` anywhere."""

    name = "NoDecay"
    state_names = ()

    def step_(self, param, grad, state, *, step, lr):
        param.add_(grad.sign(), alpha=-lr)


def test_a_rule_without_weight_decay_runs_on_both_paths():
    """Its ``tensor_hyperparams`` is ``("lr",)`` without saying so; the run is the reference's (the fast path's first
    step after warm-up raised ``KeyError: 'weight_decay'`` before)."""
    assert NoDecay().tensor_hyperparams == ("lr",) and RMSprop().tensor_hyperparams == ("lr", "weight_decay")
    grads = grad_sequence(8)
    runs = []
    for mode in ("sync", "reference"):
        params = make_params()
        opt = make(params, NoDecay(), MIXED, mode)
        runs.append(drive(opt, params, grads))
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _broken(**attrs):
    return type("Broken", (RMSprop,), attrs)()


@pytest.mark.parametrize("attrs, error, match", [
    (dict(launch_hyperparams=("alpha", "eps", "beta")), ValueError,
     r"launch_hyperparams names 'beta', which hyperparams\(\) does not give"),
    (dict(tensor_hyperparams=("lr", "decay")), ValueError, r"tensor_hyperparams names 'decay'"),
    (dict(launch_hyperparams=("alpha",)), ValueError, r"hyperparams\(\) gives 'eps', which neither tensor_hyperparams"),
    (dict(launch_hyperparams=("alpha", "eps", "lr")), ValueError,
     r"'lr' is in both tensor_hyperparams and launch_hyperparams"),
    (dict(state_names=("step",)), ValueError, "state_names=.* is invalid"),
    (dict(state_names=("m", "m")), ValueError, "state_names=.* is invalid"),
    (dict(step_=lambda self, param, grad, state, *, step, lr: None), TypeError, "step_ does not take 'alpha'"),
])
def test_the_rule_contract_is_checked_when_the_optimizer_is_made(attrs, error, match):
    for make_it in (lambda r: ZenFlow(make_params(), r, lr=LR, zenflow=MIXED),
                    lambda r: ReferenceZenFlow(make_params(), rule=r, zenflow=MIXED)):
        with pytest.raises(error, match=match):
            make_it(_broken(**attrs))


def test_the_reference_refuses_hyperparameters_its_rule_does_not_take():
    with pytest.raises(ValueError, match=r"weight_decay=0.5 is invalid with rule=.*: the rule takes no weight_decay"):
        ReferenceZenFlow(make_params(), weight_decay=0.5, rule=NoDecay(), zenflow=MIXED)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 0.9\) conflicts with rule=rules.Lion.*whose betas is"):
        ReferenceZenFlow(make_params(), betas=(0.9, 0.9), rule=rules.Lion(betas=(0.9, 0.99)), zenflow=MIXED)
    # the rule's own value; nothing passed (AdamW's defaults are not the rule's business); no rule: AdamW's, as before
    ReferenceZenFlow(make_params(), weight_decay=0.1, rule=rules.Lion(weight_decay=0.1), zenflow=MIXED)
    ReferenceZenFlow(make_params(), rule=NoDecay(), zenflow=MIXED)
    ref = ReferenceZenFlow(make_params(), weight_decay=0.01, eps=1e-8, zenflow=MIXED)
    assert ref.rule.weight_decay == 0.01


def test_the_checks_rules_use_are_public():
    from zenflow_kernels.rules import check_betas, check_real, check_rule, check_state_dtype, unpack_item

    with pytest.raises(ValueError, match=r"mine: x=-1 is invalid: allowed a finite number >= 0"):
        check_real("mine", "x", -1)
    with pytest.raises(ValueError, match="betas=.* is invalid"):
        check_betas("mine", (0.9, 1.0))
    with pytest.raises(ValueError, match="state_dtype"):
        check_state_dtype("mine", torch.float16)
    check_rule(RMSprop(), dict(RMSprop().group_defaults(), lr=LR), "mine")
    p = torch.zeros(2, 3)
    item = unpack_item(RMSprop(), (p, p, None, p, None, 4, 0.1, 0.0))
    assert item.state == (p,) and item.step == 4 and item.tensor_hyperparams == dict(lr=0.1, weight_decay=0.0)


def test_a_rule_of_ones_own_checkpoints_with_its_compiled_path(tmp_path):
    """Saved at step 5 and loaded into a fresh optimizer: the rest of the compiled run is the uninterrupted one's."""
    grads = grad_sequence(9)
    params = make_params()
    with make(params, RMSprop(compile=True), MIXED, "sync") as opt:
        want = drive(opt, params, grads)
    params = make_params()
    with make(params, RMSprop(compile=True), MIXED, "sync") as opt:
        drive(opt, params, grads[:5])
        saved, weights = opt.state_dict(), snapshot(params)
    params = params_at(weights)
    with make(params, RMSprop(compile=True), MIXED, "sync") as opt, warnings.catch_warnings():
        opt.load_state_dict(saved)
        got = drive(opt, params, grads[5:])
    for a, b in zip(got, want[5:], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_compile_on_the_worker_does_not_count_against_host_timeout():
    """A first compile takes seconds (tens on a loaded machine): a wait for the worker pauses ``host_timeout``'s clock
    while one is in progress, and keeps it otherwise (a stuck update still fails, naming the limit)."""
    import time

    from zenflow_kernels.link.worker import HostWorker, HostWorkerError

    def compiling_job():
        with compiled._compile_clock():
            time.sleep(0.5)

    worker = HostWorker(timeout=0.15, poll=0.01)
    try:
        worker.wait(worker.submit(compiling_job))
        assert not compiled.compiling()
        with pytest.raises(HostWorkerError, match=r"host_timeout=0\.15"):
            worker.wait(worker.submit(time.sleep, 0.5))
    finally:
        worker.close()


def test_the_compiled_steps_thread_count_follows_the_numba_kernels():
    """On the CPU the calling thread's numba count, fewer (a power of two: a compile each) below 2^16 elements per
    thread, as the numba kernels launch; on a device none of the CPU's (Inductor's Triton there)."""
    import numba

    from zenflow_kernels.cpu_ops._common import MIN_ELEMENTS_PER_THREAD

    most = numba.get_num_threads()
    assert compiled._threads(torch.device("cuda"), 1 << 24) == 0
    assert compiled._threads(torch.device("cpu"), 1) == 1
    assert compiled._threads(torch.device("cpu"), most * MIN_ELEMENTS_PER_THREAD) == most
    for numel in (3 * MIN_ELEMENTS_PER_THREAD, 5 * MIN_ELEMENTS_PER_THREAD, 1 << 30):
        wanted = numel // MIN_ELEMENTS_PER_THREAD
        got = compiled._threads(torch.device("cpu"), numel)
        assert got == (most if wanted >= most else 1 << (wanted.bit_length() - 1)), (numel, got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by bench/gpu_suite.sh)")
def test_the_compiled_fast_path_on_cuda_is_the_reference_within_the_bound():
    """On a GPU the compiled fast path is Inductor's Triton over columns packed by torch ops: within the bound of the
    reference (``reference_fast_step_``, eager torch on the same device), one compile over steps 1..4."""
    rule = RMSprop(weight_decay=0.01, compile=True)
    gen = torch.Generator().manual_seed(8)
    shapes = [(64, 48, 9), (32, 80, 11), (1, 37, None)] * 4

    def items(step):
        out = []
        for rows, cols, k in shapes:
            p = torch.randn(rows, cols, generator=gen).cuda()
            idx = None if k is None else torch.sort(torch.randperm(cols, generator=gen)[:k]).values.cuda()
            out.append((p, torch.randn(rows, cols, generator=gen).cuda(), idx,
                        torch.rand(rows, cols if k is None else k, generator=gen).cuda(), None, step, LR, 0.01))
        return out

    for step in range(1, 5):
        a = items(step)
        b = [(it[0].clone(), it[1], it[2], it[3].clone(), *it[4:]) for it in a]
        before = [(it[0].clone(), it[3].clone()) for it in a]
        rule.fast_step_(a, grad_scale=2.0, alpha=0.99, eps=1e-8)
        rule.reference_fast_step_(b, grad_scale=2.0, alpha=0.99, eps=1e-8)
        for x, y, z in zip(a, b, before, strict=True):
            for at, was in ((0, z[0]), (3, z[1])):  # the parameter, its state
                assert ulps(x[at].cpu(), y[at].cpu(), was.cpu()) <= ULPS, (step, at)
    fast = compiled.paths(rule)["fast"]
    assert fast["path"] == "compiled" and fast["compiles"] == 1, fast


def test_a_rule_written_with_the_old_names_still_works_and_is_told_the_new_ones():
    """``numbers``, ``per_tensor`` and ``shared`` became ``hyperparams``, ``tensor_hyperparams`` and
    ``launch_hyperparams``: a rule of one's own that still writes the old names runs, with a DeprecationWarning."""
    from zenflow_kernels.rules import check_rule

    with pytest.warns(DeprecationWarning, match="numbers is now called hyperparams") as caught:
        class OldSignum(rules.UpdateRule):
            name = "OldSignum"
            state_names = ("momentum",)
            shared = ("beta",)
            per_tensor = ("lr",)
            uses_step = False

            def group_defaults(self):
                return dict(beta=0.9)

            def numbers(self, group):
                return dict(lr=float(group["lr"]), beta=group["beta"])

            def step_(self, param, grad, state, *, step, lr, beta):
                param.add_(state["momentum"].lerp_(grad, 1 - beta).sign(), alpha=-lr)

    assert sorted(str(w.message).split(".")[1].split(" ")[0] for w in caught) == ["numbers", "per_tensor", "shared"]
    rule = OldSignum()
    assert rule.launch_hyperparams == ("beta",) and rule.tensor_hyperparams == ("lr",)
    assert rule.hyperparams(dict(lr=0.1, beta=0.5)) == dict(lr=0.1, beta=0.5)
    check_rule(rule, dict(rule.group_defaults(), lr=0.1), "test")
