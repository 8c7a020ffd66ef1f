"""ZenFlowAdamW with its host state on disk (``offload_device="nvme"``, issue 25; ZeRO and FSDP2 in
test_zero.py and test_fsdp2.py): the same bits as the in-memory host (synchronous and overlapped updates,
clipping, a non-finite skip, warm-up, re-selections, the asynchronous link under chaos), checkpoints moving
between memory and disk both ways and handed out backed by a file, building, loading and re-selection one
pass over the file each, the state file private and removed at close, its bytes reported apart from memory."""

import contextlib
import copy
import os
import stat

import pytest
import torch
import torch.nn.functional as F
from support import HYPER, SWEEP, _ids, grad_sequence, make_params, quiet, recording_device_sums, snapshot

from zenflow_kernels import ZenFlowAdamW, ZenFlowConfig, ZenFlowConfigError
from zenflow_kernels.ops import use_backend
from zenflow_kernels.rules import AdamW
from zenflow_kernels.state_files import StateFileError
from zenflow_kernels.testing import chaos

STEPS, NAN_AT = 14, 7
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, full_warm_up_rounds=1)
FIELDS = ("master", *AdamW.state_names)  # a state file's fields for AdamW's host state


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 1024 elements: the model's 3.2 K host elements span four, parameters cross block edges."""
    monkeypatch.setattr(ZenFlowAdamW, "NVME_BLOCK_NUMEL", 1024)
    with use_backend("numba"):
        yield


def model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dtype)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 40, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]


def make(where, zen, *, mode="sync", clip=False, dtype=torch.float32, seed=0):
    m = model(dtype, seed)
    z = dict(ZEN, **zen) | (dict(offload_device="nvme", nvme_path=str(where)) if where is not None else {})
    with chaos(seed=int(mode[-1]), max_delay=0.002) if mode.startswith("chaos") else contextlib.nullcontext():
        opt = ZenFlowAdamW(m.parameters(), lr=1e-2, zenflow=z, max_grad_norm=1.0 if clip else None)
    return m, opt


def train(m, opt, data, start=0, stop=STEPS):
    history = {}
    for t in range(start, stop):
        x, y = data[t]
        loss = F.mse_loss(m(x.to(m[0].weight.dtype)).float(), y)
        (loss * float("nan") if t == NAN_AT else loss).backward()  # one skipped step
        opt.step()
        opt.zero_grad()
        history[t] = snapshot(m.parameters())
    return history


def assert_same(a, b, what):
    for t in a:
        for n, (x, y) in enumerate(zip(a[t], b[t], strict=True)):
            assert torch.equal(x, y), f"{what}: step {t} parameter {n}"


@pytest.mark.parametrize("mode", ["sync", "chaos1"])
@pytest.mark.parametrize("overlap, clip, dtype, devacc", [
    (False, False, torch.float32, False), (True, True, torch.float32, False), (True, False, torch.bfloat16, False),
    (False, True, torch.float32, True), (True, True, torch.bfloat16, True)])
