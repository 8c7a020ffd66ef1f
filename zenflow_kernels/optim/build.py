"""Setting an optimizer up: the checks of its parameters, how the ranks hold state (sharding), the CPUs of
training and of the host worker, and at the first step the host shard, the link and the workers."""

from __future__ import annotations

import math
import os

import torch

from .. import cpu_ops
from .. import link as link_module
from ..handover import grad_ready_hook
from ..host import HostShard
from ..sharding import FSDP2, Sharding, Zero1, Zero2, fsdp2_mesh
from .run import Run
from .sums import host_buffers

__all__ = ["PARAM_DTYPES", "check_arguments", "index_params", "device_of", "check_params", "choose_sharding",
           "rank_cores", "make_host_and_link", "make_run", "grad_hooks", "shutdown", "training_threads"]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_arguments(zero_stage, collective_timeout, release_gradients) -> None:
    """ZenFlowAdamW's ZeRO arguments, or an error naming the argument, its value and what is allowed."""
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
        raise ValueError(f"ZenFlowAdamW: zero_stage={zero_stage!r} is invalid: allowed 0, 1 or 2")
    if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)) or not (
            math.isfinite(collective_timeout) and collective_timeout > 0):
        raise ValueError(f"ZenFlowAdamW: collective_timeout={collective_timeout!r} is invalid: allowed a "
                         "positive number of seconds")
    if release_gradients is not None and (not isinstance(release_gradients, bool) or (
            release_gradients and zero_stage != 2)):
        raise ValueError(f"ZenFlowAdamW: release_gradients={release_gradients!r} with zero_stage={zero_stage} is "
                         "invalid: allowed None, or True/False with zero_stage=2 (only stage 2 reduces each "
                         "gradient to one owner)")


def index_params(param_groups: list[dict]) -> tuple[list[torch.Tensor], list[int]]:
    """The parameters of every group in order, and each one's group, checked (:func:`check_params`)."""
    params = [p for g in param_groups for p in g["params"]]
    check_params(params)
    return params, [gi for gi, g in enumerate(param_groups) for _ in g["params"]]


def device_of(params: list[torch.Tensor]) -> torch.device:
    """The parameters' device (:func:`check_params` makes it one), the CPU for an optimizer without any."""
    return params[0].device if params else torch.device("cpu")


def check_params(params: list[torch.Tensor]) -> None:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"ZenFlowAdamW: parameters on several devices {sorted(map(str, devices))}: allowed one")
    for p in params:
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"ZenFlowAdamW: parameter dtype {p.dtype} is invalid: allowed float32, bfloat16, float16")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("ZenFlowAdamW: a parameter appears more than once")


def choose_sharding(params, *, world: int, zero_stage: int, process_group, timeout: float, release: bool,
                    bucket_numel: int) -> Sharding:
    """One process, ZeRO-1/2 over ``torch.distributed`` or FSDP2 (DTensor parameters)."""
    mesh = fsdp2_mesh(params)
    if mesh is not None:
        if zero_stage:
            raise ValueError(
                f"ZenFlowAdamW: zero_stage={zero_stage} with FSDP2 (DTensor) parameters is invalid: allowed 0 "
                "(FSDP2 already shards the parameters and gradients; the host state follows its shards)")
        if process_group is not None:
            raise ValueError("ZenFlowAdamW: process_group with FSDP2 (DTensor) parameters is invalid: allowed "
                             "None (the parameters' device mesh is the group)")
        return FSDP2(mesh, timeout)
    if world == 1:
        return Sharding()
    if zero_stage == 0:
        raise ValueError(
            f"ZenFlowAdamW: torch.distributed runs {world} ranks and zero_stage=0: pick zero_stage=1 or 2 (each "
            "rank holds 1/world of the host state; the optimizer averages the gradients itself, without DDP)"
        )
    if zero_stage == 1:
        return Zero1(process_group, timeout)
    return Zero2(process_group, timeout, release=release, bucket_numel=bucket_numel)


