"""Every ablation notebook runs top to bottom in its reduced mode, and the committed ones hold outputs.

The notebooks run in a ``python3`` kernel started from this interpreter (the kernelspec's ``python``
resolves to ``sys.executable``; checked below), with ``ZENFLOW_NOTEBOOK_QUICK=1`` (a tiny model, a few
steps) and the pre-training cache in a temporary folder shared by the notebooks of this session.
Nothing is written back to the notebooks.
"""

from __future__ import annotations

import os
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tools import notebooks as runner

pytestmark = pytest.mark.notebook

NOTEBOOK_NAMES = ["topk_ratio", "update_interval", "selection_dynamics", "selection_policy", "timeline_model",
                  "update_rules", "concentration", "tuned_comparison"]


def test_every_notebook_is_listed():
    assert sorted(p.stem for p in runner.notebook_paths()) == sorted(NOTEBOOK_NAMES)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pretrain_cache"))


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_runs_quick(name, cache):
    path = runner.NOTEBOOKS / f"{name}.ipynb"
    before = path.read_bytes()
    nb = runner.execute(path, quick=True, timeout=300, save=False, env={"ZENFLOW_E2E_CACHE": cache})
    assert path.read_bytes() == before  # not written back
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code)
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was drawn"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "notebook time:" in text


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_committed_notebook_holds_its_outputs(name):
    """Saved executed (full mode): the plots show on GitHub without running anything."""
    nb = nbformat.read(runner.NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "a code cell was never run"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "QUICK" not in text and "tiny model" not in text  # the full run, not the reduced mode


def test_python3_kernel_is_this_interpreter(tmp_path):
    path = tmp_path / "probe.ipynb"
    nb = new_notebook(cells=[new_code_cell("import sys; print(sys.executable)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    out = runner.execute(path, quick=True, timeout=120)
    printed = out.cells[0].outputs[0]["text"].strip()
    assert os.path.samefile(printed, sys.executable), (printed, sys.executable)


def test_the_kernel_gets_the_environment_asked_for_and_this_process_keeps_its_own(tmp_path, monkeypatch):
    """``env`` and ``quick`` reach the kernel, ``TRITON_INTERPRET`` is removed there, and nothing of it is set or
    removed in the process that runs the notebook."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("ZENFLOW_PROBE", raising=False)
    path = tmp_path / "probe.ipynb"
    names = ("TRITON_INTERPRET", "ZENFLOW_PROBE", "ZENFLOW_NOTEBOOK_QUICK")
    nb = new_notebook(cells=[new_code_cell(f"import os; print([os.environ.get(k) for k in {names!r}])")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    before = dict(os.environ)
    out = runner.execute(path, quick=True, timeout=120, env={"ZENFLOW_PROBE": "seen"})
    assert out.cells[0].outputs[0]["text"].strip() == str([None, "seen", "1"])
    assert dict(os.environ) == before