def test_the_disk_host_gives_the_in_memory_bits(tmp_path, mode, overlap, clip, dtype, devacc):
    """With ``device_accumulation`` the disk host keeps no accumulation buffer: the update fetches each block's
    piece of the device sums (twice with clipping: the norm, then the step), the in-memory one uploads them."""
    data, zen = batches(), dict(overlap_step=overlap, device_accumulation=devacc)
    m, opt = make(None, zen, mode=mode, clip=clip, dtype=dtype)
    with opt:
        memory = train(m, opt, data)
        expected = opt.state_dict()
    m, opt = make(tmp_path, zen, mode=mode, clip=clip, dtype=dtype)
    with opt:
        disk = train(m, opt, data)
        [folder] = os.listdir(tmp_path)
        assert stat.S_IMODE(os.stat(tmp_path / folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / folder / "rank0.state").st_mode) == 0o600
        got = opt.state_dict()
        hb = opt.host_bytes()
        assert opt.skipped_steps == 1 and opt.selections >= 2 and opt.host_updates >= 5
    assert_same(disk, memory, "disk against memory")
    for i, st in expected["state"].items():
        for key in ("host_master", "host_exp_avg", "host_exp_avg_sq"):
            assert torch.equal(got["state"][i][key], st[key]), (i, key)
    assert os.listdir(tmp_path) == []  # removed at close
    numel = opt.host_shard.numel
    assert hb["disk"] == -(-numel // 1024) * 1024 * 12
    assert hb["master"] == hb["exp_avg"] == hb["exp_avg_sq"] == 0
    assert hb["total"] == hb["accumulation"] + hb["copy_out"] + hb["landing"] + hb.get("sums_blocks", 0)
    if devacc:  # the sums' bytes are the device's (two buffers with overlap), three blocks fetch them
        assert hb["accumulation"] == 0 and hb["sums_blocks"] == 3 * numel * 4  # (a norm's chunk, at most the shard)
        assert hb["device_sums"] == (2 if overlap else 1) * numel * 4
    else:
        assert hb["accumulation"] == (2 if overlap else 1) * numel * 4 and "sums_blocks" not in hb


def test_the_fused_last_gradient_path_on_disk_gives_the_in_memory_bits(tmp_path, monkeypatch):
    """The synchronous CPU link folds the interval's last gradient of a parameter of at least
    ``FUSE_MIN_NUMEL`` (65536) elements into a synchronous host update (``HostShard.update(last=...)``): every
    warm-up step and every synchronous boundary takes it. On disk the last gradient joins the sums first (the
    same fp32 addition) and the update streams: the in-memory bits, with the path taken (counted) on both."""
    from zenflow_kernels.host import HostShard

    fused = []
    real = HostShard.update
    monkeypatch.setattr(HostShard, "update", lambda self, *a, **kw: fused.append(len(kw.get("last") or {})) or
                        real(self, *a, **kw))
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g)) for _ in range(8)]
    zen = dict(overlap_step=False, full_warm_up_rounds=3, update_interval=2, select_interval=4)
    runs, counts = [], []
    for where in (None, tmp_path):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
        assert m[0].weight.numel() == ZenFlowAdamW.FUSE_MIN_NUMEL
        z = dict(ZEN, **zen) | (dict(offload_device="nvme", nvme_path=str(where)) if where is not None else {})
        fused.clear()
        with ZenFlowAdamW(m.parameters(), lr=1e-2, zenflow=z) as opt:
            history = []
            for x, y in data:
                F.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
                history.append(snapshot(m.parameters()))
        runs.append(dict(enumerate(history)))
        counts.append(list(fused))
    assert_same(runs[1], runs[0], "disk against memory")
    # 3 warm-up updates and 2 synchronous boundaries, each with both matrices' last gradients fused
    assert counts[0] == counts[1] == [2] * 5, counts


@pytest.mark.parametrize("first, then", [("memory", "disk"), ("disk", "memory")])
def test_a_checkpoint_moves_between_memory_and_disk_exactly(tmp_path, first, then):
    """Saved mid-interval with an overlapped update in flight by one host, loaded by the other: the run
    continues bit-identical to the uninterrupted one (where the state lives is the loading optimizer's)."""
    data, zen, save_at = batches(), dict(overlap_step=True), 5
    where = {"memory": None, "disk": tmp_path}
    m, opt = make(where[first], zen)
    with opt:
        straight = train(m, opt, data)
    m, opt = make(where[first], zen)
    with opt:
        train(m, opt, data, stop=save_at)
        with opt.flushed():
            saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    m, opt = make(where[then], zen, seed=3)
    m.load_state_dict(saved["model"])
    with opt:
        opt.load_state_dict(saved["opt"])
        assert opt.config.offload_device == ("nvme" if then == "disk" else "cpu")
        resumed = train(m, opt, data, start=save_at)
        assert ("disk" in opt.host_bytes()) == (then == "disk")
    assert_same(resumed, {t: straight[t] for t in resumed}, f"{first} -> {then}")


def test_the_configuration_in_both_forms_and_what_is_refused(tmp_path):
    ds = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                                "zenflow": {"topk_ratio": 0.1}}}
    config = ZenFlowConfig.from_dict(ds)
    assert config.offload_device == "nvme" and config.nvme_path == str(tmp_path)
    assert ZenFlowConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ZenFlowConfigError, match=r"nvme_path=None .* a directory for the state files"):
        ZenFlowConfig(offload_device="nvme")
    with pytest.raises(ZenFlowConfigError, match=r"nvme_path='/x' .* None when offload_device='cpu'"):
        ZenFlowConfig(nvme_path="/x")
    with pytest.raises(ZenFlowConfigError, match=r"offload_device='disk' .* 'cpu' or 'nvme'"):
        ZenFlowConfig(offload_device="disk")
    with pytest.raises(ZenFlowConfigError, match=r"offload_param.device='nvme' .* not supported"):
        ZenFlowConfig.from_dict({"zero_optimization": {"offload_param": {"device": "nvme"}, "zenflow": {}}})
    # a path that cannot hold the state files is refused by the constructor, naming it, before anything exists
    (tmp_path / "a-file").write_text("")
    for name, why in (("missing", "does not exist"), ("a-file", "is not a folder")):
        with pytest.raises(ValueError, match=f"nvme_path='.*{name}' {why}: allowed an existing, writable folder"):
            make(tmp_path / name, dict(overlap_step=True))
    assert os.listdir(tmp_path) == ["a-file"]


