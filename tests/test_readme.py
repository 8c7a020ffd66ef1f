"""The README is a front door that works: its first Python block runs as is on CPU and stands near the top, it
stays short, every relative link in it and in docs/ points to a file that exists, and `make demo` writes only to
an ignored folder (the committed results are refreshed on purpose, by `make bench-results`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_first_python_block_runs_as_is_within_the_first_60_lines(tmp_path):
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "```python")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
    assert start < 60, f"the first Python block starts at line {start + 1}"
    script = tmp_path / "quick_start.py"
    script.write_text("\n".join(lines[start + 1:end]) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user has it
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], proc.stdout  # it trains
    assert re.search(r"stall: [0-9.]+ fast columns of layer 0: \[(\d+, ){5}\d+\]", proc.stdout), proc.stdout


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 250


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_point_to_files_that_exist(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name}: {missing}"


def test_make_demo_writes_to_an_ignored_folder():
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.MULTILINE).group(1)
    out = re.search(r"--out (\S+)", demo).group(1)
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/e2e.json"], cwd=ROOT)
    assert ignored.returncode == 0, f"make demo writes to {out}, which git does not ignore"
    assert re.search(r"^bench-results:.*\n\t.*--out bench/results", makefile, re.MULTILINE)
