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


def test_the_recorded_numba_signatures_are_kernels_and_types_that_exist():
    """tests/numba_warmup.py compiles the recorded signatures before the workers start: each names a kernel of
    cpu_ops/kernels/ with as many argument types as it has parameters, each type spelled as numba spells it
    (``numba_type`` turns it back: ``str`` gives the spelling again); the compile processes split whole kernels,
    each once, none empty."""
    import inspect
    import json

    from numba_warmup import RECORD, numba_type, split

    from zenflow_kernels.cpu_ops.kernels import all_kernels

    record = json.loads(RECORD.read_text())
    assert sum(map(len, record.values())) > 20
    kernels = all_kernels()
    for name, signatures in record.items():
        arity = len(inspect.signature(kernels[name].py_func).parameters)
        for signature in signatures:
            assert len(signature) == arity, (name, signature)
            assert [str(numba_type(t)) for t in signature] == signature
    for parts in (1, 2, 3, 16):
        groups = split(record, parts)
        assert sorted(n for g in groups for n in g) == sorted(record) and all(groups)
        assert len(groups) == min(parts, len(record))
