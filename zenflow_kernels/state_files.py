"""The host Adam state of one rank's shard in a file (issue 25's NVMe tier, its storage layer).

The fp32 master and both moments of a shard of ``numel`` elements live in one file, cut into blocks of
``block_numel`` elements; block ``j`` holds ``master[jB:(j+1)B]``, ``exp_avg[...]`` and ``exp_avg_sq[...]``
one after the other (12 B per element), so streaming the shard is one sequential read and one sequential
write of whole blocks, each a single ``os.preadv``/``os.pwritev`` of three buffers (both release the GIL).

Files never touch anyone else's: each :class:`StateFiles` creates a private folder under ``nvme_path``
(``tempfile.mkdtemp``: a fresh name, mode 0700) and its file with ``O_EXCL`` (mode 0600); the space is
reserved at creation (``posix_fallocate``), so a disk that is too small fails there, with the path, the
bytes needed and the bytes free, and not in the middle of training. The folder is removed at
:meth:`StateFiles.close`, when the object is collected, at interpreter exit, and when creation fails.
Every I/O error names the file, the operation, the offset and the byte count (:class:`StateFileError`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import tempfile
import weakref

import numpy as np
import torch

__all__ = ["FIELDS", "StateFileError", "StateFiles"]

FIELDS = ("master", "exp_avg", "exp_avg_sq")
_ITEM = 4  # fp32


class StateFileError(OSError):
    """Reading, writing or creating a state file failed (the message names file, operation and offset)."""


class _PosixIO:
    """The system calls, one object so that tests can inject faults (ENOSPC, EIO, short transfers)."""

    preadv = staticmethod(os.preadv)
    pwritev = staticmethod(os.pwritev)
    fallocate = staticmethod(os.posix_fallocate)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _remove(fd: int, folder: str) -> None:
    # module level: the finalizer must not hold the object
    with contextlib.suppress(OSError):
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)


class StateFiles:
    """One shard's master and moments in a file under ``nvme_path`` (module docstring).

    Args:
        nvme_path: an existing directory (a local NVMe mount for speed; any filesystem works).
        numel: elements per field (the shard's flat fp32 size).
        block_numel: elements per block (a multiple of 1024, so that blocks stay 4 KiB-aligned).
        rank: names the file (``rank<r>.state``); ranks on one node share ``nvme_path`` safely anyway.
        direct: open with ``O_DIRECT`` (the page cache does not hold the file; block buffers are page-aligned
            and blocks 4 KiB multiples, as it requires); a filesystem without it (tmpfs) raises at creation.
        io: the system calls (tests pass a faulty one).
    """

    def __init__(self, nvme_path, numel: int, *, block_numel: int = 1 << 20, rank: int = 0, direct: bool = False,
                 io=None):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"StateFiles: numel={numel!r} is invalid: allowed an int >= 0")
        if isinstance(block_numel, bool) or not isinstance(block_numel, int) or block_numel <= 0 or \
                block_numel % 1024:
            raise ValueError(f"StateFiles: block_numel={block_numel!r} is invalid: allowed a positive multiple of 1024")
        path = os.fspath(nvme_path)
        if not os.path.isdir(path):
            raise ValueError(f"StateFiles: nvme_path={path!r} is not an existing directory")
        self.numel, self.block_numel, self._io = numel, block_numel, io or _PosixIO()
        self.blocks = -(-numel // block_numel)
        self.nbytes = self.blocks * block_numel * _ITEM * len(FIELDS)
        self.folder = tempfile.mkdtemp(prefix="zenflow-state-", dir=path)  # 0700, a name nobody else has
        self.path = os.path.join(self.folder, f"rank{rank}.state")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if direct:
            if not hasattr(os, "O_DIRECT"):
                shutil.rmtree(self.folder, ignore_errors=True)
                raise ValueError("StateFiles: direct=True needs O_DIRECT, which this platform lacks")
            flags |= os.O_DIRECT
        self.direct = direct
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise StateFileError(exc.errno, f"ZenFlowAdamW NVMe state: creating {self.path} "
                                 f"{'with O_DIRECT ' if direct else ''}failed: {exc.strerror or exc}") from exc
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.folder)
        try:
            self._reserve()
        except BaseException:
            self.close()
            raise

    def _reserve(self) -> None:
        if not self.nbytes:
            return
        stat = os.statvfs(self.folder)
        free = stat.f_bavail * stat.f_frsize
        need = f"{self.nbytes} bytes ({self.nbytes / 2**30:.2f} GiB: master and both Adam moments, fp32)"
        if self.nbytes > free:
            raise StateFileError(errno.ENOSPC, f"ZenFlowAdamW NVMe state: {self.path} needs {need}, the filesystem "
                                 f"has {free} bytes free")
        try:
            self._io.fallocate(self._fd, 0, self.nbytes)
        except OSError as exc:
            raise StateFileError(exc.errno, f"ZenFlowAdamW NVMe state: reserving {need} for {self.path} failed: "
                                 f"{exc.strerror or exc} ({free} bytes were free)") from exc

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Close and remove the file and its folder (idempotent)."""
        self._finalizer()

    def block_range(self, j: int) -> tuple[int, int]:
        """Block ``j``'s elements ``[lo, hi)`` of each field (the last block may be shorter than its size)."""
        lo = j * self.block_numel
        return lo, min(lo + self.block_numel, self.numel)

    def pieces(self, lo: int, hi: int):
        """The blocks holding elements ``[lo, hi)``: ``(j, a, s, e)`` for each, ``a`` the block's first element and
        ``[s, e)`` its part of the range."""
        for j in range(lo // self.block_numel, -(-hi // self.block_numel)):
            a, b = self.block_range(j)
            yield j, a, max(a, lo), min(b, hi)

    def new_block(self) -> list[torch.Tensor]:
        """Three fp32 buffers of one block (master, exp_avg, exp_avg_sq), page-aligned (an anonymous mapping,
        given back to the system when the tensors go)."""
        mapped = mmap.mmap(-1, self.block_numel * _ITEM * len(FIELDS))
        flat = torch.from_numpy(np.frombuffer(mapped, dtype=np.float32))
        return list(flat.view(len(FIELDS), self.block_numel).unbind(0))

    def _transfer(self, op: str, j: int, bufs: list[torch.Tensor]) -> None:
        if self.closed:
            raise StateFileError(errno.EBADF, f"ZenFlowAdamW NVMe state: {op} of block {j} after close ({self.path})")
        offset = j * self.block_numel * _ITEM * len(FIELDS)
        want = self.block_numel * _ITEM * len(FIELDS)
        call = self._io.preadv if op == "read" else self._io.pwritev
        views = [_bytes(b) for b in bufs]
        done = 0
        try:
            while done < want:  # a short transfer continues where it stopped
                n = call(self._fd, _tail(views, done), offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "end of file" if op == "read" else "nothing written")
                done += n
        except OSError as exc:
            raise StateFileError(exc.errno, f"ZenFlowAdamW NVMe state: {op} of {want} bytes at offset {offset + done} "
                                 f"of {self.path} failed: {exc.strerror or exc}") from exc

    def read_block(self, j: int, bufs: list[torch.Tensor]) -> None:
        """Block ``j`` into ``bufs`` (from :meth:`new_block`)."""
        self._transfer("read", j, bufs)

    def write_block(self, j: int, bufs: list[torch.Tensor]) -> None:
        """``bufs`` into block ``j``."""
        self._transfer("write", j, bufs)

    def read(self, field: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of one field, as a new fp32 tensor (checkpoints, the fast path's reads)."""
        k = FIELDS.index(field)
        out = torch.empty(hi - lo, dtype=torch.float32)
        bufs = self.new_block()
        for j, a, s, e in self.pieces(lo, hi):
            self.read_block(j, bufs)
            out[s - lo : e - lo] = bufs[k][s - a : e - a]
        return out

    def write(self, field: str, lo: int, data: torch.Tensor) -> None:
        """``data`` (fp32, flat) into elements ``[lo, lo + len)`` of one field (read-modify-write of its blocks)."""
        k, hi = FIELDS.index(field), lo + data.numel()
        bufs = self.new_block()
        for j, a, s, e in self.pieces(lo, hi):
            self.read_block(j, bufs)
            bufs[k][s - a : e - a] = data[s - lo : e - lo]
            self.write_block(j, bufs)


def _tail(views: list[memoryview], skip: int) -> list[memoryview]:
    """The buffers after their first ``skip`` bytes (to resume a short transfer)."""
    out = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out
