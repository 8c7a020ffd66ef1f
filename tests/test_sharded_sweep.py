"""The sharded contract (docs/design.md section 14): ZeRO-1, ZeRO-2 (keeping or releasing the gradients) and FSDP2 at
2 ranks equal one process fed the ranks' average, in every loop one process supports, for each update rule, overlap
on and off, either link; or the loop is refused with a clear error before anything changes. Never a silent
difference, never a hang.

One launch of 2 gloo ranks runs every case (tests/sharded_sweep_worker.py). The oracle is ``ReferenceZenFlow`` fed,
each step, the gradient one process would hold: each rank's gradient of its half batch, computed here from the
reference's own weights, with the loop's edits made where that sharding's loop makes them (ZeRO: on each rank's own
gradient before the optimizer averages it in ``step()``; FSDP2: on the average its reduce-scatter already gave
each rank, by rows), then averaged. The assertions cover the whole table at once and name every failing case.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sharded_sweep_worker as W
import torch
from support import launch
from tolerance import assert_all_within_stated_bound

from zenflow_kernels import rules
from zenflow_kernels.reference import ReferenceZenFlow

pytestmark = pytest.mark.ranks

WORLD = 2
# the loops ZeRO-2 with released gradients cannot honour (a released gradient cannot be unscaled, clipped, repaired
# or edited in place), and the step each is refused at: the first whose loop changes a gradient after backward
# (step 0 builds the optimizer, and with it the hooks: its gradients are let go only in step(), after the loop)
FIRST_EDIT = min(t for t, f in W.EDIT_AT.items() if f != 1.0)  # (a no-op edit leaves the bits as they were)
REFUSED = {("zero2_release", "amp_unscale_clip"): 1, ("zero2_release", "data_all"): FIRST_EDIT,
           ("zero2_release", "edit_one_rank"): FIRST_EDIT, ("zero2_release", "nan_repair"): W.FAULT_AT}
# ZENFLOW_SWEEP_ONLY="zero2_keep,amp_": only the cases whose name holds one of these (tools/handmade_bugs.py)
CASES = [c for c in W.cases() if not os.environ.get("ZENFLOW_SWEEP_ONLY")
         or any(part in c["name"] for part in os.environ["ZENFLOW_SWEEP_ONLY"].split(","))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_sweep")
    results, done = launch([*CASES, W.MESSAGES], tmp, world=WORLD, timeout=900.0, worker=Path(W.__file__))
    errors = "\n".join(p.read_text() for p in sorted(tmp.glob("error-rank*.txt")))
    assert all(code == 0 for code, _, _ in done), f"a rank failed:\n{errors}\n" + "\n".join(e[-3000:] for *_, e in done)
    return results


def reference(params, case: dict) -> ReferenceZenFlow:
    zen = dict(W.ZEN, overlap_step=case["overlap"])
    if case["rule"] == "AdamW":
        return ReferenceZenFlow(params, **W.HYPER, zenflow=zen)
    name, arguments = W.RULES[case["rule"]]
    return ReferenceZenFlow(params, lr=W.HYPER["lr"], zenflow=zen, rule=getattr(rules, name)(**arguments))


def clip_by_norm_(grads: list[torch.Tensor], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic: the L2 norm of the norms, ``min(1, max / (norm + 1e-6))``."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def fed_gradients(case: dict, t: int, per_rank: list[list]) -> list:
    """The gradient one process is fed at step ``t`` (``per_rank``: each rank's own gradients, unscaled)."""
    pattern = case["pattern"]
    if case["sharding"] == "fsdp2":  # the loop sees (its rows of) the reduce-scattered average
        avg = [None if gs[0] is None else sum(gs[1:], gs[0].clone()) / WORLD for gs in zip(*per_rank, strict=True)]
        if pattern == "edit_one_rank" and t in W.EDIT_AT:  # the last rank's rows only
            for j in W.edited(case):
                avg[j].chunk(WORLD, 0)[WORLD - 1].mul_(W.EDIT_AT[t])
        elif pattern != "edit_one_rank":
            W.edit_local(case, t, 0, WORLD, avg)
        if pattern == "amp_unscale_clip":
            clip_by_norm_([g for g in avg if g is not None], W.CLIP)
        return avg
    # ZeRO-2 letting go of the gradients: from step 1 on (the hooks come with the optimizer, built at step 0) a
    # matrix's gradient has left during backward, and the loop finds its .grad None
    released = case["sharding"] == "zero2_release" and t >= 1
    for r, grads in enumerate(per_rank):  # ZeRO: the loop edits each rank's own gradient, step() averages
        seen = [None if g is None or (released and g.dim() == 2) else g for g in grads]
        W.edit_local(case, t, r, WORLD, seen)
        if pattern == "amp_unscale_clip":
            clip_by_norm_([g for g in seen if g is not None], W.CLIP)
    return [None if gs[0] is None else sum(gs[1:], gs[0].clone()) / WORLD for gs in zip(*per_rank, strict=True)]


def one_process(case: dict, steps: int = W.STEPS) -> list[torch.Tensor]:
    """The reference fed the ranks' average for the first ``steps`` steps, flushed."""
    model = W.make_model(case)
    params = list(model.parameters())
    ref = reference(params, case)
    for t in range(steps):
        for j, p in enumerate(params):
            p.requires_grad_(j not in W.frozen_at(case, t))
        if not W.stepped(case, t):
            continue
        per_rank = []
        for r in range(WORLD):
            model.zero_grad(set_to_none=True)
            x, y = W.rank_batch(case, t, r, WORLD)
            torch.nn.functional.mse_loss(model(x), y).backward()
            per_rank.append([None if p.grad is None else p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
        fed = fed_gradients(case, t, per_rank)
        if not all(g is None or torch.isfinite(g).all() for g in fed):
            continue  # a non-finite gradient (GradScaler's found_inf, or the optimizer's own check): skipped
        for p, g in zip(params, fed, strict=True):
            p.grad = g
        if case["pattern"] == "routed_clip":
            ref.clip_grad_norm_(W.CLIP)
        ref.step()
        model.zero_grad(set_to_none=True)
    ref.flush()
    return [p.detach().clone() for p in params]


def test_every_sharded_loop_matches_one_process_fed_the_average_or_is_refused_before_anything_changes(runs):
    failures = []
    for case in CASES:
        name = case["name"]
        got = runs.get(name)
        if got is None:
            failures.append(f"{name}: no result")
            continue
        refused = [r["refused"] for r in got]
        expected_at = REFUSED.get((case["sharding"], case["pattern"]))
        if case.get("bare") and case["pattern"] == "data_all":
            expected_at = None  # the edit finds the released matrices' .grad None: it changes nothing
        if expected_at is None:
            if any(refused):
                failures.append(f"{name}: refused unexpectedly: {refused[0] or refused[-1]}")
                continue
            steps = W.STEPS
        else:
            if not all(r is not None and r[0] == expected_at for r in refused):
                failures.append(f"{name}: expected a refusal at step {expected_at} on every rank, got {refused}")
                continue
            if not all("release_gradients=False" in r[1] and "Nothing was applied" in r[1] for r in refused):
                failures.append(f"{name}: the refusal does not name the way out: {refused[0][1]}")
            steps = expected_at
        for r in range(1, WORLD):
            if not all(torch.equal(a, b) for a, b in zip(got[0]["params"], got[r]["params"], strict=True)):
                failures.append(f"{name}: the replicas differ (rank 0 and rank {r})")
        want = one_process(case, steps)
        try:
            assert_all_within_stated_bound(got[0]["params"], want, lr=W.HYPER["lr"], steps=max(steps, 1), what=name)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, f"{len(failures)} of {len(CASES)} cases:\n" + "\n".join(failures)


def test_every_rank_s_grad_scaler_backs_off_when_any_rank_overflows(runs):
    """One rank's batch holds an inf: the averaged gradient is non-finite, the step is skipped on every rank, and
    every rank's GradScaler halves its scale at that step, as one process's scaler fed the average does (the other
    ranks' scalers did not see an inf in their own gradients)."""
    expected = [W.SCALE] * W.FAULT_AT + [W.SCALE / 2] * (W.STEPS - W.FAULT_AT)
    wrong = {}
    for case in CASES:
        if case["pattern"] == "amp_inf_one_rank":
            scales = [r["scales"] for r in runs[case["name"]]]
            if any(s != expected for s in scales):
                wrong[case["name"]] = scales
        elif case["pattern"] == "amp_fused":
            scales = [r["scales"] for r in runs[case["name"]]]
            if any(s != [W.SCALE] * W.STEPS for s in scales):
                wrong[case["name"]] = scales
    assert not wrong, wrong


def test_the_sweep_spans_every_sharding_loop_rule_overlap_and_link():
    cases = W.cases()
    seen = {(c["sharding"], c["pattern"], c["rule"]) for c in cases if not c.get("bare")}
    assert len(seen) == len(W.SHARDINGS) * len(W.PATTERNS) * len(W.RULES)
    for sharding in W.SHARDINGS:
        for rule in W.RULES:
            combos = {(c["overlap"], c["link"]) for c in cases if c["sharding"] == sharding and c["rule"] == rule}
            assert combos == {(False, "sync"), (True, "sync"), (False, "async"), (True, "async")}, (sharding, rule)


def test_the_ranks_messages_name_the_optimizer_as_built(runs):
    """A gradient on some ranks only, a DDP-wrapped model, a loop that unscales released gradients: with
    ``ZenFlow(rules.Lion())`` / ``ZenFlow(rules.SGD())`` every rank's message names that optimizer."""
    for rank, messages in enumerate(runs[W.MESSAGES["name"]]):
        assert set(messages) == {"presence", "ddp", "released"}, (rank, messages)
        for key, want in (("presence", "ZenFlow(Lion) rank"), ("ddp", "ZenFlow(SGD)(zero_stage>0)"),
                          ("released", "ZenFlow(Lion) rank")):
            assert want in messages[key] and "ZenFlowAdamW" not in messages[key], (rank, key, messages[key])
        assert "release_gradients=False" in messages["released"]


def test_an_overflow_the_scaler_did_not_see_is_told_to_the_scaler_stepping_the_optimizer(monkeypatch):
    """``tell_scaler_found_inf`` finds the ``torch.amp.GradScaler`` whose ``step()`` called the optimizer's and makes
    its ``update()`` back off; called by anything else it raises, naming the optimizer, rather than let the ranks'
    scales part silently."""
    from zenflow_kernels import ZenFlow
    from zenflow_kernels.optim.step_inputs import tell_scaler_found_inf

    model = torch.nn.Linear(4, 3)
    opt = ZenFlow(model.parameters(), rules.Lion(), lr=1e-3, zenflow=W.ZEN)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()  # finite: the scaler itself finds nothing
    monkeypatch.setattr(opt, "step", lambda *args, **kwargs: tell_scaler_found_inf(opt))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0  # backed off, as for an inf it had found (a finite step: 8.0)
    with pytest.raises(RuntimeError, match=r"ZenFlow\(Lion\)\.step\(\): .*not torch\.amp\.GradScaler\.step"):
        tell_scaler_found_inf(opt)
    opt.close()