def rank_cores(config) -> tuple[list[int], str]:
    """The CPUs this rank's training and host worker share out (``zenflow.cores``), and why."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if config.cores != "auto":
        outside = sorted(set(config.cores) - affinity)
        if outside:
            raise ValueError(f"ZenFlowAdamW: zenflow.cores={list(config.cores)!r} is invalid: CPUs {outside} "
                             f"are outside this process's affinity {sorted(affinity)} (allowed: a subset of it; "
                             "never widened)")
        return list(config.cores), "zenflow.cores as given"
    cores, why = cpu_ops.rank_cores(affinity)
    return cpu_ops.physical_cores(cores), why


def split_cores(config, device: torch.device) -> dict:
    """``{"train": cores, "host": cores, "why": ...}``: training's and the host worker's CPUs."""
    cores, why = rank_cores(config)
    train, host = cpu_ops.split_cores(config.reserved_cores_perc(device.type), cores)
    return dict(train=train, host=host, why=why)


def host_threads(cores: dict, device: torch.device) -> int:
    """Threads of the host worker's numba team."""
    train, host = cores["train"], cores["host"]
    if device.type == "cpu" and set(train) & set(host):
        # CPU-only, cores shared with training: a worker takes only what torch leaves free. A numba team started
        # from a second thread joins torch's OpenMP runtime (numba binds to the libgomp torch loaded); once its
        # threads and torch's exceed the cores, libgomp stops idle threads from spinning and every parallel op of
        # the training thread pays a wake-up (measured on 2 cores: forward + backward 20-40% slower). One thread
        # starts no team.
        return max(1, len(set(train) | set(host)) - torch.get_num_threads())
    return len(host)


def training_threads(config, cores: dict) -> int | None:
    """With an overlapped update on CPUs of its own, training's torch threads keep to training's CPUs: the
    former thread count (to restore at close), or None where nothing changed."""
    if not (config.overlap_step and set(cores["train"]) != set(cores["host"])):
        return None
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, len(cores["train"])))
    return saved


def make_run(params, group_of, param_groups, state, config, shard, telemetry, *, timeout, chaos, nvme_block: int,
             nvme_direct: bool) -> Run:
    """The first step's setup: the CPUs of training and of the host worker, the sharding started, the host shard
    laid out, the link and the context the parts share (:class:`Run`)."""
    device = device_of(params)
    cores = split_cores(config, device)
    shard.start(params, group_of, device, chaos)
    local = [shard.local(p) for p in params]  # the parameters, or (FSDP2) this rank's rows
    for p in params:  # a built optimizer has state: torch.distributed.checkpoint would otherwise
        state.setdefault(p, {})  # run a (learning rate 0) step to create it
    torch_threads = training_threads(config, cores)
    disk = None
    if config.offload_device == "nvme":
        from ..state_files import StateFiles

        path, rank = config.nvme_path, shard.rank
        disk = lambda numel: StateFiles(path, numel, block_numel=nvme_block, rank=rank, direct=nvme_direct)  # noqa: E731
    host, link = make_host_and_link(local, group_of, device, config=config, cores=cores, timeout=timeout, chaos=chaos,
                                    owned=shard.owned, num_acc=host_buffers(config), disk=disk)
    shard.use_host_memory(link.alloc)  # ZeRO: the write-back's receive buffers (pinned on a GPU)
    return Run(params, local, group_of, param_groups, state, config, device, shard, link, host, telemetry, cores,
               torch_threads)


def make_host_and_link(local, group_of, device, *, config, cores: dict, timeout, chaos, owned, num_acc: int, disk):
    """The host shard of this rank's parameters (laid out by the optimizer) and the link that moves data between
    it and the device: CUDA streams and pinned memory, plain CPU copies, or (``chaos``) the asynchronous CPU link."""
    engine = link_module.make_engine(device, chaos=chaos, timeout=timeout)
    # an asynchronous link's gradients cross through a landing area, except where the sums are on the device
    host = HostShard(local, group_of, num_acc=num_acc, indices=owned, disk=disk,
                     landing=engine is not None and not config.device_accumulation, **link_module.host_alloc(engine))
    link = link_module.make_link(host, engine, overlap=config.overlap_step, host_threads=host_threads(cores, device),
                                 cores=cores["host"], timeout=timeout)
    return host, link


def grad_hooks(params, grad_ready) -> list:
    """``grad_ready(i)`` from each parameter's post-accumulate-grad hook (``grad_ready``: a ``WeakMethod``, so the
    hooks do not keep the optimizer alive)."""
    return [p.register_post_accumulate_grad_hook(grad_ready_hook(grad_ready, i)) for i, p in enumerate(params)]


def shutdown(link, torch_threads: int | None, hooks) -> None:
    """The optimizer's finalizer: remove its backward hooks, stop the link's workers, give training its threads
    back."""
    for handle in hooks:
        handle.remove()
    link.close()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
