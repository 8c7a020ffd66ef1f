"""How long the whole suite takes: ``make test`` (what CI runs) timed, on this machine.

    python -m bench.suite_time [--out DIR] [--pytest-args "-q -n 2 --dist loadfile"]

Runs ``make test`` from the repository root with the Makefile's pytest arguments plus ``--durations=25`` (the
install step is done first and not timed; a fresh clone's first ``make test`` also builds ``.venv``), and records
the wall time of the whole command, the numba warm-up's share (``tests/numba_warmup.py`` prints it before the
workers start), pytest's own time and counts, and the slowest cases. Results: ``suite_time.json`` in bench/results
(or ``--out``), with the record of the run (the machine, the load). The README's suite time is checked against it
(``tests/test_readme.py``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time

from bench.harness import REPO, OneLineParser, output_dir, write_result

PYTEST_ARGS = "-q -n 2 --dist loadfile"  # the Makefile's PYTEST_ARGS


def parse(log: str) -> dict:
    """pytest's summary (counts, seconds), the numba warm-up's seconds and the slowest cases from ``log``."""
    summary = re.findall(r"^=*\s*(.*\d+ passed.*) in ([0-9.]+)s", log, re.MULTILINE)
    counts = {}
    if summary:
        for number, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|warnings?)",
                                        summary[-1][0]):
            counts[what] = int(number)
    warm = re.search(r"numba_warmup: recorded signatures ([0-9.]+) s, optimizer paths ([0-9.]+) s", log)
    slowest = [dict(seconds=float(s), when=w, test=t) for s, w, t in
               re.findall(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)", log, re.MULTILINE)]
    return dict(counts=counts, pytest_s=float(summary[-1][1]) if summary else None,
                numba_warmup_s=float(warm[1]) + float(warm[2]) if warm else None, slowest=slowest)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.suite_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--pytest-args", default=PYTEST_ARGS, help=f"pytest's arguments (default {PYTEST_ARGS!r})")
    args = ap.parse_args(argv)
    out = output_dir(args.out)
    subprocess.run(["make", "install"], cwd=REPO, check=True, capture_output=True)
    pytest_args = f"{args.pytest_args} --durations=25"
    started = time.perf_counter()
    proc = subprocess.run(["make", "test", f"PYTEST_ARGS={pytest_args}"], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    result = parse(log)
    payload = dict(benchmark="suite_time", command=" ".join(["python -m bench.suite_time",
                                                             *map(shlex.quote, argv if argv is not None
                                                                  else sys.argv[1:])]),
                   make_test=f"make test PYTEST_ARGS={pytest_args!r}", returncode=proc.returncode, wall_s=wall,
                   **result, log_tail=log[-3000:])
    path = write_result(out / "suite_time.json", payload)
    counts = ", ".join(f"{n} {w}" for w, n in result["counts"].items())
    print(f"make test: {wall:.0f} s (rc {proc.returncode}; numba warm-up {result['numba_warmup_s']} s, pytest "
          f"{result['pytest_s']} s: {counts}); wrote {path}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
