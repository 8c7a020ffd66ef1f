"""The library's layout, as facts a test can assert (tests/test_layout.py): the import graph of ``zenflow_kernels``
(every import, module level or inside a function), its cycles, attribute accesses of another object's private
names, and module sizes."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zenflow_kernels"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from .x import y`` names ``x.y`` where that is a module)."""
    mods = modules()
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk finds (empty: the graph is acyclic). A package importing its own submodules
    is not a cycle; a submodule importing its package back is."""
    found, state = [], {}

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif not state.get(nxt):
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            walk(node, [])
    return found


def part_of(module: str) -> str:
    """The part a module belongs to: its subpackage (``link``, ``optim``, ``sharding``, ``cpu_ops``, ...) or, for a
    top-level module, itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names() -> dict[str, set[str]]:
    """Each underscore name the package defines as an attribute of its objects (``self._x = ...``, a method or a
    class attribute ``_x``), with the parts that define it."""
    names: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                names[node.attr].add(part_of(module))
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = ([item.name] if isinstance(item, ast.FunctionDef) else
                               [t.id for t in item.targets if isinstance(t, ast.Name)] if isinstance(item, ast.Assign)
                               else [])
                    names.update({t: names[t] | {part_of(module)} for t in targets if _private(t)})
    return names


def reach_through() -> list[str]:
    """One part touching another's insides: ``obj._name`` where ``obj`` is not ``self``/``cls`` and no module of
    this part defines ``_name``, or ``from <another part> import _name`` (a private module, ``_validate``, is a
    shared helper and may be imported)."""
    own = private_names()
    mods = modules()
    out = []
    for module, path in mods.items():
        part = part_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in own and part not in own[node.attr]:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    out.append(f"{where}: .{node.attr} (defined in {sorted(own[node.attr])})")
            elif isinstance(node, ast.ImportFrom) and node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    if (_private(alias.name) and f"{source}.{alias.name}" not in mods and source in mods
                            and part_of(source) != part):
                        out.append(f"{where}: from {source} import {alias.name}")
    return out


def sizes() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in modules().items()}


if __name__ == "__main__":
    for cycle in cycles(import_graph()):
        print("cycle:", " -> ".join(cycle))
    for line in reach_through():
        print("reach-through:", line)
    for name, n in sorted(sizes().items(), key=lambda kv: -kv[1])[:5]:
        print(f"{n:5d} {name}")


def _touches_state(node: ast.AST) -> bool:
    """Whether an expression reads an optimizer's per-parameter state: ``x.state[...]``, ``x.state.get(...)``,
    ``x.fast_state(...)``."""
    return any(isinstance(n, ast.Attribute) and n.attr in ("state", "fast_state") for n in ast.walk(node))


def state_writers(owner: str = "zenflow_kernels.optim.run") -> list[str]:
    """``module:line`` of every write into an optimizer's per-parameter ``state`` entries outside ``owner``: an
    assignment or augmented assignment to ``<state>[...]`` or to ``name[...]`` where ``name`` was bound to a state
    entry in the same function (or loop), and ``.update(...)`` / ``.setdefault(...)`` / ``.pop(...)`` on one."""
    found = []
    for name, path in modules().items():
        if name == owner or not name.startswith(("zenflow_kernels.optim", "zenflow_kernels.sharding")):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            bound = set()
            for n in ast.walk(fn):
                # (a comprehension over an entry makes a copy: writing that is no write into the state)
                if isinstance(n, ast.Assign) and not isinstance(n.value, (ast.DictComp, ast.Dict)) and _touches_state(
                        n.value):
                    for t in n.targets:
                        bound |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
                elif isinstance(n, (ast.For, ast.comprehension)) and _touches_state(n.iter):
                    bound |= {e.id for e in ast.walk(n.target) if isinstance(e, ast.Name)}

            def entry(target: ast.AST, bound: set = bound) -> bool:
                return isinstance(target, ast.Subscript) and (
                    _touches_state(target.value) or isinstance(target.value, ast.Name) and target.value.id in bound)

            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
                if any(entry(t) for t in targets):
                    found.append(f"{name}:{n.lineno}")
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr in ("update", "setdefault", "pop")
                        and isinstance(n.func.value, ast.Name) and n.func.value.id in bound):
                    found.append(f"{name}:{n.lineno}")
    return found
