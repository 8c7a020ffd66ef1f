"""The host state of an update rule for one rank's shard in a file (issue 25's NVMe tier, its storage layer).

The fp32 fields of a shard of ``numel`` elements (``fields``: ``master`` and the rule's ``state_names``) live in one
file, cut into blocks of ``block_numel`` elements; block ``j`` holds each field's elements ``[jB, (j+1)B)`` one
after the other (4 B per element and field: AdamW's ``master``, ``exp_avg``, ``exp_avg_sq`` take 12 B), so
streaming the shard is one sequential read and one sequential write of whole blocks, each a single
``os.preadv``/``os.pwritev`` of one buffer per field (both release the GIL).

Files never touch anyone else's: each :class:`StateFiles` creates a private folder under ``nvme_path``
(``tempfile.mkdtemp``: a fresh name, mode 0700) and its file with ``O_EXCL`` (mode 0600); the space is
reserved at creation (``posix_fallocate``), so a disk that is too small fails there, with the path, the
bytes needed and the bytes free, and not in the middle of training. The folder is removed at
:meth:`StateFiles.close`, when the object is collected, at interpreter exit, and when creation fails. A
closed file is gone from ``nvme_path`` but stays readable through its open descriptor until the object is
collected (or :meth:`StateFiles.release`): ``state_dict()`` after the optimizer's ``close()`` works, as it does
with the state in memory, whose buffers also live as long as the optimizer object.
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

__all__ = ["StateFileError", "StateFiles"]

_ITEM = 4  # fp32
_PAGE = 1024  # elements: 4 KiB, the alignment O_DIRECT needs of offsets and sizes


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
    """One shard's master and update-rule state in a file under ``nvme_path`` (module docstring).

    Args:
        nvme_path: an existing directory (a local NVMe mount for speed; any filesystem works).
        numel: elements per field (the shard's flat fp32 size).
        fields: the fp32 fields of each block, in order: the update rule's ``("master", *rule.state_names)``
            (required: which fields there are is the rule's, never a default).
        block_numel: elements per block (a multiple of 1024, so that blocks stay 4 KiB-aligned).
        rank: names the file (``rank<r>.state``); ranks on one node share ``nvme_path`` safely anyway.
        direct: open with ``O_DIRECT`` (the page cache does not hold the file; block buffers are page-aligned
            and blocks 4 KiB multiples, as it requires); a filesystem without it (tmpfs) raises at creation.
        io: the system calls (tests pass a faulty one).
        owner: what the errors call the optimizer whose state this is (``ZenFlowAdamW``, ``ZenFlow(Lion)``, ...).
    """

    def __init__(self, nvme_path, numel: int, *, fields: tuple[str, ...], block_numel: int = 1 << 20, rank: int = 0,
                 direct: bool = False, io=None, owner: str = "ZenFlow"):
        self.owner = owner
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"StateFiles: numel={numel!r} is invalid: allowed an int >= 0")
        if isinstance(block_numel, bool) or not isinstance(block_numel, int) or block_numel <= 0 or \
                block_numel % 1024:
            raise ValueError(f"StateFiles: block_numel={block_numel!r} is invalid: allowed a positive multiple of 1024")
        path = os.fspath(nvme_path)
        if not os.path.isdir(path):
            raise ValueError(f"StateFiles: nvme_path={path!r} is not an existing directory")
        if not fields or len(set(fields)) != len(fields) or not all(isinstance(f, str) for f in fields):
            raise ValueError(f"StateFiles: fields={fields!r} is invalid: allowed distinct names, at least one")
        self.fields = tuple(fields)
        self.numel, self.block_numel, self._io = numel, block_numel, io or _PosixIO()
        self.nvme_path = path
        self._removed = False
        self.blocks = -(-numel // block_numel)
        self.nbytes = self.blocks * block_numel * _ITEM * len(self.fields)
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
            raise StateFileError(exc.errno, f"{self.owner} NVMe state: creating {self.path} "
                                 f"{'with O_DIRECT ' if direct else ''}failed: {exc.strerror or exc}") from exc
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.folder)
        try:
            self._reserve()
        except BaseException:
            self.release()
            raise

    def _reserve(self, fd: int | None = None, path: str | None = None, nbytes: int | None = None,
                 what: str | None = None) -> None:
        """Space for ``nbytes`` in ``fd`` (default: the state file), refused with the bytes needed and free (and
        ``what`` they hold; default: the fields, fp32)."""
        fd, path = (self._fd, self.path) if fd is None else (fd, path)
        nbytes = self.nbytes if nbytes is None else nbytes
        what = f"the fields {', '.join(self.fields)}, fp32" if what is None else what
        if not nbytes:
            return
        stat = os.statvfs(self.nvme_path)
        free = stat.f_bavail * stat.f_frsize
        need = f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB: {what})"
        if nbytes > free:
            raise StateFileError(errno.ENOSPC, f"{self.owner} NVMe state: {path} needs {need}, the filesystem "
                                 f"has {free} bytes free")
        try:
            self._io.fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise StateFileError(exc.errno, f"{self.owner} NVMe state: reserving {need} for {path} failed: "
                                 f"{exc.strerror or exc} ({free} bytes were free)") from exc

    @property
    def closed(self) -> bool:
        """The file is gone from ``nvme_path`` (:meth:`close`): no more writes; reads until :meth:`release`."""
        return self._removed or self.released

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the file and its folder from ``nvme_path`` (idempotent). The open descriptor keeps the data
        readable (:meth:`read`, :meth:`snapshot`) and its disk space held until :meth:`release` or collection."""
        self._removed = True
        shutil.rmtree(self.folder, ignore_errors=True)

    def release(self) -> None:
        """Close the descriptor too: the disk space is given back (idempotent; also when collected, at exit)."""
        self._removed = True
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
        """One fp32 buffer per field of one block (``fields`` order), page-aligned (a private anonymous
        mapping, given back to the system when the tensors go; a shared one would count as page cache)."""
        mapped = mmap.mmap(-1, self.block_numel * _ITEM * len(self.fields), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.from_numpy(np.frombuffer(mapped, dtype=np.float32))
        return list(flat.view(len(self.fields), self.block_numel).unbind(0))

    def _transfer(self, op: str, j: int, bufs: list[torch.Tensor]) -> None:
        if self.released or (op == "write" and self.closed):
            raise StateFileError(errno.EBADF, f"{self.owner} NVMe state: {op} of block {j} after "
                                 f"{'release' if self.released else 'close'} ({self.path})")
        self._move(op, self._fd, self.path, j * self.block_numel * _ITEM * len(self.fields), [_bytes(b) for b in bufs])

    def _move(self, op: str, fd: int, path: str, offset: int, views: list[memoryview]) -> None:
        """One vectored read or write of ``views`` at ``offset`` of ``fd`` (a short transfer continues where it
        stopped); a failure names ``path``, the operation, the offset reached and the byte count."""
        want = sum(len(v) for v in views)
        call = self._io.preadv if op == "read" else self._io.pwritev
        done = 0
        try:
            while done < want:
                n = call(fd, _tail(views, done), offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "end of file" if op == "read" else "nothing written")
                done += n
        except OSError as exc:
            raise StateFileError(exc.errno, f"{self.owner} NVMe state: {op} of {want} bytes at offset {offset + done} "
                                 f"of {path} failed: {exc.strerror or exc}") from exc

    def read_block(self, j: int, bufs: list[torch.Tensor]) -> None:
        """Block ``j`` into ``bufs`` (from :meth:`new_block`)."""
        self._transfer("read", j, bufs)

    def write_block(self, j: int, bufs: list[torch.Tensor]) -> None:
        """``bufs`` into block ``j``."""
        self._transfer("write", j, bufs)

    def read(self, field: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of one field, as a new fp32 tensor (the fast path's reads of a parameter): only
        that field's part of each block is read (rounded out to 4 KiB, as ``O_DIRECT`` requires), a third of the
        block's bytes."""
        if self.released:
            raise StateFileError(errno.EBADF, f"{self.owner} NVMe state: read after release ({self.path})")
        k = self.fields.index(field)
        out = torch.empty(hi - lo, dtype=torch.float32)
        buf = self.new_block()[0]
        for j, a, s, e in self.pieces(lo, hi):
            first = (s - a) // _PAGE * _PAGE
            stop = min(-(-(e - a) // _PAGE) * _PAGE, self.block_numel)
            offset = ((j * len(self.fields) + k) * self.block_numel + first) * _ITEM
            self._move("read", self._fd, self.path, offset, [_bytes(buf[: stop - first])])
            out[s - lo : e - lo] = buf[s - a - first : e - a - first]
        return out

    def write(self, field: str, lo: int, data: torch.Tensor) -> None:
        """``data`` (any float tensor, its elements flat) into elements ``[lo, lo + len)`` of one field
        (read-modify-write of its blocks: :meth:`write_many` of one item)."""
        self.write_many([(field, lo, data)])

    def write_many(self, items, *, fresh: bool = False) -> dict:
        """Several writes ``(field, lo, value)`` (``value``: any float tensor, any device, its elements flat) in one
        pass over the blocks they touch, in file order: each block read once, filled and written once (``fresh``: a
        file nothing was written to yet, whose blocks are zeros, is not read). Values are converted to fp32 on
        the host a block's piece at a time, so the pass holds one block whatever the tensors' sizes (building the
        file of a model of many tensors, loading a checkpoint). Returns the blocks read and written."""
        flat: dict[int, torch.Tensor] = {}

        def copier(n: int, value: torch.Tensor):
            def fill(dst: torch.Tensor, s: int, e: int, last: bool) -> None:
                if n not in flat:
                    flat[n] = value.detach().reshape(-1)  # a view unless the value is not contiguous
                dst.copy_(flat[n][s:e])  # converted (and copied from its device) a block's piece at a time
                if last:
                    del flat[n]
            return fill

        return self.fill_many([(field, lo, value.numel(), copier(n, value))
                               for n, (field, lo, value) in enumerate(items)], fresh=fresh)

    def fill_many(self, items, *, fresh: bool = False) -> dict:
        """The pass of :meth:`write_many` for items ``(field, lo, numel, fill)``: ``fill(dst, s, e, last)`` writes
        the item's elements ``[s, e)`` into ``dst`` (the block's part of them, holding what the file has: a
        partial update such as a matrix's columns reads and writes each block once too); ``last`` says it is the
        item's last piece."""
        plan: dict[int, list] = {}
        for n, (field, lo, numel, _) in enumerate(items):
            k = self.fields.index(field)
            for j, a, s, e in self.pieces(lo, lo + numel):
                plan.setdefault(j, []).append((n, k, a, s, e, lo))
        last_block = {n: j for j in sorted(plan) for n, *_ in plan[j]}
        bufs = self.new_block()
        reads = 0
        for j in sorted(plan):
            if fresh:
                for b in bufs:
                    b.zero_()
            else:
                self.read_block(j, bufs)
                reads += 1
            for n, k, a, s, e, lo in plan[j]:
                items[n][3](bufs[k][s - a : e - a], s - lo, e - lo, last_block[n] == j)
            self.write_block(j, bufs)
        return {"read": reads, "written": len(plan)}

    def snapshot(self, extra: torch.Tensor | None = None) -> torch.Tensor:
        """The fields as they are now, ``[len(fields), numel]`` fp32 (``fields`` order; one row more with ``extra``,
        a flat tensor of ``numel`` elements anywhere, e.g. the gradient sums, copied as the last), held by a new
        file, mapped shared and unlinked at once: none of it sits in the process's anonymous memory (the
        kernel pages it in as it is read, e.g. by ``torch.save`` or ``torch.distributed.checkpoint``, and may drop
        those pages again; what is written into it, e.g. a DCP load into the state dict, goes to the file, which
        nobody else maps), it stays valid after :meth:`close`, and its disk space is given back when the last
        tensor viewing it goes. Written through the page cache and dropped from it as it goes
        (``fdatasync`` + ``POSIX_FADV_DONTNEED`` every few blocks). Made directly under ``nvme_path`` (a fresh
        name, mode 0600, visible only while it is written), so that it works after :meth:`close` too."""
        n, rows = self.numel, len(self.fields) + (extra is not None)
        if self.released:
            raise StateFileError(errno.EBADF, f"{self.owner} NVMe state: a snapshot after release ({self.path})")
        if extra is not None and tuple(extra.shape) != (n,):
            raise ValueError(f"StateFiles.snapshot: extra has shape {tuple(extra.shape)}, allowed ({n},)")
        if n == 0:
            return torch.zeros(rows, 0)
        fd, path = tempfile.mkstemp(prefix="zenflow-snapshot-", dir=self.nvme_path)  # O_EXCL, 0600
        try:
            self._reserve(fd, path, rows * n * _ITEM, f"a checkpoint's copy of the fields {', '.join(self.fields)}"
                          + (" and the gradient sums" if extra is not None else ""))
            bufs = self.new_block()
            for j in range(self.blocks):
                self.read_block(j, bufs)
                a, b = self.block_range(j)
                for k in range(len(self.fields)):
                    self._move("write", fd, path, (k * n + a) * _ITEM, [_bytes(bufs[k][: b - a])])
                if extra is not None:
                    piece = extra[a:b].to("cpu", torch.float32).contiguous()
                    self._move("write", fd, path, (len(self.fields) * n + a) * _ITEM, [_bytes(piece)])
                if j % 8 == 7 or j == self.blocks - 1:  # keep the page cache from holding the copy
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            flat = torch.from_file(path, shared=True, size=rows * n, dtype=torch.float32)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return flat.view(rows, n)


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
