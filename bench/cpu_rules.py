"""Host update rules side by side: cpu_lion_, cpu_sgd_ (momentum 0.9), cpu_adam_ and compiled rules of one's own
against a memory roofline.

    python -m bench.cpu_rules [--out DIR] [--sizes 2^20 2^22 2^24] [--rounds N] [--retry-budget S] [--wait-quiet S]
                              [--quick]

The offloaded optimizer's use of each kernel: the gradient is the fp32 accumulation buffer, consumed and zeroed in
the same pass (``zero_grad=True``), and the updated parameter is written as a bf16 copy (``out=``) for the
host-to-device transfer. Bytes moved per element (``BYTES``):

    Lion        read p, acc, m;     write p, acc (zeroed), m;     write out (bf16)   12 + 12 + 2 = 26
    SGD (0.9)   read p, acc, buf;   write p, acc (zeroed), buf;   write out (bf16)   12 + 12 + 2 = 26
    Adam        read p, acc, m, v;  write p, acc (zeroed), m, v;  write out (bf16)   16 + 16 + 2 = 34

Beside them, the rules of one's own of ``bench.custom_rules`` (a plain-torch ``step_``, no kernel; their host pass
``UpdateRule.host_step_`` compiled by Inductor at the calling thread's numba thread count), with the same buffer,
zeroing and bf16 out (``host_bytes_per_element``: ``16 + 8 * states + 2``): ``rmsprop_compiled`` (26),
``rmsprop_eager`` (the same rule, ``compile=False``: what it cost before; 26 nominal, its temporaries move more),
``ademamix_compiled`` (AdEMAMix without schedulers, 42) and ``from_torch_rmsprop`` (torch's own step, 26). Each is
called once per size and thread count before the timed blocks (a compile: Inductor bakes the thread count into the
kernel); its rows record that first call (``first_call_s``), the compiles during the block and their seconds
(``compiles``, ``compile_s``, from ``rules.compiled.paths``), the path the calls took (``rule_path``: "compiled", or
"compiled and eager" where a rule fell back) and ``vs_lion``, its time over Lion's in the same block. Every rule
gets a step count that grows by one each call, as the optimizer's do (each custom rule its own, from 1).

Roofline: numba ``prange`` streaming passes that move the same bytes with trivial arithmetic and ordinary stores
(the multiply by ``one`` keeps LLVM from turning a loop into ``memcpy``, whose non-temporal stores would skip the
read-for-ownership that the kernels' stores pay):

* ``rmw_26`` / ``rmw_34`` / ``rmw_42``, the roofline: ``x[i] = x[i] * one`` in place over a float32 array of half
  the bytes, the way the kernels update p and state;
* ``copy_26`` / ``copy_34`` / ``copy_42``: ``dst[i] = src[i] * one``, the same nominal bytes, but on a
  write-allocate cache every line of dst is read before it is written, so it moves 1.5x that (measured: the rules
  run ~1.5x its bytes/s at 2^24). Kept as the naive reference.

Each rule's ``fraction_of_roofline`` = its bytes/s over ``rmw``'s at the same size and thread count, its
``fraction_of_copy`` the same over ``copy``'s. The kernels' bf16 out may pay a read-for-ownership (2 bytes per
element ``rmw`` does not read); on the AMD EPYC this was written on the rules measured 0.98-1.0 of ``rmw`` at 2^24 on
one thread all the same.

Timing as bench/cpu_adam.py (``measure_quietly``), at 1 and all of numba's threads; blocks disturbed by other
processes are measured again only within ``--retry-budget`` seconds of the start, so a busy machine cannot stretch
the run without end. At 2^20 elements each candidate's working set (13 to 22 MB, 27 to 44 MB for a copy) fits in or
near a 32 MB L3, warmed by the settle calls: there the fractions compare cache traffic more than DRAM's; 2^22 (56 to
92 MB) and 2^24 (225 to 370 MB) stream from DRAM.

Results: ``cpu_rules.json`` (command, machine, versions, commit, rows) and ``cpu_rules.png`` in ``bench/results``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from bench import harness
from bench.cpu_adam import measure_quietly, numpy_view, parse_size, set_threads
from bench.custom_rules import host_bytes_per_element, make_rule
from zenflow_kernels.cpu_ops.adam import cpu_adam_
from zenflow_kernels.cpu_ops.lion import cpu_lion_
from zenflow_kernels.cpu_ops.sgd import cpu_sgd_
from zenflow_kernels.rules import compiled

BYTES = {"lion": 26, "sgd": 26, "adam": 34}
CUSTOM = ("rmsprop_compiled", "rmsprop_eager", "ademamix_compiled", "from_torch_rmsprop")
LION = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.01}
SGD = {"lr": 1e-3, "momentum": 0.9, "dampening": 0.0, "nesterov": False, "weight_decay": 0.01}
ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
GRAD_SCALE = 4 * 1024.0  # interval 4, loss scale 1024: the accumulated sum's mean, unscaled


def bytes_per_element(rules: dict) -> dict:
    """Every candidate rule's bytes moved per element (``BYTES`` and the custom rules')."""
    return {**BYTES, **{name: host_bytes_per_element(rule) for name, rule in rules.items()}}


@njit(parallel=True, nogil=True, cache=True)
def _stream_rmw(x, one):
    """x = x * one (one = 1) in place: reads and writes every byte once, with ordinary stores."""
    for i in prange(x.size):
        x[i] = x[i] * one


@njit(parallel=True, nogil=True, cache=True)
def _stream_copy(dst, src, one):
    """dst = src * one (one = 1): reads src, writes dst, with ordinary stores (dst is read for ownership too)."""
    for i in prange(src.size):
        dst[i] = src[i] * one


class State:
    """The tensors of one size: p, acc and the bf16 out shared by the rules (each step only moves p a little),
    each rule's own state, and the rooflines' buffers."""

    def __init__(self, n: int, rules: dict):
        gen = torch.Generator().manual_seed(0)
        self.p = torch.randn(n, generator=gen)
        self.acc = torch.randn(n, generator=gen) * 1e-2  # zeroed by the first call: the values do not matter
        self.out = torch.empty(n, dtype=torch.bfloat16)
        self.lion_m = torch.randn(n, generator=gen) * 1e-3
        self.sgd_buf = torch.randn(n, generator=gen) * 1e-3
        self.adam_m = torch.randn(n, generator=gen) * 1e-3
        self.adam_v = torch.rand(n, generator=gen) * 1e-6
        self.step = 1
        self.rules, self.bytes = rules, bytes_per_element(rules)
        self.custom_state = {name: [torch.rand(n, generator=gen) * 1e-6 if "sq" in s or "square" in s
                                    else torch.randn(n, generator=gen) * 1e-3 for s in rule.state_names]
                             for name, rule in rules.items()}
        self.numbers = {name: rule.hyperparams(dict(rule.group_defaults(), lr=1e-3)) for name, rule in rules.items()}
        self.custom_steps = dict.fromkeys(rules, 0)
        self.rmw, self.copies = {}, {}
        for b in sorted(set(self.bytes.values())):
            half = b * n // 8  # float32 elements: b/2 bytes per element of the rule, read and written back
            self.rmw[f"rmw_{b}"] = numpy_view(torch.randn(half, generator=gen))
            self.copies[f"copy_{b}"] = (np.zeros(half, np.float32), numpy_view(torch.randn(half, generator=gen)))

    def candidates(self, k: int) -> dict:
        def lion():
            cpu_lion_(self.p, self.acc, self.lion_m, grad_scale=GRAD_SCALE, out=self.out, zero_grad=True,
                      num_threads=k, **LION)

        def sgd():
            self.step += 1  # past the buffer's first step: momentum and dampening apply
            cpu_sgd_(self.p, self.acc, self.sgd_buf, step=self.step, grad_scale=GRAD_SCALE, out=self.out,
                     zero_grad=True, num_threads=k, **SGD)

        def adam():
            self.step += 1
            cpu_adam_(self.p, self.acc, self.adam_m, self.adam_v, step=self.step, grad_scale=GRAD_SCALE, out=self.out,
                      zero_grad=True, num_threads=k, **ADAM)

        def custom(name):
            rule, state, numbers = self.rules[name], self.custom_state[name], self.numbers[name]

            def call():
                self.custom_steps[name] += 1  # its own count, from 1, as the optimizer's host updates count
                rule.host_step_(self.p, self.acc, state, step=self.custom_steps[name], grad_scale=GRAD_SCALE,
                                out=self.out, zero_grad=True, **numbers)

            return call

        one = np.float32(1.0)
        out = {"lion": lion, "sgd": sgd, "adam": adam, **{name: custom(name) for name in self.rules}}
        for name, x in self.rmw.items():
            out[name] = lambda x=x: _stream_rmw(x, one)
        for name, (dst, src) in self.copies.items():
            out[name] = lambda dst=dst, src=src: _stream_copy(dst, src, one)
        return out

    def bytes_of(self, candidate: str, n: int) -> int:
        if candidate in self.bytes:
            return self.bytes[candidate] * n
        if candidate in self.rmw:
            return 2 * self.rmw[candidate].nbytes
        dst, src = self.copies[candidate]
        return dst.nbytes + src.nbytes


def measure(state: State, n: int, k: int, rounds: int, attempts: int, deadline: float) -> list[dict]:
    """One interleaved block of every candidate at n elements and k threads (``measure_quietly``: redone after
    waiting up to 15 s for quiet, only before ``deadline``), each compiled rule compiled before it. The copies run at
    numba's thread count, the rules take k."""
    set_threads(k)
    candidates = state.candidates(k)
    before = {name: compiled.paths(rule)["host"] for name, rule in state.rules.items()}
    first_call = {}
    for name, fn in candidates.items():  # compile (or load from the cache) outside the timed blocks
        t0 = time.perf_counter()
        fn()
        first_call[name] = time.perf_counter() - t0
        rule = state.rules.get(name)
        # a rule whose compiled step reads a number as a constant compiles again at each new step count, up to
        # MAX_COMPILES, then runs eager: here, not in the timed blocks (its rows then say "compiled and eager")
        for _ in range(compiled.MAX_COMPILES if rule is not None else 0):
            compiles = compiled.paths(rule)["host"]["compiles"]
            fn()
            if compiled.paths(rule)["host"]["compiles"] == compiles:
                break
    timings, calls, other, attempt = measure_quietly(candidates, n, k, rounds, attempts, wait_s=15, deadline=deadline)
    rows = []
    for name, t in timings.items():
        nbytes = state.bytes_of(name, n)
        rows.append({"size": n, "threads": k, "candidate": name, "bytes_per_element": nbytes / n, **t.as_row(),
                     "calls_per_round": calls, "melements_per_s": n / t.median / 1e6, "gbps": nbytes / t.median / 1e9,
                     "other_processes_cpu_fraction": other, "attempts": attempt})
    by = {r["candidate"]: r for r in rows}
    for r in rows:
        name = r["candidate"]
        if name in state.rules:
            after = compiled.paths(state.rules[name])["host"]
            r.update(rule_path=after["path"], first_call_s=first_call[name],
                     compiles=after["compiles"] - before[name]["compiles"],
                     compile_s=after["compile_s"] - before[name]["compile_s"],
                     vs_lion=r["median_s"] / by["lion"]["median_s"])
        roof = by.get(f"rmw_{state.bytes[name]}") if name in state.bytes else None
        if roof is not None:
            r["roofline"] = roof["candidate"]
            r["roofline_gbps"] = roof["gbps"]
            r["fraction_of_roofline"] = r["gbps"] / roof["gbps"]
            r["fraction_of_copy"] = r["gbps"] / by[f"copy_{state.bytes[name]}"]["gbps"]
    return rows


