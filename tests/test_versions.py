"""The dependency floors in pyproject.toml are the ones checked, and every kernel module imports.

* The installed torch, triton, numba and numpy satisfy pyproject's [project].dependencies (read here,
  so the floors and this test cannot drift apart), and the running Python its requires-python.
* ``make test-min`` runs this file in .venv-min with triton, numba and numpy at exactly their floors
  (ZENFLOW_AT_FLOORS names the packages that must be at the floor there); the Makefile's pins for it
  are the floors of pyproject.toml, and the CPU torch the Makefile installs satisfies torch's range.
* Every module under zenflow_kernels/triton/ and zenflow_kernels/cpu_ops/ imports. That each
  @triton.jit kernel is compiled is tests/test_triton_compile.py's own check.

packaging and (on Python 3.10) tomli are pytest's own dependencies.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pkgutil
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
REQUIREMENTS = {Requirement(d).name: Requirement(d) for d in PYPROJECT["project"]["dependencies"]}
CORE = ["torch", "triton", "numba", "numpy"]


def floor(name: str) -> Version:
    (spec,) = REQUIREMENTS[name].specifier
    return Version(spec.version)


def installed(name: str) -> Version:
    try:
        return Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{name} is a dependency ({REQUIREMENTS[name]}) but is not installed")


def test_the_core_dependencies_are_floors_only():
    """One lower bound each, no upper bound (torch's range lets the Makefile's CPU build satisfy it)."""
    assert set(CORE) <= set(REQUIREMENTS), REQUIREMENTS
    for name in CORE:
        specs = list(REQUIREMENTS[name].specifier)
        assert [s.operator for s in specs] == [">="], f"{name}: {REQUIREMENTS[name]}"


@pytest.mark.parametrize("name", CORE)
def test_the_installed_version_satisfies_the_floor(name):
    req = REQUIREMENTS[name]
    if req.marker is not None and not req.marker.evaluate():
        pytest.skip(f"{req} does not apply here")
    version = installed(name)
    assert req.specifier.contains(version, prereleases=True), f"{name} {version} installed; pyproject says {req}"


def test_the_python_satisfies_requires_python():
    python = ".".join(map(str, sys.version_info[:3]))
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(python)


AT_FLOORS = os.environ.get("ZENFLOW_AT_FLOORS", "").split()


@pytest.mark.skipif(not AT_FLOORS, reason="ZENFLOW_AT_FLOORS is unset (only `make test-min` sets it)")
@pytest.mark.parametrize("name", AT_FLOORS)
def test_make_test_min_runs_at_the_floor(name):
    version = installed(name)
    assert Version(version.base_version) == floor(name), f"{name} {version} installed; its floor is {floor(name)}"


def _make_variable(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert m, f"Makefile sets no {name}"
    return m.group(1).strip()


def test_make_test_min_pins_the_floors():
    pins = dict(p.split("==") for p in _make_variable("MIN_PINS").split())
    assert {n: Version(v) for n, v in pins.items()} == {n: floor(n) for n in ["triton", "numba", "numpy"]}
    assert set(_make_variable("MIN_AT_FLOORS").split()) == set(pins)


def test_the_makefiles_cpu_torch_satisfies_the_torch_range():
    """`make` installs TORCH_PIN before the project, so pip has no torch to fetch."""
    name, version = _make_variable("TORCH_PIN").split("==")
    assert name == "torch" and REQUIREMENTS["torch"].specifier.contains(version)


def _modules(package: str) -> list[str]:
    """The package and every module below it (cpu_ops/kernels/ too: the numba kernels and their cache)."""
    path = REPO.joinpath(*package.split("."))
    return [package] + [name for m in pkgutil.iter_modules([str(path)]) for name in (
        _modules(f"{package}.{m.name}") if m.ispkg else [f"{package}.{m.name}"])]


@pytest.mark.parametrize("module", _modules("zenflow_kernels.triton") + _modules("zenflow_kernels.cpu_ops"))
def test_every_kernel_module_imports(module):
    if module.startswith("zenflow_kernels.triton"):
        req = REQUIREMENTS["triton"]
        if req.marker is not None and not req.marker.evaluate():
            pytest.skip(f"{req} does not apply here")
    importlib.import_module(module)
