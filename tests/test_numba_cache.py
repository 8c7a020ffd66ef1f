"""numba's on-disk cache never serves a host kernel's stale code (cpu_ops/kernels/_jit.py): in a copy of the kernels
package with its own cache directory, a kernel's second run loads it from the cache, and after a change to a helper
it inlines from another file, or to its own file, the next run compiles it again and computes the changed result.
The same helper change under numba's plain ``cache=True`` is shown to run the stale code (the hazard _jit closes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from zenflow_kernels.cpu_ops import kernels

RUN = """
import json
import numpy as np
from kernels_copy.accumulate import accumulate_kernel
acc = np.zeros(4, np.float32)
accumulate_kernel(acc, np.ones(4, np.float32))
print(json.dumps({"acc": acc.tolist(), "cache_hits": sum(accumulate_kernel.stats.cache_hits.values())}))
"""

# accumulate_kernel's loop: acc[i] = acc[i] + load_f32(grad, i); load_f32 is an @overload in _dtype.py
HELPER = ("_dtype.py", "        return lambda a, i: a[i]\n", "        return lambda a, i: a[i] * np.float32(2.0)\n")
KERNEL = ("accumulate.py", "acc[i] = acc[i] + load_f32(grad, i)\n", "acc[i] = acc[i] - load_f32(grad, i)\n")
PLAIN_CACHE = ("_jit.py", "kernel._cache = PackageCache(kernel.py_func)", "kernel.enable_caching()")


def _copy(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(Path(kernels.__file__).parent, root / "kernels_copy", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edit(root: Path, change) -> None:
    file, old, new = change
    path = root / "kernels_copy" / file
    text = path.read_text()
    assert text.count(old) == 1, (file, old)
    path.write_text(text.replace(old, new))


def _run(root: Path) -> tuple[list[float], int]:
    env = dict(os.environ, PYTHONPATH=str(root), NUMBA_CACHE_DIR=str(root / "cache"))
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return got["acc"], got["cache_hits"]


def test_a_changed_helper_or_kernel_is_compiled_again_not_loaded_stale(tmp_path):
    root = _copy(tmp_path, "package")
    assert _run(root) == ([1.0] * 4, 0)  # compiled and cached
    assert _run(root) == ([1.0] * 4, 1)  # loaded from the cache
    _edit(root, HELPER)
    assert _run(root) == ([2.0] * 4, 0)  # the helper's change compiled in, not the cached code
    assert _run(root) == ([2.0] * 4, 1)  # ... and cached again
    _edit(root, KERNEL)
    assert _run(root) == ([-2.0] * 4, 0)


def test_numbas_plain_cache_would_run_the_stale_helper(tmp_path):
    root = _copy(tmp_path, "plain")
    _edit(root, PLAIN_CACHE)
    assert _run(root) == ([1.0] * 4, 0)
    _edit(root, HELPER)
    assert _run(root) == ([1.0] * 4, 1)  # stale: the helper's change is not compiled in
