"""One rank of tests/test_rank_cores.py: ZeRO-1 over gloo, one step, and the CPUs its host worker runs on.

argv: OUT_DIR PRETEND. PRETEND "0": the real machine; the host worker's CPUs are read back from
/proc/self/task/<tid>/status. PRETEND "16": a node of 16 logical CPUs, 8 cores of 2 SMT threads (c, c + 8), that
each rank may run on entirely (as torchrun leaves it); the affinity calls are recorded instead of made.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from zenflow_kernels import ZenFlowAdamW, cpu_ops


def allowed_cpus(tid: int) -> list[int]:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return sorted(cpu_ops.cores._parse_cpu_list(line.split(":", 1)[1]))
    raise AssertionError("no Cpus_allowed_list")


def pretend_node(root: Path, n: int) -> dict:
    """Make the optimizer see an ``n``-CPU node; returns the affinity each thread asked for."""
    half = n // 2
    for c in range(n):
        topo = root / f"cpu{c}" / "topology"
        topo.mkdir(parents=True, exist_ok=True)
        (topo / "thread_siblings_list").write_text(f"{c % half},{c % half + half}\n")
    cpuset = root / "cpuset"
    cpuset.write_text(f"0-{n - 1}\n")
    asked: dict = {}
    os.sched_getaffinity = lambda pid: set(range(n))
    os.sched_setaffinity = lambda pid, cpus: asked.__setitem__(threading.current_thread().name, sorted(cpus))
    cpu_ops.rank_cores = functools.partial(cpu_ops.rank_cores, sysfs=root, cpusets=[cpuset])
    cpu_ops.physical_cores = functools.partial(cpu_ops.physical_cores, sysfs=root)
    return asked


def main() -> None:
    out, pretend = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    asked = pretend_node(out / f"node{rank}", pretend) if pretend else None
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    zen = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=4, overlap_step=True,
               pt_reserved_cores_perc=0.5)
    opt = ZenFlowAdamW(model.parameters(), zenflow=zen, zero_stage=1)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    host = next(w for w in opt.link.workers if w._thread.name == "zenflow-host")
    host.wait(host.submit(lambda: None))  # the worker pins itself before its first job
    result = dict(rank=rank, stats=opt.stats()["cores"], explain=opt.explain(1).splitlines())
    result["host_thread"] = asked["zenflow-host"] if pretend else allowed_cpus(host._thread.native_id)
    opt.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
