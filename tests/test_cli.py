"""`python -m zenflow_kernels explain`: the report, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from zenflow_kernels.__main__ import main


def write(tmp_path, payload, name="ds.json"):
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


def test_explain_default_config_says_never_reselected(tmp_path, capsys):
    path = write(tmp_path, {"zero_optimization": {"stage": 2, "zenflow": {"update_interval": 4}}})
    assert main(["explain", path, "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "select_interval   = 0" in out and "never re-selected" in out
    assert "selections          (1): 0" in out
    assert "host updates        (10): 3, 7, 11" in out


def test_explain_with_epoch_length(tmp_path, capsys):
    path = write(tmp_path, {"zenflow": {"update_interval": 5, "full_warm_up_rounds": 2}})
    assert main(["explain", path, "--steps", "40", "--steps-per-epoch", "10"]) == 0
    out = capsys.readouterr().out
    assert "steps_per_epoch   = 10 (from argument)" in out
    assert "selections          (4): 2, 12, 22, 32" in out
    assert "warnings:\n  none" in out
    assert "warm-up steps       (2): 0, 1" in out
    table = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 4]
    assert len(table) == 40 and table[2] == ["2", "zenflow", "S", "."] and table[0][3] == "sync"


def test_explain_auto_lists_forced_updates(tmp_path, capsys):
    path = write(tmp_path, {"select_strategy": "step", "select_interval": 8, "max_update_interval": 3})
    assert main(["explain", path, "--steps", "16"]) == 0
    out = capsys.readouterr().out
    assert "auto (Zen-auto, bounded by 3 steps)" in out
    assert "forced host updates (6): 2, 5, 7, 10, 13, 15" in out


@pytest.mark.parametrize(
    "payload, argv_extra, message",
    [
        (None, [], "does not exist"),
        ("{not json", [], "not valid JSON"),
        ({"zenflow": {"topk_ratio": 3}}, [], "zenflow.topk_ratio=3 is invalid"),
        ({"zenflow": {"topk_ratoi": 0.1}}, [], "did you mean 'topk_ratio'"),
        ({"zenflow": {"update_interval": 4}}, ["--steps-per-epoch", "2"], "update_interval=4"),
        ({"zenflow": {}}, ["--steps", "0"], "--steps"),
        ({"zenflow": {}}, ["--steps-per-epoch", "x"], "--steps-per-epoch"),
    ],
)
def test_errors_are_one_line_and_exit_2(tmp_path, payload, argv_extra, message):
    path = str(tmp_path / "missing.json") if payload is None else write(tmp_path, payload)
    proc = subprocess.run(
        [sys.executable, "-m", "zenflow_kernels", "explain", path, *argv_extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


# -- DeepSpeed settings ZenFlow cannot honour: `explain` and the constructor refuse them alike ------------------------


@pytest.mark.parametrize("payload, message", [
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}, "zenflow": {"update_interval": 4}}},
     "zero_optimization.offload_optimizer.device='gpu' in {path} is not supported: allowed 'cpu' or 'nvme'"),
    ({"zero_optimization": {"offload_optimizer": "nvme", "zenflow": {"update_interval": 4}}},
     "zero_optimization.offload_optimizer='nvme' in {path} is invalid: allowed an object"),
    ({"zero_optimization": {"stage": 3, "zenflow": {"update_interval": 4}}},
     "zero_optimization.stage=3 in {path} is not supported: allowed 0, 1 or 2"),
    ({"zero_optimisation": {"zenflow": {"update_interval": 4}}, "gradient_accumulation_steps": 4},
     "unknown key 'zero_optimisation' in {path} (did you mean 'zero_optimization'?)"),
    ({"zenflow": {"semantics": "deepspeed"}},
     "zenflow.semantics='deepspeed' with update_interval='auto' is invalid"),
])
def test_explain_and_the_constructor_refuse_alike(tmp_path, capsys, payload, message):
    from zenflow_kernels import ZenFlowAdamW, ZenFlowConfigError
    from zenflow_kernels.config import ZenFlowConfig

    path = write(tmp_path, payload)
    message = message.format(path=path)
    assert main(["explain", path]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"error: {out.err[7:]}" and message in out.err
    assert len(out.err.strip().splitlines()) == 1 and "device_accumulation" not in out.err
    import torch

    with pytest.raises(ZenFlowConfigError) as err:
        ZenFlowAdamW([torch.nn.Parameter(torch.zeros(4, 4))], zenflow=path)
    assert str(err.value) == out.err[len("error: "):].strip()
    with pytest.raises(ZenFlowConfigError):
        ZenFlowConfig.from_dict(path)


def test_explain_lists_a_field_kept_against_semantics(tmp_path, capsys):
    path = write(tmp_path, {"zero_optimization": {"stage": 2, "zenflow": {
        "update_interval": 4, "select_strategy": "step", "select_interval": 8, "semantics": "deepspeed",
        "reselect_state": "carry"}}})
    assert main(["explain", path, "--steps", "8"]) == 0
    out = capsys.readouterr()
    assert "warnings:\n  - zenflow: semantics='deepspeed' fills the fields not set" in out.out
    assert "reselect_state='carry' (DeepSpeed's: 'reset')" in out.out and "warnings:\n  none" not in out.out
    assert "reselect_state = 'carry'" in out.out and "vector_state = 'reset'" in out.out
    assert out.err == ""  # (the report says it, once)


# -- plan's arguments ---------------------------------------------------------------------------------------------


def test_plan_counts_take_integral_floats_alike():
    from zenflow_kernels.__main__ import _build_parser

    args = _build_parser().parse_args(["plan", "--params", "7e9", "--vector-params", "1e6", "--device-step-ms", "9",
                                       "--probe-params", "1e6", "--update-interval", "4.0"])
    assert (args.params, args.vector_params, args.probe_params, args.update_interval) == (7 * 10**9, 10**6, 10**6, 4)
    assert all(type(v) is int for v in (args.params, args.vector_params, args.probe_params, args.update_interval))
    args = _build_parser().parse_args(["plan", "--params", "7000000000", "--device-step-ms", "9",
                                       "--probe-params", "1000000"])
    assert (args.params, args.probe_params) == (7 * 10**9, 10**6)


@pytest.mark.parametrize("argv, message", [
    (["--params", "1e30", "--device-step-ms", "9"], "argument --params: '1e30' is too large: allowed at most 1e+13"),
    (["--params", "7.5", "--device-step-ms", "9"], "argument --params: '7.5' is not a whole number of parameters"),
    (["--params", "7e9", "--vector-params", "0.5", "--device-step-ms", "9"], "argument --vector-params: '0.5' is not "
                                                                            "a whole number"),
    (["--params", "7e9", "--vector-params", "2e13", "--device-step-ms", "9"], "'2e13' is too large"),
    (["--params", "7e9", "--device-step-ms", "9", "--probe-params", "1e6.5"], "argument --probe-params: '1e6.5' is "
                                                                             "not an integer"),
    (["--params", "7e9", "--device-step-ms", "9", "--probe-params", "4096.5"], "argument --probe-params: '4096.5' is "
                                                                              "not an integer (allowed e.g. 4096"),
    (["--params", "7e9", "--device-step-ms", "9", "--probe-params", "1e3"], "argument --probe-params: '1e3' must be "
                                                                           "an integer >= 4096"),
    (["--params", "7e9", "--device-step-ms", "9", "--update-interval", "0"], "'0' must be an integer >= 1"),
    (["--params", "7e9", "--device-step-ms", "9", "--tokens-per-step", "4096"],
     "--tokens-per-step 4096 needs --device-tflops"),
    (["--params", "nan", "--device-step-ms", "9"], "argument --params: 'nan' must be a finite number > 0"),
])
def test_plan_refuses_with_one_line_naming_the_argument(capsys, argv, message):
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # (argparse's own errors)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
