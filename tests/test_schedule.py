"""The select/update schedule: the resolution table of the select-interval fix, warnings, boundaries."""

import os
import warnings

import pytest

from zenflow_kernels.config import ZenFlowConfig, ZenFlowConfigError, ZenFlowWarning
from zenflow_kernels.schedule import Schedule, resolve_schedule


def resolve_quietly(config, **kwargs):
    """Resolve and return (schedule, [warning messages])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = resolve_schedule(config, **kwargs)
    return sched, [str(w.message) for w in caught if issubclass(w.category, ZenFlowWarning)]


# The table from the select-interval fix: 40 steps, a 10-step epoch.
# (select_strategy, select_interval, epoch length known) -> (resolved interval, selections in 40 steps)
FIX_TABLE = [
    ("auto", "auto", False, 0, 1),
    ("auto", "auto", True, 10, 4),
    ("epoch", 1, False, 0, 1),
    ("epoch", 1, True, 10, 4),
    ("step", 10, None, 10, 4),
]


def test_select_interval_fix_table():
    rows = []
    for strategy, interval, known, *_ in FIX_TABLE:
        cfg = ZenFlowConfig(select_strategy=strategy, select_interval=interval, update_interval=1)
        sched, notes = resolve_quietly(cfg, steps_per_epoch=10 if known else None)
        rows.append((strategy, interval, known, sched.select_interval, len(sched.select_steps(40)), bool(notes)))
    expected = [(s, i, k, wi, ws, k is False) for s, i, k, wi, ws in FIX_TABLE]
    assert rows == expected


def test_never_reselected_warning_names_the_three_ways_out():
    _, notes = resolve_quietly(ZenFlowConfig())
    assert len(notes) == 1
    msg = notes[0]
    assert "never re-selected" in msg
    assert "steps_per_epoch" in msg and "dataloader" in msg and "select_strategy='step'" in msg


def test_warning_category_and_once_per_resolution():
    assert issubclass(ZenFlowWarning, UserWarning)
    with pytest.warns(ZenFlowWarning) as record:
        resolve_schedule(ZenFlowConfig(select_strategy="auto", select_interval=5))
    messages = [str(w.message) for w in record]
    # two distinct warnings, each once: the ignored integer and the unknown epoch length
    assert len(messages) == 2 and len(set(messages)) == 2
    assert any("select_interval=5 is ignored" in m for m in messages)


def test_auto_with_integer_interval_warns_not_raises_and_means_one_epoch():
    sched, notes = resolve_quietly(ZenFlowConfig(select_strategy="auto", select_interval=3), steps_per_epoch=10)
    assert sched.select_interval == 10 and sched.select_strategy == "epoch"
    assert len(notes) == 1 and "ignored" in notes[0]


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "10"])
def test_steps_per_epoch_argument_validated_like_config(bad):
    with pytest.raises(ZenFlowConfigError, match=r"steps_per_epoch=.* is invalid"):
        resolve_schedule(ZenFlowConfig(), steps_per_epoch=bad)


@pytest.mark.parametrize("bad", [0, -5])
def test_steps_per_epoch_config_rejected(bad):
    with pytest.raises(ZenFlowConfigError, match="zenflow.steps_per_epoch"):
        ZenFlowConfig(steps_per_epoch=bad)


def test_epoch_length_sources_and_priority():
    loader = list(range(7))
    sched, notes = resolve_quietly(ZenFlowConfig(), dataloader=loader)
    assert (sched.select_interval, sched.steps_per_epoch_source, notes) == (7, "dataloader", [])
    sched, _ = resolve_quietly(ZenFlowConfig(), steps_per_epoch=5, dataloader=loader)
    assert (sched.select_interval, sched.steps_per_epoch_source) == (5, "argument")
    sched, _ = resolve_quietly(ZenFlowConfig(steps_per_epoch=4), dataloader=loader)
    assert (sched.select_interval, sched.steps_per_epoch_source) == (4, "config")
    sched, _ = resolve_quietly(ZenFlowConfig(steps_per_epoch=4), steps_per_epoch=4)
    assert sched.select_interval == 4
    with pytest.raises(ZenFlowConfigError, match="conflicts with zenflow.steps_per_epoch=4"):
        resolve_schedule(ZenFlowConfig(steps_per_epoch=4), steps_per_epoch=6)
    sched, _ = resolve_quietly(ZenFlowConfig(select_strategy="epoch", select_interval=3), steps_per_epoch=5)
    assert sched.select_interval == 15


def test_empty_dataloader_warns_instead_of_crashing():
    sched, notes = resolve_quietly(ZenFlowConfig(), dataloader=[])
    assert sched.select_interval == 0
    assert len(notes) == 1 and "empty" in notes[0] and "never re-selected" in notes[0]


def test_dataloader_without_len_warns():
    sched, notes = resolve_quietly(ZenFlowConfig(), dataloader=iter(range(3)))
    assert sched.select_interval == 0 and "has no len()" in notes[0]


def test_step_strategy_ignores_epoch_length():
    sched, notes = resolve_quietly(
        ZenFlowConfig(select_strategy="step", select_interval=6, update_interval=2), dataloader=[]
    )
    assert (sched.select_interval, sched.steps_per_epoch, notes) == (6, None, [])


def test_resolved_select_interval_below_update_interval_rejected():
    with pytest.raises(ZenFlowConfigError, match=r"resolves to 3 steps.*update_interval=4"):
        resolve_schedule(ZenFlowConfig(update_interval=4), steps_per_epoch=3)
    # unknown epoch: interval 0, no re-selection, nothing to straddle: legal (with the warning)
    sched, _ = resolve_quietly(ZenFlowConfig(update_interval=4))
    assert sched.select_interval == 0
    with pytest.raises(ZenFlowConfigError, match="update_interval=5"):
        ZenFlowConfig(select_strategy="step", select_interval=4, update_interval=5)


def brute_boundaries(warmup, select_interval, update_interval, steps):
    """docs/design.md section 3 written out literally, as an independent check."""
    sel, upd = [], []
    for t in range(steps):
        if t >= warmup and (t == warmup or (select_interval != 0 and (t - warmup) % select_interval == 0)):
            sel.append(t)
    for t in range(warmup, steps):
        before_select = select_interval != 0 and (t + 1 - warmup) % select_interval == 0
        if (t - warmup + 1) % update_interval == 0 or before_select:
            upd.append(t)
    return sel, upd


@pytest.mark.parametrize("warmup", [0, 1, 3])
@pytest.mark.parametrize("select_interval, update_interval", [(10, 1), (10, 3), (10, 10), (6, 4), (7, 7), (12, 5)])
def test_fixed_boundaries_match_the_spec(warmup, select_interval, update_interval):
    cfg = ZenFlowConfig(
        select_strategy="step",
        select_interval=select_interval,
        update_interval=update_interval,
        full_warm_up_rounds=warmup,
    )
    sched, _ = resolve_quietly(cfg)
    sel, upd = brute_boundaries(warmup, select_interval, update_interval, 60)
    assert sched.select_steps(60) == sel
    assert sched.update_steps(60) == upd
    assert [t for t in range(60) if sched.is_warmup(t)] == list(range(warmup))
    # every step before a re-selection ends an interval: no interval straddles a change of owner
    assert all(t - 1 in upd for t in sel if t > warmup)


def test_never_reselected_boundaries():
    sched, _ = resolve_quietly(ZenFlowConfig(update_interval=4, full_warm_up_rounds=2))
    assert sched.select_steps(40) == [2]
    assert sched.update_steps(20) == [5, 9, 13, 17]


def test_auto_update_boundaries():
    cfg = ZenFlowConfig(select_strategy="step", select_interval=10, update_interval="auto", max_update_interval=4)
    sched, _ = resolve_quietly(cfg)
    assert sched.auto_bound == 4
    assert sched.is_update_boundary(0, steps_accumulated=1, auto_trigger=True)
    assert not sched.is_update_boundary(0, steps_accumulated=1, auto_trigger=False)
    assert sched.is_update_boundary(3, steps_accumulated=4)
    assert sched.is_update_boundary(9, steps_accumulated=1)  # the step before a re-selection
    assert sched.update_steps(20) == [3, 7, 9, 13, 17, 19]
    with pytest.raises(ValueError, match="steps_accumulated"):
        sched.is_update_boundary(5)
    # the select interval bounds the auto interval too
    sched, _ = resolve_quietly(ZenFlowConfig(select_strategy="step", select_interval=3, update_interval="auto"))
    assert sched.auto_bound == 3
    # unknown epoch length: the configured maximum alone
    sched, _ = resolve_quietly(ZenFlowConfig(max_update_interval=9))
    assert sched.auto_bound == 9


def test_schedule_round_trips_through_dict():
    sched, _ = resolve_quietly(ZenFlowConfig(), dataloader=[])
    assert Schedule.from_dict(sched.to_dict()) == sched


def test_accepts_dict_config():
    sched, _ = resolve_quietly({"select_strategy": "step", "select_interval": 5, "update_interval": 5})
    assert sched.select_interval == 5 and sched.update_interval == 5


class _Loader:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


# (config fields, resolve_schedule keyword arguments) -> every field of the resolved Schedule and how many
# ZenFlowWarnings; the whole table is asserted at once
RESOLUTION = [
    (dict(select_strategy="auto", update_interval=2), dict(steps_per_epoch=7),
     dict(warmup=0, select_strategy="epoch", select_interval=7, update_interval=2, auto_bound=None,
          steps_per_epoch=7, steps_per_epoch_source="argument"), 0),
    (dict(select_strategy="epoch", select_interval="auto", update_interval=1, steps_per_epoch=5), {},
     dict(warmup=0, select_strategy="epoch", select_interval=5, update_interval=1, auto_bound=None,
          steps_per_epoch=5, steps_per_epoch_source="config"), 0),
    (dict(select_strategy="epoch", select_interval=3, update_interval="auto", max_update_interval=4), dict(
        dataloader=_Loader(2)),
     dict(warmup=0, select_strategy="epoch", select_interval=6, update_interval="auto", auto_bound=4,
          steps_per_epoch=2, steps_per_epoch_source="dataloader"), 0),
    (dict(select_strategy="epoch", select_interval=1, update_interval="auto", max_update_interval=9,
          full_warm_up_rounds=3), dict(steps_per_epoch=1),
     dict(warmup=3, select_strategy="epoch", select_interval=1, update_interval="auto", auto_bound=1,
          steps_per_epoch=1, steps_per_epoch_source="argument"), 0),
    (dict(select_strategy="epoch", select_interval=2, update_interval="auto", max_update_interval=6), dict(
        dataloader=_Loader(0)),
     dict(warmup=0, select_strategy="epoch", select_interval=0, update_interval="auto", auto_bound=6,
          steps_per_epoch=None, steps_per_epoch_source=None), 1),
    (dict(select_strategy="step", select_interval=4, update_interval=2), dict(steps_per_epoch=3),
     dict(warmup=0, select_strategy="step", select_interval=4, update_interval=2, auto_bound=None,
          steps_per_epoch=None, steps_per_epoch_source=None), 0),
    (dict(select_strategy="auto", select_interval=5, update_interval=3, full_warm_up_rounds=2), {},
     dict(warmup=2, select_strategy="epoch", select_interval=0, update_interval=3, auto_bound=None,
          steps_per_epoch=None, steps_per_epoch_source=None), 2),
]


def test_resolution_table_every_field():
    got, expected = [], []
    for fields, kwargs, schedule, n_warnings in RESOLUTION:
        sched, notes = resolve_quietly(ZenFlowConfig(**fields), **kwargs)
        row = {k: v for k, v in sched.to_dict().items() if k != "warnings"}
        got.append((row, len(notes), list(sched.warnings) == notes))
        expected.append((schedule, n_warnings, True))
    assert got == expected


def test_never_reselected_messages_are_exact():
    def message(**kwargs):
        _, notes = resolve_quietly(ZenFlowConfig(select_strategy="epoch", select_interval=1, full_warm_up_rounds=3),
                                   **kwargs)
        assert len(notes) == 1
        return notes[0]

    tail = (", so select_interval resolves to 0: the important columns are chosen once, at step 3, and never "
            "re-selected. To re-select, set zenflow.steps_per_epoch, hand over the dataloader or its length "
            "(steps_per_epoch=len(loader)), or use select_strategy='step' with an integer select_interval.")
    head = "zenflow: select_strategy='epoch' measures select_interval in epochs, but the epoch length is unknown"
    assert message() == head + " (no steps_per_epoch and no dataloader)" + tail
    assert message(dataloader=_Loader(0)) == head + " (the dataloader handed over is empty)" + tail
    assert message(dataloader=iter([])) == head + " (the dataloader of type list_iterator has no len())" + tail


def test_warnings_point_at_the_caller():
    with pytest.warns(ZenFlowWarning) as record:
        resolve_schedule(ZenFlowConfig())
    if "MUTANT_UNDER_TEST" in os.environ:  # mutmut puts a trampoline frame between the caller and the library
        assert "zenflow_kernels" not in record[0].filename, record[0].filename
    else:
        assert record[0].filename == __file__


def test_boundary_details():
    sched, _ = resolve_quietly(ZenFlowConfig(select_strategy="step", select_interval=8, update_interval="auto",
                                             max_update_interval=3, full_warm_up_rounds=2))
    assert not any(sched.is_update_boundary(t, steps_accumulated=99, auto_trigger=True) for t in range(2))
    assert not sched.is_update_boundary(2, steps_accumulated=1)  # no vote given: no vote
    assert sched.is_update_boundary(2, steps_accumulated=1, auto_trigger=True)
    # the forced boundaries count steps from the end of warm-up: bound 3, and the step before each selection
    assert sched.update_steps(20) == [4, 7, 9, 12, 15, 17]
    with pytest.raises(ValueError, match=r"^is_update_boundary with update_interval='auto' needs steps_accumulated$"):
        sched.is_update_boundary(5)


def test_schedule_from_a_dict_without_warnings():
    sched, _ = resolve_quietly(ZenFlowConfig(select_strategy="step", select_interval=4, update_interval=2))
    data = sched.to_dict()
    del data["warnings"]  # written before the field existed
    assert Schedule.from_dict(data) == sched
