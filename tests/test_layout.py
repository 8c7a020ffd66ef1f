"""The library's layout holds (tools/layout.py computes it from the source): no import cycle anywhere in
zenflow_kernels (every import, inside functions too), no part touching another part's private names, no test module
importing another, module sizes bounded, and the optimizer a facade whose class stays small. The checks are shown to
fail on a planted cycle and a planted reach-through."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("layout", ROOT / "tools" / "layout.py")
layout = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = layout
_spec.loader.exec_module(layout)


def test_the_library_has_no_import_cycle():
    graph = layout.import_graph()
    assert graph["zenflow_kernels.optim.optimizer"] >= {"zenflow_kernels.optim.selection", "zenflow_kernels.handover"}
    assert layout.cycles(graph) == []
    planted = {k: set(v) for k, v in graph.items()}
    planted["zenflow_kernels.link.factory"].add("zenflow_kernels.optim.optimizer")  # optim -> build -> link -> here
    assert any("zenflow_kernels.link.factory" in c and "zenflow_kernels.optim.optimizer" in c
               for c in layout.cycles(planted))


def test_no_part_touches_another_parts_private_names(tmp_path, monkeypatch):
    assert layout.reach_through() == []
    # planted: a module of another part reaching into the optimizer's interval ledger
    fake = tmp_path / "zenflow_kernels"
    (fake / "sharding").mkdir(parents=True)
    (fake / "optim").mkdir()
    (fake / "optim" / "interval.py").write_text(
        "class HostInterval:\n    def __init__(self):\n        self._ledger = 0\n")
    (fake / "sharding" / "peek.py").write_text("def peek(interval):\n    return interval._ledger\n")
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    monkeypatch.setattr(layout, "PACKAGE", fake)
    assert [line.split(": ", 1)[1] for line in layout.reach_through()] == ["._ledger (defined in ['optim'])"]


def test_modules_are_small_and_the_optimizer_is_a_facade():
    """At most ~600 lines a module (the numba kernels too, one op a module: cpu_ops/kernels/_jit.py keeps their
    cache fresh across files). ``ZenFlow`` itself (the torch surface and step()'s order of calls,
    about half of it docstrings; ``ZenFlowAdamW`` is it with ``rules.AdamW``) is at most 500 lines; its parts are in
    optim/."""
    sizes = layout.sizes()
    over = {name: n for name, n in sizes.items() if n > 600}
    assert over == {}
    tree = ast.parse((ROOT / "zenflow_kernels" / "optim" / "optimizer.py").read_text())
    facade = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ZenFlow")
    assert facade.end_lineno - facade.lineno + 1 <= 500
    assert {"selection_class", "fast_path_class", "interval_class", "schedule_class"} <= {
        t.id for n in facade.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def test_the_benchmarks_and_studies_stay_under_half_the_librarys_lines():
    """bench/ measures and studies/ answers questions; together they stay under half of the library's lines (issue
    57: bench/ alone had grown to 72% of it), so that a new measurement condenses or retires an old one."""
    lines = {folder: sum(len(p.read_text().splitlines()) for p in (ROOT / folder).rglob("*.py"))
             for folder in ("zenflow_kernels", "bench", "studies")}
    assert 2 * (lines["bench"] + lines["studies"]) < lines["zenflow_kernels"], lines


def test_no_test_module_imports_another_and_only_workers_touch_sys_path():
    """(A rank or child process's script, a separate file or a string it runs, may put tests/ on its path.)"""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    names = {p.stem for p in tests}
    for path in tests:
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & names, f"{path.name} imports {sorted(imported & names)}"
        touches = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path" and
                   isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert touches == [], f"{path.name} edits sys.path at lines {touches} (worker scripts may; test modules not)"


def test_the_per_parameter_state_has_one_writer(tmp_path, monkeypatch):
    """``optimizer.state[p]`` is written only by ``BuiltOptimizer.set_state`` / ``BuiltOptimizer.replace_state``
    (optim/run.py): selection's column moves and votes, the fast path's vectors and step counts and a checkpoint's
    restore all go through them, and ``BuiltOptimizer.fast_state`` hands the parts a read-only view. The scan is
    shown to find planted writes."""
    assert layout.state_writers() == []
    fake = tmp_path / "zenflow_kernels"
    (fake / "optim").mkdir(parents=True)
    (fake / "optim" / "peek.py").write_text(
        "def a(run, i):\n    st = run.fast_state(i)\n    st['step'] = 0\n"
        "def b(run, p):\n    run.state[p]['selected'] = None\n"
        "def c(run):\n    for st in run.state.values():\n        st.update(x=1)\n"
        "def d(run, p):\n    copy = {k: v for k, v in run.state[p].items()}\n    copy['x'] = 1\n")
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    monkeypatch.setattr(layout, "PACKAGE", fake)
    assert layout.state_writers() == ["zenflow_kernels.optim.peek:3", "zenflow_kernels.optim.peek:5",
                                      "zenflow_kernels.optim.peek:8"]


def test_fast_state_is_read_only():
    import pytest
    import torch

    from zenflow_kernels import ZenFlowAdamW

    w = torch.nn.Parameter(torch.randn(4, 6))
    with ZenFlowAdamW([w], lr=1e-2, zenflow=dict(topk_ratio=0.5, full_warm_up_rounds=0, update_interval=2,
                                                     select_strategy="step", select_interval=4)) as opt:
        w.grad = torch.randn(4, 6)
        opt.step()
        view = opt.run.fast_state(0)
        assert "selected" in view
        with pytest.raises(TypeError):
            view["selected"] = None
