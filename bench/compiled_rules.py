"""A rule written only in plain torch, compiled (``zenflow_kernels.rules.compiled``), beside the built-ins' kernels.

    python -m bench.compiled_rules [--out DIR] [--quick] [--rounds N] [--steps N] [--cold] [--wait-quiet S]

Candidates (``bench.custom_rules.make_rule``; every measurement interleaved round by round in one process, medians
over the rounds): ``lion`` and ``adamw``, the built-ins on their numba host kernels and fused fast paths (the
hand-written reference point, and one whose speed must not change); ``rmsprop_compiled``, RMSprop as a researcher
writes it (``bench.custom_rules.RMSprop``), ``compile=True``; ``rmsprop_eager``, the same with ``compile=False``
(what such a rule cost before); ``from_torch_rmsprop``, ``rules.from_torch(torch.optim.RMSprop)`` compiled (torch's
own functional step); ``lion_compiled`` and ``adamw_compiled`` (``host_pass`` and ``fast`` only), the built-ins with
their kernels taken away, their plain-torch ``step_`` compiled: the hand-written kernel or Inductor's, which is
faster where.

Sections:

* ``host``: a 4 x 1024^2 MLP (four ``Linear(1024, 1024, bias=False)``, batch 32, MSE loss) trained ``--steps``
  steps on the CPU by ``ZenFlow(topk_ratio=0.1, update_interval=4, overlap_step=True)``: the host updates' median
  (``stats()["host_update_s"]``: on the host worker, at its thread count) and the training thread's wait for the
  worker over the steps (``worker_wait_s``; ``worker_wait_in_steps_ms``: before the final ``flush()``, which waits
  for the last update whatever its speed) and the training thread's mean step (``step_ms``, forward and backward
  included: a worker that holds the GIL slows it without being waited for), each candidate's run after an untimed
  one (its compile);
* ``host_pass``: the host pass alone, ``host_step_`` over 2^22 flat fp32 elements with a bf16 copy-out, on a thread
  at the worker's numba thread count;
* ``fast``: 64 matrices of 128 x 128, ``topk_ratio=0.1`` (13 columns each), gradients fixed: the fast path's
  median per step (``stats()["fast_path_s"]``) over ``--steps`` steps after 5, in ``2 * rounds - 1`` rounds;
* ``compile``: the compile seconds this process paid for each compiled candidate (``stats()["rule_paths"]``) and
  the Inductor cache it used; with ``--cold``, two fresh processes over an empty ``TORCHINDUCTOR_CACHE_DIR`` (the
  first compiles everything, the second finds it cached);
* ``accuracy``: compiled against eager, one host step and one fast step of ``RMSprop`` on random data: the largest
  difference in ulps of the largest of each element's value before, after and its update, and absolute.

Goals (issue 55): ``rmsprop_compiled`` within 1.5x of ``lion`` on the host pass and on the fast path. Each section
records the share of the cores other processes used while it ran (``other_processes_share_of_cores``: OpenMP teams,
torch's, numba's and Inductor's, slow down by several times when another process takes a core they wait on);
``--wait-quiet S`` waits up to S seconds for quiet before each.

Results: ``compiled_rules_cpu.json`` (command, machine, versions, commit, sections) in ``bench/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench import harness
from bench.custom_rules import RMSprop, make_rule

CANDIDATES = ("lion", "adamw", "rmsprop_compiled", "rmsprop_eager", "from_torch_rmsprop")
BUILTINS_COMPILED = ("lion_compiled", "adamw_compiled")  # (the host pass and the fast path only)
GOAL = 1.5
ZEN_HOST = dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=1000, overlap_step=True)
ZEN_FAST = dict(topk_ratio=0.1, update_interval=1000, select_strategy="step", select_interval=1000,
                overlap_step=True)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def host_run(name: str, steps: int, batch: int = 32) -> dict:
    """One training run of the MLP (``host``): the host updates' median, the waits for the worker, the mean step."""
    from zenflow_kernels import ZenFlow

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)
    opt = ZenFlow(model.parameters(), make_rule(name), lr=1e-3, zenflow=ZEN_HOST)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    in_steps = opt.stats()["worker_wait_s"]  # (before the flush: the waits inside step())
    opt.flush()
    wall = time.perf_counter() - t0
    stats = opt.stats()
    opt.close()
    updates = stats["host_update_s"][1:]  # (the first: the warm-up's, on the training thread)
    return {"host_update_ms": median(updates) * 1e3, "worker_wait_ms": stats["worker_wait_s"] * 1e3,
            "worker_wait_in_steps_ms": in_steps * 1e3, "step_ms": wall / steps * 1e3,
            "host_updates": len(stats["host_update_s"]), "rule_paths": stats["rule_paths"]}


