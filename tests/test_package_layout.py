"""The seam's package imports in one direction (issue: sharding.py and fsdp2.py used to import each other)."""

import ast
from pathlib import Path

import pytest

SHARDING = Path(__file__).resolve().parents[1] / "zenflow_kernels" / "sharding"
ORDER = ["base", "collectives", "zero_context", "zero", "fsdp2"]  # each may import only those before it


def _sibling_imports(module: str) -> set[str]:
    tree = ast.parse((SHARDING / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too: they close a circle as well
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {a.name for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module in ("optim", "sharding"):
            found.add(f"..{node.module}")
    return found


@pytest.mark.parametrize("module", ORDER)
def test_sharding_modules_import_only_those_listed_before_them(module):
    allowed = set(ORDER[: ORDER.index(module)])
    assert _sibling_imports(module) <= allowed, (module, _sibling_imports(module) - allowed)


def test_every_sharding_module_is_in_the_order():
    assert {p.stem for p in SHARDING.glob("*.py")} - {"__init__"} == set(ORDER)
