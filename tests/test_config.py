"""ZenFlowConfig: the domain of every field swept as a table, plus the three ways to build one."""

import json
import math

import pytest

from zenflow_kernels.config import (
    DEFAULT_MAX_UPDATE_INTERVAL,
    ZenFlowConfig,
    ZenFlowConfigError,
    check_adamw_hyperparameters,
)

# (field, value, expected stored value) -- accepted and normalised as documented
ACCEPTED = [
    ("topk_ratio", 0, 0.0),
    ("topk_ratio", 0.0, 0.0),
    ("topk_ratio", 0.1, 0.1),
    ("topk_ratio", 1, 1.0),
    ("topk_ratio", 1.0, 1.0),
    ("select_strategy", "auto", "auto"),
    ("select_strategy", "step", "step"),
    ("select_strategy", "epoch", "epoch"),
    ("select_interval", "auto", "auto"),
    ("select_interval", 1, 1),
    ("select_interval", 10_000, 10_000),
    ("update_interval", "auto", "auto"),
    ("update_interval", 1, 1),
    ("update_interval", 7, 7),
    ("overlap_step", True, True),
    ("overlap_step", False, False),
    ("offload", True, True),
    ("offload", False, False),
    ("device_accumulation", True, True),
    ("device_accumulation", False, False),
    ("auto_ratio", 0, 0.0),
    ("auto_ratio", 0.5, 0.5),
    ("auto_ratio", 1, 1.0),
    ("full_warm_up_rounds", 0, 0),
    ("full_warm_up_rounds", 5, 5),
    ("steps_per_epoch", None, None),
    ("steps_per_epoch", 1, 1),
    ("steps_per_epoch", 123, 123),
    ("pt_reserved_cores_perc", "auto", "auto"),
    ("pt_reserved_cores_perc", 0, 0.0),
    ("pt_reserved_cores_perc", 0.25, 0.25),
    ("pt_reserved_cores_perc", 1.0, 1.0),
    ("cores", "auto", "auto"),
    ("cores", [0, 1], (0, 1)),
    ("cores", (3,), (3,)),
    ("cores", range(2), (0, 1)),
    ("cores", [5, 2], (5, 2)),  # the order given is kept
    ("importance", "l2", "l2"),
    ("importance", "l1", "l1"),
    ("importance", "random", "random"),
    ("importance", len, len),  # any callable: a scorer
    ("selection_seed", 0, 0),
    ("selection_seed", 12345, 12345),
    ("max_update_interval", 1, 1),
    ("max_update_interval", 64, 64),
    ("offload_device", "cpu", "cpu"),  # "nvme" needs nvme_path too: tests/test_nvme_optim.py
    ("nvme_path", None, None),
    ("gradient_scale", "raw", "raw"),
    ("gradient_scale", "interval", "interval"),
    ("host_step_count", "updates", "updates"),
    ("host_step_count", "steps", "steps"),
    ("reselect_state", "carry", "carry"),
    ("reselect_state", "reset", "reset"),
    ("vector_state", "continuous", "continuous"),
    ("vector_state", "reset", "reset"),
    ("select_anchor", "warm_up", "warm_up"),
    ("select_anchor", "absolute", "absolute"),
    ("semantics", "zenflow_kernels", "zenflow_kernels"),
    ("semantics", "deepspeed", "deepspeed"),  # (what it sets: tests/test_deepspeed_semantics.py)
]

