"""The examples run end to end at a tiny size, as a user runs them (a subprocess each)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the default path, as a user has it
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_custom_loop_example_trains_checkpoints_and_resumes_identically():
    proc = run_example("custom_loop.py", "--steps", "24")
    assert proc.returncode == 0, proc.stderr
    assert "trained 24 steps" in proc.stdout and "resumed from step 12: identical weights" in proc.stdout


def test_hf_trainer_example():
    pytest.importorskip("transformers")
    proc = run_example("hf_trainer.py", "--steps", "6")
    assert proc.returncode == 0, proc.stderr
    # 256 samples, batch 8, 2 accumulation steps: 16 optimizer steps an epoch
    assert "epoch length given to ZenFlow: 16 optimizer steps" in proc.stdout


def test_lightning_example():
    pytest.importorskip("lightning")
    proc = run_example("lightning_trainer.py", "--steps", "6")
    assert proc.returncode == 0, proc.stderr
    # 256 samples, batch 16: 16 optimizer steps an epoch
    assert "ZenFlow re-selects every 16 steps (one epoch)" in proc.stdout and "last.ckpt" in proc.stdout
