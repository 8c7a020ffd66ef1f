"""ZeRO-1 over torch.distributed (gloo, CPU): processes started by the test, one per rank, as torchrun
would start them (tests/zero_worker.py). Each rank gets a different gradient; their average is fed to
one rank and to the reference, which the ranks must match as docs/design.md ("Numeric guarantees")
states: replicas bit for bit among themselves; at 2 ranks bit for bit against one rank fed that average (a
sum of two rounds the same in either order); at 3 ranks (the all-reduce's order of the sum), on half batches
against one rank on the whole batch (a mean of rank means) and against the reference, within the stated
bound (tests/tolerance.py)."""

import time
from pathlib import Path

import pytest
import torch
import zero_worker  # noqa: E402
from support import assert_same_state, launch  # noqa: E402
from tolerance import assert_all_within_stated_bound  # noqa: E402

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.config import ZenFlowConfig
from zenflow_kernels.ops import use_backend
from zenflow_kernels.reference import ReferenceZenFlow
from zenflow_kernels.sharding.zero_context import owner_runs, owners

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(zero_worker.__file__)
ZEN = dict(topk_ratio=0.1, select_strategy="step", select_interval=6, update_interval=3, full_warm_up_rounds=1)




def single_rank(case: dict, world: int, steps: int | None = None, state=None):
    """One rank fed the ranks' average gradient (and, with ``state``, resumed from it)."""
    dtype = getattr(torch, case.get("dtype", "float32"))
    params = zero_worker.make_params(dtype)
    grads = zero_worker.mean_grads(case["steps"], world, dtype)
    with use_backend("numba"), zero_worker.optimizer(zero_worker.param_groups(params, case), case,
                                                     zenflow=case["zenflow"],
                                                     max_grad_norm=case.get("max_grad_norm")) as opt:
        start = 0
        if state is not None:
            params_at, sd, start = state
            with torch.no_grad():
                for p, v in zip(params, params_at, strict=True):
                    p.copy_(v)
            opt.load_state_dict(sd)
        for t, step in enumerate(grads[start:steps], start):
            zero_worker.set_grads(params, step, t, case, dtype)
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in params]


def reference(case: dict, world: int):
    params = [torch.nn.Parameter(p.detach().float()) for p in zero_worker.make_params()]
    rule = zero_worker.make_rule(case) if case.get("rule") else None
    hyper = zero_worker.HYPER if rule is None else dict(lr=zero_worker.HYPER["lr"])  # (a rule has its own)
    ref = ReferenceZenFlow(zero_worker.param_groups(params, case), **hyper, zenflow=case["zenflow"],
                           max_grad_norm=case.get("max_grad_norm"), rule=rule)
    for t, step in enumerate(zero_worker.mean_grads(case["steps"], world)):
        zero_worker.set_grads(params, step, t, case, torch.float32)
        ref.step()
    ref.flush()
    return [p.detach().clone() for p in params]


def close(actual, expected, rtol=1e-5, atol=1e-6):
    pairs = zip(actual, expected, strict=True)
    return all(torch.allclose(a.float(), e.float(), rtol=rtol, atol=atol) for a, e in pairs)


def assert_as_stated(actual, expected, case: dict, what: str, steps: int | None = None) -> None:
    """Ranks against one rank (or the reference) where the bits are not the same (sums over other orders or
    slices): within the stated bound of docs/design.md, "Numeric guarantees" (HYPER's lr: the largest of the
    case's groups)."""
    assert_all_within_stated_bound([a.float() for a in actual], [e.float() for e in expected],
                                   lr=zero_worker.HYPER["lr"], steps=case["steps"] if steps is None else steps,
                                   what=f"{case['name']}: {what}")


