"""A seeded uniform sample of the mutants, run with mutmut, scored with a confidence interval.

A full ``make mutation`` takes hours on 2 cores. This draws ``--size`` mutants uniformly at
random (``--seed``) from every mutant mutmut generates for the current code, runs those not checked
yet, and prints the score over the sample with its 95% Wilson interval::

    python tools/mutation_sample.py --size 700        # make mutation-sample

The sample's names are written to ``mutants/sample.txt``; results persist in mutants/ like a full run's.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from mutation_score import results  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutmut", default=str(Path(sys.executable).with_name("mutmut")))
    ap.add_argument("--size", type=int, default=700)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    status = results(args.mutmut)
    if not status:  # no mutants generated yet: generate them (and the test map) with one mutant's run
        print("no mutants yet: run `make mutation` once (it can be interrupted after 'Running mutation testing')")
        return 1
    names = sorted(status)
    # in draw order: the first n names of a larger sample are the sample of size n (same seed)
    sample = random.Random(args.seed).sample(names, min(args.size, len(names)))
    (ROOT / "mutants" / "sample.txt").write_text("\n".join(sample) + "\n")
    todo = [n for n in sample if status[n] == "not checked"]
    print(f"sample: {len(sample)} of {len(names)} mutants (seed {args.seed}); {len(todo)} to run", flush=True)
    if todo:
        subprocess.run([args.mutmut, "run", "--max-children", str(args.jobs), *todo], cwd=ROOT, check=True)
    return subprocess.run([sys.executable, str(HERE / "mutation_score.py"), "--names",
                           str(ROOT / "mutants" / "sample.txt")], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
