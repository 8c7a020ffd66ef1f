"""The repository's tools stay usable as the code changes: each hand-made bug of tools/handmade_bugs.py (a patch
of today's code) still finds the snippet it replaces exactly once, so `python tools/handmade_bugs.py` applies
every one (a stale snippet would be reported as "not applied" only when someone runs it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _handmade():
    spec = importlib.util.spec_from_file_location("handmade_bugs", ROOT / "tools" / "handmade_bugs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BUGS = _handmade().BUGS


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_each_handmade_bug_patches_code_that_exists_once(bug):
    text = (ROOT / bug.file).read_text()
    found = text.count(bug.original)
    assert found == 1, f"{bug.name}: its snippet occurs {found} times in {bug.file}"
    assert bug.replacement != bug.original
    for test in bug.tests:
        assert (ROOT / test.split("::")[0]).exists(), test