CASES = [
    dict(name="sync", zenflow=ZEN, steps=20),
    dict(name="overlap", zenflow=dict(ZEN, overlap_step=True), steps=20),
    dict(name="overlap_chaos", zenflow=dict(ZEN, overlap_step=True), steps=20, chaos=1),
    dict(name="sync_chaos_clip", zenflow=ZEN, steps=20, chaos=2, max_grad_norm=5.0),
    dict(name="overlap_clip", zenflow=dict(ZEN, overlap_step=True), steps=20, max_grad_norm=5.0),
    dict(name="bf16_overlap", zenflow=dict(ZEN, overlap_step=True), steps=20, dtype="bfloat16"),
    dict(name="devacc_chaos", zenflow=dict(ZEN, overlap_step=True, device_accumulation=True), steps=20, chaos=0),
    dict(name="save", zenflow=dict(ZEN, overlap_step=True), steps=20, save_at=10),
    # ZeRO-2: matrices reduced to their owners, selection scored by the owners
    dict(name="s2_sync", zenflow=ZEN, steps=20, zero_stage=2),
    dict(name="s2_overlap_chaos", zenflow=dict(ZEN, overlap_step=True), steps=20, zero_stage=2, chaos=0),
    dict(name="s2_overlap_clip", zenflow=dict(ZEN, overlap_step=True), steps=20, zero_stage=2, max_grad_norm=5.0),
    dict(name="s2_auto_chaos_clip", zenflow=dict(ZEN, update_interval="auto"), steps=20, zero_stage=2, chaos=1,
         max_grad_norm=5.0),
    dict(name="s2_bf16_devacc", zenflow=dict(ZEN, overlap_step=True, device_accumulation=True), steps=20,
         zero_stage=2, dtype="bfloat16"),
    dict(name="s2_save", zenflow=dict(ZEN, overlap_step=True), steps=20, zero_stage=2, save_at=10),
    # ZeRO-2 keeping every .grad: the selected columns of the local gradients are averaged instead
    dict(name="s2_keep_overlap_chaos", zenflow=dict(ZEN, overlap_step=True), steps=20, zero_stage=2, chaos=2,
         release_gradients=False),
    # write-backs whose span on a rank does not start at the rank's first parameter (see
    # test_write_back_spans_start_past_a_ranks_first_parameter): rank 1's run starts with a vector (the
    # fast path's after warm-up); rank 0's first parameter has no gradient at t = 1 (warm-up), 4, 7, ...
    # per-group ZenFlow settings: a callable scorer (owners score under stage 2) and a host-only group
    dict(name="policy", zenflow=dict(ZEN, overlap_step=True), steps=20, policy=True),
    dict(name="s2_policy_chaos", zenflow=ZEN, steps=20, zero_stage=2, chaos=1, policy=True),
    dict(name="groups_vector_first", zenflow=ZEN, steps=20, groups=True, chaos=1),
    dict(name="s2_groups_first_missing", zenflow=dict(ZEN, overlap_step=True, update_interval=1, full_warm_up_rounds=3),
         steps=20, zero_stage=2, groups=True, missing=[0], chaos=0, reload_at=[10, 10, 14]),
    # frozen parameters (a LoRA base, frozen embeddings): the first matrix and its bias frozen at construction and
    # trained from step 8 (host state laid out then, on its owner; ZeRO-2 reduces the matrix outside the buckets
    # made at the first step until the layout is made again), the second matrix frozen again from step 13
    dict(name="frozen_overlap_chaos", zenflow=dict(ZEN, overlap_step=True), steps=20, chaos=1,
         frozen=dict(params=[0, 1], until=8, again=[13, [2]])),
    dict(name="s2_frozen_clip_chaos", zenflow=ZEN, steps=20, zero_stage=2, chaos=0, max_grad_norm=5.0,
         frozen=dict(params=[0, 1], until=8, again=[13, [2]]), reload_at=[10]),
    # another update rule (its state by name through the owners, the exchange and the checkpoints)
    dict(name="s2_lion_overlap_chaos", zenflow=dict(ZEN, overlap_step=True), steps=20, zero_stage=2, chaos=1,
         rule=["Lion", dict(betas=[0.9, 0.99], weight_decay=0.1)], reload_at=[10]),
    dict(name="sgd_clip_save", zenflow=ZEN, steps=20, max_grad_norm=5.0, save_at=10,
         rule=["SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.01)]),
    # bf16 host state rounded stochastically: each element's bits keyed by its place in the whole model's host
    # layout, so the ranks' shards round as one process does; reloaded mid-run, and (ZeRO-1) with frozen parameters
    # trained later, which lays the host state out again (and moves every key)
    dict(name="s2_bf16_state_stochastic_overlap_chaos", zenflow=dict(ZEN, overlap_step=True), steps=20, zero_stage=2,
         chaos=1, reload_at=[10], rule=["AdamW", dict(state_dtype="bfloat16", state_rounding="stochastic",
                                                      rounding_seed=11)]),
    dict(name="bf16_state_stochastic_frozen_groups", zenflow=ZEN, steps=20, groups=True, chaos=0,
         frozen=dict(params=[0, 1], until=8, again=[13, [2]]),
         rule=["Lion", dict(betas=[0.9, 0.99], weight_decay=0.1, state_dtype="bfloat16",
                            state_rounding="stochastic")]),
    # DeepSpeed's six choices (tests/test_deepspeed_semantics.py): the gradients divided by the interval, host steps
    # numbered by t, state reset at each selection, selections at absolute multiples of the interval
    dict(name="s2_deepspeed_overlap_chaos_clip", zenflow=dict(ZEN, overlap_step=True, semantics="deepspeed"),
         steps=20, zero_stage=2, chaos=1, max_grad_norm=5.0, reload_at=[10]),
]
# the same run without the reloads: a rank that loads its own checkpoint continues bit for bit
CASES_NO_RELOAD = [dict({k: v for k, v in next(c for c in CASES if c["name"] == "s2_groups_first_missing").items()
                         if k != "reload_at"}, name="s2_groups_first_missing_straight")]
# "save" and "s2_save" saving inside opt.flushed() at steps 10 and 13: resuming from each save (ZeRO-1), going
# on (ZeRO-2, chaos)
CASES_FLUSHED = [dict(next(c for c in CASES if c["name"] == name), name=f"{name}_flushed", flushed_at=[10, 13],
                      resume_at=resume, chaos=chaos) for name, chaos, resume in (("save", None, [10, 13]),
                                                                                 ("s2_save", 1, []))]
# per-group topk_ratio (0.5 and 0, a callable scorer): each rank's own checkpoint loaded back at steps 10 and 13,
# and a consolidated one saved at 10, against the same run without them ("s2_policy_chaos")
CASES_GROUPS_SAVED = [dict(next(c for c in CASES if c["name"] == "s2_policy_chaos"), name="s2_policy_saved",
                           save_at=10, reload_at=[10, 13])]
# the host state on disk (offload_device="nvme"): the same runs as their in-memory twins, bit for bit
NVME_TWINS = ["save", "sync_chaos_clip", "s2_overlap_chaos", "s2_bf16_devacc", "s2_groups_first_missing",
              "save_flushed"]
CASES_NVME = [dict(next(c for c in CASES + CASES_FLUSHED if c["name"] == name), name=f"{name}_nvme", nvme=True)
              for name in NVME_TWINS]
MODEL_CASES = [
    dict(name="model_s1", kind="model", zenflow=dict(ZEN, overlap_step=True), steps=12, zero_stage=1),
    dict(name="model_s2", kind="model", zenflow=dict(ZEN, overlap_step=True), steps=12, zero_stage=2),
    dict(name="model_s2_micro", kind="model", zenflow=ZEN, steps=12, zero_stage=2, micro=2),
    dict(name="model_s2_micro_keep", kind="model", zenflow=ZEN, steps=12, zero_stage=2, micro=2,
         release_gradients=False),
    # declared with opt.no_sync(): kept gradients start no bucket until the last micro-batch
    dict(name="model_s2_micro_keep_declared", kind="model", zenflow=ZEN, steps=12, zero_stage=2, micro=2,
         release_gradients=False, declare=True),
    # a frozen first layer trained from step 5: its hooks (and its bucket) from then on
    dict(name="model_s2_frozen", kind="model", zenflow=dict(ZEN, overlap_step=True), steps=12, zero_stage=2,
         frozen=dict(params=[0, 1], until=5)),
]


THREE_RANK_CASES = [
    dict(name="w3_s1_overlap_groups_missing", zenflow=dict(ZEN, overlap_step=True), steps=15, groups=True,
         missing=[0, 4]),
    dict(name="w3_s2_chaos_clip_groups", zenflow=ZEN, steps=15, zero_stage=2, chaos=3, max_grad_norm=5.0,
         groups=True, missing=[2]),
]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    results, done = launch(THREE_RANK_CASES, tmp, world=3)
    for rc, _out, err in done:
        assert rc == 0, err[-3000:]
    return results


@pytest.mark.ranks
@pytest.mark.parametrize("case", THREE_RANK_CASES, ids=[c["name"] for c in THREE_RANK_CASES])
def test_three_ranks_with_param_groups_and_missing_gradients(three_ranks, case):
    ranks = three_ranks[case["name"]]
    assert sorted(i for r in ranks for i in r["owned"]) == list(range(len(zero_worker.SHAPES)))
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], other["params"], strict=True))
    assert_as_stated(ranks[0]["params"], single_rank(case, world=3), case, "3 ranks against 1 rank")
    assert_as_stated(ranks[0]["params"], reference(case, world=3), case, "3 ranks against the reference")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    results, done = launch(CASES + CASES_NO_RELOAD + CASES_FLUSHED + CASES_GROUPS_SAVED + CASES_NVME + MODEL_CASES +
                           [dict(name="errors", kind="errors")], tmp)
    for rc, _out, err in done:
        assert rc == 0, err[-3000:]
    return results


