"""ZenFlowAdamW with its host state on disk (``offload_device="nvme"``, issue 25; one process for now): the
same bits as the in-memory host (synchronous and overlapped updates, clipping, a non-finite skip, warm-up,
re-selections, the asynchronous link under chaos), checkpoints moving between memory and disk both ways,
the state file private and removed at close, its bytes reported apart from memory."""

import contextlib
import copy
import os
import stat

import pytest
import torch
import torch.nn.functional as F
from test_optim import snapshot

from zenflow_kernels import ZenFlowAdamW, ZenFlowConfig, ZenFlowConfigError
from zenflow_kernels.ops import use_backend
from zenflow_kernels.testing import chaos

STEPS, NAN_AT = 14, 7
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=2, full_warm_up_rounds=1)


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
@pytest.mark.parametrize("overlap, clip, dtype", [(False, False, torch.float32), (True, True, torch.float32),
                                                  (True, False, torch.bfloat16)])
def test_the_disk_host_gives_the_in_memory_bits(tmp_path, mode, overlap, clip, dtype):
    data = batches()
    m, opt = make(None, dict(overlap_step=overlap), mode=mode, clip=clip, dtype=dtype)
    with opt:
        memory = train(m, opt, data)
        expected = opt.state_dict()
    m, opt = make(tmp_path, dict(overlap_step=overlap), mode=mode, clip=clip, dtype=dtype)
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
    numel = opt._host.numel
    assert hb["disk"] == -(-numel // 1024) * 1024 * 12
    assert hb["master"] == hb["exp_avg"] == hb["exp_avg_sq"] == 0
    assert hb["total"] == hb["accumulation"] + hb["copy_out"] + hb["staging"]


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
    # a path that is not a directory fails at the first step, naming it, and leaves nothing behind
    m, opt = make(tmp_path / "missing", dict(overlap_step=True))
    x, y = batches()[0]
    F.mse_loss(m(x), y).backward()
    with pytest.raises(ValueError, match="missing' is not an existing directory"):
        opt.step()
    assert os.listdir(tmp_path) == []


def test_an_io_error_in_an_update_fails_the_optimizer_naming_file_and_offset(tmp_path, monkeypatch):
    """A write that fails (EIO) during an overlapped host update: the next wait raises in the training thread
    with the worker's traceback naming the state file and the offset; the optimizer stays failed (step and
    state_dict refuse: the file may hold half an update), and close() still removes the file."""
    import errno

    from zenflow_kernels.host import HostWorkerError
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
