"""Test-session setup.

TRITON_INTERPRET must be set before ``triton`` is first imported (it is read when kernels are
decorated), so it is set here, at import time, before any test module imports the package. With it
set, ``ops`` runs the Triton kernels on CPU tensors; tests that exercise the optimizer's logic
rather than the kernels pin the fast torch path with ``ops.use_backend("torch")``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep numba's threads modest on 2-core machines.
os.environ.setdefault("NUMBA_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
# torch and numba each bring an OpenMP runtime; with the default active wait, the idle threads of one
# spin on the cores the other needs (10x slower steps on 2 cores). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest  # noqa: E402  (after the environment above)


def pytest_configure(config):
    """Before pytest-xdist starts its workers: compile and cache the numba kernels once (tests/numba_warmup.py), so
    that no two processes create the same cache entry at the same time (numba/numba#4807)."""
    if hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None) in (None, 0):
        return  # a worker, or one process (nothing races)
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "numba_warmup.py"
    root = script.parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, str(script)], cwd=root, env=env, check=True, timeout=900)


@pytest.fixture
def numba_backend():
    """The host's numba kernels for the device's too (a module uses it with ``pytestmark``): optimizer-level tests
    that run many steps; the Triton kernels have their own tests against torch (tests/test_triton_*.py), and under
    TRITON_INTERPRET=1 they would run in numpy here."""
    from zenflow_kernels.ops import use_backend

    with use_backend("numba"):
        yield


@pytest.fixture
def host_workers_made(monkeypatch):
    """The keyword arguments of every HostWorker the link package creates from here on (threads, cores,
    timeout, name), in creation order (every module of it starts its workers through ``completions.new_worker``)."""
    from zenflow_kernels.link import completions
    from zenflow_kernels.link.worker import HostWorker

    made = []

    class Recording(HostWorker):
        def __init__(self, **kwargs):
            made.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(completions, "HostWorker", Recording)
    return made

