"""Run mutants judged ``multi-rank`` (tools/mutation_equivalent.txt) against tests/test_zero.py.

mutmut runs each mutant's tests in its own process with the mutant chosen by the environment variable
``MUTANT_UNDER_TEST``; tests/test_zero.py starts one process per rank from ``mutants/`` (its workers
import the package next to the tests), which inherit that variable, so the ranks run the mutant too.
A full pass takes minutes per mutant, so this takes a seeded random sample::

    python tools/mutation_multirank.py --sample 12        # after `make mutation`

and prints each mutant's outcome (killed: the ZeRO tests failed; survived: they passed) and the count.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from mutation_score import judged  # noqa: E402


def run_one(name: str, timeout: float) -> tuple[str, float]:
    env = {**os.environ, "MUTANT_UNDER_TEST": name}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "tests/test_zero.py"], cwd=ROOT / "mutants", env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.monotonic() - t0
    return ("survived" if proc.returncode == 0 else "killed"), time.monotonic() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--equivalent", type=Path, default=HERE / "mutation_equivalent.txt")
    ap.add_argument("--sample", type=int, default=12, help="how many multi-rank mutants (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if not (ROOT / "mutants" / "tests" / "test_zero.py").exists():
        print("no mutants/ with tests/test_zero.py: run `make mutation` first")
        return 1
    names = sorted(n for n, c in judged(args.equivalent).items() if c == "multi-rank")
    if args.sample and args.sample < len(names):
        names = sorted(random.Random(args.seed).sample(names, args.sample))
    killed = 0
    for name in names:
        outcome, seconds = run_one(name, args.timeout)
        killed += outcome.startswith("killed")
        print(f"  {outcome:<17} {seconds:6.0f} s  {name}", flush=True)
    print(f"multi-rank: {killed} of {len(names)} sampled mutants killed by tests/test_zero.py")
    return 0 if killed == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
