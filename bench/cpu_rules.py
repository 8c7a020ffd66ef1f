"""Host update rules side by side: cpu_lion_, cpu_sgd_ (momentum 0.9), cpu_adam_ and compiled rules of one's own
against a memory roofline.

    python -m bench.cpu_rules [--out DIR] [--sizes 2^20 2^22 2^24] [--rounds N] [--wait-quiet S] [--quick]

The offloaded optimizer's use of each kernel: the gradient is the fp32 accumulation buffer, consumed and zeroed in
the same pass (``zero_grad=True``), and the updated parameter is written as a bf16 copy (``out=``) for the
host-to-device transfer. Bytes moved per element (``BYTES``):

    Lion        read p, acc, m;     write p, acc (zeroed), m;     write out (bf16)   12 + 12 + 2 = 26
    SGD (0.9)   read p, acc, buf;   write p, acc (zeroed), buf;   write out (bf16)   12 + 12 + 2 = 26
    Adam        read p, acc, m, v;  write p, acc (zeroed), m, v;  write out (bf16)   16 + 16 + 2 = 34

Beside those hand-written numba kernels, rules written as a researcher writes them (``bench.custom_rules``: a
plain-torch ``step_``, no kernel; their host pass ``UpdateRule.host_step_``, compiled by Inductor into one C++ loop
at the calling thread's numba thread count, ``zenflow_kernels.rules.compiled``), with the same accumulation buffer,
zeroing and bf16 out (``custom_rules.host_bytes_per_element``: ``16 + 8 * states + 2``):

    rmsprop_compiled     RMSprop (square_avg), compile=True                                   26
    rmsprop_eager        the same rule, compile=False: eager torch ops (what it cost before)   26 (nominal: its
                         temporaries move more)
    ademamix_compiled    AdEMAMix without schedulers (exp_avg, exp_avg_slow, exp_avg_sq)      42
    from_torch_rmsprop   rules.from_torch(torch.optim.RMSprop), compiled: torch's own step    26

Each compiled candidate is called once per size and thread count before the timed blocks (a compile: Inductor bakes
the thread count into the kernel); its rows record that first call (``first_call_s``), the compiles and their
seconds during the block (``compiles``, ``compile_s``, from ``rules.compiled.paths``), the path the calls took
(``rule_path``: "compiled", or "compiled and eager" where a rule fell back) and ``vs_lion``, its time over Lion's
in the same block. Every rule is called with a step count that grows by one each call, as the optimizer's do (each
custom rule its own count from 1).

Roofline: numba ``prange`` streaming passes that move the same bytes with trivial arithmetic, ordinary stores
(the multiply by ``one`` keeps LLVM from turning a loop into ``memcpy``, whose non-temporal stores would skip
the read-for-ownership that the kernels' stores pay):

* ``rmw_26`` / ``rmw_34`` / ``rmw_42``, the roofline: ``x[i] = x[i] * one`` in place over a float32 array of half
  the bytes (13, 17 or 21 bytes per element of the rule read, the same written back), the way the kernels update p
  and state.
* ``copy_26`` / ``copy_34`` / ``copy_42``: ``dst[i] = src[i] * one``, src and dst of half the bytes each: the same
  nominal bytes, but on a write-allocate cache every line of dst is read before it is written, so it moves 1.5x that
  (measured: the rules run ~1.5x its bytes/s at 2^24). Kept as the naive reference.

Each rule's ``fraction_of_roofline`` = its bytes/s over ``rmw``'s at the same size and thread count; its
``fraction_of_copy`` the same over ``copy``'s. The kernels' one fresh stream, the bf16 out, may pay a
read-for-ownership (2 bytes per element that ``rmw`` does not read); on the AMD EPYC this was written on the rules
measured 0.98-1.0 of ``rmw`` at 2^24 on one thread all the same.

Timing as bench/cpu_adam.py: per size and thread count (1 and all of numba's threads) every candidate
interleaved round by round (``interleaved_settled``: each timed block after 25 ms of untimed calls of the same
candidate), ``calls_per_round`` = 2^22 / n, medians over the rounds; a block is measured again after waiting for
quiet when other processes used more than 10% of the CPUs while it ran (``other_processes_cpu_fraction``; only
within ``--retry-budget`` seconds of the start, so a busy machine cannot stretch the run without end).
At 2^20 elements each candidate's own working set (13 to 22 MB, 27 to 44 MB for a copy) fits in or near a
32 MB L3, and the untimed settle calls warm it: there the fractions compare cache traffic more than DRAM's;
2^22 (56 to 92 MB) and 2^24 (225 to 370 MB) stream from DRAM.

Results: ``cpu_rules.json`` (command, machine, versions, commit, rows) and ``cpu_rules.png`` in ``bench/results``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from bench.cpu_adam import interleaved_settled, numpy_view
from bench.custom_rules import AdEMAMix, RMSprop, from_torch_rmsprop, host_bytes_per_element
from bench.harness import OneLineParser, OtherLoad, machine_info_light, output_dir, plt, wait_quiet, write_json
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
MAX_OTHER_LOAD = 0.1


def custom_rules() -> dict:
    """The compiled rules of one's own (and RMSprop eager), one instance each for the whole run: the compiled
    kernels are kept per rule class, the paths' counts per instance."""
    return {"rmsprop_compiled": RMSprop(weight_decay=0.01, compile=True),
            "rmsprop_eager": RMSprop(weight_decay=0.01, compile=False),
            "ademamix_compiled": AdEMAMix(weight_decay=0.01, compile=True),
            "from_torch_rmsprop": from_torch_rmsprop(weight_decay=0.01)}


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