# (field, value) -- rejected, with a message that names the field and the value
REJECTED = [
    ("topk_ratio", -0.1),
    ("topk_ratio", 1.5),
    ("topk_ratio", math.nan),
    ("topk_ratio", math.inf),
    ("topk_ratio", True),
    ("topk_ratio", "0.1"),
    ("topk_ratio", None),
    ("select_strategy", "steps"),
    ("select_strategy", "AUTO"),
    ("select_strategy", None),
    ("select_strategy", 1),
    ("select_interval", 0),
    ("select_interval", -3),
    ("select_interval", 2.5),
    ("select_interval", 2.0),
    ("select_interval", True),
    ("select_interval", "10"),
    ("select_interval", "never"),
    ("select_interval", None),
    ("update_interval", 0),
    ("update_interval", -1),
    ("update_interval", 1.5),
    ("update_interval", False),
    ("update_interval", "Auto"),
    ("update_interval", None),
    ("overlap_step", 1),
    ("overlap_step", "true"),
    ("overlap_step", None),
    ("offload", 0),
    ("offload", "yes"),
    ("device_accumulation", 1),
    ("device_accumulation", "true"),
    ("auto_ratio", -0.01),
    ("auto_ratio", 1.01),
    ("auto_ratio", False),
    ("auto_ratio", math.nan),
    ("full_warm_up_rounds", -1),
    ("full_warm_up_rounds", 1.0),
    ("full_warm_up_rounds", True),
    ("full_warm_up_rounds", None),
    ("steps_per_epoch", 0),
    ("steps_per_epoch", -5),
    ("steps_per_epoch", 10.0),
    ("steps_per_epoch", True),
    ("steps_per_epoch", "10"),
    ("pt_reserved_cores_perc", -0.5),
    ("pt_reserved_cores_perc", 2),
    ("pt_reserved_cores_perc", True),
    ("pt_reserved_cores_perc", None),
    ("pt_reserved_cores_perc", "AUTO"),
    ("pt_reserved_cores_perc", "0.5"),
    ("cores", []),
    ("cores", [0, 0]),
    ("cores", [-1]),
    ("cores", [True]),
    ("cores", [1.0]),
    ("cores", "0,1"),
    ("cores", "AUTO"),
    ("cores", 0),
    ("cores", None),
    ("cores", {0: 1}),
    ("importance", "l3"),
    ("importance", "L2"),
    ("importance", None),
    ("importance", "RANDOM"),
    ("importance", 2),
    ("selection_seed", -1),
    ("selection_seed", 1.0),
    ("selection_seed", True),
    ("selection_seed", None),
    ("max_update_interval", 0),
    ("max_update_interval", True),
    ("max_update_interval", None),
    ("max_update_interval", 3.0),
    ("offload_device", "disk"),
    ("offload_device", "NVMe"),
    ("offload_device", None),
    ("nvme_path", "/x"),  # without offload_device="nvme" it would be ignored
    ("nvme_path", 5),
    ("gradient_scale", "mean"),
    ("gradient_scale", None),
    ("host_step_count", 1),
    ("reselect_state", "RESET"),
    ("vector_state", True),
    ("select_anchor", "start"),
    ("semantics", "ours"),
    ("semantics", None),
]


def _base_for(field):
    # an integer select_interval is meant for an explicit strategy ("epoch" takes "auto" too)
    # and "step" needs an integer select_interval
    # and gradient_scale="interval" (semantics="deepspeed" sets it) an integer update_interval
    return {"select_interval": {"select_strategy": "epoch"}, "select_strategy": {"select_interval": 10},
            "gradient_scale": {"update_interval": 2}, "semantics": {"update_interval": 2}}.get(field, {})


def test_every_field_is_in_the_sweep():
    swept = {f for f, *_ in ACCEPTED} | {f for f, _ in REJECTED}
    assert swept == set(ZenFlowConfig.field_names())


def test_accepted_table():
    table = []
    for field, value, expected in ACCEPTED:
        cfg = ZenFlowConfig(**{**_base_for(field), field: value})
        got = getattr(cfg, field)
        table.append((field, value, expected, got, type(got) is type(expected)))
    bad = [row for row in table if row[2] != row[3] or not row[4]]
    assert not bad, f"accepted values stored wrongly (field, value, expected, got, same type): {bad}"


def test_rejected_table():
    failures = []
    for field, value in REJECTED:
        try:
            ZenFlowConfig(**{**_base_for(field), field: value})
        except ZenFlowConfigError as exc:
            msg = str(exc)
            if f"zenflow.{field}" not in msg or repr(value) not in msg or "allowed" not in msg:
                failures.append((field, value, f"message lacks field/value/domain: {msg}"))
        else:
            failures.append((field, value, "accepted"))
    assert not failures, failures


def test_config_error_is_a_value_error():
    assert issubclass(ZenFlowConfigError, ValueError)
    with pytest.raises(ValueError):
        ZenFlowConfig(topk_ratio=2)


