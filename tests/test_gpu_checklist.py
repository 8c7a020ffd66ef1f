"""tests/gpu_checklist.py, the CUDA path's checklist for a lent GPU (bench/gpu_suite.sh stage 1b), run on CPU.

On CPU the same rows run with the asynchronous CPU link against the synchronous one: every row passes, and a row
fails when the bug it exists to catch is put back (a link holding a step's gradients past ``zero_grad``, copies
read before they ran, ``close()`` not landing the update in flight).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import gpu_checklist as checklist
import pytest
import torch

from zenflow_kernels import ZenFlowAdamW, link
from zenflow_kernels.host import HostShard

REPO = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as gpu_suite.sh: the default backend


pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


@pytest.fixture
def dev():
    return checklist.Device(torch.device("cpu"), quick=True)


@pytest.mark.subprocess
@pytest.mark.ranks
def test_every_row_passes_on_cpu_and_the_json_says_what_was_measured(tmp_path):
    """The whole script in a fresh process, as gpu_suite.sh runs it (the ZeRO row starts 2 ranks of its own)."""
    proc = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-m", "tests.gpu_checklist", "--device",
                           "cpu", "--quick", "--out", str(tmp_path)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_checklist_cpu.json").read_text())
    rows = result["rows"]
    assert list(rows) == list(checklist.CHECKS) and all(r["ok"] is True for r in rows.values()), rows
    assert rows["memory"]["handover"] == "on" and len(rows["memory"]["held_after_zero_grad"]) == 6
    assert rows["slow_d2h"]["steps_bit_identical"] == [True] * 7 and rows["slow_d2h"]["d2h_bytes_in_backward"] > 0
    assert rows["grad_scaler"]["step0_skipped"] and rows["grad_scaler"]["scales"][0] == 2.0**15
    assert rows["pinned"]["d2h_destinations"] > 0 and rows["pinned"]["fetch_destinations"] > 0
    assert rows["close_during_update"]["update_in_flight"]
    zero = rows["zero"]
    assert [r["rank"] for r in zero["ranks"]] == [0, 1] and zero["ranks_equal"]
    assert zero["ranks"][0]["profiled_events"] > 0 and zero["context_on_gpu0"] == "skipped: CPU"
    trace = json.loads((tmp_path / "zero_boundary_trace.json").read_text())
    assert trace["traceEvents"]
    # without a GPU the CUDA run refuses clearly
    proc = subprocess.run([sys.executable, "-m", "tests.gpu_checklist", "--out", str(tmp_path / "gpu")], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=120)
    if not torch.cuda.is_available():
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout


def test_the_memory_row_fails_when_the_link_holds_a_steps_gradients(dev, tmp_path, monkeypatch):
    """The bug of the CUDA engine before issue 32: a copy job's sources kept until the next job."""
    held = []
    original = link.ThreadEngine.d2h

    def keeping(engine, copies):
        held[:] = [src for _, src in copies] or held
        original(engine, copies)

    monkeypatch.setattr(link.ThreadEngine, "d2h", keeping)
    row = checklist.check_memory(dev, tmp_path)
    assert not row["ok"] and row["worst_difference_bytes"] > 0 and row["held_reference"] == [0] * 6


def test_the_slow_d2h_row_fails_when_copies_are_read_before_they_ran(dev, tmp_path, monkeypatch):
    """The step's completion for every gradient copy taken as done at once: the fold reads a landing area the
    delayed copies have not written. Each copy step() queues is held until a fold has run after it (at most 5 s),
    so a fold reads what no copy wrote yet on any machine: random delays alone left the order a race the fold could
    win or lose (on a loaded CI machine the copies once ran first and the row passed). The hooks' copies are not
    held: on CPU the end of backward waits for them, as a GPU's compute stream would."""

    class Done:
        def wait(self, *a, **k):
            return None

        def done(self):
            return True

    folds, finished, in_step = threading.Condition(), [0], [False]
    original_fold, original_d2h = HostShard.fold, link.ThreadEngine.d2h
    original_accumulate = link.AsyncLink.accumulate

    def counted_fold(host, *args, **kwargs):
        original_fold(host, *args, **kwargs)
        with folds:
            finished[0] += 1
            folds.notify_all()

    def held_d2h(engine, copies):
        if copies and in_step[0]:
            queued_after = finished[0]

            def until_a_fold_ran():
                with folds:
                    folds.wait_for(lambda: finished[0] > queued_after, timeout=5.0)

            engine.behind_d2h(until_a_fold_ran)
        original_d2h(engine, copies)

    def accumulate(self, *args, **kwargs):
        in_step[0] = True
        try:
            return original_accumulate(self, *args, **kwargs)
        finally:
            in_step[0] = False

    monkeypatch.setattr(link.ThreadEngine, "d2h_marker", lambda engine: Done())
    monkeypatch.setattr(link.ThreadEngine, "d2h", held_d2h)
    monkeypatch.setattr(link.AsyncLink, "accumulate", accumulate)
    monkeypatch.setattr(HostShard, "fold", counted_fold)
    try:
        row = checklist.check_slow_d2h(dev, tmp_path)
    except Exception as exc:  # a wait the protocol needs may also surface as an error: caught either way
        row = dict(ok=False, error=repr(exc))
    assert not row["ok"], row
    assert "error" in row or not all(row["steps_bit_identical"]), row  # the weights, not only the hand-over


def test_the_close_row_fails_when_close_drops_the_update_in_flight(dev, tmp_path, monkeypatch):
    original = ZenFlowAdamW.close

    def dropping(opt):
        monkeypatch.setattr(opt, "flush", lambda: None)
        original(opt)

    monkeypatch.setattr(ZenFlowAdamW, "close", dropping)
    row = checklist.check_close_during_update(dev, tmp_path)
    assert row["update_in_flight"] and not row["bit_identical"] and not row["ok"]


def test_inside_buffers_checks_the_whole_destination():
    base = torch.zeros(16)
    buffers = [(base.data_ptr(), 64)]
    assert checklist.inside_buffers(base[4:8], buffers) and checklist.inside_buffers(base, buffers)
    assert not checklist.inside_buffers(torch.zeros(4), buffers)
    bigger = torch.zeros(32)
    assert not checklist.inside_buffers(bigger, [(bigger.data_ptr(), 64)])  # runs past the buffer's end