@pytest.mark.ranks
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_ranks_match_one_rank_and_the_reference(two_ranks, case):
    ranks = two_ranks[case["name"]]
    # every replica holds the same weights, bit for bit
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], other["params"], strict=True))
    one = single_rank(case, world=2)
    # 1 rank fed the average as the all-reduce computes it (g0 + g1, then / 2): the same bits
    for i, (a, b) in enumerate(zip(ranks[0]["params"], one, strict=True)):
        assert torch.equal(a, b), f"param {i}: 2 ranks differ from 1 rank on their average by {(a - b).abs().max()}"
    if case.get("dtype", "float32") == "float32" and "state_dtype" not in (case.get("rule") or [None, {}])[1]:
        # (bf16 host state against the fp32 reference: tests/test_stochastic_rounding.py has its oracle)
        assert_as_stated(ranks[0]["params"], reference(case, world=2), case, "2 ranks against the reference")
    # and the weights moved: the comparison is not between two copies of the initial values
    init = zero_worker.make_params(getattr(torch, case.get("dtype", "float32")))
    assert not close(ranks[0]["params"], init, rtol=1e-3, atol=1e-3)


def _written_back_spans(case: dict, world: int) -> dict[int, list[tuple[int, list[int]]]]:
    """Per rank, the steps at which the rank's first parameter (in its shard's layout) is left out of a
    write-back that holds others of its parameters: [(t, written-back parameters it owns)]."""
    from zenflow_kernels.host import layout
    from zenflow_kernels.schedule import resolve_schedule

    params = zero_worker.make_params()
    grouped = zero_worker.param_groups(params, case)
    groups = [n for n, g in enumerate(grouped) for _ in g["params"]] if isinstance(grouped[0], dict) else \
        [0] * len(params)
    owner = owners(params, groups, world)
    order = layout(params, groups)[0]
    schedule = resolve_schedule(ZenFlowConfig.coerce(case["zenflow"]))
    out: dict[int, list] = {r: [] for r in range(world)}
    for t in range(case["steps"]):
        active = [i for i in order if not (i in case.get("missing", ()) and t % 3 == 1)]
        written = active if schedule.is_warmup(t) else [i for i in active if params[i].dim() == 2]
        for r in range(world):
            run = [i for i in order if owner[i] == r]
            mine = [i for i in written if owner[i] == r]
            if mine and mine[0] != run[0]:
                out[r].append((t, mine))
    return out


