"""The NVMe tier's storage layer (issue 25): an update rule's host state in a private file (here AdamW's), streamed
through the in-memory host's kernel (the rule's ``host_step_``: AdamW's numba Adam) block by block with the same
bits, and every fault (no space, an I/O error at an offset, a short transfer) either handled or raised naming file
and offset, with nothing left on disk."""

import errno
import os
import stat
import subprocess
import sys
from io import BytesIO

import pytest
import torch
from support import recording_device_sums

from zenflow_kernels import cpu_ops
from zenflow_kernels.rules import AdamW
from zenflow_kernels.state_files import StateFileError, StateFiles, _PosixIO
from zenflow_kernels.streamed_host import DeviceSums, RangeStep, streamed_host_step_

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
ADAMW = AdamW()
FIELDS = ("master", *ADAMW.state_names)  # the fields of AdamW's host state, in the file's order


def test_files_are_private_unique_reserved_and_removed(tmp_path):
    a = StateFiles(tmp_path, 5000, fields=FIELDS, block_numel=1024)
    b = StateFiles(tmp_path, 5000, fields=FIELDS, block_numel=1024)  # the same path, the same rank: no collision
    assert a.path != b.path and os.path.dirname(a.path) != os.path.dirname(b.path)
    assert stat.S_IMODE(os.stat(a.folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
    assert os.stat(a.path).st_size == a.nbytes == 5 * 1024 * 12  # reserved at creation
    assert os.stat(a.path).st_blocks * 512 >= a.nbytes  # allocated, not a sparse file
    a.close()
    a.close()  # idempotent
    assert not os.path.exists(a.folder) and os.path.exists(b.folder)
    folder = b.folder
    del b  # collected: removed too
    assert not os.path.exists(folder)
    assert os.listdir(tmp_path) == []


def test_files_are_removed_at_interpreter_exit(tmp_path):
    code = ("import sys; from zenflow_kernels.state_files import StateFiles\n"
            f"f = StateFiles({str(tmp_path)!r}, 4096, fields=('master',), block_numel=1024)\n"
            "print(f.folder); sys.stdout.flush()\n"
            "import os; os.environ['KEEP_REF'] = f.folder\n")  # a live reference at exit
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and not os.path.exists(out.stdout.strip())


@pytest.mark.parametrize("bad, match", [
    (dict(numel=-1), "numel=-1"), (dict(numel=True), "numel=True"), (dict(block_numel=1000), "block_numel=1000"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        StateFiles(tmp_path, fields=FIELDS, **(dict(numel=10, block_numel=1024) | bad))
    with pytest.raises(ValueError, match="not an existing directory"):
        StateFiles(tmp_path / "missing", 10, fields=FIELDS, block_numel=1024)
    assert os.listdir(tmp_path) == []


def test_too_little_space_fails_at_creation_naming_path_needed_and_free(tmp_path):
    with pytest.raises(StateFileError, match=rf"needs {(1 << 46) * 12} bytes .* has \d+ bytes free") as info:
        StateFiles(tmp_path, 1 << 46, fields=FIELDS, block_numel=1 << 20)
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing left behind

    class Full(_PosixIO):  # the space check passed, the reservation finds the disk full
        @staticmethod
        def fallocate(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(StateFileError, match=r"reserving 61440 bytes .* failed: No space left") as info:
        StateFiles(tmp_path, 5000, fields=FIELDS, block_numel=1024, io=Full())
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("direct", [False, True])
def test_fields_read_and_write_across_blocks(tmp_path, direct):
    if direct and not _direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    files = StateFiles(tmp_path, 5000, fields=FIELDS, block_numel=1024, direct=direct)
    for field in FIELDS:
        assert torch.equal(files.read(field, 0, 5000), torch.zeros(5000))  # reserved space reads as zeros
    data = {f: torch.randn(5000, generator=torch.Generator().manual_seed(k)) for k, f in enumerate(FIELDS)}
    for f in FIELDS:
        files.write(f, 0, data[f])
    files.write("exp_avg", 1000, torch.full((100,), 7.0))  # across the first block boundary
    data["exp_avg"][1000:1100] = 7.0
    for f in FIELDS:
        assert torch.equal(files.read(f, 0, 5000), data[f])
        assert torch.equal(files.read(f, 1023, 4097), data[f][1023:4097])
    counting = Counting()
    files._io = counting
    assert torch.equal(files.read("exp_avg_sq", 1030, 2050), data["exp_avg_sq"][1030:2050])
    # only that field's part of blocks 1 and 2, whole 4 KiB pages: a third of what the blocks hold
    assert counting.reads == [(1 * 3 + 2) * 4096, (2 * 3 + 2) * 4096] and counting.read_bytes == [4096, 4096]
    files.close()  # gone from the folder, still readable (state_dict() after the optimizer's close()) ...
    assert not os.path.exists(files.folder) and torch.equal(files.read("master", 0, 5000), data["master"])
    with pytest.raises(StateFileError, match="write of block 0 after close"):  # ... but never written again
        files.write("master", 0, torch.zeros(10))
    files.release()  # the descriptor too: the space is given back
    with pytest.raises(StateFileError, match="read after release"):
        files.read("master", 0, 10)


def _state(numel, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(master=torch.randn(numel, generator=g), exp_avg=torch.randn(numel, generator=g) * 0.1,
                exp_avg_sq=torch.rand(numel, generator=g) * 0.01, acc=torch.randn(numel, generator=g) * 3)


def _in_memory(state, runs):
    """The in-memory host's update of the same runs: one cpu_adam_ call per run."""
    s = {k: v.clone() for k, v in state.items()}
    outs = []
    for lo, hi, dtype, args in runs:
        out = None if dtype is None else torch.empty(hi - lo, dtype=dtype)
        cpu_ops.cpu_adam_(s["master"][lo:hi], s["acc"][lo:hi], s["exp_avg"][lo:hi], s["exp_avg_sq"][lo:hi], out=out,
                          zero_grad=True, **args)
        outs.append(out)
    return s, outs


RUN_SETS = {
    "one run, ragged": (5000, [(0, 5000, torch.bfloat16, dict(HYPER, step=3, grad_scale=4.0))]),
    "runs sharing blocks": (5000, [(0, 1500, torch.float32, dict(HYPER, step=1, grad_scale=1.0)),
                                   (1504, 2048, torch.float16, dict(HYPER, step=7, grad_scale=2.0)),
                                   (3000, 3001, None, dict(HYPER, step=2, grad_scale=3.0, lr=0.1))]),
    "gaps and the last element": (4097, [(16, 32, torch.bfloat16, dict(HYPER, step=5, grad_scale=1.0)),
                                         (4096, 4097, torch.float32, dict(HYPER, step=1, grad_scale=1.0))]),
    "smaller than a block": (100, [(0, 100, torch.float32, dict(HYPER, step=2, grad_scale=1.0))]),
}


def _direct_supported(path) -> bool:
    try:
        StateFiles(path, 1024, fields=FIELDS, block_numel=1024, direct=True).close()
        return True
    except (StateFileError, ValueError):
        return False


@pytest.mark.parametrize("sums", ["host", "device"])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("block_numel, direct", [(1024, False), (2048, False), (2048, True)])
@pytest.mark.parametrize("name", list(RUN_SETS))
def test_streamed_host_step_gives_the_in_memory_bits(tmp_path, name, block_numel, direct, depth, sums):
    """The sums in host memory (zeroed where stepped), or fetched from the device block by block (``device``:
    each stepped element fetched once, in order, into blocks that start out NaN; the device's sums untouched)."""
    if direct and not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem has no O_DIRECT")
    numel, runs = RUN_SETS[name]
    state = _state(numel, seed=len(name))
    expected, outs = _in_memory(state, runs)
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=block_numel, direct=direct)
    for f in FIELDS:
        files.write(f, 0, state[f])
    acc, fetched = state["acc"].clone(), []
    got_outs = [None if dtype is None else torch.empty(hi - lo, dtype=dtype) for lo, hi, dtype, _ in runs]
    work = [RangeStep(lo, hi, o, args) for (lo, hi, _, args), o in zip(runs, got_outs, strict=True)]
    if sums == "host":
        report = streamed_host_step_(files, acc, work, rule=ADAMW, depth=depth)
    else:
        sums = recording_device_sums(acc, block_numel, depth, fetched)
        report = streamed_host_step_(files, None, work, rule=ADAMW, depth=depth, sums=sums)
    touched = {j for lo, hi, _, _ in runs for j in range(lo // block_numel, -(-hi // block_numel))}
    assert report["blocks"] == len(touched)
    for f in FIELDS:
        assert torch.equal(files.read(f, 0, numel), expected[f]), f
    if sums == "host":
        assert torch.equal(acc, expected["acc"])  # zeroed where stepped, kept elsewhere
    else:
        assert torch.equal(acc, state["acc"])  # the owner zeroes the device's sums, not the update
        pieces = [(max(lo, j * block_numel), min(hi, (j + 1) * block_numel)) for j in sorted(touched)
                  for lo, hi, _, _ in runs if lo < (j + 1) * block_numel and hi > j * block_numel]
        assert fetched == pieces
    for a, b in zip(got_outs, outs, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    files.close()


@pytest.mark.parametrize("beside", [True, False])
def test_streamed_host_step_reads_a_block_while_its_sums_are_fetched(tmp_path, monkeypatch, beside):
    """A fetch that returns a wait (a copy engine): the reader starts each block's fetches, reads the block, then
    waits for them, so the link and the disk work side by side (``orderings.fetch_beside_read=False``: the former
    order, read, then fetch and wait). Either way the in-memory bits, and every wait called once."""
    from zenflow_kernels.orderings import orderings

    monkeypatch.setattr(orderings, "fetch_beside_read", beside)
    numel, block = 4096 + 300, 1024
    runs = [(0, 1500, torch.bfloat16, dict(HYPER, step=3, grad_scale=1.0)),
            (2000, numel, None, dict(HYPER, step=1, grad_scale=0.5))]
    state = _state(numel, seed=5)
    expected, outs = _in_memory(state, runs)
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=block)
    for f in FIELDS:
        files.write(f, 0, state[f])
    events = []
    read_block = files.read_block
    monkeypatch.setattr(files, "read_block", lambda j, bufs: events.append(("read", j)) or read_block(j, bufs))
    flat = state["acc"].clone()

    def fetch(dst, lo, hi):
        events.append(("fetch", lo // block))
        dst.copy_(flat[lo:hi])
        return lambda: events.append(("wait", lo // block))

    got_outs = [None if dtype is None else torch.empty(hi - lo, dtype=dtype) for lo, hi, dtype, _ in runs]
    work = [RangeStep(lo, hi, o, args) for (lo, hi, _, args), o in zip(runs, got_outs, strict=True)]
    streamed_host_step_(files, None, work, rule=ADAMW,
                        sums=DeviceSums(fetch, [torch.full((block,), float("nan")) for _ in range(3)]))
    for f in FIELDS:
        assert torch.equal(files.read(f, 0, numel), expected[f]), f
    assert torch.equal(got_outs[0], outs[0])
    pieces = {0: 1, 1: 2, 2: 1, 3: 1, 4: 1}  # block 1 holds the end of one run and the start of the next
    for j, n in pieces.items():
        mine = [e for e in events if e[1] == j]
        order = [("fetch", j)] * n + [("read", j)] + [("wait", j)] * n if beside else (
            [("read", j)] + [("fetch", j)] * n + [("wait", j)] * n)
        assert mine == order, (j, mine)
    files.close()


def test_streamed_host_step_waits_for_started_fetches_before_a_read_error_and_raises_a_failed_wait(tmp_path,
                                                                                                   monkeypatch):
    numel, block = 4096, 1024
    state = _state(numel, seed=11)
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=block)
    for f in FIELDS:
        files.write(f, 0, state[f])
    before = files.read("master", 0, numel)
    work = [RangeStep(0, numel, None, dict(HYPER, step=1, grad_scale=1.0))]
    started, waited = [], []

    def fetch(dst, lo, hi):
        started.append(lo)
        dst.copy_(state["acc"][lo:hi])

        def wait():
            waited.append(lo)
            if lo == 3072:
                raise RuntimeError(f"CUDA error: the copy at {lo} failed")
        return wait

    buffers = [torch.empty(block) for _ in range(3)]
    with pytest.raises(RuntimeError, match="the copy at 3072 failed"):  # a failed copy raises at its wait
        streamed_host_step_(files, None, work, rule=ADAMW, sums=DeviceSums(fetch, buffers))
    after = files.read("master", 0, numel)
    assert not torch.equal(after[:3072], before[:3072]) and torch.equal(after[3072:], before[3072:])
    read_block, started[:], waited[:] = files.read_block, [], []

    def failing_read(j, bufs):
        if j == 2:
            raise StateFileError(errno.EIO, f"injected read error in block {j}")
        read_block(j, bufs)

    monkeypatch.setattr(files, "read_block", failing_read)
    with pytest.raises(StateFileError, match="injected read error in block 2"):
        streamed_host_step_(files, None, work, rule=ADAMW, sums=DeviceSums(fetch, buffers))
    assert started == [0, 1024, 2048] and waited == started  # block 2's copy was settled before the error came out
    files.close()


def test_streamed_host_step_refuses_ambiguous_sums_and_short_buffers_and_raises_a_failed_fetch(tmp_path):
    numel = 4096
    state = _state(numel, seed=9)
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=1024)
    for f in FIELDS:
        files.write(f, 0, state[f])
    work = [RangeStep(0, numel, None, dict(HYPER, step=1, grad_scale=1.0))]
    sums = recording_device_sums(state["acc"], 1024, 3, [])
    with pytest.raises(ValueError, match="either as acc .* or as sums .* exactly one"):
        streamed_host_step_(files, state["acc"], work, rule=ADAMW, sums=sums)
    with pytest.raises(ValueError, match="either as acc .* or as sums .* exactly one"):
        streamed_host_step_(files, None, work, rule=ADAMW)
    with pytest.raises(ValueError, match=r"at least depth=3 fp32 buffers of min\(block_numel, numel\)=1024 elements, "
                                         r"got \[\(1024, torch.float32\), \(512, torch.float32\)\]"):
        streamed_host_step_(files, None, work, rule=ADAMW,
                            sums=DeviceSums(sums.fetch, [torch.empty(1024), torch.empty(512)]))
    before = files.read("master", 0, numel)

    def failing(dst, lo, hi):
        if lo >= 2048:
            raise RuntimeError(f"CUDA error: an illegal memory access at {lo}")
        dst.copy_(state["acc"][lo:hi])

    with pytest.raises(RuntimeError, match="illegal memory access at 2048"):
        streamed_host_step_(files, None, work, rule=ADAMW, sums=DeviceSums(failing, sums.buffers))
    after = files.read("master", 0, numel)  # the blocks before it were stepped, none from it on
    assert not torch.equal(after[:2048], before[:2048]) and torch.equal(after[2048:], before[2048:])
    files.close()


class FailAt(_PosixIO):
    """``op`` ("read"/"write") raises ``code`` at the call whose file offset is ``offset``; transfers are cut
    short to at most ``short`` bytes (a kernel may transfer less than asked)."""

    def __init__(self, op=None, offset=None, code=errno.EIO, short=None):
        self.op, self.offset, self.code, self.short, self.writes = op, offset, code, short, []

    def _cut(self, bufs):
        if self.short is None:
            return bufs
        out, left = [], self.short
        for b in bufs:
            if left <= 0:
                break
            out.append(b[:left])
            left -= len(out[-1])
        return out

    def preadv(self, fd, bufs, offset):
        if self.op == "read" and offset == self.offset:
            raise OSError(self.code, os.strerror(self.code))
        return os.preadv(fd, self._cut(bufs), offset)

    def pwritev(self, fd, bufs, offset):
        if self.op == "write" and offset == self.offset:
            raise OSError(self.code, os.strerror(self.code))
        self.writes.append(offset)
        return os.pwritev(fd, self._cut(bufs), offset)


def test_short_transfers_continue_where_they_stopped(tmp_path):
    numel, runs = RUN_SETS["runs sharing blocks"]
    state = _state(numel, seed=3)
    expected, _ = _in_memory(state, runs)
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=1024, io=FailAt(short=5000))
    for f in FIELDS:
        files.write(f, 0, state[f])
    streamed_host_step_(files, state["acc"].clone(), [RangeStep(lo, hi, None, args) for lo, hi, _, args in runs],
                        rule=ADAMW)
    for f in FIELDS:
        assert torch.equal(files.read(f, 0, numel), expected[f])


@pytest.mark.parametrize("op, code", [("read", errno.EIO), ("write", errno.EIO), ("write", errno.ENOSPC)])
def test_an_io_error_during_the_stream_raises_naming_file_and_offset(tmp_path, op, code):
    numel = 8 * 1024
    state = _state(numel, seed=5)
    block_bytes = 1024 * 12
    io = FailAt()
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=1024, io=io)
    for f in FIELDS:
        files.write(f, 0, state[f])
    io.op, io.offset, io.code, io.writes = op, 3 * block_bytes, code, []
    with pytest.raises(StateFileError, match=rf"{op} of {block_bytes} bytes at offset {3 * block_bytes} of "
                                             rf".*rank0.state failed: {os.strerror(code)}") as info:
        streamed_host_step_(files, state["acc"].clone(),
                            [RangeStep(0, numel, None, dict(HYPER, step=1, grad_scale=1.0))], rule=ADAMW)
    assert info.value.errno == code
    # the blocks after the failed one were not written
    assert all(offset < 3 * block_bytes for offset in io.writes), io.writes
    folder = files.folder
    files.close()
    assert not os.path.exists(folder)


class Counting(_PosixIO):
    """The system calls, counted (offsets of each read and write)."""

    def __init__(self):
        self.reads, self.read_bytes, self.writes, self.reserved = [], [], [], []

    def preadv(self, fd, bufs, offset):
        self.reads.append(offset)
        self.read_bytes.append(sum(len(b) for b in bufs))
        return os.preadv(fd, bufs, offset)

    def pwritev(self, fd, bufs, offset):
        self.writes.append(offset)
        return os.pwritev(fd, bufs, offset)

    def fallocate(self, fd, offset, length):
        self.reserved.append(length)
        return os.posix_fallocate(fd, offset, length)


@pytest.mark.parametrize("fresh", [True, False])
def test_many_writes_are_one_pass_over_the_blocks_they_touch(tmp_path, fresh):
    """Tensors of every size, dtype and layout (bf16, a non-contiguous view, one crossing three blocks, two in
    one block, several fields): each touched block is read at most once (not at all for a fresh file) and
    written once, in file order, and the file holds what one write per tensor gives."""
    numel, g = 6000, torch.Generator().manual_seed(7)
    big = torch.randn(2500, generator=g)
    items = [("master", 0, torch.randn(10, generator=g).to(torch.bfloat16)),
             ("master", 16, torch.randn(20, 30, generator=g).t()),  # not contiguous
             ("master", 1000, big),  # blocks 0-3
             ("exp_avg", 1000, big * 2),
             ("exp_avg_sq", 5990, torch.rand(10, generator=g, dtype=torch.float64))]
    expected = {f: torch.zeros(numel) for f in FIELDS}
    if not fresh:  # an existing file: what is not written stays
        for k, f in enumerate(FIELDS):
            expected[f] = torch.randn(numel, generator=torch.Generator().manual_seed(k))
    for f, lo, v in items:
        expected[f][lo : lo + v.numel()] = v.float().reshape(-1)
    io = Counting()
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=1024, io=io)
    if not fresh:
        for f in FIELDS:
            files.write(f, 0, expected[f].clone())
        for f, lo, v in items:  # put other values where the items go
            files.write(f, lo, torch.full((v.numel(),), -1.0))
    io.reads, io.writes = [], []
    counts = files.write_many(items, fresh=fresh)
    touched = [0, 1, 2, 3, 5]  # block 4 holds nothing of them
    assert io.writes == [j * 1024 * 12 for j in touched] and counts["written"] == len(touched)
    assert io.reads == ([] if fresh else [j * 1024 * 12 for j in touched])
    for f in FIELDS:
        assert torch.equal(files.read(f, 0, numel), expected[f]), f
    files.close()


def test_a_snapshot_is_a_file_backed_copy_that_outlives_close(tmp_path):
    """The three fields as a [3, numel] copy: equal to the file's contents at the time, backed by a file that is
    already unlinked (nothing left under nvme_path, no anonymous memory), unaffected by later writes, still
    readable after close(), and taken after close() too (until release()); its space is reserved (and checked)
    like the state file's."""
    numel = 5000
    io = Counting()
    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=1024, io=io)
    data = {f: torch.randn(numel, generator=torch.Generator().manual_seed(k)) for k, f in enumerate(FIELDS)}
    files.write_many([(f, 0, data[f]) for f in FIELDS])
    snap = files.snapshot()
    assert snap.shape == (3, numel) and snap.dtype == torch.float32
    for k, f in enumerate(FIELDS):
        assert torch.equal(snap[k], data[f])
    storage = snap.untyped_storage()
    assert os.path.dirname(storage.filename) == str(tmp_path) and "zenflow-snapshot-" in storage.filename
    assert not os.path.exists(storage.filename) and io.reserved[-1] == 3 * numel * 4
    assert os.listdir(tmp_path) == [os.path.basename(files.folder)] and os.listdir(files.folder) == ["rank0.state"]
    sums = torch.randn(numel, dtype=torch.float64)  # a fourth row from memory (the interval's gradient sums)
    with_sums = files.snapshot(sums)
    assert with_sums.shape == (4, numel) and torch.equal(with_sums[3], sums.float())
    assert torch.equal(with_sums[:3], snap) and io.reserved[-1] == 4 * numel * 4
    with pytest.raises(ValueError, match=r"extra has shape \(10,\), allowed \(5000,\)"):
        files.snapshot(torch.zeros(10))
    files.write("master", 0, torch.zeros(numel))  # the snapshot is a copy
    assert torch.equal(snap[0], data["master"])
    folder = files.folder
    files.close()
    assert not os.path.exists(folder) and torch.equal(snap[2], data["exp_avg_sq"])  # valid after close
    buf = BytesIO()
    torch.save({"master": snap[0][10:20]}, buf)  # torch.save writes it out like any tensor
    buf.seek(0)
    assert torch.equal(torch.load(buf)["master"], data["master"][10:20])
    assert torch.equal(files.snapshot()[0], torch.zeros(numel))  # after close: what the file held last
    files.release()
    with pytest.raises(StateFileError, match="a snapshot after release"):
        files.snapshot()
    assert os.listdir(tmp_path) == []
    assert StateFiles(tmp_path, 0, fields=FIELDS, block_numel=1024).snapshot().shape == (3, 0)

    class FullAtSnapshot(_PosixIO):  # the state file fits, its copy finds the disk full
        calls = 0

        def fallocate(self, fd, offset, length):
            FullAtSnapshot.calls += 1
            if FullAtSnapshot.calls > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return os.posix_fallocate(fd, offset, length)

    files = StateFiles(tmp_path, numel, fields=FIELDS, block_numel=1024, io=FullAtSnapshot())
    with pytest.raises(StateFileError, match=rf"reserving {3 * numel * 4} bytes .* checkpoint's copy .* for "
                                             r".*zenflow-snapshot-\w+ failed: No space left") as info:
        files.snapshot()
    assert info.value.errno == errno.ENOSPC and os.listdir(files.folder) == ["rank0.state"]  # nothing left
    assert os.listdir(tmp_path) == [os.path.basename(files.folder)]
    files.close()
