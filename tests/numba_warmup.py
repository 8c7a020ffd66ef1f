"""Compile and cache the numba kernels the suite uses, once, before pytest-xdist starts its workers (conftest.py).

numba's on-disk cache is not safe to fill from several processes at once (numba/numba#4807): two processes that
compile *different* signatures of one kernel at the same time each number their new entry after the index they
loaded, so one entry's file can be overwritten with another signature's machine code, and a later process loads
it (SIGSEGV, or wrong results). From a fresh clone, two pytest workers and their rank processes would otherwise
do exactly that. Here every signature the suite compiles is compiled before any worker starts:

1. the signatures recorded in ``numba_signatures.json`` (kernel -> argument types), compiled with
   ``dispatcher.compile`` by one process per CPU, each owning whole kernels (a kernel's entries are only ever
   written by one process at a time);
2. then, in this process, the optimizer's own paths (every dtype, link and accumulation mode): a signature the
   record misses (a kernel changed since it was written) is compiled here, still before the workers start.

``python tests/numba_warmup.py --record`` rewrites the record from the cache after a full ``make test`` in a clean
clone (do it when a kernel's arguments or the tests' dtype sweeps change). A signature that no longer compiles is
reported and skipped; one the record misses is compiled by step 2 if the optimizer uses it, else by the test that
does, as before the record (with the race back for it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

RECORD = Path(__file__).with_name("numba_signatures.json")
_ARRAY = re.compile(r"array\((\w+), (\d)d, (\w)\)")
_SCALARS = {"bool": "boolean", "none": "none"}


def recorded_signatures(cache_dir: Path) -> dict[str, list[list[str]]]:
    """kernel name -> the argument types (numba's spelling) of every entry in numba's cache index files."""
    out: dict[str, list[list[str]]] = {}
    for index in sorted(cache_dir.glob("*.nbi")):
        kernel = index.name.split(".")[1].rsplit("-", 1)[0]
        with open(index, "rb") as f:
            pickle.load(f)  # numba's version
            _, overloads = pickle.loads(f.read())
        out[kernel] = sorted([str(t) for t in key[0]] for key in overloads)
    return out


def dumps(record: dict[str, list[list[str]]]) -> str:
    """The record as JSON, one signature a line."""
    kernels = [f" {json.dumps(name)}: [\n" + ",\n".join(f"  {json.dumps(sig)}" for sig in sigs) + "\n ]"
               for name, sigs in sorted(record.items())]
    return "{\n" + ",\n".join(kernels) + "\n}\n"


def numba_type(spelling: str):
    from numba.core import types

    if m := _ARRAY.fullmatch(spelling):
        return types.Array(getattr(types, m[1]), int(m[2]), m[3])
    return getattr(types, _SCALARS.get(spelling, spelling))


def compile_recorded(kernels: list[str]) -> None:
    """Compile these kernels' recorded signatures (a worker of :func:`warm`)."""
    from zenflow_kernels.cpu_ops.kernels import all_kernels

    record = json.loads(RECORD.read_text())
    dispatchers = all_kernels()
    for name in kernels:
        dispatcher = dispatchers.get(name)
        for signature in record[name]:
            try:
                dispatcher.compile(tuple(numba_type(t) for t in signature))
            except Exception as e:  # a kernel renamed or its arguments changed since the record
                print(f"numba_warmup: skipped {name}{tuple(signature)}: {type(e).__name__}: {str(e)[:200]}",
                      file=sys.stderr)


def split(record: dict[str, list], parts: int) -> list[list[str]]:
    """Whole kernels into ``parts`` groups of about equal signature counts (largest first)."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for name in sorted(record, key=lambda n: -len(record[n])):
        k = sizes.index(min(sizes))
        groups[k].append(name)
        sizes[k] += len(record[name])
    return [g for g in groups if g]


def optimizer_paths() -> None:
    import torch

    from zenflow_kernels import ZenFlow, ZenFlowAdamW, cpu_ops, rules
    from zenflow_kernels.config import ZenFlowWarning
    from zenflow_kernels.ops import use_backend
    from zenflow_kernels.testing import chaos

    torch.manual_seed(0)
    with warnings.catch_warnings(), use_backend("numba"):  # (the CPU fast path's numba kernels too)
        warnings.simplefilter("ignore", ZenFlowWarning)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # every copy-out and gradient dtype through the host update, accumulation, the fused last gradient,
            # clipping (sum of squares), the selective CPU fast path, fingerprints on the asynchronous link
            for settings in (dict(overlap_step=False), dict(overlap_step=True), dict(device_accumulation=True)):
                for asynchronous in (False, True):
                    params = [torch.nn.Parameter(torch.randn(64, 1100).to(dtype)), torch.nn.Parameter(
                        torch.randn(64).to(dtype))]
                    zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=2, update_interval=2,
                               full_warm_up_rounds=1, **settings)
                    with chaos(seed=0, max_delay=0) if asynchronous else contextlib.nullcontext():
                        opt = ZenFlowAdamW(params, zenflow=zen, max_grad_norm=1.0)
                    with opt:
                        for _ in range(4):
                            for p in params:
                                p.grad = torch.randn_like(p)
                            opt.step()
            with tempfile.TemporaryDirectory() as folder:  # the state on disk: the streamed update
                params = [torch.nn.Parameter(torch.randn(64, 1100).to(dtype))]
                zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=2, update_interval=2,
                           offload_device="nvme", nvme_path=folder, overlap_step=True)
                with ZenFlowAdamW(params, zenflow=zen) as opt:
                    for _ in range(3):
                        params[0].grad = torch.randn_like(params[0])
                        opt.step()
            x = torch.randn(1000).to(dtype)
            cpu_ops.sum_squares(x)
            # the other update rules' host kernels, with fp32 and bf16 state
            for rule in (rules.Adam(), rules.Lion(), rules.SGD(momentum=0.9), rules.SGD(),
                         rules.AdamW(state_dtype=torch.bfloat16), rules.Lion(state_dtype=torch.bfloat16),
                         rules.SGD(momentum=0.9, state_dtype=torch.bfloat16),
                         *(rule(state_dtype=torch.bfloat16, state_rounding="stochastic")
                           for rule in (rules.AdamW, rules.Lion, lambda **kw: rules.SGD(momentum=0.9, **kw)))):
                params = [torch.nn.Parameter(torch.randn(64, 1100).to(dtype))]
                zen = dict(topk_ratio=0.25, select_strategy="step", select_interval=2, update_interval=1,
                           overlap_step=False)
                with ZenFlow(params, rule, zenflow=zen) as opt:
                    for _ in range(2):
                        params[0].grad = torch.randn_like(params[0])
                        opt.step()


def warm() -> None:
    t0 = time.perf_counter()
    if RECORD.exists():
        record = json.loads(RECORD.read_text())
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        procs = [subprocess.Popen([sys.executable, __file__, "--kernels", *group])
                 for group in split(record, max(1, cpus))]
        if any(p.wait() for p in procs):
            raise SystemExit("numba_warmup: a compile process failed")
    t1 = time.perf_counter()
    optimizer_paths()
    print(f"numba_warmup: recorded signatures {t1 - t0:.0f} s, optimizer paths {time.perf_counter() - t1:.0f} s",
          file=sys.stderr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help="write numba_signatures.json from the kernels' cache")
    ap.add_argument("--kernels", nargs="+", help="(internal) compile these kernels' recorded signatures")
    args = ap.parse_args(argv)
    if args.record:
        from zenflow_kernels.cpu_ops import kernels

        record = recorded_signatures(Path(kernels.__file__).parent / "__pycache__")
        RECORD.write_text(dumps(record))
        print(f"wrote {RECORD}: {sum(map(len, record.values()))} signatures of {len(record)} kernels")
    elif args.kernels:
        compile_recorded(args.kernels)
    else:
        warm()


if __name__ == "__main__":
    main()