@pytest.mark.parametrize("name, rank, reason", [("groups_vector_first", 1, "vector"),
                                                ("s2_groups_first_missing", 0, "missing")])
def test_write_back_spans_start_past_a_ranks_first_parameter(name, rank, reason):
    """What the two cases above are for (the gap of every other case: each rank's write-back starts at
    offset 0 of its shard): a rank whose first parameter is not written back at some step while others
    of its run are, after warm-up and (the missing gradient) in warm-up too. The cases themselves run in
    test_two_ranks_match_one_rank_and_the_reference."""
    case = next(c for c in CASES if c["name"] == name)
    spans = _written_back_spans(case, world=2)
    assert spans[rank], f"{name}: rank {rank}'s write-backs all start at its first parameter"
    params = zero_worker.make_params()
    first_of_rank = {0: 0, 1: 1}[rank]  # layout order with the two groups: [0, 2 | 1, 5, 3, 4]
    assert all(first_of_rank not in mine for _, mine in spans[rank])
    if reason == "vector":
        assert params[first_of_rank].dim() == 1 and len(spans[rank]) > 10  # every step after warm-up
    else:
        warmup = case["zenflow"]["full_warm_up_rounds"]
        assert any(t < warmup for t, _ in spans[rank]) and any(t >= warmup for t, _ in spans[rank])