def host_section(names, steps: int, rounds: int) -> dict:
    first = {name: host_run(name, steps) for name in names}  # untimed: compiles
    rows = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            rows[name].append(host_run(name, steps))
    out = {}
    for name in names:
        keys = ("host_update_ms", "worker_wait_ms", "worker_wait_in_steps_ms", "step_ms")
        out[name] = {key: median([r[key] for r in rows[name]]) for key in keys}
        out[name].update(rounds=[{k: r[k] for k in keys[:3]} for r in rows[name]],
                         paths=rows[name][-1]["rule_paths"], first_run_paths=first[name]["rule_paths"])
    return out


def host_pass_section(names, rounds: int, numel: int) -> dict:
    import numba

    from zenflow_kernels.config import ZenFlowConfig
    from zenflow_kernels.optim.build import host_threads, split_cores

    threads = host_threads(split_cores(ZenFlowConfig.coerce(ZEN_HOST), torch.device("cpu")), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    p, acc = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    out = torch.empty(numel, dtype=torch.bfloat16)
    candidates = {}
    for name in names:
        rule = make_rule(name)
        state = [torch.rand(numel, generator=g) for _ in rule.state_names]
        candidates[name] = (rule, state, rule.hyperparams(dict(rule.group_defaults(), lr=1e-3)))
    samples = {name: [] for name in names}

    def work():
        numba.set_num_threads(threads)
        with torch.no_grad():
            for rule, state, numbers in candidates.values():  # warm (compiles)
                rule.host_step_(p, acc, state, step=2, grad_scale=4.0, out=out, zero_grad=True, **numbers)
            for _ in range(rounds):
                for name, (rule, state, numbers) in candidates.items():
                    t0 = time.perf_counter()
                    rule.host_step_(p, acc, state, step=2, grad_scale=4.0, out=out, zero_grad=True, **numbers)
                    samples[name].append(time.perf_counter() - t0)

    thread = threading.Thread(target=work)  # a thread of its own, as the host worker
    thread.start()
    thread.join()
    return {"numel": numel, "threads": threads,
            **{name: {"median_ms": median(s) * 1e3, "min_ms": min(s) * 1e3} for name, s in samples.items()}}


def fast_run(name: str, steps: int) -> dict:
    from zenflow_kernels import ZenFlow

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(128, 128, generator=g)) for _ in range(64)]
    grads = [[torch.randn(128, 128, generator=g) for _ in params] for _ in range(4)]
    opt = ZenFlow(params, make_rule(name), lr=1e-3, zenflow=ZEN_FAST)
    for t in range(steps + 5):
        for p, grad in zip(params, grads[t % 4], strict=True):
            p.grad = grad
        opt.step()
    stats = opt.stats()
    opt.close()
    return {"fast_path_ms": median(stats["fast_path_s"][5:]) * 1e3, "rule_paths": stats["rule_paths"]}


def fast_section(names, steps: int, rounds: int) -> dict:
    from zenflow_kernels.ops import use_backend

    with use_backend("numba"):
        first = {name: fast_run(name, steps) for name in names}
        rows = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:
                rows[name].append(fast_run(name, steps)["fast_path_ms"])
    return {name: {"fast_path_ms": median(rows[name]), "rounds": rows[name],
                   "paths": first[name]["rule_paths"]} for name in names}


