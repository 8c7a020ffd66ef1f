"""The committed results (bench/results/, and the studies' results bench.refresh makes under studies/results/): each
listed in ``bench.refresh.RESULTS`` (``STUDY_RESULTS``) with the command that makes it,
and each made again since the record existed carries a complete one (``bench.harness.write_result``): that command,
a clean commit of this repository, the machine (CPU model, cores, memory) and the load during the run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from bench import harness
from bench.refresh import MOVED, NOT_YET_REMADE, RESULTS, STUDY_RESULTS, listed

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
COMMITTED = sorted(str(p.relative_to(RESULTS_DIR)) for p in RESULTS_DIR.rglob("*.json"))
STUDIES = sorted(STUDY_RESULTS)  # (the other JSONs under studies/results: tests/test_studies.py)
HAS_GIT = (REPO / ".git").exists()
# e2e.json, the demo's result the README quotes, is made again within this many commits that change the library
E2E_MAX_LIBRARY_COMMITS_BEHIND = 10


def record_problems(name: str, result: dict) -> list[str]:
    """What is missing or wrong in a committed result's record (empty: complete)."""
    record = result.get("record")
    if not isinstance(record, dict):
        return ["no record"]
    problems = [f"no {field!r}" for field in harness.RECORD_FIELDS if field not in record]
    if problems:
        return problems
    argv = shlex.split(record["command"] or "")
    if argv[2:3] and argv[2] in MOVED:  # made before its module moved: the name it had at the record's commit
        argv[2] = MOVED[argv[2]]
    if "--out" in argv:  # made in another folder and copied or renamed here (bench.refresh does that)
        i = argv.index("--out")
        del argv[i:i + 2]
    entry, _ = listed(name)
    if argv != ["python", "-m", *entry.argv()]:
        problems.append(f"command {record['command']!r} is not bench.refresh's {entry.command!r}")
    if not (record["clean"] and record["changed"] == [] and re.fullmatch(r"[0-9a-f]{40}", record["commit"] or "")):
        problems.append(f"not a clean commit: {record['commit']!r}, changed {record['changed'][:3]}")
    machine = record["machine"]
    if not (machine.get("cpu") and machine.get("logical_cores") and machine.get("memory_gib")):
        problems.append(f"machine incomplete: {machine}")
    if not isinstance(record["load"].get("other_processes_share_of_cores"), float | int):
        problems.append(f"load missing: {record['load']}")
    return problems


def test_every_committed_result_is_listed_with_its_command():
    assert COMMITTED, "no results found"
    unlisted, missing = sorted(set(COMMITTED) - set(RESULTS)), sorted(set(RESULTS) - set(COMMITTED))
    assert not unlisted and not missing, (unlisted, missing)
    assert set(RESULTS) >= NOT_YET_REMADE
    for name, result in RESULTS.items():  # each command names a benchmark module that exists
        module = result.argv()[0]
        assert module.startswith("bench.") and (REPO / (module.replace(".", "/") + ".py")).exists(), (name, module)
    for name, result in STUDY_RESULTS.items():  # each study's result committed under studies/results, its module there
        module = result.argv()[0]
        assert (REPO / "studies" / "results" / name).exists(), name
        assert module.startswith("studies.") and (REPO / (module.replace(".", "/") + ".py")).exists(), (name, module)
    assert not set(RESULTS) & set(STUDY_RESULTS)
    for old, new in MOVED.items():  # a moved module is gone from its old place and the new one is listed
        assert not (REPO / (old.replace(".", "/") + ".py")).exists() and new in {
            r.argv()[0] for r in (*RESULTS.values(), *STUDY_RESULTS.values())}, (old, new)


@pytest.mark.parametrize("name", COMMITTED + STUDIES)
def test_a_remade_result_has_a_complete_record_and_a_listed_one_none(name):
    """A result made since the record existed: complete (its command bench.refresh's, a clean commit, the
    machine, the load); one still listed in NOT_YET_REMADE: not complete (once remade, it leaves the list)."""
    result = json.loads((listed(name)[1] / name).read_text())
    problems = record_problems(name, result)
    if name in NOT_YET_REMADE:
        assert problems, f"{name} has a complete record now: take it out of bench.refresh.NOT_YET_REMADE"
    else:
        assert not problems, f"{name}: {problems}"


