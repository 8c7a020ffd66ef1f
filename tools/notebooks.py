"""Execute the ablation notebooks in ``notebooks/`` with nbclient, and save them with their outputs.

    python -m tools.notebooks [--quick] [--no-save] [--timeout S] [NAME ...]

Each notebook runs top to bottom in a fresh ``python3`` kernel started from this interpreter (the
``python3`` kernelspec resolves ``python`` to ``sys.executable``), with the working directory set to
``notebooks/``. ``--quick`` sets ``ZENFLOW_NOTEBOOK_QUICK=1`` (a tiny model, a few steps), which is
what the test suite runs; saving is for full runs (the committed notebooks hold their outputs, so the
plots show without running anything).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
KERNEL = "python3"


def notebook_paths(names: Sequence[str] | None = None) -> list[Path]:
    """The notebooks to run: all of ``notebooks/*.ipynb``, or those named (with or without .ipynb)."""
    if not names:
        return sorted(NOTEBOOKS.glob("*.ipynb"))
    paths = []
    for name in names:
        path = NOTEBOOKS / (name if name.endswith(".ipynb") else f"{name}.ipynb")
        if not path.exists():
            raise SystemExit(f"error: no notebook {path.name!r} in {NOTEBOOKS}")
        paths.append(path)
    return paths


def execute(path: Path, quick: bool = False, timeout: int = 600, save: bool = False, env: dict | None = None):
    """Run one notebook top to bottom; return the executed notebook (written back to ``path`` if ``save``).

    ``env`` entries are set in the kernel's environment (a value of None removes the variable); this process's own
    is left as it is. ``TRITON_INTERPRET`` is removed unless ``env`` sets it: the notebooks time the default CPU path,
    never Triton's interpreter. A failing cell raises ``nbclient.exceptions.CellExecutionError``.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    changes = {"TRITON_INTERPRET": None, **(env or {}), "ZENFLOW_NOTEBOOK_QUICK": "1" if quick else "0"}
    kernel_env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=kernel_env)  # (jupyter_client's start_kernel: the kernel process's environment)
    if save:
        nbformat.write(nb, path)
    return nb


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.notebooks", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebook names (default: all)")
    ap.add_argument("--quick", action="store_true", help="reduced mode (ZENFLOW_NOTEBOOK_QUICK=1)")
    ap.add_argument("--no-save", dest="save", action="store_false", help="do not write the outputs back")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = ap.parse_args(argv)
    for path in notebook_paths(args.names):
        t0 = time.perf_counter()
        execute(path, quick=args.quick, timeout=args.timeout, save=args.save and not args.quick)
        print(f"{path.name}: {time.perf_counter() - t0:.0f} s" + (" (saved)" if args.save and not args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