@pytest.mark.ranks
def test_stage2_keeps_one_backward_hook_per_parameter_across_reloads(two_ranks):
    """ZeRO-2 starts its reductions from post-accumulate-grad hooks: one per parameter after the first
    step, after each load of the rank's own checkpoint into the stepped optimizer, and none after close.
    And the reloaded ranks continue bit for bit like the same run without the loads."""
    case = next(c for c in CASES if c["name"] == "s2_groups_first_missing")
    n = len(zero_worker.SHAPES)
    straight = two_ranks[CASES_NO_RELOAD[0]["name"]]
    for r, s in zip(two_ranks[case["name"]], straight, strict=True):
        hooks = r["hooks"]
        assert hooks["first step"] == [[1] * n]
        assert hooks["reload"] == [[1] * n] * len(case["reload_at"])
        assert hooks["closed"] == [[0] * n]
        assert "reload" not in s["hooks"]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], s["params"], strict=True))


@pytest.mark.ranks
@pytest.mark.parametrize("case", MODEL_CASES, ids=[c["name"] for c in MODEL_CASES])
def test_two_ranks_on_half_batches_match_one_rank_on_the_whole_batch(two_ranks, case):
    ranks = two_ranks[case["name"]]
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], other["params"], strict=True))
    model = zero_worker.make_model()
    with use_backend("numba"), ZenFlowAdamW(model.parameters(), **zero_worker.HYPER, zenflow=case["zenflow"]) as opt:
        zero_worker.train_model(model, opt, zero_worker.batch(case["steps"]), slice(0, 8), 1, case=case)
        opt.flush()
        one = [p.detach().clone() for p in model.parameters()]
    assert_as_stated(ranks[0]["params"], one, case, "2 ranks on half batches against 1 rank on the whole batch")
    assert not close(one, list(zero_worker.make_model().parameters()), rtol=1e-3, atol=1e-3)
    if case["zero_stage"] == 2:
        # the reductions started during backward, in buckets (from the second step on: the hooks are set
        # at the first step()). Released gradients: each micro-batch's backward starts its own round of
        # the buckets. Kept: the first start of each bucket is superseded by the second micro-batch's
        # backward and started again in step()
        micro, release = case.get("micro", 1), case.get("release_gradients", True)
        model = zero_worker.make_model()
        matrix_numel = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        vector_numel = sum(p.numel() for p in model.parameters() if p.dim() != 2)
        for r in ranks:
            if case.get("frozen"):  # (the buckets, made again with the layout when the first layer trains)
                assert r["buckets"] == 2 and r["started_in_backward"] >= r["buckets"] * (case["steps"] - 6)
                continue
            assert r["buckets"] == 2  # the two Linear weights: one per owner
            if release:
                assert r["started_in_backward"] == r["buckets"] * (case["steps"] - 1) * micro
                assert r["restarted"] == 0
                assert 0 < r["owned_matrix_numel"] < matrix_numel
            else:
                assert r["started_in_backward"] == r["buckets"] * (case["steps"] - 1)
                restarts = micro > 1 and not case.get("declare")  # declared: started once, by the last
                assert r["restarted"] == (r["buckets"] * (case["steps"] - 1) if restarts else 0)
            # what a rank holds after backward (measured): released, no matrix gradient in .grad and,
            # once both buckets' inputs are let go, its own range's sums only (one per micro-batch)
            for held in r["held"][1:]:
                assert held["vectors"] == vector_numel
                if release:
                    assert held["matrices"] == 0
                    assert r["owned_matrix_numel"] * micro <= held["reducer"] <= matrix_numel * micro
                else:
                    assert held["matrices"] == matrix_numel and held["reducer"] == 0