@pytest.mark.skipif(not HAS_GIT, reason="needs the repository's history")
@pytest.mark.parametrize("name", [n for n in COMMITTED + STUDIES if n not in NOT_YET_REMADE])
def test_a_remade_results_commit_is_in_this_history(name):
    commit = json.loads((listed(name)[1] / name).read_text())["record"]["commit"]
    known = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True)
    if known.returncode == 128 and (REPO / ".git" / "shallow").exists():
        pytest.skip("a shallow clone")
    assert known.returncode == 0, f"{name}: commit {commit} is not an ancestor of HEAD"


@pytest.mark.skipif(not HAS_GIT or (REPO / ".git" / "shallow").exists(), reason="needs the repository's history")
def test_the_demos_result_is_recent():
    """e2e.json (the README's end-to-end figures) made within a few commits that change the library."""
    commit = json.loads((RESULTS_DIR / "e2e.json").read_text())["record"]["commit"]
    behind = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD", "--", "zenflow_kernels"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.strip()
    assert int(behind) <= E2E_MAX_LIBRARY_COMMITS_BEHIND, (
        f"e2e.json was made {behind} library commits ago: python -m bench.refresh --only e2e.json")


def test_the_record_of_a_run_names_its_command_commit_machine_and_load(tmp_path):
    """write_result on a payload: the record's fields (the command the payload names; the load a share of the
    cores; this checkout's HEAD)."""
    path = harness.write_result(tmp_path / "r.json", {"command": "python -m bench.kernels --quick", "rows": [1]})
    record = json.loads(path.read_text())["record"]
    assert set(record) == set(harness.RECORD_FIELDS)
    assert record["command"] == "python -m bench.kernels --quick"
    assert 0.0 <= record["load"]["other_processes_share_of_cores"] <= 1.0
    assert record["machine"]["cpu"] and record["machine"]["logical_cores"] >= 1
    # what tells two hosts of one model name apart (/proc/cpuinfo and sysfs: Linux, where the results are made)
    detail = record["machine"]["cpu_detail"]
    if Path("/proc/cpuinfo").exists():
        assert detail["vendor"] and detail["mhz"] > 0 and isinstance(detail["flags"], list)
        assert set(detail["flags"]) <= set(harness._CPU_FLAGS)
    if Path("/sys/devices/system/cpu/cpu0/cache").is_dir():  # (a container may hide sysfs' cache folders)
        assert {"L1d", "L2"} <= set(detail["caches"]), detail["caches"]
    if HAS_GIT:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        assert record["commit"] == head and record["clean"] == (record["changed"] == [])


def test_the_suite_time_benchmark_reads_pytests_summary():
    """bench.suite_time's parse on a log of the shape ``make test`` prints (warm-up line, durations, summary)."""
    from bench.suite_time import parse

    log = ("numba_warmup: recorded signatures 93 s, optimizer paths 3 s\n....\n"
           "41.04s setup    tests/test_fsdp2.py::test_dcp[2]\n"
           "22.56s call     tests/test_bench.py::test_fsdp2_quick\n"
           "= 3 failed, 2860 passed, 13 skipped, 40 warnings in 415.63s (0:06:55) =\n")
    got = parse(log)
    assert got["counts"] == {"failed": 3, "passed": 2860, "skipped": 13, "warnings": 40}
    assert got["pytest_s"] == 415.63 and got["numba_warmup_s"] == 96.0
    assert got["slowest"][0] == dict(seconds=41.04, when="setup", test="tests/test_fsdp2.py::test_dcp[2]")
    assert parse("no summary")["pytest_s"] is None


def test_refresh_makes_a_renamed_result_with_its_record_and_refuses_unknown_names(tmp_path, monkeypatch, capsys):
    """bench.refresh: a result its benchmark names otherwise is made in a temporary folder and its files renamed
    (JSON and plot), the record's command the listed one plus ``--out``; ``--list`` prints every result; an unknown
    ``--only`` is a one-line usage error."""
    from bench import refresh

    monkeypatch.setitem(refresh.RESULTS, "fp_renamed.json",
                        refresh.Result("bench.fingerprint --quick", writes="fingerprint_cpu.json"))
    refresh.remake("fp_renamed.json", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp_renamed.json", "fp_renamed.png"]
    record = json.loads((tmp_path / "fp_renamed.json").read_text())["record"]
    argv = shlex.split(record["command"])
    assert argv[:4] == ["python", "-m", "bench.fingerprint", "--quick"] and argv[4] == "--out" and len(argv) == 6
    assert refresh.main(["--list"]) == 0
    assert "fp_renamed.json" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        refresh.main(["--only", "nope.json"])
    assert err.value.code == 2 and "unknown result(s) nope.json" in capsys.readouterr().err
