"""ops dispatch: device and environment pick the implementation, use_backend overrides it, and the
module imports (and runs on torch) where triton is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from zenflow_kernels import ops, torch_ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
REPO = Path(__file__).resolve().parents[1]


def launches_of(fn):
    from zenflow_kernels.triton._util import count_launches

    with count_launches() as n:
        fn()
    return sum(n.values())


def test_public_names_resolve_to_ops():
    import zenflow_kernels

    for name in ops.__all__:
        assert getattr(zenflow_kernels, name) is getattr(ops, name), name


def test_use_backend_context_and_plain_call():
    assert ops.current_backend() == "auto"
    with ops.use_backend("torch") as b:
        assert repr(b) == "use_backend('torch')" and ops.current_backend() == "torch"
        with ops.use_backend("triton"):
            assert ops.current_backend() == "triton"
        assert ops.current_backend() == "torch"
    assert ops.current_backend() == "auto"
    token = ops.use_backend("torch")  # plain call: stays in effect until changed
    try:
        assert ops.current_backend() == "torch"
        seen = []
        t = threading.Thread(target=lambda: seen.append(ops.current_backend()))
        t.start()
        t.join()
        assert seen == ["auto"]  # per thread: another thread is not affected
    finally:
        token.__exit__(None, None, None)
    assert ops.current_backend() == "auto"
    names = r"\('auto', 'torch', 'numba', 'triton'\)"
    with pytest.raises(ValueError, match=rf"use_backend: name must be one of {names}, got 'cuda'"):
        ops.use_backend("cuda")


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_auto_dispatch_on_cpu_follows_the_environment(monkeypatch):
    g = torch.randn(8, 6)
    assert launches_of(lambda: ops.column_scores(g)) == 1  # interpreter requested: Triton on CPU
    with ops.use_backend("torch"):
        assert launches_of(lambda: ops.column_scores(g)) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launches_of(lambda: ops.column_scores(g)) == 0  # plain CPU: the torch path
    with ops.use_backend("triton"), pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        ops.column_scores(g)
    assert torch.equal(ops.column_scores(g), torch_ops.column_scores(g))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_dispatch_on_cuda_uses_triton():
    g = torch.randn(64, 48, device="cuda")
    assert launches_of(lambda: ops.column_scores(g)) >= 1
    with ops.use_backend("torch"):
        assert launches_of(lambda: ops.column_scores(g)) == 0


def test_import_without_triton():
    """Block ``import triton``: ops imports, "auto" runs torch on CPU, "triton" raises a clear error."""
    code = textwrap.dedent(
        """
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")
        sys.meta_path.insert(0, Block())
        import os; os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from zenflow_kernels import ops
        s = ops.column_scores(torch.ones(3, 2))
        assert s.tolist() == [3.0, 3.0], s
        assert ops.topk_columns(torch.tensor([1.0, 3.0, 2.0]), 2).tolist() == [1, 2]
        try:
            with ops.use_backend("triton"):
                ops.column_scores(torch.ones(3, 2))
        except RuntimeError as e:
            assert "triton cannot be imported" in str(e), e
            print("OK")
        assert "triton" not in sys.modules
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
