"""The same gradient gets the same selection everywhere: two ZeRO-1 ranks whose column-score kernels
run different autotune configs select identical columns on a near-tie built for it (the ranks score
their identical averaged gradients locally; a difference would silently split the replicas, or hang a
zen-auto vote). The kernel-level half (bit-identical scores under every config and row split) is in
tests/test_triton_column_scores.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zenflow_kernels.testing import free_port

pytest.importorskip("triton")

import score_determinism_worker as worker  # noqa: E402

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2




def run_ranks(tmp_path: Path, timeout: float = 240.0) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD),
           "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, worker.__file__, str(tmp_path)], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the ranks did not finish within {timeout} s (a hang)") from None
    for r, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{err[-3000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_near_tie_is_a_tie():
    """The built gradient: the two columns' sums are equal in exact arithmetic, and they share the last
    place of the top k, so only the fp32 rounding of the scores decides between them."""
    g = worker.near_tie_grad().double()
    s = (g * g).sum(0)
    a, b = worker.TIE
    assert torch.equal(torch.sort(g[:, a]).values, torch.sort(g[:, b]).values)
    rest = [c for c in range(worker.C) if c not in worker.BIG + worker.TIE]
    assert s[list(worker.BIG)].min() > s[a] > s[rest].max()


def test_zero1_ranks_on_different_configs_select_identically(tmp_path):
    results = run_ranks(tmp_path)
    assert results[0]["config"] != results[1]["config"], "the ranks must run different score configs"
    gathered = results[0]["gathered"]
    assert gathered == results[1]["gathered"] == [r["selections"] for r in results]
    first, second = gathered
    for t, (sel0, sel1) in enumerate(zip(first, second, strict=True)):
        assert sel0 == sel1, f"step {t}: rank 0 selected {sel0}, rank 1 selected {sel1}"
    last = first[-1]
    for sel in last:  # the tie sits at the boundary: the three large columns and one of the pair
        assert len(sel) == 4 and set(worker.BIG) < set(sel) and len(set(sel) & set(worker.TIE)) == 1