def accuracy_section() -> dict:
    def measure(x, y, before):
        d = (x.double() - y.double()).abs()
        scale = torch.maximum(torch.maximum(x.abs(), y.abs()), before.abs()).double()  # value before, after,
        scale = torch.maximum(scale, (y.double() - before.double()).abs()).clamp_min(1e-30)  # and the update
        return {"max_ulps": float((d / (torch.finfo(torch.float32).eps * scale)).max()), "max_abs": float(d.max()),
                "differing_fraction": float((d > 0).double().mean())}

    rule = RMSprop(weight_decay=0.01, compile=True)
    g = torch.Generator().manual_seed(3)
    n = 1 << 20
    p0, s0, g0 = torch.randn(n, generator=g), torch.rand(n, generator=g), torch.randn(n, generator=g)
    runs = []
    for kernel in (rule.host_step_, rule.eager_host_step_):
        p, s = p0.clone(), s0.clone()
        kernel(p, g0.clone(), [s], step=1, grad_scale=4.0, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.01)
        runs.append((p, s))
    host = {"param": measure(runs[0][0], runs[1][0], p0), "square_avg": measure(runs[0][1], runs[1][1], s0)}
    items = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(4)
        items.append([(torch.randn(128, 128, generator=gen), torch.randn(128, 128, generator=gen),
                       torch.sort(torch.randperm(128, generator=gen)[:13]).values,
                       torch.rand(128, 13, generator=gen), None, torch.zeros(13, dtype=torch.int64), 1e-2, 0.01)
                      for _ in range(64)])
    before = [it[0].clone() for it in items[0]]
    rule.fast_step_(items[0], grad_scale=2.0, alpha=0.99, eps=1e-8)
    rule.reference_fast_step_(items[1], grad_scale=2.0, alpha=0.99, eps=1e-8)
    fast = measure(torch.cat([it[0].reshape(-1) for it in items[0]]), torch.cat([it[0].reshape(-1) for it in items[1]]),
                   torch.cat([b.reshape(-1) for b in before]))
    return {"host": host, "fast_param": fast}


def compile_child(out: str) -> None:
    """One fresh process: a compiled RMSprop's host pass and fast path, first calls timed."""
    from zenflow_kernels.rules import compiled

    rule = RMSprop(compile=True)
    t0 = time.perf_counter()
    n = 1 << 16
    p, acc, s, o = torch.randn(n), torch.randn(n), torch.rand(n), torch.empty(n, dtype=torch.bfloat16)
    rule.host_step_(p, acc, [s], step=1, grad_scale=1.0, out=o, zero_grad=True, lr=1e-3, alpha=0.99, eps=1e-8,
                    weight_decay=0.0)
    host_s = time.perf_counter() - t0
    items = [(torch.randn(64, 64), torch.randn(64, 64), torch.arange(0, 64, 8), torch.zeros(64, 8), None, 1, 1e-3,
              0.0) for _ in range(8)]
    t0 = time.perf_counter()
    rule.fast_step_(items, grad_scale=1.0, alpha=0.99, eps=1e-8)
    fast_s = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"first_host_call_s": host_s, "first_fast_call_s": fast_s,
                                     "paths": compiled.paths(rule)}))


