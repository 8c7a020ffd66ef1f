"""The package's import graph: no module imports the command line (``zenflow_kernels.__main__``), and no circle.

Every ``import`` and ``from ... import`` of every ``zenflow_kernels/**/*.py`` counts, those inside a function too
(a function-local import is a circle put off, not removed). ``from .a import b`` is an edge to the module ``a.b``
where that is a module, else to ``a``, and to the packages above it that the importer is not inside (importing
``optim.build`` from the top level runs ``optim/__init__.py`` first); ``if TYPE_CHECKING:`` imports never run and
do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zenflow_kernels"
NAME = PACKAGE.name


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """The import statements of ``tree``, anywhere (functions, classes, ``try``), but not under ``TYPE_CHECKING``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if _type_checking_only(node):
            children = list(node.orelse)  # the ``if`` body never runs; an ``else`` would
        stack.extend(children)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                # ``import a.b.c`` runs a.b.c; the nearest enclosing module of the package names the edge
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # and it runs the packages above it (a/__init__.py, a/b/__init__.py) first, but for those the
                # importer sits in (already running before the importer can)
                while target and (target == NAME or target.startswith(NAME + ".")):
                    if target != name and not (name + ".").startswith(target + "."):
                        edges.add(target)
                    target = target.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if colour[root] != WHITE:
            continue
        path, iters = [root], [iter(sorted(graph[root]))]
        colour[root] = GREY
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                colour[path.pop()] = BLACK
                iters.pop()
            elif colour.get(nxt, BLACK) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt) == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_no_module_imports_the_command_line():
    importers = sorted(m for m, edges in import_graph().items() if f"{NAME}.__main__" in edges)
    assert importers == [], f"{importers} import {NAME}.__main__ (the command line): import {NAME}.explain instead"


def test_the_import_graph_has_no_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_finder_sees_a_circle_and_a_function_local_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse("def f():\n    from .x import y\nif TYPE_CHECKING:\n    import z\n")
    assert [ast.unparse(n) for n in _imports(tree)] == ["from .x import y"]


def test_the_graph_resolves_relative_imports():
    graph = import_graph()
    assert f"{NAME}.explain" in graph[f"{NAME}.__main__"]
    assert f"{NAME}.explain" in graph[f"{NAME}.optim.optimizer"]
    assert f"{NAME}.config" in graph[f"{NAME}.optim.build"]
    # a sibling inside the package: no edge to the package it sits in; from outside: the package runs first
    assert f"{NAME}.optim.run" in graph[f"{NAME}.optim.build"] and f"{NAME}.optim" not in graph[f"{NAME}.optim.build"]
    assert f"{NAME}.rules" in graph[f"{NAME}.optim.build"]  # from ..rules import UpdateRule
