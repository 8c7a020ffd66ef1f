"""The test tiers stay honest (docs/testing.md, "The suite"): a test that starts rank processes, runs an entry point
in a subprocess, executes notebooks or runs a benchmark carries the marker that keeps it out of ``make test-fast``
(``-m "not ranks and not subprocess and not notebook and not bench"``).

A static check of tests/test_*.py: each test function is read with the module's helpers and fixtures it names
(transitively), and what they do decides the markers it needs:

* ``ranks``: a call of ``launch(...)`` (tests/support.py's or a module's own rank launcher), the ``"RANK"``
  environment variable set for a process, ``torch.distributed.run`` (torchrun), ``mp.spawn`` / ``start_processes``;
* ``bench``: ``[..., "-m", "bench.<name>", ...]`` (a benchmark run in a subprocess);
* ``subprocess``: ``[..., "-m", <anything but zenflow_kernels>, ...]`` (a study, a tool, a bench module named by a
  variable), a path under ``examples/`` or ``tools/``, or a script of tests/ run as a program;
* ``notebook``: a name imported from ``nbclient`` or ``tools.notebooks`` used.

Not a tier: ``python -c <snippet>`` and ``python -m zenflow_kernels ...`` (one short process of the library, in
the edit loop like any single-process case). A marker may be on the module (``pytestmark``), a class or the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("ranks", "subprocess", "notebook", "bench")
TEST_SCRIPTS = {p.stem for p in TESTS.glob("*.py") if not p.name.startswith("test_")} - {"conftest", "support"}


def _marks(node: ast.AST) -> set[str]:
    """The tier markers an expression names (``pytest.mark.X``, a list of them, ``pytest.param(marks=...)`` not
    read: a tier is a property of a test, not of one case)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr in TIERS
            and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def _after_m(elts: list[ast.expr]) -> set[str]:
    needs = set()
    for i, e in enumerate(elts[:-1]):
        if isinstance(e, ast.Constant) and e.value == "-m":
            nxt = elts[i + 1]
            if isinstance(nxt, ast.Constant) and isinstance(nxt.value, str):
                if nxt.value.startswith("bench."):
                    needs.add("bench")
                elif nxt.value.split(".")[0] != "zenflow_kernels":
                    needs.add("subprocess")
            else:
                needs.add("subprocess")
    return needs


def _leaves(fn: ast.AST, notebook_names: set[str], script_names: set[str]) -> set[str]:
    """The tiers a function's own body needs (not counting the helpers it calls)."""
    needs = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id == "launch":
                needs.add("ranks")
            if isinstance(f, ast.Attribute) and f.attr in ("spawn", "start_processes") and \
                    isinstance(f.value, ast.Name) and f.value.id in ("mp", "multiprocessing", "torch_mp"):
                needs.add("ranks")
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "subprocess":
                for c in ast.walk(n):  # a path under examples/ or tools/ in the command
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and (
                            c.value in ("examples", "tools") or c.value.startswith(("examples/", "tools/"))):
                        needs.add("subprocess")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            if n.value in ("RANK", "torch.distributed.run", "torchrun"):
                needs.add("ranks")
        elif isinstance(n, ast.List | ast.Tuple) and n.elts and isinstance(n.elts[0], ast.Attribute) and \
                n.elts[0].attr == "executable":  # a command line: [sys.executable, ...]
            needs |= _after_m(n.elts)
            if len(n.elts) > 1:  # [sys.executable, <a script of tests/>.__file__, ...]: run as a program
                second = n.elts[1]
                inner = second.args[0] if isinstance(second, ast.Call) and second.args else second
                if isinstance(inner, ast.Attribute) and inner.attr == "__file__" and \
                        isinstance(inner.value, ast.Name) and inner.value.id in script_names:
                    needs.add("subprocess")
        elif isinstance(n, ast.Name) and n.id in notebook_names:
            needs.add("notebook")
    return needs


