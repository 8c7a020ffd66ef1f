"""The planner (zenflow_kernels.planner, ``python -m zenflow_kernels plan``): its model worked by hand on round
numbers, its host memory against a built optimizer's ``host_bytes()``, its probe and its command line. Its
predictions against the modeled device are bench/plan.py's (bench/results/plan_cpu.json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW, rules
from zenflow_kernels.planner import HostProbe, host_bytes_per_param, predict, probe_host, state_bytes_per_param
from zenflow_kernels.testing import chaos

REPO = Path(__file__).resolve().parents[1]
# 10 ns a parameter to update beside the steps (8 alone), 2 to fold: a million parameters take 10 (8) ms and 2 ms
PROBE = HostProbe(update_s_per_param=10e-9, accumulate_s_per_param=2e-9, step_work_s_per_param=1e-9,
                  update_alone_s_per_param=8e-9, threads=2, params=1 << 22, grad_dtype="bfloat16")
SLOW_FOLDS = HostProbe(10e-9, 5e-9, 0.0, 10e-9, 2, 1, "bf16")
MS = 1e-3


def plan(**kwargs):
    args = dict(matrix_params=10**6, device_step_s=10 * MS, d2h_bytes_per_s=1e9, probe=PROBE, topk_ratio=0.0,
                handover="step", state_bytes=8)
    return predict(**{**args, **kwargs})


@pytest.mark.parametrize("kwargs, sync_ms, zenflow_ms, hiding", [
    # crossing 2 ms (2 MB at 1 GB/s, at step()), folds 2 ms inside the 12 ms step, update 8 ms alone (10 beside
    # the steps), write-back 2 ms; synchronous offload: 2 + 8 + 2 every step
    (dict(update_interval=4, overlap_step=False), 12, 2 + (8 + 2) / 4, 1),
    # the update (and last fold) within 48 ms; the write-back beside the next crossing
    (dict(update_interval=4, overlap_step=True), 12, 2, 1),
    (dict(update_interval=1, overlap_step=True, device_step_s=1 * MS), 12, 2 + (10 + 2 - 3), 4),  # 12 ms in 3
    (dict(update_interval=2, overlap_step=True, device_step_s=1 * MS), 12, 2 + (12 - 6) / 2, 4),
    (dict(update_interval=4, overlap_step=True, topk_ratio=0.5), 12, 2, 1),  # half the columns written back
    # the crossing inside backward (2 < 6.7 ms): a 10 ms step, so the update needs two of them
    (dict(update_interval=4, overlap_step=False, handover="backward"), 0 + 8 + 2, (8 + 2) / 4, 2),
    (dict(update_interval=4, overlap_step=True, handover="backward"), 10, 2 / 4, 2),  # nothing to hide it behind
    (dict(update_interval=4, overlap_step=False, handover="backward", backward_share=0.1), 1 + 10, 1 + 10 / 4, 2),
    # folds slower than a step (5 ms against 1 + 2): 2 ms a step waited; the update and the last fold, 15 ms, in
    # intervals of 5 ms steps
    (dict(update_interval=4, overlap_step=True, device_step_s=1 * MS, probe=SLOW_FOLDS), 2 + 2 + 10 + 2, 2 + 2, 3),
])
def test_the_model_worked_by_hand(kwargs, sync_ms, zenflow_ms, hiding):
    got = plan(**kwargs)
    assert got.sync_offload_stall_s == pytest.approx(sync_ms * MS)
    assert got.zenflow_stall_s == pytest.approx(zenflow_ms * MS)
    assert got.smallest_hiding_update_interval == hiding


@pytest.mark.parametrize("kwargs, zenflow_ms, limit", [
    # device_accumulation: no per-step crossing or folds; the 4 ms of fp32 sums cross beside the next 10 ms step,
    # then the 10 ms update, inside the 40 ms window; only the 2 ms write-back (nothing crossing beside it) stays
    (dict(device_accumulation=True), 2 / 4, "write_back"),
    (dict(device_accumulation=True, overlap_step=False), (4 + 8 + 2) / 4, "update"),  # sums, update alone, write-back
    # 1 ms steps: the next step waits 3 ms for the sums; the update then has 4 + 3 ms of window for 4 + 10 ms of work
    (dict(device_accumulation=True, device_step_s=1 * MS), (3 + 7 + 2) / 4, "update"),
    # on disk at 1 GB/s: 24 bytes a parameter (master and moments read and written) take 24 ms, more than the 10 ms
    # of compute; hidden in 4 steps of 12 ms (with the last 2 ms fold), not in 2
    (dict(nvme_bytes_per_s=1e9), 2, "crossing"),
    (dict(nvme_bytes_per_s=1e9, update_interval=2), 2 + (24 + 2 - 24) / 2, "crossing"),
    (dict(nvme_bytes_per_s=1e9, update_interval=2, device_step_s=5 * MS), 2 + (24 + 2 - 14) / 2, "disk"),
    # four host threads where the probe had two: the update takes 5 ms and a fold 1 ms (linear in the threads)
    (dict(host_threads=4, update_interval=1, device_step_s=1 * MS), 2 + (5 + 1 - 3), "update"),
    (dict(host_threads=1, update_interval=1, device_step_s=1 * MS), 2 + 1 + (20 + 4 - 4), "update"),
    # a fast link and slow folds (5 ms against a 1.2 ms step): the folds set the stall
    (dict(probe=SLOW_FOLDS, d2h_bytes_per_s=1e10, device_step_s=1 * MS), 0.2 + 3.8 + 0, "folds"),
])
def test_the_new_lanes_worked_by_hand(kwargs, zenflow_ms, limit):
    got = plan(**{"update_interval": 4, "overlap_step": True, **kwargs})
    assert got.zenflow_stall_s == pytest.approx(zenflow_ms * MS)
    assert got.limit == limit and got.remedy  # the remedy names the setting
    assert got.sync_offload_stall_s > 0


def test_the_limit_names_device_accumulation_where_folds_stall_and_it_removes_them():
    slow = plan(probe=SLOW_FOLDS, d2h_bytes_per_s=1e10, device_step_s=1 * MS, update_interval=8)
    assert slow.limit == "folds" and "device_accumulation=True" in slow.remedy
    fixed = plan(probe=SLOW_FOLDS, d2h_bytes_per_s=1e10, device_step_s=1 * MS, update_interval=8,
                 device_accumulation=True)
    assert fixed.zenflow_lanes["fold_excess_s"] == 0 and fixed.zenflow_stall_s < slow.zenflow_stall_s


def test_disk_and_device_accumulation_change_the_host_bytes():
    plain, disk = plan(), plan(nvme_bytes_per_s=1e9)
    assert plain.host_bytes - disk.host_bytes == (4 + 8) * 10**6 and disk.disk_bytes == 12 * 10**6
    # one fp32 buffer for the sums instead of two (overlap), no landing area
    assert plan(device_accumulation=True).host_bytes == plain.host_bytes - (4 + 2) * 10**6


def test_no_interval_hides_an_update_slower_than_64_steps():
    fast_folds = HostProbe(10e-9, 0.0, 0.0, 10e-9, 2, 1, "bf16")  # (folds slower than a step lengthen the window)
    assert plan(device_step_s=1e-5, d2h_bytes_per_s=1e15, probe=fast_folds).smallest_hiding_update_interval is None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(matrix_params=-1), "matrix_params=-1 is invalid"),
    (dict(matrix_params=1.5), "matrix_params=1.5 is invalid"),
    (dict(device_step_s=0), "device_step_s=0 is invalid"),
    (dict(d2h_bytes_per_s=float("nan")), "d2h_bytes_per_s=nan is invalid"),
    (dict(topk_ratio=1.5), "topk_ratio=1.5 is invalid"),
    (dict(update_interval=0), "update_interval=0 is invalid"),
    (dict(handover="hooks"), "handover='hooks' is invalid: allowed 'backward' or 'step'"),
    (dict(nvme_bytes_per_s=0), "nvme_bytes_per_s=0 is invalid: allowed None or a number > 0"),
    (dict(host_threads=0), "host_threads=0 is invalid"),
    (dict(device_accumulation=1), "device_accumulation=1 is invalid"),
])
def test_bad_arguments_name_the_argument(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        plan(**kwargs)


@pytest.mark.parametrize("device_accumulation", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_host_bytes_per_param_is_what_the_optimizer_allocates(overlap, asynchronous, device_accumulation):
    """Against ``host_bytes()`` of a built optimizer: the asynchronous link (as on a GPU) has a landing area, except
    with ``device_accumulation``, whose sums land in one fp32 buffer (with or without overlap)."""
    params = [torch.nn.Parameter(torch.randn(64, 256).to(torch.bfloat16))]
    zen = dict(topk_ratio=0.25, update_interval=2, overlap_step=overlap, select_strategy="step", select_interval=4,
               device_accumulation=device_accumulation)
    with chaos(seed=0, max_delay=0) if asynchronous else torch.no_grad():
        opt = ZenFlowAdamW(params, zenflow=zen)
    with opt:
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        measured = opt.host_bytes()
    want = host_bytes_per_param(state_bytes=state_bytes_per_param(rules.AdamW()), overlap_step=overlap,
                                on_gpu=asynchronous, device_accumulation=device_accumulation)
    assert measured["total"] == want * params[0].numel(), measured
    if device_accumulation:
        assert want == 4 + 8 + 4 + 2
    else:
        assert want == 4 + 8 + (8 if overlap else 4) + 2 + (2 if asynchronous else 0)


def test_the_probe_measures_this_hosts_passes():
    probe = probe_host(rules.AdamW(), params=1 << 16, seconds=0.2)
    assert probe.params == 1 << 16 and probe.threads >= 1 and probe.grad_dtype == "bfloat16"
    assert 0 < probe.accumulate_s_per_param < 1e-6 and 0 < probe.update_s_per_param < 1e-6
    with pytest.raises(ValueError, match="params=100 is invalid"):
        probe_host(rules.AdamW(), params=100)
    for bad in (-0.001, float("nan"), "0.02", True):
        with pytest.raises(ValueError, match=r"pause_s=.* is invalid: allowed None or a number >= 0"):
            probe_host(rules.AdamW(), params=1 << 16, pause_s=bad)


def test_the_probe_pauses_as_told_between_steps(monkeypatch):
    """``pause_s``: every pause between the overlapped probe's steps is that long (the default: a third of the last
    update, which varies)."""
    import threading

    import zenflow_kernels.planner as planner_module

    pauses = []
    real_sleep = planner_module.time.sleep

    def sleep(seconds):  # the training thread's pauses only (the copy threads sleep through the same module)
        if threading.current_thread() is threading.main_thread():
            pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(planner_module.time, "sleep", sleep)
    probe_host(rules.AdamW(), params=1 << 14, seconds=0.1, pause_s=0.003)
    assert len(pauses) >= 12 and pauses[0] == 0.0 and set(pauses[1:]) == {0.003}, pauses


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "zenflow_kernels", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_command_line_prints_the_plan():
    proc = run_cli("--params", "7e9", "--device-step-ms", "900", "--pcie-gbps", "25", "--probe-seconds", "0.2",
                   "--probe-params", "65536")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for fragment in ("this host: update", "synchronous offload stall:", "ZenFlow stall:",
                     "smallest update_interval that hides the host update", "host memory: 156.5 GiB (24 bytes"):
        assert fragment in out, out


def test_the_command_line_plans_the_new_lanes():
    proc = run_cli("--params", "7e9", "--device-step-ms", "900", "--probe-seconds", "0.2", "--probe-params", "65536",
                   "--device-accumulation", "--state-dtype", "bf16", "--nvme-gbps", "6", "--host-cores", "32",
                   "--ranks-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # master 4 and bf16 moments 4 on disk; on the host the bf16 copy-out (the sums are fetched from the device)
    for fragment in ("sums' crossing", "disk", "what limits the step:", "host memory: 13.0 GiB (2 bytes",
                     "on disk 52.2 GiB", "host worker threads: 8 (32 cores x 0.5 / 2 rank(s))"):
        assert fragment in out, out


@pytest.mark.parametrize("args, fragment", [
    (["--params", "1e6", "--device-tflops", "100"], "--device-tflops needs --tokens-per-step"),
    (["--params", "1e6", "--device-step-ms", "10", "--ranks-per-node", "2"], "--ranks-per-node 2 needs --host-cores"),
    (["--params", "1e6", "--device-step-ms", "10", "--host-cores", "8", "--pt-reserved-cores-perc", "1"],
     "--pt-reserved-cores-perc 1.0 is invalid"),
    (["--params", "-5", "--device-step-ms", "10"], "'-5' must be a finite number > 0"),
    (["--params", "1e6", "--device-step-ms", "10", "--topk-ratio", "2"], "--topk-ratio 2.0 is invalid"),
    (["--params", "1e6"], "one of the arguments --device-step-ms --device-tflops is required"),
])
def test_bad_command_lines_are_one_line_errors(args, fragment):
    proc = run_cli(*args)
    assert proc.returncode == 2 and fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr


@pytest.mark.bench
def test_the_validation_benchmark_runs_quick(tmp_path):
    """bench.plan --quick: every configuration measured and predicted (the structure; the agreement is the committed
    full run's, bench/results/plan_cpu.json)."""
    proc = subprocess.run([sys.executable, "-m", "bench.plan", "--quick", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "plan_cpu.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert names == ["sync_offload", "zenflow_no_overlap", "zenflow_overlap_hidden", "zenflow_overlap_short",
                     "zenflow_overlap_hidden_ui8", "device_accumulation", "device_accumulation_no_overlap",
                     "bf16_state_overlap_short", "bf16_state_no_overlap", "nvme_overlap_short", "nvme_no_overlap"]
    assert result["nvme_bytes_per_s"] > 0
    for r in result["rows"]:
        assert r["measured_stall_s"] > -r["compute_s"] and r["predicted_stall_s"] >= 0, r
        assert r["within"] == (abs(r["error_s"]) <= max(0.002, 0.2 * abs(r["measured_stall_s"]))), r
        assert r["host_bytes"] == r["predicted_host_bytes"], r
    assert result["record"]["command"].startswith("python -m bench.plan --quick")


def test_the_planner_is_public():
    import zenflow_kernels

    assert zenflow_kernels.planner.predict is predict and "planner" in zenflow_kernels.__all__


def test_the_planner_docs_quote_the_committed_validation():
    """docs/planner.md's figures of the validation run: its number of configurations, the disk probe's rate and the
    update time it implies, all within the goal (bench/results/plan_cpu.json)."""
    result = json.loads((REPO / "bench" / "results" / "plan_cpu.json").read_text())
    # (the figures' annotations, which tools/docs_results.py checks too, left out)
    text = re.sub(r"<!--=.*?-->", "", " ".join((REPO / "docs" / "planner.md").read_text().split()))
    words = {9: "Nine", 10: "Ten", 11: "Eleven", 12: "Twelve"}
    assert f"{words[len(result['rows'])]} configurations on 2^22 bf16" in text
    rate = result["nvme_bytes_per_s"]
    assert f"{rate / 1e9:.2f} GB/s in the committed run" in text
    update_ms = 2 * 12 * result["params"] / rate * 1e3
    assert f"a {result['params'] / 1e6:.0f}M-parameter update of {update_ms:.0f} ms" in text
    assert result["params"] == 1 << 22 and result["all_within"]
    assert {r["name"] for r in result["rows"]} >= {"nvme_overlap_short", "nvme_no_overlap"}