@pytest.mark.parametrize("mode", ["sync", "chaos0"])
def test_an_unwritable_folder_is_refused_and_a_failed_first_step_leaves_nothing(tmp_path, monkeypatch, mode):
    """The constructor refuses a folder this process may not write (os.access: root may write anything, so the
    answer is patched); a first step whose state file cannot be made (the folder removed after construction)
    raises, and leaves no thread, no hook, no file and training's thread count as it was; the optimizer stays
    unbuilt and a later step builds it."""
    import threading

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, how: False if str(path) == str(tmp_path) else real_access(path, how))
    with pytest.raises(ValueError, match="is not writable by this process"):
        make(tmp_path, dict(overlap_step=True))
    monkeypatch.setattr(os, "access", real_access)
    where = tmp_path / "state"
    where.mkdir()
    before = {t.name for t in threading.enumerate()}, torch.get_num_threads()
    m, opt = make(where, dict(overlap_step=True), mode=mode)
    where.rmdir()
    x, y = batches()[0]
    F.mse_loss(m(x), y).backward()
    with pytest.raises(ValueError, match="is not an existing directory"):
        opt.step()
    assert ({t.name for t in threading.enumerate()}, torch.get_num_threads()) == before
    assert not opt.built and all(not p._post_accumulate_grad_hooks for p in m.parameters())
    assert os.listdir(tmp_path) == []
    where.mkdir()
    opt.step()  # the folder is back: the step builds and runs
    assert opt.built and len(os.listdir(where)) == 1
    opt.close()
    assert os.listdir(where) == [] and {t.name for t in threading.enumerate()} == before[0]


def test_an_io_error_in_an_update_fails_the_optimizer_naming_file_and_offset(tmp_path, monkeypatch):
    """A write that fails (EIO) during an overlapped host update: the next wait raises in the training thread
    with the worker's traceback naming the state file and the offset; the optimizer stays failed (step and
    state_dict refuse: the file may hold half an update), and close() still removes the file."""
    import errno

    from zenflow_kernels.link.worker import HostWorkerError
    from zenflow_kernels.state_files import _PosixIO

    data = batches()
    m, opt = make(tmp_path, dict(overlap_step=True))
    train(m, opt, data, stop=4)  # built, a few updates done
    real = os.pwritev

    def failing(fd, bufs, offset):
        if offset == 2 * 1024 * 12:  # the third block
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    monkeypatch.setattr(_PosixIO, "pwritev", staticmethod(failing))
    with pytest.raises(HostWorkerError, match=r"(?s)write of 12288 bytes at offset 24576 of .*rank0\.state failed: "
                                              r"Input/output error"):
        train(m, opt, data, start=4, stop=10)
    with pytest.raises(HostWorkerError):
        train(m, opt, data, start=10, stop=11)
    with pytest.raises(HostWorkerError):
        opt.state_dict()
    opt.close()
    assert os.listdir(tmp_path) == []


