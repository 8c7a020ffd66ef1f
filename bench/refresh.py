"""Make every committed result again: ``python -m bench.refresh`` (``make bench-results``).

``RESULTS`` names, for each JSON under bench/results/, the command that makes it (run from the repository root; the
benchmark writes the JSON and its plot to bench/results/); ``STUDY_RESULTS`` the same for two studies' results under
studies/results/ (a study answers a question rather than times something; the other JSONs there, the tuned
comparison's and time_to_target's, are made by running those modules). A result whose benchmark names
its file otherwise (a run of ``bench.nvme`` kept as ``nvme_cpu_repeat.json``) is made in a temporary folder and its
files renamed. Every result carries the record of its run (``bench.harness.write_result``: command, commit, whether
the tree was clean, machine, load); ``tests/test_results.py`` checks that each JSON is listed here and that its
record matches.

Run it on a clean checkout (commit first): a record of a dirty tree does not count. ``--only NAME ...`` makes some
of them, ``--list`` prints the table. The whole table takes hours on two cores; GPU results (``gpu=True``) run only
where CUDA is available.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import REPO, RESULTS_DIR, OneLineParser, git_state


@dataclass(frozen=True)
class Result:
    """How one committed result is made: ``command`` (after ``python -m``), the file name the benchmark writes
    (``writes``, when it is not the result's own), and whether it needs a GPU."""

    command: str
    writes: str | None = None
    gpu: bool = False

    def argv(self) -> list[str]:
        return shlex.split(self.command)


RESULTS: dict[str, Result] = {
    "e2e.json": Result("bench.e2e --demo --quiet"),
    "e2e_base_batch2.json": Result(
        "bench.e2e --model base --batch 2 --context 48 --steps 160 --repeats 3 --pt-reserved-cores-perc 0.5 1.0 "
        "--variant nooverlap:overlap_step=false --baseline-threads 1 --name e2e_base_batch2 --quiet"),
    "e2e_lr1e-3.json": Result("bench.e2e --lr 1e-3 --variant nooverlap:overlap_step=false --name e2e_lr1e-3 --quiet"),
    "e2e_scratch_lr3e-3.json": Result("bench.e2e --pretrain-steps 0 --lr 3e-3 --name e2e_scratch_lr3e-3 --quiet"),
    "e2e_variants.json": Result(
        "bench.e2e --repeats 3 --pt-reserved-cores-perc 0.5 1.0 --variant nooverlap:overlap_step=false "
        "--baseline-threads 1 --name e2e_variants --quiet"),
    "kernels_cpu.json": Result("bench.kernels"),
    "cpu_adam.json": Result("bench.cpu_adam"),
    "cpu_rules.json": Result("bench.cpu_rules --wait-quiet 20"),
    "stochastic_rounding.json": Result("bench.stochastic_rounding"),
    "step_overhead_cpu.json": Result("bench.step_overhead"),
    "step_overhead_rules_cpu.json": Result("bench.step_overhead --rules"),
    "host_multi_cpu.json": Result("bench.host_multi"),
    "fingerprint_cpu.json": Result("bench.fingerprint"),
    "overlap_cpu.json": Result("bench.overlap"),
    "nvme_cpu.json": Result("bench.nvme"),
    "nvme_cpu_repeat.json": Result("bench.nvme --attempts 3", writes="nvme_cpu.json"),
    "scale_cpu.json": Result("bench.scale"),
    "zero_cpu.json": Result("bench.zero"),
    "fsdp2_cpu.json": Result("bench.fsdp2"),
    "plan_cpu.json": Result("bench.plan"),
    "suite_time.json": Result("bench.suite_time"),
    "h200-2026-11-30/kernels_gpu.json": Result("bench.kernels", gpu=True),
}

STUDIES_DIR = REPO / "studies" / "results"
STUDY_RESULTS: dict[str, Result] = {
    "concentration_study.json": Result("studies.concentration_study"),
    "deepspeed_semantics.json": Result("studies.deepspeed_semantics"),
}
# Modules moved since a committed result was made: its record names the module where it was then (at the commit the
# record names, that command makes it); tests/test_results.py reads a record's old name as the new one.
MOVED = {
    "bench.concentration_study": "studies.concentration_study",
    "bench.deepspeed_semantics": "studies.deepspeed_semantics",
}

# Results made before the record existed (no command, a dirty tree or no clean commit named): each stays listed here
# until it is made again by this module (tests/test_results.py fails for a listed result whose record is complete, so
# the list only shrinks). The H200 results need the GPU machine.
NOT_YET_REMADE = frozenset({
    "h200-2026-11-30/kernels_gpu.json",
})


def listed(name: str) -> tuple[Result, Path]:
    """A listed result's entry and the folder it is committed in (bench/results or studies/results)."""
    return (RESULTS[name], RESULTS_DIR) if name in RESULTS else (STUDY_RESULTS[name], STUDIES_DIR)


def remake(name: str, out_dir: Path | None = None) -> float:
    """Make one result (its JSON and the files beside it of the same stem) in ``out_dir`` (default: the folder it is
    committed in); returns its seconds."""
    result, home = listed(name)
    out_dir = home if out_dir is None else out_dir
    target = out_dir / name
    t0 = time.perf_counter()
    if result.writes is None and target.parent == out_dir:
        extra = [] if out_dir == home else ["--out", str(out_dir)]
        subprocess.run([sys.executable, "-m", *result.argv(), *extra], cwd=REPO, check=True)
    else:
        with tempfile.TemporaryDirectory(prefix="refresh-") as tmp:
            subprocess.run([sys.executable, "-m", *result.argv(), "--out", tmp], cwd=REPO, check=True)
            produced = Path(result.writes or Path(name).name)
            target.parent.mkdir(parents=True, exist_ok=True)
            for path in Path(tmp).glob(f"{produced.stem}.*"):
                shutil.move(str(path), target.parent / f"{Path(name).stem}{path.suffix}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.refresh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these results (names as in --list)")
    ap.add_argument("--list", action="store_true", help="print each result and its command, then exit")
    ap.add_argument("--allow-dirty", action="store_true", help="run on a tree that differs from its commit")
    args = ap.parse_args(argv)
    if args.list:
        for name, result in {**RESULTS, **STUDY_RESULTS}.items():
            where = "" if name in RESULTS else "  (studies/results)"
            print(f"{name:40s} python -m {result.command}{'  (GPU)' if result.gpu else ''}{where}")
        return 0
    unknown = sorted(set(args.only or ()) - set(RESULTS) - set(STUDY_RESULTS))
    if unknown:
        ap.error(f"--only: unknown result(s) {', '.join(unknown)}; allowed: the names of --list")
    commit, changed = git_state()
    if changed and not args.allow_dirty:
        ap.error(f"the tree differs from {commit} ({', '.join(changed[:5])}): commit first (or --allow-dirty)")
    import torch

    for name in args.only or [*RESULTS, *STUDY_RESULTS]:
        result, _ = listed(name)
        if result.gpu and not torch.cuda.is_available():
            print(f"bench.refresh: {name}: needs a GPU, skipped", flush=True)
            continue
        print(f"bench.refresh: {name}: python -m {result.command}", flush=True)
        print(f"bench.refresh: {name}: {remake(name):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