COLORS = {"lion": "C0", "sgd": "C1", "adam": "C2", "rmsprop_compiled": "C3", "rmsprop_eager": "C4",
          "ademamix_compiled": "C6", "from_torch_rmsprop": "C8", "rmw_26": "0.45", "rmw_34": "k", "rmw_42": "0.7",
          "copy_26": "C7", "copy_34": "C5", "copy_42": "C9"}


def plot(payload: dict, path) -> None:
    rows = payload["rows"]
    threads = sorted({r["threads"] for r in rows})
    fig, axes = harness.figure(2, size=(15, 5.2))
    styles = dict(zip(threads, ("--", "-"), strict=False)) if len(threads) > 1 else {threads[0]: "-"}
    for cand, color in COLORS.items():
        for k in threads:
            pts = sorted((r["size"], r["gbps"]) for r in rows if r["candidate"] == cand and r["threads"] == k)
            if pts:
                axes[0].plot(*zip(*pts, strict=True), styles[k], color=color, marker="o", ms=3,
                             label=f"{cand} ({k} thr)")
    harness.style(axes[0], "elements", "GB/s (bytes moved / time)",
                  "fp32 acc (zeroed) -> update -> bf16 out; rmw/copy: the same bytes", logx=2, legend=None)
    axes[0].legend(fontsize=6, ncol=3)
    sizes = sorted({r["size"] for r in rows})
    rules = [rule for rule in payload["bytes_per_element"] if any(r["candidate"] == rule for r in rows)]
    width = 0.8 / (len(rules) * len(threads))
    for j, (rule, k) in enumerate((rule, k) for rule in rules for k in threads):
        vals = [next((r["fraction_of_roofline"] for r in rows if r["size"] == s and r["candidate"] == rule
                      and r["threads"] == k), 0.0) for s in sizes]
        xs = [i - 0.4 + (j + 0.5) * width for i in range(len(sizes))]
        axes[1].bar(xs, vals, width, color=COLORS[rule], alpha=1.0 if k == max(threads) else 0.5,
                    label=f"{rule} ({k} thr)")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_xticks(range(len(sizes)), [f"2^{s.bit_length() - 1}" if s & (s - 1) == 0 else str(s) for s in sizes])
    harness.style(axes[1], "elements", "bytes/s over the roofline's bytes/s",
                  "fraction of the memory roofline (in-place read+write of the same bytes)", legend=None, grid="y")
    axes[1].legend(fontsize=6, ncol=4)
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = harness.OneLineParser(prog="python -m bench.cpu_rules", description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    # (a multiple of 8: the rooflines' buffers are float32 halves of the rules' bytes)
    ap.add_argument("--sizes", nargs="+", type=lambda text: parse_size(text, multiple=8), default=[2**20, 2**22, 2**24],
                    help="element counts, e.g. 1048576 or 2^20 (default 2^20 2^22 2^24)")
    ap.add_argument("--rounds", type=int, default=11, help="interleaved rounds per size and thread count")
    ap.add_argument("--retry-budget", type=float, default=90.0, metavar="S",
                    help="re-measure blocks disturbed by other processes only in the first S seconds (default 90)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to go idle (shared machines)")
    ap.add_argument("--quick", action="store_true", help="2^16 elements, 2 rounds, no retries (the test suite's run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.retry_budget = [2**16], 2, 0.0
    out_dir = harness.output_dir(args.out)
    threads = sorted({1, min(numba.config.NUMBA_NUM_THREADS, os.cpu_count() or 1)})
    if args.wait_quiet > 0:
        print(f"other processes' CPU share before starting: {harness.wait_quiet(args.wait_quiet):.2f}", flush=True)
    print(f"sizes {args.sizes}, threads {threads}, rounds {args.rounds}", flush=True)
    t_start = time.perf_counter()
    rows = []
    rules = {name: make_rule(name) for name in CUSTOM}  # one each for the whole run (compiles are kept per class)
    for n in args.sizes:
        t0 = time.perf_counter()
        state = State(n, rules)
        for k in threads:
            rows += measure(state, n, k, args.rounds, attempts=3, deadline=t_start + args.retry_budget)
        del state
        summary = "; ".join(
            f"{k} thr: " + ", ".join(f"{r['candidate']} {r['gbps']:.1f}"
                                     + (f" ({r['fraction_of_roofline']:.2f})" if "fraction_of_roofline" in r else "")
                                     for r in rows if r["size"] == n and r["threads"] == k)
            for k in threads)
        print(f"n={n}: GB/s (fraction of roofline): {summary} [{time.perf_counter() - t0:.0f}s]", flush=True)
        print(f"n={n}: time over lion's (compiles, their seconds, path): " + "; ".join(
            f"{k} thr: " + ", ".join(f"{r['candidate']} {r['vs_lion']:.2f}x ({r['compiles']}, {r['compile_s']:.1f}s, "
                                     f"{r['rule_path']})" for r in rows
                                     if r["size"] == n and r["threads"] == k and "vs_lion" in r)
            for k in threads), flush=True)

    payload = {
        "command": " ".join(["python -m bench.cpu_rules", *argv]),
        "description": __doc__,
        "bytes_per_element": bytes_per_element(rules),
        "config": {
            "sizes": args.sizes, "threads": threads, "rounds": args.rounds, "quick": args.quick,
            "grad": "fp32 accumulation buffer, zero_grad=True", "out_dtype": "bfloat16", "grad_scale": GRAD_SCALE,
            "lion": LION, "sgd": SGD, "adam": ADAM,
            "custom_rules": {name: {"rule": repr(rule), "compile": rule.compile, "state_names": list(rule.state_names),
                                    "source": "bench/custom_rules.py"} for name, rule in rules.items()},
            "compile_s_total": {name: compiled.paths(rule)["host"]["compile_s"] for name, rule in rules.items()},
            "numba_threading_layer": numba.threading_layer(),
            "NUMBA_NUM_THREADS": numba.config.NUMBA_NUM_THREADS,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        },
        "git_commit": harness.git_state()[0],
        "machine": harness.machine_info(),  # /proc/cpuinfo model name, core counts, torch/numba versions
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
    }
    json_path = harness.write_result(out_dir / "cpu_rules.json", payload)
    plot(payload, out_dir / "cpu_rules.png")
    print(f"wrote {json_path} and {out_dir / 'cpu_rules.png'} ({payload['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