def test_state_dict_hands_out_file_backed_tensors_valid_after_close(tmp_path):
    """On disk, state_dict()'s host state and gradient sums are views of one file-backed copy (already unlinked:
    nothing left under nvme_path once the optimizer closes, nothing in anonymous memory), bit-identical to the
    in-memory run's, torch.save-able, still valid after close(); state_dict() after close() works, as it does in
    memory (the closed file, gone from nvme_path, stays readable until the optimizer is collected), and the
    saved dict resumes a fresh disk optimizer exactly."""
    data, zen = batches(), dict(overlap_step=True)
    m, opt = make(None, zen)
    with opt:
        memory = train(m, opt, data)
        expected = opt.state_dict()
    m, opt = make(tmp_path, zen)
    with opt:
        train(m, opt, data, stop=6)
        saved = opt.state_dict()
        weights_at_save = [p.detach().clone() for p in m.parameters()]
        train(m, opt, data, start=6)
        got = opt.state_dict()
    after_close = opt.state_dict()
    for i, st in got["state"].items():
        assert torch.equal(after_close["state"][i]["host_exp_avg_sq"], st["host_exp_avg_sq"])
        for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "acc"):
            t = st[key]
            assert torch.equal(t, expected["state"][i][key]), (i, key)  # read after close()
            name = t.untyped_storage().filename
            assert name is not None and "snapshot-" in name and not os.path.exists(name), (i, key, name)
    assert os.listdir(tmp_path) == []
    opt.host_shard.disk.release()  # what collecting the optimizer does
    with pytest.raises(StateFileError, match="snapshot after release"):
        opt.state_dict()
    path = tmp_path.parent / f"{tmp_path.name}-saved.pt"
    torch.save(saved, path)
    m, opt = make(tmp_path, zen, seed=3)
    with torch.no_grad():
        for p, w in zip(m.parameters(), weights_at_save, strict=True):
            p.copy_(w)
    with opt:
        opt.load_state_dict(torch.load(path, weights_only=False))
        resumed = train(m, opt, data, start=6)
    assert_same(resumed, {t: memory[t] for t in resumed}, "resumed from the file-backed dict")


