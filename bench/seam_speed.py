"""AdamW's speed before and after a change, side by side: the host AdamW kernel and ``step()``'s own cost.

    python -m bench.seam_speed [--base COMMIT] [--rounds 3] [--out DIR] [--quick]

Checks a change that must not slow AdamW down (issue 41, the update rule seam: "bench.cpu_adam and
bench.step_overhead within 5% of today, side by side in one run"). The base commit is checked out in a temporary
git worktree; each round runs, for the base tree and then this one (the order alternating between rounds, so drift
hits both alike), one subprocess per tree with ``PYTHONPATH`` at that tree, which measures:

* ``cpu_adam_`` (the optimizer's host pass: fp32 master and moments, the sums zeroed, bf16 copy-out) at 2^20 and
  2^24 elements (``--quick``: 2^16 and 2^20), one thread: the median of repeated calls;
* the tree's own ``bench.step_overhead`` at 150 and 600 tensors (``--quick``: its own counts, 8 and 16; the asynchronous
  link and torch's foreach AdamW, one repeat): the training thread's CPU time per step and its ratio to torch's foreach
  AdamW measured in the same process.

When the base's numba kernels (``zenflow_kernels/cpu_ops/kernels``) are byte for byte this tree's, the worktree gets
this tree's compiled kernels (numba's cache is keyed by the source file's path and time stamp, so a fresh worktree would
compile every kernel again: half a minute of the suite's quick run).

Reported per metric: each tree's median over the rounds and the ratio this tree / base (1.0: unchanged). Results:
``seam_speed.json`` in bench/results (or ``--out``) with the machine description and the load seen.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import OneLineParser, machine_info_light, output_dir, write_json_light

REPO = Path(__file__).resolve().parent.parent

KERNEL_PROBE = r"""
import json, sys, time, torch
from zenflow_kernels import cpu_ops
out = {}
for n in map(int, sys.argv[2:]):
    g = torch.Generator().manual_seed(0)
    p, m, v = torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)
    acc, dst = torch.randn(n, generator=g), torch.empty(n, dtype=torch.bfloat16)
    times = []
    for k in range(int(sys.argv[1])):
        t0 = time.perf_counter()
        cpu_ops.cpu_adam_(p, acc, m, v, step=k + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                          grad_scale=4.0, out=dst, zero_grad=True, num_threads=1)
        times.append(time.perf_counter() - t0)
    out[f"cpu_adam_ms_at_2^{n.bit_length() - 1}"] = 1e3 * sorted(times)[len(times) // 2]
print(json.dumps(out))
"""


KERNELS = Path("zenflow_kernels", "cpu_ops", "kernels")  # every numba kernel and its cache (__pycache__)


def share_numba_cache(base_tree: Path) -> bool:
    """Give ``base_tree`` this tree's compiled numba kernels when its ``cpu_ops/kernels`` sources are identical to
    this tree's (a cached kernel is checked against its source file's modification time and size and the digest of
    the whole folder: ``cpu_ops/kernels/_jit.py``). Returns whether it did."""
    ours, theirs = REPO / KERNELS, base_tree / KERNELS
    sources = sorted(p.name for p in ours.glob("*.py"))
    if sources != sorted(p.name for p in theirs.glob("*.py")):
        return False
    if any((ours / n).read_bytes() != (theirs / n).read_bytes() for n in sources):
        return False
    cache = ours / "__pycache__"
    entries = [*cache.glob("*.nbi"), *cache.glob("*.nbc")]
    if not entries:
        return False
    (theirs / "__pycache__").mkdir(exist_ok=True)
    for entry in entries:
        shutil.copy2(entry, theirs / "__pycache__" / entry.name)
    for n in sources:  # the time stamps numba's index holds
        st = (ours / n).stat()
        os.utime(theirs / n, ns=(st.st_atime_ns, st.st_mtime_ns))
    return True


def run_tree(tree: Path, quick: bool, calls: int) -> dict:
    """One round's measurements in ``tree`` (a subprocess each: the kernel probe, the tree's step_overhead)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    sizes = (1 << 16, 1 << 20) if quick else (1 << 20, 1 << 24)
    probe = subprocess.run([sys.executable, "-c", KERNEL_PROBE, str(calls), *map(str, sizes)], cwd=tree, env=env,
                           capture_output=True, text=True, check=True)
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as out:
        counts = (8, 16) if quick else (150, 600)  # (step_overhead --quick's counts)
        cmd = [sys.executable, "-m", "bench.step_overhead", "--out", out, "--repeats", "1"]
        cmd += ["--quick"] if quick else ["--tensors", *map(str, counts)]
        subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
        summary = json.loads((Path(out) / "step_overhead_cpu.json").read_text())["summary"]
    for n in counts:
        cpu = summary["zenflow_async_link"]["cpu"]
        result[f"step_ms_at_{n}"] = cpu[f"ms_at_{n}"]
        result[f"step_vs_foreach_at_{n}"] = cpu[f"vs_torch_adamw_foreach_at_{n}"]
    return result


def main(argv=None) -> None:
    ap = OneLineParser(prog="python -m bench.seam_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="a12208b", help="the commit to compare with (default: before the rule seam)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each measuring both trees (default 3)")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="one round, few calls and steps (the test suite's run)")
    args = ap.parse_args(argv)
    rounds, calls = (1, 5) if args.quick else (args.rounds, 21)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.strip())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=REPO,
                       capture_output=True, check=True)
        shared_cache = share_numba_cache(base_tree)
        try:
            trees = {"base": base_tree, "head": REPO}
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            loads = []
            for r in range(rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                for name in order:
                    runs[name].append(run_tree(trees[name], args.quick, calls))
                    loads.append(os.getloadavg()[0])
                    print(f"round {r + 1}/{rounds} {name}: {runs[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, capture_output=True)
    metrics = sorted(runs["head"][0])
    summary = {}
    for key in metrics:
        base = statistics.median(x[key] for x in runs["base"])
        this = statistics.median(x[key] for x in runs["head"])
        summary[key] = {"base": base, "head": this, "head_over_base": this / base}
    payload = {
        "command": "python -m bench.seam_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "base": args.base, "head": head + ("+dirty" if dirty else ""), "rounds": rounds, "calls": calls,
        "base_shared_numba_cache": shared_cache,
        "summary": summary, "runs": runs, "load_average_1min": loads, "total_s": time.perf_counter() - t0,
        "machine": machine_info_light(),
    }
    path = write_json_light(output_dir(args.out) / "seam_speed.json", payload)
    for key, row in summary.items():
        print(f"{key:>28}: base {row['base']:.4g}  head {row['head']:.4g}  head/base {row['head_over_base']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
