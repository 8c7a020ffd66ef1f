"""Print the mutation score of the last ``mutmut run`` (``make mutation``).

Reads ``mutmut results --all true`` (run in the repository root), counts the outcome of every mutant
per module, and prints the score: killed / (all - judged), with the survivors left to look at.
"Judged" are the mutants listed in ``tools/mutation_equivalent.txt``, one name per line, then ``#``,
a category and the reason:

* ``equivalent``: no test can tell the mutant from the original (a default that is never used, a
  performance-only change, ...);
* ``cuda-only``: the mutated code runs only with CUDA (the CUDA engine, the CUDA branch of the link
  factory); the CUDA cases of the optimizer tests exercise it on a GPU (bench/gpu_suite.sh), which
  this score, computed on CPU, cannot count.
* ``multi-rank``: the mutated code runs only with several ranks (ZeRO's branches of the optimizer);
  tests/test_zero.py runs it in rank processes it starts, which mutmut's in-process selection does not
  run (and which take minutes a mutant). ``tools/mutation_multirank.py`` runs a sample of them against
  tests/test_zero.py and prints how many it kills.

Mutants in code no selected test runs at all (mutmut's "no tests") are reported in the "other"
column and count as not killed. Exit status 0 when the score reaches ``--goal`` (default 0.90).
"""

from __future__ import annotations

import argparse
import collections
import math
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KILLED = {"killed", "timeout", "segfault"}  # a timeout or a crash is a detected mutant too
CATEGORIES = ("equivalent", "cuda-only", "multi-rank")


def judged(path: Path) -> dict[str, str]:
    """mutant name -> category (one of CATEGORIES)."""
    out = {}
    if path.exists():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            name, _, why = line.partition("#")
            if not name.strip():
                continue
            category = why.strip().split(":", 1)[0]
            if category not in CATEGORIES:
                raise SystemExit(f"{path.name}:{n}: the category must be one of {CATEGORIES}, got {category!r}")
            out[name.strip()] = category
    return out


def results(mutmut: str) -> dict[str, str]:
    proc = subprocess.run([mutmut, "results", "--all", "true"], capture_output=True, text=True, check=True)
    out = {}
    for line in proc.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            out[name] = status.strip()
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion k/n."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def module_of(name: str) -> str:
    return name.split(".x", 1)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutmut", default=str(Path(sys.executable).with_name("mutmut")))
    ap.add_argument("--equivalent", type=Path, default=HERE / "mutation_equivalent.txt")
    ap.add_argument("--goal", type=float, default=0.90)
    ap.add_argument("--names", type=Path, default=None,
                    help="score only these mutants (one name per line: a sample, tools/mutation_sample.py)")
    args = ap.parse_args(argv)
    status = results(args.mutmut)
    equiv = judged(args.equivalent)
    stale = sorted(set(equiv) - set(status))
    if args.names is not None:
        wanted = set(args.names.read_text().split())
        status = {n: st for n, st in status.items() if n in wanted}
    if not status:
        print("no mutmut results: run `mutmut run` first (make mutation does)")
        return 1
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    survivors = []
    for name, st in sorted(status.items()):
        mod = module_of(name)
        if name in equiv:
            table[mod][equiv[name]] += 1
        elif st in KILLED:
            table[mod]["killed"] += 1
        else:
            table[mod][st] += 1
            survivors.append((name, st))
    print(f"{'module':<34}{'killed':>8}{'equivalent':>12}{'cuda-only':>11}{'multi-rank':>12}{'survived':>10}"
          f"{'other':>8}{'score':>8}")
    tot_k = tot_n = 0
    for mod, c in sorted(table.items()):
        n = sum(c.values()) - sum(c[k] for k in CATEGORIES)
        other = n - c["killed"] - c["survived"]
        tot_k += c["killed"]
        tot_n += n
        print(f"{mod:<34}{c['killed']:>8}{c['equivalent']:>12}{c['cuda-only']:>11}{c['multi-rank']:>12}"
              f"{c['survived']:>10}{other:>8}{c['killed'] / n if n else 1.0:>8.1%}")
    score = tot_k / tot_n if tot_n else 1.0
    judged_counts = ", ".join(f"{sum(c[k] for c in table.values())} {k}" for k in CATEGORIES)
    print(f"score: {tot_k} of {tot_n} mutants killed = {score:.1%} (goal {args.goal:.0%}); judged in "
          f"{args.equivalent.name}: {judged_counts}")
    unchecked = sum(1 for _, st in survivors if st == "not checked")
    if args.names is not None and tot_n and not unchecked:
        lo, hi = wilson(tot_k, tot_n)
        print(f"a sample of {len(status)} mutants: the score of all of them is within {lo:.1%} .. {hi:.1%} "
              "(95% Wilson interval)")
    if unchecked:
        print(f"incomplete: {unchecked} mutants not checked yet (counted as not killed); run `make mutation` "
              "again to go on (finished results are kept)")
    if survivors:
        print("not killed (`mutmut show NAME` shows the change):")
        for name, st in survivors:
            if st != "not checked":
                print(f"  {st:<10} {name}")
    if stale:
        print(f"{len(stale)} names in {args.equivalent.name} are no longer mutants (the code moved): review them")
    return 0 if score >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
