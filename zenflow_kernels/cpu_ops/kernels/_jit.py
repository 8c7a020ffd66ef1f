"""How every host kernel is compiled, and the on-disk cache that keeps it fresh.

numba's ``cache=True`` stamps a kernel's cache index with the file that defines the kernel, and loads the cached
machine code while that file is unchanged, even when an ``@njit``/``@overload``/``@intrinsic`` helper the kernel
inlined from another file has changed (the stale code would run). ``host_kernel`` caches the same way but stamps
the index with every source file of this package as well (``SOURCES_DIGEST``), so a change to any of them,
helper or kernel, recompiles every kernel on its next call. The package holds numba code only, so editing a
launcher recompiles nothing. tests/test_numba_cache.py checks both cases in a copy of the package.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba import njit
from numba.core.caching import FunctionCache, IndexDataCacheFile

REDUCE_FASTMATH = {"reassoc", "contract", "nsz"}
"""The only fastmath flags used, by the sums of squares (see the package's docstring)."""


def sources_digest(folder: Path) -> str:
    """sha256 of the names and bytes of every ``*.py`` file in ``folder``."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


SOURCES_DIGEST = sources_digest(Path(__file__).parent)  # read as the package is imported: the code that runs

KERNELS: dict = {}
"""Every host kernel by name (the modules that define them register them as they are imported)."""


class PackageCache(FunctionCache):
    """numba's per-function cache, fresh only while the kernel's file and ``SOURCES_DIGEST`` are unchanged: a stale
    index is emptied (and its entries overwritten) as numba does when the kernel's own file changes."""

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = IndexDataCacheFile(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=(self._impl.locator.get_source_stamp(), SOURCES_DIGEST),
        )


def host_kernel(fastmath=False):
    """``njit(parallel=True, nogil=True, cache=True, fastmath=fastmath)`` with ``PackageCache`` as the cache."""

    def compile_later(py_func):
        kernel = njit(parallel=True, nogil=True, fastmath=fastmath)(py_func)
        kernel._cache = PackageCache(kernel.py_func)  # what cache=True sets (Dispatcher.enable_caching), restamped
        KERNELS[py_func.__name__] = kernel
        return kernel

    return compile_later