def test_defaults_follow_deepspeed():
    cfg = ZenFlowConfig()
    assert cfg.to_dict() == {
        "topk_ratio": 0.1,
        "select_strategy": "auto",
        "select_interval": "auto",
        "update_interval": "auto",
        "overlap_step": False,
        "offload": False,
        "auto_ratio": 0.99,
        "full_warm_up_rounds": 0,
        "steps_per_epoch": None,
        "pt_reserved_cores_perc": "auto",  # DeepSpeed's 0.5 on a GPU, 1.0 on a CPU-only run
        "cores": "auto",  # not in DeepSpeed: its launcher binds cores (--bind_cores_to_rank)
        "importance": "l2",
        "max_update_interval": DEFAULT_MAX_UPDATE_INTERVAL,
        "device_accumulation": False,
        "selection_seed": 0,
        "offload_device": "cpu",
        "nvme_path": None,
        # where DeepSpeed's ZenFlow chooses otherwise, ours (semantics="deepspeed" sets DeepSpeed's, importance too)
        "gradient_scale": "raw",
        "host_step_count": "updates",
        "reselect_state": "carry",
        "vector_state": "continuous",
        "select_anchor": "warm_up",
        "semantics": "zenflow_kernels",
    }


def test_reserved_cores_auto_resolves_by_device_and_a_given_value_stays():
    """``pt_reserved_cores_perc``: not given, 1.0 for CPU parameters (training and the host worker share the
    cores) and DeepSpeed's 0.5 on a GPU; a value given is used on every device; the setting, not its
    resolution, is what to_dict/from_dict (and so a checkpoint) carry."""
    from zenflow_kernels.config import reserved_cores_perc

    auto = ZenFlowConfig()
    assert auto.pt_reserved_cores_perc == "auto"
    assert [auto.reserved_cores_perc(d) for d in ("cpu", "cuda", "xpu")] == [1.0, 0.5, 0.5]
    for given in (0.5, 1.0, 0.25, 0):
        cfg = ZenFlowConfig(pt_reserved_cores_perc=given)
        assert [cfg.reserved_cores_perc(d) for d in ("cpu", "cuda")] == [float(given)] * 2
    assert reserved_cores_perc("auto", "cpu") == 1.0 and reserved_cores_perc(0.5, "cpu") == 0.5
    with pytest.raises(ZenFlowConfigError, match=r"pt_reserved_cores_perc=2 is invalid: allowed 'auto' or a number"):
        reserved_cores_perc(2, "cpu")
    for cfg in (auto, ZenFlowConfig(pt_reserved_cores_perc=0.5)):
        again = ZenFlowConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert again == cfg and again.pt_reserved_cores_perc == cfg.pt_reserved_cores_perc
    # a DeepSpeed config without the key is "auto" (0.5 on its GPUs, as DeepSpeed); with it, the value
    ds = {"zero_optimization": {"zenflow": {"topk_ratio": 0.05}}}
    assert ZenFlowConfig.from_dict(ds).reserved_cores_perc("cuda") == 0.5
    ds["zero_optimization"]["zenflow"]["pt_reserved_cores_perc"] = 0.5
    assert ZenFlowConfig.from_dict(ds).reserved_cores_perc("cpu") == 0.5


def test_cross_field_rules():
    # step strategy needs an integer interval
    with pytest.raises(ZenFlowConfigError, match=r"select_interval='auto'.*select_strategy='step'"):
        ZenFlowConfig(select_strategy="step")
    # select_interval below update_interval: rejected, naming both
    with pytest.raises(ZenFlowConfigError, match=r"select_interval.*update_interval=4"):
        ZenFlowConfig(select_strategy="step", select_interval=3, update_interval=4)
    assert ZenFlowConfig(select_strategy="step", select_interval=4, update_interval=4).select_interval == 4
    assert ZenFlowConfig(select_strategy="step", select_interval=3, update_interval="auto").select_interval == 3
    # epoch with "auto" means one epoch, legal
    assert ZenFlowConfig(select_strategy="epoch").select_interval == "auto"
    # auto strategy with an integer: legal here, warned about at resolution
    assert ZenFlowConfig(select_strategy="auto", select_interval=5).select_interval == 5


def test_frozen_and_replace():
    cfg = ZenFlowConfig()
    with pytest.raises(AttributeError):
        cfg.topk_ratio = 0.5
    other = cfg.replace(topk_ratio=0.5)
    assert other.topk_ratio == 0.5 and cfg.topk_ratio == 0.1
    with pytest.raises(ZenFlowConfigError, match="topk_ratio"):
        cfg.replace(topk_ratio=-1)
    with pytest.raises(ZenFlowConfigError, match="unknown zenflow key"):
        cfg.replace(topk=0.5)