def module_problems(path: Path) -> list[str]:
    """Each test of the module that needs a tier marker it does not carry."""
    tree = ast.parse(path.read_text())
    module_marks: set[str] = set()
    notebook_names: set[str] = set()
    script_names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            module_marks |= _marks(node.value)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nbclient" or \
                isinstance(node, ast.ImportFrom) and node.module == "tools" and \
                any(a.name == "notebooks" for a in node.names) or \
                isinstance(node, ast.ImportFrom) and node.module == "tools.notebooks":
            notebook_names |= {a.asname or a.name for a in node.names}
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "nbclient":
                    notebook_names.add(a.asname or a.name.split(".")[0])
                if a.name in TEST_SCRIPTS:
                    script_names.add(a.asname or a.name)

    functions: dict[str, ast.FunctionDef] = {}
    owners: dict[str, set[str]] = {}  # a test's class's markers
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            class_marks = set().union(*(_marks(d) for d in node.decorator_list)) if node.decorator_list else set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    functions[f"{node.name}.{item.name}"] = item
                    owners[f"{node.name}.{item.name}"] = class_marks
    own = {name: _leaves(fn, notebook_names, script_names) for name, fn in functions.items()}
    plain = {name.split(".")[-1]: name for name in functions}

    def needs(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        fn = functions[name]
        got = set(own[name])
        used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        used |= {a.arg for a in fn.args.args}  # fixtures by parameter name
        for other in used & set(plain):
            if plain[other] != name:
                got |= needs(plain[other], seen)
        return got

    problems = []
    for name, fn in functions.items():
        if not name.split(".")[-1].startswith("test_"):
            continue
        carried = module_marks | owners.get(name, set()) | set().union(*map(_marks, fn.decorator_list or [ast.Pass()]))
        missing = needs(name, set()) - carried
        if carried & set(TIERS):  # a test out of the fast tier already: any tier covers a process it runs
            missing.discard("subprocess")
        if missing:
            problems.append(f"{path.name}::{name} needs {' and '.join(sorted(missing))}")
    return problems


def test_every_test_that_starts_ranks_or_runs_an_entry_point_carries_its_tier_marker():
    problems = [p for path in sorted(TESTS.glob("test_*.py")) if path.name != "test_markers.py"
                for p in module_problems(path)]
    assert not problems, ("these would run in `make test-fast`: mark them (pytest.mark.<tier>, docs/testing.md)\n"
                          + "\n".join(problems))


def test_the_check_sees_a_rank_launch_through_a_fixture_and_a_subprocess_through_a_helper(tmp_path):
    """The check on a made-up module: a rank launch behind a fixture, a study run behind a helper, both unmarked;
    then marked, nothing to report."""
    body = '''
import subprocess, sys
import pytest
from support import launch

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch([], tmp_path_factory.mktemp("r"))

def run_quick(tmp):
    return subprocess.run([sys.executable, "-m", "studies.tuned_comparison", "--out", str(tmp)])

def test_ranks(two_ranks):
    assert two_ranks

def test_study(tmp_path):
    run_quick(tmp_path)

def test_bench(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.kernels", "--quick"])

def test_cli(tmp_path):
    subprocess.run([sys.executable, "-m", "zenflow_kernels", "explain"])
    subprocess.run([sys.executable, "-c", "print(1)"])
'''
    path = tmp_path / "test_made_up.py"
    path.write_text(body)
    assert module_problems(path) == ["test_made_up.py::test_ranks needs ranks",
                                     "test_made_up.py::test_study needs subprocess",
                                     "test_made_up.py::test_bench needs bench"]
    marked = (body.replace("def test_ranks", "@pytest.mark.ranks\ndef test_ranks")
              .replace("def test_study", "@pytest.mark.subprocess\ndef test_study"))
    path.write_text(marked.replace("import pytest\n", "import pytest\npytestmark = pytest.mark.bench\n", 1))
    assert module_problems(path) == []


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_is_registered_and_deselected_by_make_test_fast(tier):
    import re

    root = TESTS.parent
    pyproject = (root / "pyproject.toml").read_text()
    assert re.search(rf'^\s*"{tier}: ', pyproject, re.MULTILINE), f"{tier} is not in [tool.pytest.ini_options]"
    assert "--strict-markers" in pyproject
    makefile = (root / "Makefile").read_text()
    fast = re.search(r'^FAST_SELECT \?= -m "(.*)"$', makefile, re.MULTILINE)
    assert fast and f"not {tier}" in fast.group(1).split(" and ")


# the test modules that import bench/, each a test of the bench module it names (bench/ measures; what tests need
# that is not a benchmark lives in tests/support.py or zenflow_kernels.testing)
BENCH_IMPORTERS = {
    "test_bench.py": "every benchmark entry point",
    "test_results.py": "bench.refresh and bench.harness's record of a result",
    "test_handover.py": "bench.overlap's measurement at test sizes",
    "test_studies.py": "bench.e2e's demo settings against the tuned comparison, bench.e2e_target",
    "test_compiled_rules.py": "bench.custom_rules' RMSprop, the rule the benchmarks time, compiled against eager",
    "gpu_checklist.py": "bench.harness's rank launcher and result writer (run by bench/gpu_suite.sh)",
}


def test_only_the_tests_of_bench_modules_import_bench():
    importers = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bench" or \
                    isinstance(node, ast.Import) and any(a.name.split(".")[0] == "bench" for a in node.names):
                importers.add(path.name)
    assert importers <= set(BENCH_IMPORTERS), sorted(importers - set(BENCH_IMPORTERS))
