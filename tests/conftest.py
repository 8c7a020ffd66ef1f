"""Test-session setup.

TRITON_INTERPRET must be set before ``triton`` is first imported (it is read when kernels are
decorated), so it is set here, at import time, before any test module imports the package. With it
set, ``ops`` runs the Triton kernels on CPU tensors; tests that exercise the optimizer's logic
rather than the kernels pin the fast torch path with ``ops.use_backend("torch")``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep numba's first-compile cost out of repeated runs and its threads modest on 2-core machines.
os.environ.setdefault("NUMBA_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
