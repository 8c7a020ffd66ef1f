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
