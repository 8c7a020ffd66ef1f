"""The CUDA link on a real GPU (bench/gpu_suite.sh runs this file; skipped without CUDA).

tests/test_cuda_protocol.py and tests/test_cuda_stand_in.py check the same choices on CPU against stand-ins for
``torch.cuda``; here they meet the driver: the accumulate worker blocks on its events instead of
spinning, zeroing gradients in place right after ``step()`` gives the bits of ``set_to_none``, and the
pinned buffers are locked in place, in whole pages of their own.
"""

from __future__ import annotations

import mmap

import pytest
import torch
from worker_clock import accumulate_worker_times  # noqa: E402

from zenflow_kernels import ZenFlowAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by bench/gpu_suite.sh)")

ZEN = dict(topk_ratio=0.1, select_strategy="step", select_interval=6, update_interval=2, overlap_step=True,
           full_warm_up_rounds=1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()


def test_the_accumulate_worker_blocks_instead_of_spinning():
    model = _model()
    x = torch.randn(64, 1024, device="cuda")
    with ZenFlowAdamW(model.parameters(), zenflow=ZEN) as opt:
        def train_step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        model(x).square().mean().backward()
        opt.step()
        cpu, wall = accumulate_worker_times(opt, train_step)
    print(f"accumulate worker: {cpu * 1e3:.1f} ms CPU over {wall * 1e3:.1f} ms wall")
    assert cpu < 0.5 * wall, (cpu, wall)


@pytest.mark.parametrize("how", ["model.zero_grad(False)", "grad.zero_()"])
def test_zeroing_in_place_after_step_gives_the_bits_of_set_to_none(how):
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [(torch.randn(32, 1024, device="cuda", generator=g)) for _ in range(12)]
    runs = []
    for zero in ("none", how):
        model = _model()
        with ZenFlowAdamW(model.parameters(), zenflow=ZEN) as opt:
            for x in batches:
                model(x).square().mean().backward()
                opt.step()
                if zero == "none":
                    opt.zero_grad()
                elif zero == "model.zero_grad(False)":
                    model.zero_grad(set_to_none=False)
                else:
                    for p in model.parameters():
                        p.grad.zero_()
            opt.flush()
        runs.append([p.detach().cpu() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_device_accumulation_with_the_state_on_disk_fetches_the_sums_exactly(tmp_path):
    """``device_accumulation`` with the host state on disk: each host update fetches the device's sums block by
    block on the engine's fetch stream into pinned blocks (no host accumulation buffer), with overlap and
    clipping; the weights are the in-memory run's, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(5)
    batches = [torch.randn(32, 1024, device="cuda", generator=g) for _ in range(10)]
    runs = []
    for where in (None, tmp_path):
        model = _model()
        zen = dict(ZEN, device_accumulation=True, update_interval=3)
        if where is not None:
            zen.update(offload_device="nvme", nvme_path=str(where))
        with ZenFlowAdamW(model.parameters(), zenflow=zen, max_grad_norm=0.5) as opt:
            for x in batches:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            opt.flush()
            runs.append(([p.detach().cpu() for p in model.parameters()], opt.host_bytes()))
    (memory, _), (disk, hb) = runs
    assert all(torch.equal(a, b) for a, b in zip(disk, memory, strict=True))
    assert hb["accumulation"] == 0 and hb["sums_blocks"] > 0 and hb["disk"] > 0
    assert hb["pinned_requested"] >= hb["sums_blocks"] + hb["copy_out"]


def test_pinned_buffers_are_page_locked_in_whole_pages_of_their_own():
    """A shard of 2^26 + 16 fp32 elements: torch's caching host allocator would round each buffer up to the
    next power of two (2^29 B for 2^28 + 64 B: about 2x); page-locking in place reserves whole pages only.
    Unpinned at close; torch's own pinned pool does not grow for the optimizer's buffers."""
    before = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)
    p = torch.nn.Parameter(torch.zeros(2**26 + 16, device="cuda"))
    opt = ZenFlowAdamW([p], zenflow=dict(ZEN, overlap_step=True))
    p.grad = torch.ones_like(p)
    opt.step()
    hb = opt.host_bytes()
    print({k: v for k, v in hb.items() if "pinned" in k or k in ("total", "landing")})
    assert hb["pinned_requested"] >= 6 * 4 * (2**26 + 16)  # master, 2 moments, 2 accumulation, copy-out
    assert hb["pinned_reserved"] <= 1.1 * hb["pinned_requested"]
    assert all(t.data_ptr() % mmap.PAGESIZE == 0 for t, _ in opt.link.engine.pinned)
    grown = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0) - before
    assert grown < 0.01 * hb["pinned_requested"], grown
    opt.close()
    assert opt.link.pinned_bytes()["pinned_requested"] == 0


def test_cuda_parameters_keep_deepspeeds_core_split_by_default(monkeypatch):
    """``pt_reserved_cores_perc="auto"`` is DeepSpeed's 0.5 for parameters on a GPU (1.0 only on a CPU-only
    run: tests/test_reserved_cores.py)."""
    from zenflow_kernels import cpu_ops

    seen, real = [], cpu_ops.split_cores
    monkeypatch.setattr(cpu_ops, "split_cores", lambda perc, cores=None: seen.append(perc) or real(perc, cores))
    model = _model()
    with ZenFlowAdamW(model.parameters(), zenflow=ZEN) as opt:
        model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
        opt.step()
        assert opt.config.pt_reserved_cores_perc == "auto"
    assert seen == [0.5]