def test_building_and_loading_the_state_file_are_one_pass_each(tmp_path, monkeypatch):
    """60 small tensors (3 blocks of 1024 elements): building the file at the first step writes each block once
    and reads none; load_state_dict writes the host fields in one more pass (each block read and written
    once), not one read-modify-write per tensor and field."""
    from zenflow_kernels.state_files import _PosixIO

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 8) if k % 2 else torch.randn(40)) for k in range(60)]
    opt = ZenFlowAdamW(params, lr=1e-2, zenflow=dict(ZEN, offload_device="nvme", nvme_path=str(tmp_path)))
    calls = {"read": [], "write": []}
    monkeypatch.setattr(_PosixIO, "preadv",
                        staticmethod(lambda fd, b, o: calls["read"].append(o) or os.preadv(fd, b, o)))
    monkeypatch.setattr(_PosixIO, "pwritev",
                        staticmethod(lambda fd, b, o: calls["write"].append(o) or os.pwritev(fd, b, o)))
    with opt:
        opt._build()
        blocks = -(-opt.host_shard.numel // 1024)
        assert blocks == 3 and calls == {"read": [], "write": [j * 1024 * 12 for j in range(blocks)]}
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        sd = opt.state_dict()
        calls["read"], calls["write"] = [], []
        opt.load_state_dict(sd)
        every = [j * 1024 * 12 for j in range(blocks)]
        assert calls == {"read": every, "write": every + every}  # the new file built, then the loaded fields
        for i, st in opt.state_dict()["state"].items():
            for key in ("host_master", "host_exp_avg", "host_exp_avg_sq"):
                assert torch.equal(st[key], sd["state"][i][key]), (i, key)


@pytest.mark.parametrize("shapes", [[(30, 50), (7, 300), (64, 3)], [(5, 4096)], [(1, 1), (2000, 1)]])
def test_columns_written_back_at_reselection_are_one_pass_and_the_in_memory_values(tmp_path, shapes):
    """Re-selection hands the columns leaving the fast path back to the host master: on disk, every matrix's
    columns in one pass over the blocks (each read and written once), giving what the in-memory host holds
    (matrices crossing block edges, wider than a block, one column, unsorted columns)."""
    from zenflow_kernels.host import HostShard
    from zenflow_kernels.state_files import StateFiles

    g = torch.Generator().manual_seed(len(shapes))
    params = [torch.randn(s, generator=g) for s in shapes]
    groups = [0] * len(params)
    calls = {"read": [], "write": []}

    class Counting(StateFiles):
        def read_block(self, j, bufs):
            calls["read"].append(j)
            super().read_block(j, bufs)

        def write_block(self, j, bufs):
            calls["write"].append(j)
            super().write_block(j, bufs)

    memory = HostShard(params, groups, rule=AdamW(), num_acc=1)
    disk = HostShard(params, groups, rule=AdamW(), num_acc=1,
                     disk=lambda n: Counting(tmp_path, n, fields=FIELDS, block_numel=1024))
    items = []
    for i, p in enumerate(params):
        cols = torch.randperm(p.shape[1], generator=g)[: max(1, p.shape[1] // 3)]
        items.append(("master", i, cols, torch.randn(p.shape[0], cols.numel(), generator=g)))
    calls["read"], calls["write"] = [], []
    memory.set_columns(items)
    disk.set_columns(items)
    touched = sorted({j for i in range(len(params)) for j, *_ in disk.disk.pieces(
        disk.slots[i].offset, disk.slots[i].offset + disk.slots[i].numel)})
    assert calls == {"read": touched, "write": touched}
    for i in range(len(params)):
        assert torch.equal(disk.field("master", i), memory.field("master", i)), i
        assert not torch.equal(memory.field("master", i), params[i])  # the columns did change
    disk.close()


def test_a_save_that_finds_the_disk_full_fails_alone_and_training_goes_on(tmp_path, monkeypatch):
    """state_dict() needs space for its copy: a full disk fails it naming the copy's path, the bytes needed and
    free, leaves no file behind and does not fail the optimizer (its state is intact): training continues
    bit-identical to the in-memory run and the next save works."""
    import errno

    from zenflow_kernels.state_files import _PosixIO

    data, zen = batches(), dict(overlap_step=True)
    m, opt = make(None, zen)
    with opt:
        memory = train(m, opt, data)
    m, opt = make(tmp_path, zen)
    with opt:
        train(m, opt, data, stop=5)

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        with monkeypatch.context() as patch:
            patch.setattr(_PosixIO, "fallocate", staticmethod(full))
            with pytest.raises(StateFileError, match=r"reserving \d+ bytes .*checkpoint's copy of the fields master, "
                                                     r"exp_avg, exp_avg_sq and the gradient sums\) for "
                                                     r".*zenflow-snapshot-\w+ "
                                                     r"failed: No space left on device \(\d+ bytes were free\)"):
                opt.state_dict()
        [folder] = os.listdir(tmp_path)  # no copy left
        assert os.listdir(tmp_path / folder) == ["rank0.state"]
        disk = train(m, opt, data, start=5)
        assert opt.state_dict()["state"][0]["host_master"].untyped_storage().filename is not None
    assert_same(disk, {t: memory[t] for t in disk}, "after the failed save")


def _sweep_settings(case, devacc=False):
    topk, upd, overlap, dtype, warmup, (strategy, interval, epoch), importance = case
    zenflow = dict(topk_ratio=topk, update_interval=upd, overlap_step=overlap, full_warm_up_rounds=warmup,
                   select_strategy=strategy, select_interval=interval, importance=importance, max_update_interval=5,
                   auto_ratio=0.5, device_accumulation=devacc)
    if epoch is not None and strategy != "step":
        zenflow["steps_per_epoch"] = epoch
    return zenflow, dtype


@pytest.mark.parametrize("n", range(len(SWEEP)), ids=[_ids(c) for c in SWEEP])
def test_the_oracle_sweep_on_disk_gives_the_in_memory_bits(tmp_path, n):
    """Every case of test_optim's oracle sweep (top-k 0/0.1/1, update interval 1/3/auto, sync and overlap,
    fp32/bf16, warm-up, the selection strategies, both importances, clipping) on disk and in memory, the
    synchronous link and chaos alternating, half of them with ``device_accumulation`` (every pairing of sync or
    overlap, fp32 or bf16, and link): the same weights at every step and the same host state at the end."""
    zenflow, dtype = _sweep_settings(SWEEP[n], devacc=n % 8 in (0, 3, 5, 6))
    grads = grad_sequence(30)
    runs = []
    for where in (None, tmp_path):
        params = make_params(dtype)
        zen = zenflow | ({} if where is None else dict(offload_device="nvme", nvme_path=str(where)))
        ctx = chaos(seed=n % 3, max_delay=0.001) if n % 2 else contextlib.nullcontext()
        with ctx, quiet(ZenFlowAdamW, params, **HYPER, zenflow=zen, max_grad_norm=8.0) as opt:
            history = []
            for step_grads in grads:
                for p, g in zip(params, step_grads, strict=True):
                    p.grad = g.to(dtype)
                opt.step()
                history.append(snapshot(params))
            sd = opt.state_dict()
        runs.append((history, sd))
    (memory, msd), (disk, dsd) = runs
    for t, (a, b) in enumerate(zip(disk, memory, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {t}"
    for i, st in msd["state"].items():
        for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "acc"):
            if key in st:
                assert torch.equal(dsd["state"][i][key], st[key]), (i, key)


@pytest.mark.parametrize("mode", ["sync", "chaos1", "chaos2"])
@pytest.mark.parametrize("zen", [dict(overlap_step=True), dict(overlap_step=True, device_accumulation=True),
                                 dict(device_accumulation=True)], ids=["overlap", "overlap_devacc", "devacc"])
def test_the_patterns_users_write_give_the_in_memory_bits_on_disk(tmp_path, zen, mode):
    """Two micro-batches a step (the first declared with ``opt.no_sync()``), in-place
    ``zero_grad(set_to_none=False)``, an evaluation and a save inside ``flushed()`` at step 7 reloaded into the
    stepped optimizer, with and without ``device_accumulation`` (whose sums the file-backed checkpoint copies
    from the device buffer): weights at every step and the final host state and sums as in memory."""
    def run(where):
        m, opt = make(where, zen, mode=mode)
        weights = []
        with opt:
            for t, (x, y) in enumerate(batches()):
                with opt.no_sync():  # declared: the second micro-batch still adds to these gradients
                    F.mse_loss(m(x[:4]), y[:4]).backward()
                F.mse_loss(m(x[4:]), y[4:]).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                if t == 6:
                    with torch.no_grad(), opt.flushed():
                        m(x)  # an evaluation
                        saved = opt.state_dict()
                    opt.load_state_dict(saved)
                weights.append(snapshot(m.parameters()))
            return weights, opt.state_dict()

    (memory, expected), (disk, got) = run(None), run(tmp_path)
    assert_same(dict(enumerate(disk)), dict(enumerate(memory)), "disk against memory")
    for i, st in expected["state"].items():
        for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "acc"):
            assert torch.equal(got["state"][i][key], st[key]), (i, key)


def test_clipping_over_sums_fetched_in_pieces_has_the_bits_of_the_whole_buffer(tmp_path):
    """A host update on disk whose sums stay on the device (``HostShard(num_acc=0)``, ``update(sums=...)``) against
    one whose sums are in host memory, with clipping active: parameters longer than the fetch blocks (their norm
    summed from pieces of ``SUM_CHUNK`` multiples), odd sizes, two dtypes and groups: the same clipped step, bit
    for bit, every element fetched once for the norm and once for the step, the device's sums left unchanged."""
    from zenflow_kernels.cpu_ops.accumulate import SUM_CHUNK
    from zenflow_kernels.host import HostShard
    from zenflow_kernels.state_files import StateFiles

    g = torch.Generator().manual_seed(4)
    params = [torch.randn(41, 16_001, generator=g), torch.randn(3, SUM_CHUNK, generator=g).bfloat16(),
              torch.randn(333, generator=g), torch.randn(5, 9, generator=g)]
    groups, counts = [0, 0, 1, 1], {0: 3, 1: 2, 2: 3, 3: 1}
    hyper = [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
             dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0)]
    shards = []
    for num_acc in (1, 0):
        shard = HostShard(params, groups, rule=AdamW(), num_acc=num_acc,
                          disk=lambda n: StateFiles(tmp_path, n, fields=FIELDS, block_numel=4096))
        shards.append(shard)
    sums = torch.randn(shards[0].numel, generator=g) * 5
    shards[0].acc[0].copy_(sums)
    device, fetched = sums.clone(), []
    source = recording_device_sums(device, SUM_CHUNK, 3, fetched)  # a 656 K-element matrix: 41 pieces
    for shard, kw in zip(shards, (dict(), dict(sums=source)), strict=True):
        shard.update(0, counts, hyper, max_grad_norm=0.5, **kw)
    assert shards[1].acc == [] and torch.equal(device, sums)
    for i in range(len(params)):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(shards[1].field(name, i), shards[0].field(name, i)), (i, name)
        assert torch.equal(shards[1].out_view(i), shards[0].out_view(i)), i
    assert not torch.equal(shards[0].field("master", 0), params[0])  # a step was taken
    covered = torch.zeros(shards[0].numel, dtype=torch.int32)
    for lo, hi in fetched:
        covered[lo:hi] += 1
    for s in shards[0].slots.values():
        assert torch.all(covered[s.offset : s.offset + s.numel] == 2), s.index  # the norm, then the step
    assert int(covered.sum()) == 2 * sum(p.numel() for p in params)
    shards[0].acc[0].copy_(sums)  # the float64 norms themselves, not only what survives the fp32 step
    for i in range(len(params)):
        assert shards[1]._sum_squares(None, source, i) == shards[0]._sum_squares(shards[0].acc[0], None, i), i
    for shard in shards:
        shard.close()