@pytest.mark.ranks
def test_stage0_ddp_and_uneven_gradients_under_torchrun_are_clear_errors(two_ranks):
    for errors in two_ranks["errors"]:
        assert errors["presence"].endswith("parameters [1] have a gradient on some ranks and not on others; under "
                                           "ZeRO every rank must produce a gradient for the same parameters each "
                                           "step (set unused parameters' .grad to zeros, or to None on every rank)")
        assert "runs 2 ranks and zero_stage=0: pick zero_stage=1 or 2" in errors["stage0"]
        assert "wrapped in DistributedDataParallel" in errors["ddp"] and "model.module.parameters()" in errors["ddp"]


@pytest.mark.ranks
def test_each_rank_holds_its_share_of_the_host_state(two_ranks):
    ranks = two_ranks["overlap"]
    owned = [set(r["owned"]) for r in ranks]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(len(zero_worker.SHAPES)))
    total = sum(r["host_numel"] for r in ranks)
    # the whole model's layout, aligned (16 fp32 elements per parameter start)
    assert total == sum(-(-torch.Size(s).numel() // 16) * 16 for s in zero_worker.SHAPES)
    largest = max(-(-torch.Size(s).numel() // 16) * 16 for s in zero_worker.SHAPES)
    for r in ranks:
        assert r["host_numel"] <= total / 2 + largest
        # master, two moments and two accumulation buffers (overlap), fp32, of this rank's run only
        assert r["host_bytes"] == 5 * 4 * r["host_numel"]
        # what host_bytes() reports per rank: those buffers, and a copy-out of this rank's parameters only
        reported = r["stats"]["host_bytes"]
        assert reported["master"] + reported["exp_avg"] + reported["exp_avg_sq"] + reported["accumulation"] == \
            r["host_bytes"]
        assert reported["copy_out"] == 4 * r["host_numel"] and reported["landing"] == 0
    # the write-back's receive buffers: each rank holds the other's copy-out as it receives it (fp32 here)
    for r, other in ((ranks[0], ranks[1]), (ranks[1], ranks[0])):
        assert r["stats"]["host_bytes"]["receive"] == other["stats"]["host_bytes"]["copy_out"]
    # both ranks' sharded buffers add up to one rank's: 1/world each, give or take a parameter
    assert sum(r["stats"]["host_bytes"]["total"] - r["stats"]["host_bytes"]["receive"] for r in ranks) == 6 * 4 * total


@pytest.mark.ranks
def test_stage2_moves_each_matrix_gradient_once_and_selection_scores_not_gradients(two_ranks):
    ranks = two_ranks["s2_overlap_clip"]
    matrix_bytes = sum(torch.Size(s).numel() * 4 for s in zero_worker.SHAPES if len(s) == 2)
    vector_bytes = sum(torch.Size(s).numel() * 4 for s in zero_worker.SHAPES if len(s) != 2)
    columns = sum(s[1] for s in zero_worker.SHAPES if len(s) == 2)
    for r in ranks:
        moved, stats = r["stats"]["collective_bytes"], r["stats"]
        assert moved["gradients"] == 20 * matrix_bytes  # one reduce of each matrix per step
        assert moved["vector gradients"] == 20 * vector_bytes
        assert moved["selection scores"] == stats["selections"] * columns * 4  # a float per column
        assert moved["gradient norm"] == 20 * 8
        rows = {s[1]: s[0] for s in zero_worker.SHAPES if len(s) == 2}
        k = {c: max(1, int(0.1 * c)) for c in rows}
        assert moved["selected columns"] == 19 * sum(rows[c] * k[c] * 4 for c in rows)  # after warm-up


@pytest.mark.ranks
def test_collective_bytes_are_reported_per_kind(two_ranks):
    ranks = two_ranks["overlap"]
    grad_bytes = sum(torch.Size(s).numel() * 4 for s in zero_worker.SHAPES)
    for r in ranks:
        moved = r["stats"]["collective_bytes"]
        assert moved["gradients"] == 20 * grad_bytes  # one all-reduce of every gradient per step
        assert moved["gradient presence"] == 20 * len(zero_worker.SHAPES) * 4
        assert moved["write-back"] > 0 and moved["host state"] > 0
        assert r["stats"]["collective_bytes_per_step"]["gradients"] == grad_bytes


@pytest.mark.ranks
@pytest.mark.parametrize("case", CASES_FLUSHED, ids=[c["name"] for c in CASES_FLUSHED])
def test_saving_inside_flushed_and_resuming_from_it_leave_zero_runs_bit_identical(two_ranks, case):
    """ZeRO-1 and ZeRO-2 (chaos) at 2 ranks: each rank saves inside ``opt.flushed()`` at steps 10 and 13, and
    resumes from each save (ZeRO-1: the flushed weights into the model, then the state) or goes on (ZeRO-2:
    the context's write-back takes the other owner's broadcast result, kept for the write-back at the
    boundary, so no byte moves twice); each ends bit-identical to the same run without them."""
    straight = two_ranks[case["name"].removesuffix("_flushed")]
    for r, s in zip(two_ranks[case["name"]], straight, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(r["params"], s["params"], strict=True))
        if not case["resume_at"]:
            assert r["stats"]["collective_bytes"]["write-back"] == s["stats"]["collective_bytes"]["write-back"]
        for t, (before, inside) in r["flushed"].items():
            assert any(not torch.equal(a, b) for a, b in zip(before, inside, strict=True)), f"nothing pending at {t}"
    ranks = two_ranks[case["name"]]
    for t in case["flushed_at"]:  # every replica saw the same flushed weights
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["flushed"][t][1], ranks[1]["flushed"][t][1],
                                                     strict=True))


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["save", "s2_save", "sgd_clip_save"])
def test_a_consolidated_checkpoint_continues_on_one_rank(two_ranks, name):
    case = next(c for c in CASES if c["name"] == name)
    ranks = two_ranks[name]
    sd = ranks[0]["consolidated"]
    assert sd["zenflow"]["zero"] == dict(stage=case.get("zero_stage", 1), world=2, rank=0, consolidated=True)
    resumed = single_rank(case, world=2, state=(ranks[0]["params_at_save"], sd, case["save_at"]))
    # 1 rank fed the ranks' average continues the 2 ranks' run bit for bit (as 1 rank matches 2 above)
    assert all(torch.equal(a, b) for a, b in zip(resumed, ranks[0]["params"], strict=True))
    # a rank's own dict holds only its parameters' host state, and says so when loaded elsewhere
    per_rank = ranks[1]["per_rank"]
    held = {i for i, st in per_rank["state"].items() if "host_master" in st}
    assert held == set(ranks[1]["owned"])
    params = zero_worker.make_params()
    with zero_worker.optimizer(params, case, zenflow=case["zenflow"]) as opt:
        with pytest.raises(ValueError, match=r"saved by rank 1 of 2\) holds no host state for parameters .*"
                                             r"consolidated_state_dict"):
            opt.load_state_dict(per_rank)
        assert opt.t == 0 and not opt.state


@pytest.mark.ranks
def test_per_group_topk_ratios_survive_per_rank_and_consolidated_checkpoints(two_ranks):
    """Param groups with their own ``topk_ratio`` (and a callable scorer) under ZeRO-2 and chaos: each rank loading
    its own ``state_dict()`` back (twice) continues bit for bit like the run that never did, and the consolidated
    dict saved at step 10 continues on one rank fed the ranks' average bit for bit too."""
    case = CASES_GROUPS_SAVED[0]
    ranks, straight = two_ranks[case["name"]], two_ranks["s2_policy_chaos"]
    for r, s in zip(ranks, straight, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(r["params"], s["params"], strict=True))
    sd = ranks[0]["consolidated"]
    assert [g.get("topk_ratio") for g in sd["param_groups"]] == [0.5, 0.0]
    resumed = single_rank(case, world=2, state=(ranks[0]["params_at_save"], sd, case["save_at"]))
    assert all(torch.equal(a, b) for a, b in zip(resumed, ranks[0]["params"], strict=True))


@pytest.mark.ranks
@pytest.mark.parametrize("name", NVME_TWINS)
def test_host_state_on_disk_leaves_zero_runs_bit_identical(two_ranks, name):
    """ZeRO-1/2 at 2 ranks with each rank's host shard in its own state file: the weights, the consolidated
    and per-rank checkpoints (``save``), the reloads (``s2_groups_first_missing``: each rank loads its own
    state dict three times) and the saves inside ``flushed()`` resumed from (``save_flushed``) are those of the
    in-memory run; each rank's file holds 12 bytes per element of its
    shard (whole blocks) and is gone after close()."""
    disk, memory = two_ranks[f"{name}_nvme"], two_ranks[name]
    for rank, (d, m) in enumerate(zip(disk, memory, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(d["params"], m["params"], strict=True)), f"rank {rank}"
        hb = d["stats"]["host_bytes"]
        block = ZenFlowAdamW.NVME_BLOCK_NUMEL
        assert hb["disk"] == -(-d["host_numel"] // block) * block * 12 and hb["master"] == hb["exp_avg_sq"] == 0
        if "devacc" in name:  # the sums stay on the device (two buffers with overlap): no host accumulation
            assert hb["accumulation"] == 0 and hb["device_sums"] == 2 * d["host_numel"] * 4 > 0
        else:
            assert hb["accumulation"] == m["stats"]["host_bytes"]["accumulation"]
        parent, exists = d["nvme_folder"]  # the rank's private folder under the case's nvme_path, gone
        assert Path(parent).name == f"nvme-{name}_nvme" and not exists, (rank, d["nvme_folder"])
        for key in ("consolidated", "per_rank", "flushed"):
            if key in m:
                assert_same_state(d[key], m[key], f"rank {rank} {key}")


@pytest.mark.ranks
def test_a_rank_that_fails_ends_the_other_with_an_error_naming_the_collective(tmp_path):
    cases = [dict(name="fail", zenflow=ZEN, steps=8, fail_rank=1, fail_at=4, timeout=20.0)]
    t0 = time.monotonic()
    _, done = launch(cases, tmp_path, timeout=120.0)
    assert time.monotonic() - t0 < 100
    (rc0, _, err0), (rc1, _, err1) = done
    assert rc1 != 0 and "rank 1 fails at step 4 on purpose" in err1
    assert rc0 != 0
    assert "ZeroCollectiveError: ZenFlowAdamW rank 0 of 2: all_reduce of gradient presence" in err0, err0[-2000:]


@pytest.mark.ranks
def test_a_rank_that_hangs_ends_the_other_within_the_collective_timeout(tmp_path):
    cases = [dict(name="hang", zenflow=dict(ZEN, overlap_step=True), steps=8, zero_stage=2, fail_rank=1, fail_at=4,
                  hang_s=14, timeout=3.0)]  # (asleep past the 12 s the assertion below allows rank 0)
    _, done = launch(cases, tmp_path, timeout=150.0)
    (rc0, _, err0), (rc1, _, _) = done
    assert rc0 != 0 and rc1 == 3
    assert "ZeroCollectiveError: ZenFlowAdamW rank 0 of 2: " in err0 and "took longer than 3 s" in err0, err0[-2000:]
    # rank 0 gave up while rank 1 was still asleep, about the timeout after rank 1 stopped stepping
    hang_start = float((tmp_path / "hang-start").read_text())
    assert (tmp_path / "error-rank0.txt").stat().st_mtime - hang_start < 12


def test_owner_runs_are_contiguous_and_balanced():
    for sizes, world in [([16] * 10, 2), ([16] * 10, 3), ([1024, 16, 16, 16], 2), ([16], 2), ([], 2),
                         ([64, 64, 64, 64, 64, 64, 64], 4)]:
        owners = owner_runs(sizes, world)
        assert owners == sorted(owners) and all(0 <= r < world for r in owners)
        total = sum(sizes)
        for r in range(world):
            share = sum(s for s, o in zip(sizes, owners, strict=True) if o == r)
            assert share <= total / world + max(sizes, default=0)  # midpoints in one equal share
    assert owner_runs([16] * 10, 2) == [0] * 5 + [1] * 5