def _set_threads(k: int) -> None:
    """The same count for torch and numba in this thread (the copies run at numba's count; the rules take k)."""
    torch.set_num_threads(k)
    numba.set_num_threads(k)


def measure(state: State, n: int, k: int, rounds: int, attempts: int, deadline: float) -> list[dict]:
    """One interleaved block of every candidate at n elements and k threads; redone (after waiting up to 15 s for
    quiet, up to ``attempts`` times in all, and only before ``deadline``, a ``perf_counter`` time) when other
    processes took more than MAX_OTHER_LOAD of the CPUs meanwhile."""
    _set_threads(k)
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
    calls = max(1, (1 << 22) // n)
    for attempt in range(1, attempts + 1):
        load = OtherLoad()
        timings = interleaved_settled(candidates, rounds, calls)
        other = load.fraction()
        if other <= MAX_OTHER_LOAD or attempt == attempts or time.perf_counter() > deadline:
            break
        print(f"  n={n} threads={k}: other processes used {other:.0%} of the CPUs, measuring again", flush=True)
        wait_quiet(15)
    rows = []
    for name, t in timings.items():
        nbytes = state.bytes_of(name, n)
        rows.append({
            "size": n,
            "threads": k,
            "candidate": name,
            "bytes_per_element": nbytes / n,
            **t.as_row(),
            "calls_per_round": calls,
            "melements_per_s": n / t.median / 1e6,
            "gbps": nbytes / t.median / 1e9,
            "other_processes_cpu_fraction": other,
            "attempts": attempt,
        })
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
            copy = by[f"copy_{state.bytes[name]}"]
            r["roofline"] = roof["candidate"]
            r["roofline_gbps"] = roof["gbps"]
            r["fraction_of_roofline"] = r["gbps"] / roof["gbps"]
            r["fraction_of_copy"] = r["gbps"] / copy["gbps"]
    return rows


def plot(payload: dict, path) -> None:
    pyplot = plt()
    rows = payload["rows"]
    threads = sorted({r["threads"] for r in rows})
    fig, axes = pyplot.subplots(1, 2, figsize=(15, 5.2))
    colors = {"lion": "C0", "sgd": "C1", "adam": "C2", "rmsprop_compiled": "C3", "rmsprop_eager": "C4",
              "ademamix_compiled": "C6", "from_torch_rmsprop": "C8", "rmw_26": "0.45", "rmw_34": "k", "rmw_42": "0.7",
              "copy_26": "C7", "copy_34": "C5", "copy_42": "C9"}
    styles = {k: s for k, s in zip(threads, ("--", "-"), strict=False)} if len(threads) > 1 else {threads[0]: "-"}
    for cand, color in colors.items():
        for k in threads:
            pts = sorted((r["size"], r["gbps"]) for r in rows if r["candidate"] == cand and r["threads"] == k)
            if pts:
                axes[0].plot(*zip(*pts, strict=True), styles[k], color=color, marker="o", ms=3,
                             label=f"{cand} ({k} thr)")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("elements")
    axes[0].set_ylabel("GB/s (bytes moved / time)")
    axes[0].set_title("fp32 acc (zeroed) -> update -> bf16 out; rmw/copy: the same bytes")
    axes[0].legend(fontsize=6, ncol=3)
    axes[0].grid(alpha=0.3)
    sizes = sorted({r["size"] for r in rows})
    rules = [rule for rule in payload["bytes_per_element"] if any(r["candidate"] == rule for r in rows)]
    width = 0.8 / (len(rules) * len(threads))
    for j, (rule, k) in enumerate((rule, k) for rule in rules for k in threads):
        vals = [next((r["fraction_of_roofline"] for r in rows if r["size"] == s and r["candidate"] == rule
                      and r["threads"] == k), 0.0) for s in sizes]
        xs = [i - 0.4 + (j + 0.5) * width for i in range(len(sizes))]
        axes[1].bar(xs, vals, width, color=colors[rule], alpha=1.0 if k == max(threads) else 0.5,
                    label=f"{rule} ({k} thr)")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_xticks(range(len(sizes)), [f"2^{s.bit_length() - 1}" if s & (s - 1) == 0 else str(s) for s in sizes])
    axes[1].set_xlabel("elements")
    axes[1].set_ylabel("bytes/s over the roofline's bytes/s")
    axes[1].set_title("fraction of the memory roofline (in-place read+write of the same bytes)")
    axes[1].legend(fontsize=6, ncol=4)
    axes[1].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def _parse_size(text: str) -> int:
    text = text.strip()
    value = 2 ** int(text[2:]) if text.startswith("2^") else int(text)
    if value < 1 or value % 8:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive multiples of 8 (the copies' halves)")
    return value


def _git_head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = OneLineParser(prog="python -m bench.cpu_rules", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--sizes", nargs="+", type=_parse_size, default=[2**20, 2**22, 2**24],
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
    out_dir = output_dir(args.out)
    top = min(numba.config.NUMBA_NUM_THREADS, os.cpu_count() or 1)
    threads = sorted({1, top})
    if args.wait_quiet > 0:
        print(f"other processes' CPU share before starting: {wait_quiet(args.wait_quiet):.2f}", flush=True)
    print(f"sizes {args.sizes}, threads {threads}, rounds {args.rounds}", flush=True)
    t_start = time.perf_counter()
    rows = []
    rules = custom_rules()
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
            "sizes": args.sizes,
            "threads": threads,
            "rounds": args.rounds,
            "quick": args.quick,
            "grad": "fp32 accumulation buffer, zero_grad=True",
            "out_dtype": "bfloat16",
            "grad_scale": GRAD_SCALE,
            "lion": LION,
            "sgd": SGD,
            "adam": ADAM,
            "custom_rules": {name: {"rule": repr(rule), "compile": rule.compile, "state_names": list(rule.state_names),
                                    "source": "bench/custom_rules.py"} for name, rule in rules.items()},
            "compile_s_total": {name: compiled.paths(rule)["host"]["compile_s"] for name, rule in rules.items()},
            "numba_threading_layer": numba.threading_layer(),
            "NUMBA_NUM_THREADS": numba.config.NUMBA_NUM_THREADS,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        },
        "git_commit": _git_head(),
        "machine": machine_info_light(),  # /proc/cpuinfo model name, core counts, torch/numba versions
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
    }
    json_path = write_json(out_dir / "cpu_rules.json", payload)
    plot(payload, out_dir / "cpu_rules.png")
    print(f"wrote {json_path} and {out_dir / 'cpu_rules.png'} ({payload['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