@pytest.mark.parametrize(
    "ratio, columns, k",
    [
        (0.0, 100, 0),
        (0.1, 100, 10),
        (0.29, 100, 29),
        (0.1, 9, 1),  # max(1, 0): a narrow matrix still gets one fast column
        (0.1, 4, 1),  # a LoRA factor
        (1e-6, 1, 1),
        (0.1, 10, 1),
        (0.19, 10, 1),
        (0.2, 10, 2),
        (1.0, 7, 7),
        (1.0, 1, 1),
        (0.5, 1, 1),
        (0.0, 1, 0),
        (0.0, 0, 0),
        (0.3, 10, 3),
        (0.7, 10, 7),
        (0.01, 4096, 40),
        (0.1, 0, 0),
    ],
)
def test_num_selected_is_max_one_floor_of_the_decimal(ratio, columns, k):
    assert ZenFlowConfig(topk_ratio=ratio).num_selected(columns) == k


def test_num_selected_rejects_bad_column_counts():
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="num_columns"):
            ZenFlowConfig().num_selected(bad)


# -- building from dicts and DeepSpeed JSON ---------------------------------------------------------

BLOCK = {
    "topk_ratio": 0.2,
    "select_strategy": "step",
    "select_interval": 8,
    "update_interval": 4,
    "overlap_step": True,
    "full_warm_up_rounds": 2,
}


def test_from_block_wrapper_and_deepspeed_dict_agree():
    ds = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "zenflow": BLOCK}}
    a = ZenFlowConfig.from_dict(BLOCK)
    b = ZenFlowConfig.from_dict({"zenflow": BLOCK})
    c = ZenFlowConfig.from_dict(ds)
    d = ZenFlowConfig(**BLOCK)
    assert a == b == c == d
    assert (
        ZenFlowConfig.coerce(a) is a
        and ZenFlowConfig.coerce(BLOCK) == a
        and ZenFlowConfig.coerce(None) == ZenFlowConfig()
    )


def test_from_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}, "zenflow": BLOCK}})
    )
    assert ZenFlowConfig.from_dict(path) == ZenFlowConfig(**BLOCK)
    assert ZenFlowConfig.from_dict(str(path)) == ZenFlowConfig(**BLOCK)
    assert ZenFlowConfig.from_dict(path, topk_ratio=0.5).topk_ratio == 0.5


def test_round_trip_through_to_dict():
    cfg = ZenFlowConfig(**BLOCK)
    assert ZenFlowConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "source, match",
    [
        ({"topk_ratoi": 0.2}, r"'topk_ratoi' \(did you mean 'topk_ratio'\?\)"),
        ({"zenflow": {"select_intervall": 3}}, r"did you mean 'select_interval'"),
        ({"zero_optimization": {"stage": 2}}, "without a zero_optimization.zenflow block"),
        ({"zero_optimization": {"zenflow": [1, 2]}}, "zenflow block .* is a list"),
        ({"zenflow": "fast"}, "zenflow block .* is a str"),
        # read, so refused rather than silently ignored (the parameters stay on the device; the optimizer's
        # state may go to NVMe: tests/test_nvme_optim.py)
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}, "zenflow": {}}},
         r"nvme_path=None is invalid: allowed a directory for the state files"),
        ({"zero_optimization": {"offload_param": {"device": "NVMe"}, "zenflow": {}}},
         r"zero_optimization.offload_param.device='NVMe' .* is not supported"),
        (42, "of type int is invalid"),
    ],
)
def test_bad_sources(source, match):
    with pytest.raises(ZenFlowConfigError, match=match):
        ZenFlowConfig.from_dict(source)


