"""Several ranks on one node share out its cores (issue 34): each local rank's host worker runs on cores no other
local rank's host worker uses, when the launcher (torchrun) leaves every rank the whole node.

Ranks are processes started as torchrun starts them (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE), ZeRO-1 over
gloo, ``pt_reserved_cores_perc=0.5``: 2 ranks on this machine's real CPUs (the host worker's affinity read back
from /proc), and 2 and 4 ranks on a pretend node of 8 cores x 2 SMT threads (tests/cores_worker.py). The share
itself is tested in tests/test_cpu_ops_cores.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow_kernels.testing import free_port

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "cores_worker.py"


def launch(world: int, tmp_path: Path, pretend: int, timeout: float = 180.0) -> list[dict]:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(pretend)], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        errors = [err for p in procs for _, err in [p.communicate(timeout=timeout)] if p.returncode]
    finally:
        for p in procs:
            p.kill()
    assert not errors, errors[0][-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_on_this_machine_pin_their_host_workers_apart(tmp_path):
    affinity = sorted(os.sched_getaffinity(0))
    ranks = launch(2, tmp_path, pretend=0)
    hosts = [set(r["host_thread"]) for r in ranks]
    if len(affinity) >= 2:
        assert not hosts[0] & hosts[1], hosts
    for r in ranks:
        assert set(r["host_thread"]) <= set(affinity)
        assert r["stats"]["host"] == r["host_thread"] or len(affinity) < 2
        assert "share of 2" in r["stats"]["why"] or "launcher" in r["stats"]["why"], r["stats"]
        assert any(line.startswith("cores: training") for line in r["explain"])


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_of_a_pretend_node_get_their_own_cores_then_split_them(tmp_path, world):
    """16 CPUs (8 cores, SMT pairs c and c + 8): each rank gets 8 / world whole cores, one thread per core kept,
    training the first half of them and the host worker the rest; no two ranks' host workers share a core."""
    ranks = launch(world, tmp_path, pretend=16)
    per = 8 // world
    for r in ranks:
        own = list(range(r["rank"] * per, (r["rank"] + 1) * per))
        assert r["stats"]["train"] + r["stats"]["host"] == own, r["stats"]
        assert r["stats"]["host"] == own[len(own) - len(r["stats"]["host"]):] and r["stats"]["host"]
        assert r["host_thread"] == r["stats"]["host"]
        assert f"local rank {r['rank']}'s share of {world}" in r["stats"]["why"]
    hosts = [set(r["host_thread"]) for r in ranks]
    assert all(not (a & b) for i, a in enumerate(hosts) for b in hosts[i + 1:]), hosts