def cold_section() -> dict:
    """Compile times in two fresh processes over one empty Inductor cache: the first compiles, the second finds it."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        for label in ("cold", "warm"):
            with tempfile.TemporaryDirectory() as tmp:
                target = Path(tmp, "r.json")
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                env.pop("TRITON_INTERPRET", None)
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "bench.compiled_rules", "--compile-child", str(target)],
                               cwd=harness.REPO, env=env, check=True, timeout=1800)
                out[label] = {"process_s": time.perf_counter() - t0, **json.loads(target.read_text())}
    return out


def ratios(section: dict, key: str) -> dict:
    base = section["lion"][key]  # (None where lion's is 0: a wait it never had)
    return {name: row[key] / base if base > 0 else None for name, row in section.items()
            if isinstance(row, dict) and key in row}


def main(argv=None) -> dict:
    ap = harness.OneLineParser(prog="python -m bench.compiled_rules", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for compiled_rules_cpu.json (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one round: checks the script runs")
    ap.add_argument("--rounds", type=harness.int_at_least(1), default=3)
    ap.add_argument("--steps", type=harness.int_at_least(4), default=20)
    ap.add_argument("--cold", action="store_true", help="also time compiling in fresh processes, cold and warm cache")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before each section, wait up to this many seconds for other processes to go quiet")
    ap.add_argument("--compile-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_child:
        compile_child(args.compile_child)
        return {}
    out_dir = harness.output_dir(args.out)
    started = time.time()
    from zenflow_kernels.rules import compiled

    rounds = 1 if args.quick else args.rounds
    steps = 9 if args.quick else args.steps  # (quick: two host updates after the first)
    names = list(CANDIDATES)
    result = {"command": None, "goal": f"rmsprop_compiled within {GOAL}x of lion (host pass, fast path)",
              "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(default)"),
              "other_processes_share_of_cores": {}}

    def section(name, fn, *a):
        if args.wait_quiet > 0:
            harness.wait_quiet(args.wait_quiet)
        load = harness.OtherLoad()
        result[name] = fn(*a)
        result["other_processes_share_of_cores"][name] = round(load.fraction(), 3)

    kernels_too = names + list(BUILTINS_COMPILED)
    section("host_pass", host_pass_section, kernels_too, 3 if args.quick else 9, 1 << (16 if args.quick else 22))
    section("host", host_section, names, steps, rounds)
    section("fast", fast_section, kernels_too, steps, 1 if args.quick else 2 * rounds - 1)
    result["accuracy"] = accuracy_section()
    result["ratios_to_lion"] = {"host_pass": {k: v["median_ms"] / result["host_pass"]["lion"]["median_ms"]
                                              for k, v in result["host_pass"].items() if isinstance(v, dict)},
                                "host_update": ratios(result["host"], "host_update_ms"),
                                "worker_wait": ratios(result["host"], "worker_wait_ms"),
                                "worker_wait_in_steps": ratios(result["host"], "worker_wait_in_steps_ms"),
                                "training_step": ratios(result["host"], "step_ms"),
                                "fast_path": ratios(result["fast"], "fast_path_ms")}
    result["compile"] = {name: {place: result["host"][name]["first_run_paths"][place].get("compile_s")
                                for place in ("host", "fast")} for name in names}
    result["compile"]["fast_path_first_run"] = {name: result["fast"][name]["paths"]["fast"].get("compile_s")
                                                for name in kernels_too}
    if args.cold:
        result["compile"]["fresh_processes"] = cold_section()
    result["entries"] = [e.label for e in compiled._entries.values()]
    result["wall_s"] = time.time() - started
    result["machine"] = harness.machine_info_light()
    path = harness.write_json_light(
        out_dir / ("compiled_rules_cpu_quick.json" if args.quick else "compiled_rules_cpu.json"), result)
    r = result["ratios_to_lion"]
    print(f"bench.compiled_rules: host pass {result['host_pass']['rmsprop_compiled']['median_ms']:.1f} ms "
          f"({r['host_pass']['rmsprop_compiled']:.2f}x lion, eager {r['host_pass']['rmsprop_eager']:.2f}x); "
          f"fast path {result['fast']['rmsprop_compiled']['fast_path_ms']:.2f} ms "
          f"({r['fast_path']['rmsprop_compiled']:.2f}x lion, eager {r['fast_path']['rmsprop_eager']:.2f}x); "
          f"-> {path}")
    return result


if __name__ == "__main__":
    main()