# DeepSpeed settings ZenFlow reads but cannot honour: refused, naming the field, the value and what is allowed (they
# used to be read as host offload, or ZeRO-3 as nothing at all)
DEEPSPEED_REFUSED = [
    ({"offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device='gpu' in the config dict "
                                               "is not supported: allowed 'cpu' or 'nvme'"),
    ({"offload_optimizer": {"device": "none"}}, "zero_optimization.offload_optimizer.device='none' in the config dict "
                                                "is not supported: allowed 'cpu' or 'nvme'"),
    ({"offload_optimizer": {"device": 1}}, "zero_optimization.offload_optimizer.device=1 in the config dict"),
    ({"offload_optimizer": "nvme"}, "zero_optimization.offload_optimizer='nvme' in the config dict is invalid: allowed "
                                    "an object such as {\"device\": \"cpu\"}"),
    ({"offload_optimizer": ["cpu"]}, "zero_optimization.offload_optimizer=['cpu'] in the config dict is invalid"),
    ({"offload_param": {"device": "gpu"}}, "zero_optimization.offload_param.device='gpu' in the config dict is not "
                                           "supported: allowed 'cpu' or 'none'"),
    ({"offload_param": "cpu"}, "zero_optimization.offload_param='cpu' in the config dict is invalid"),
    ({"stage": 3}, "zero_optimization.stage=3 in the config dict is not supported: allowed 0, 1 or 2"),
    ({"stage": "2"}, "zero_optimization.stage='2' in the config dict is not supported"),
    ({"stage": True}, "zero_optimization.stage=True in the config dict is not supported"),
]


@pytest.mark.parametrize("zero, message", DEEPSPEED_REFUSED)
def test_deepspeed_settings_that_cannot_be_honoured_are_refused(zero, message):
    with pytest.raises(ZenFlowConfigError) as err:
        ZenFlowConfig.from_dict({"zero_optimization": {**zero, "zenflow": {"update_interval": 4}}})
    assert message in str(err.value)


@pytest.mark.parametrize("zero", [
    {}, {"stage": 0}, {"stage": 1}, {"stage": 2}, {"offload_optimizer": None}, {"offload_optimizer": {}},
    {"offload_optimizer": {"device": "cpu", "pin_memory": True}}, {"offload_optimizer": {"device": "CPU"}},
    {"offload_param": {"device": "none"}}, {"offload_param": {"device": "cpu"}},
])
def test_deepspeed_settings_zenflow_honours_are_read(zero):
    cfg = ZenFlowConfig.from_dict({"zero_optimization": {**zero, "zenflow": {"update_interval": 4}}})
    assert cfg == ZenFlowConfig(update_interval=4) and cfg.offload_device == "cpu"


@pytest.mark.parametrize("source, message", [
    ({"zero_optimisation": {"zenflow": {}}, "gradient_accumulation_steps": 4},
     "unknown key 'zero_optimisation' in the config dict (did you mean 'zero_optimization'?)"),
    ({"zero_optimizaton": {"stage": 2, "zenflow": {}}}, "unknown key 'zero_optimizaton' in the config dict (did you "
                                                        "mean 'zero_optimization'?)"),
    ({"zenflw": {"topk_ratio": 0.1}}, "unknown key 'zenflw' in the config dict (did you mean 'zenflow'?)"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 4}, "the config dict is a DeepSpeed config (it has "
     "'gradient_accumulation_steps', 'train_batch_size') without a zero_optimization block"),
])
def test_a_misspelt_or_missing_zero_optimization_is_named(source, message):
    """A misspelt wrapper is named as such, never read as a zenflow block whose DeepSpeed keys get zenflow
    suggestions (gradient_accumulation_steps -> device_accumulation)."""
    with pytest.raises(ZenFlowConfigError) as err:
        ZenFlowConfig.from_dict(source)
    assert message in str(err.value) and "device_accumulation" not in str(err.value)


@pytest.mark.parametrize("key", ["gradient_accumulation_steps", "gradient_clipping", "steps_per_print"])
def test_unrelated_keys_get_no_suggestion(key):
    with pytest.raises(ZenFlowConfigError) as err:
        ZenFlowConfig.from_dict({"zenflow": {key: 1}})
    assert f"unknown zenflow key(s): {key!r}; allowed keys:" in str(err.value) and "did you mean" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ZenFlowConfigError, match="does not exist"):
        ZenFlowConfig.from_dict(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ZenFlowConfigError, match="not valid JSON.*line 1"):
        ZenFlowConfig.from_dict(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ZenFlowConfigError, match="holds a JSON list"):
        ZenFlowConfig.from_dict(arr)
    with pytest.raises(ZenFlowConfigError, match="is a directory"):
        ZenFlowConfig.from_dict(tmp_path)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(lr=math.nan), "lr"),
        (dict(lr=True), "lr"),
        (dict(betas=(0.9,)), "betas"),
        (dict(betas=(1.0, 0.999)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
    ],
)
def test_adamw_hyperparameters_rejected(kwargs, name):
    args = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=None) | kwargs
    with pytest.raises(ValueError, match=rf"{name}=.* is invalid: allowed"):
        check_adamw_hyperparameters(**args)


def test_adamw_hyperparameters_accepted():
    check_adamw_hyperparameters(0.0, (0.0, 0.0), 0.0, 0.0, None)
    check_adamw_hyperparameters(1e-3, [0.9, 0.999], 1e-8, 0.1, 1.0)
