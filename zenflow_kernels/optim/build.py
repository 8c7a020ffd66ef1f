"""Setting an optimizer up: the checks of its parameters, how the ranks hold state (sharding), the CPUs of
training and of the host worker, and at the first step the host shard, the link and the workers."""

from __future__ import annotations

import math
import numbers
import os

import torch

from .. import cpu_ops
from .. import link as link_module
from ..config import check_max_grad_norm
from ..handover import GradHooks, handover_mode, release_hooks
from ..host import HostShard
from ..orderings import orderings
from ..rules import UpdateRule, check_rule
from ..sharding import FSDP2, Sharding, Zero1, Zero2, fsdp2_mesh
from .run import BuiltOptimizer
from .sums import host_buffers, make_sums

__all__ = ["Tunables", "PARAM_DTYPES", "display_name", "check_arguments", "check_host_timeout", "check_nvme_path",
           "take_params", "device_of", "check_params",
           "choose_sharding", "rank_cores", "trained", "make_host_and_link", "make_run", "make_parts", "grad_hooks",
           "shutdown", "training_threads"]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Tunables:
    """The optimizer's sizes and switches, as class attributes (a subclass or an instance may set them before the
    first step)."""

    NVME_BLOCK_NUMEL = 1 << 20
    """offload_device="nvme": elements per block of the state file (12 MiB a block for AdamW; the update streams
    three blocks at a time)."""
    NVME_DIRECT = True
    """offload_device="nvme" opens the state file with O_DIRECT (the page cache does not hold it; bench.nvme).
    False uses the page cache."""
    ZERO_BUCKET_NUMEL = 1 << 23
    """ZeRO-2 reduces matrices' gradients in buckets of at most this many elements (one owner, one dtype)."""
    FUSE_MIN_NUMEL = 1 << 16
    """A synchronous CPU update folds a parameter's last gradient into its host pass (saving a pass over the
    accumulation buffer) when it has at least this many elements; below, one merged call per run of parameters
    costs less than a fused call per parameter."""
    OFFLOAD_BUCKET_NUMEL = 1 << 26
    """With ``offload``, the fast-path state moves to the device in buckets of at most this many elements."""


def display_name(rule, facade: str | None = None) -> str:
    """What the optimizer's messages call it: the facade's name (``ZenFlowAdamW``), else ``ZenFlow(<rule name>)``
    (``ZenFlow(Lion)``; a rule without a ``name``: its class's)."""
    if facade:
        return facade
    return f"ZenFlow({getattr(rule, 'name', '') or type(rule).__name__})"


def check_host_timeout(host_timeout, name: str = "ZenFlow") -> None:
    """``host_timeout``: None (no limit) or a finite number of seconds > 0, or an error naming it."""
    if host_timeout is None:
        return
    if isinstance(host_timeout, bool) or not isinstance(host_timeout, numbers.Real):
        raise TypeError(f"{name}: host_timeout={host_timeout!r} is invalid: allowed None (no limit) or a finite "
                        "number of seconds > 0")
    if not (math.isfinite(host_timeout) and host_timeout > 0):
        raise ValueError(f"{name}: host_timeout={host_timeout!r} is invalid: allowed None (no limit) or a finite "
                         "number of seconds > 0")


def check_arguments(rule, lr, max_grad_norm, zero_stage, collective_timeout, release_gradients, host_timeout=None,
                    name: str = "ZenFlow") -> None:
    """ZenFlow's update rule (its defaults with ``lr``), ``max_grad_norm``, ``host_timeout`` and ZeRO arguments, or an
    error naming the argument, its value and what is allowed (``name``: the optimizer's, :func:`display_name`)."""
    if not isinstance(rule, UpdateRule):
        raise TypeError(f"ZenFlow: rule={rule!r} is invalid: allowed an update rule (zenflow_kernels.rules.AdamW, "
                        "Adam, Lion, SGD, or a subclass of rules.UpdateRule)")
    rule.check_group(dict(rule.group_defaults(), lr=lr), name)  # (lr with the rule's own)
    check_rule(rule, dict(rule.group_defaults(), lr=lr), name)  # the rule contract (rules.check_rule)
    check_max_grad_norm(max_grad_norm, name)
    check_host_timeout(host_timeout, name)
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
        raise ValueError(f"{name}: zero_stage={zero_stage!r} is invalid: allowed 0, 1 or 2")
    if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)) or not (
            math.isfinite(collective_timeout) and collective_timeout > 0):
        raise ValueError(f"{name}: collective_timeout={collective_timeout!r} is invalid: allowed a "
                         "positive number of seconds")
    if release_gradients is not None and (not isinstance(release_gradients, bool) or (
            release_gradients and zero_stage != 2)):
        raise ValueError(f"{name}: release_gradients={release_gradients!r} with zero_stage={zero_stage} is "
                         "invalid: allowed None, or True/False with zero_stage=2 (only stage 2 reduces each "
                         "gradient to one owner)")


def check_nvme_path(config, rule=None, name: str = "ZenFlow") -> None:
    """``offload_device="nvme"``: ``nvme_path`` is an existing folder this process may write, or an error naming it
    (at construction: before any thread, hook or file exists); the state file holds fp32 fields only."""
    if config.offload_device != "nvme":
        return
    if rule is not None and rule.state_dtype != torch.float32:
        raise ValueError(f"{name}: {rule!r} keeps its state in {rule.state_dtype} with zenflow.offload_device="
                         "'nvme': allowed float32 state on disk (bf16 state is for host memory: "
                         "offload_device='cpu')")
    path = config.nvme_path
    problem = ("does not exist" if not os.path.exists(path) else "is not a folder" if not os.path.isdir(path) else
               "is not writable by this process" if not os.access(path, os.W_OK | os.X_OK) else None)
    if problem:
        raise ValueError(f"{name}: zenflow.nvme_path={path!r} {problem}: allowed an existing, writable folder "
                         "(the host state's files are created in it at the first step)")


def take_params(param_groups: list[dict], name: str = "ZenFlow") -> tuple[list[torch.Tensor], list[int]]:
    """The parameters of every group in order, and each one's group, checked (:func:`check_params`); an optimizer
    that hooked them before (the one this replaces) no longer copies their gradients (``handover.release_hooks``)."""
    params = [p for g in param_groups for p in g["params"]]
    check_params(params, name)
    release_hooks(params)
    return params, [gi for gi, g in enumerate(param_groups) for _ in g["params"]]


def device_of(params: list[torch.Tensor]) -> torch.device:
    """The parameters' device (:func:`check_params` makes it one), the CPU for an optimizer without any."""
    return params[0].device if params else torch.device("cpu")


def check_params(params: list[torch.Tensor], name: str = "ZenFlow") -> None:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{name}: parameters on several devices {sorted(map(str, devices))}: allowed one")
    for p in params:
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"{name}: parameter dtype {p.dtype} is invalid: allowed float32, bfloat16, float16")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"{name}: a parameter appears more than once")


def choose_sharding(params, *, world: int, zero_stage: int, process_group, timeout: float, release: bool,
                    bucket_numel: int, name: str = "ZenFlow") -> Sharding:
    """One process, ZeRO-1/2 over ``torch.distributed`` or FSDP2 (DTensor parameters); its messages say ``name``."""
    shard = _sharding(params, world=world, zero_stage=zero_stage, process_group=process_group, timeout=timeout,
                      release=release, bucket_numel=bucket_numel, name=name)
    shard.name = name
    return shard


def _sharding(params, *, world: int, zero_stage: int, process_group, timeout: float, release: bool,
              bucket_numel: int, name: str) -> Sharding:
    mesh = fsdp2_mesh(params, name)
    if mesh is not None:
        if zero_stage:
            raise ValueError(
                f"{name}: zero_stage={zero_stage} with FSDP2 (DTensor) parameters is invalid: allowed 0 "
                "(FSDP2 already shards the parameters and gradients; the host state follows its shards)")
        if process_group is not None:
            raise ValueError(f"{name}: process_group with FSDP2 (DTensor) parameters is invalid: allowed "
                             "None (the parameters' device mesh is the group)")
        return FSDP2(mesh, timeout, name)
    if world == 1:
        return Sharding()
    if zero_stage == 0:
        raise ValueError(
            f"{name}: torch.distributed runs {world} ranks and zero_stage=0: pick zero_stage=1 or 2 (each "
            "rank holds 1/world of the host state; the optimizer averages the gradients itself, without DDP)"
        )
    if zero_stage == 1:
        return Zero1(process_group, timeout)
    return Zero2(process_group, timeout, release=release, bucket_numel=bucket_numel)


def rank_cores(config, name: str = "ZenFlow") -> tuple[list[int], str]:
    """The CPUs this rank's training and host worker share out (``zenflow.cores``), and why."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if config.cores != "auto":
        outside = sorted(set(config.cores) - affinity)
        if outside:
            raise ValueError(f"{name}: zenflow.cores={list(config.cores)!r} is invalid: CPUs {outside} "
                             f"are outside this process's affinity {sorted(affinity)} (allowed: a subset of it; "
                             "never widened)")
        return list(config.cores), "zenflow.cores as given"
    cores, why = cpu_ops.rank_cores(affinity)
    return cpu_ops.physical_cores(cores), why


def first_cores(config, param_groups: list[dict]) -> dict:
    """The CPUs of training and of the host worker (:func:`split_cores`) that the first step will pick, before it."""
    return split_cores(config, device_of([p for g in param_groups for p in g["params"]]))


def split_cores(config, device: torch.device, name: str = "ZenFlow") -> dict:
    """``{"train": cores, "host": cores, "why": ...}``: training's and the host worker's CPUs."""
    cores, why = rank_cores(config, name)
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


def trained(params, kept=()) -> set[int]:
    """The parameters that get host state: those that can receive a gradient (``requires_grad``) or hold one, and
    ``kept`` (held before: a checkpoint's, or an earlier layout's). A frozen parameter (a LoRA model's base, a
    frozen backbone) costs no host memory; one unfrozen later is added at the step its first gradient reaches
    (the facade's ``_admit``)."""
    return {i for i, p in enumerate(params) if p.requires_grad or p.grad is not None} | set(kept)


def make_run(params, group_of, param_groups, state, config, shard, telemetry, *, timeout, chaos, nvme_block: int,
             nvme_direct: bool, host_params: set[int], rule, name: str = "ZenFlow") -> BuiltOptimizer:
    """The first step's setup: the CPUs of training and of the host worker, the sharding started, the host shard
    of ``host_params`` (those of them this rank holds) laid out, the link and the context the parts share
    (:class:`BuiltOptimizer`). A failure leaves nothing running: training's thread count restored, no worker started."""
    device = device_of(params)
    cores = split_cores(config, device, name)
    shard.start(params, group_of, device, chaos)
    shard.hold(host_params)
    local = [shard.local(p) for p in params]  # the parameters, or (FSDP2) this rank's rows
    for p in params:  # a built optimizer has state: torch.distributed.checkpoint would otherwise
        state.setdefault(p, {})  # run a (learning rate 0) step to create it
    torch_threads = training_threads(config, cores)
    try:
        disk = None
        if config.offload_device == "nvme":
            from ..state_files import StateFiles

            path, rank, fields = config.nvme_path, shard.rank, ("master", *rule.state_names)
            disk = lambda numel: StateFiles(path, numel, block_numel=nvme_block, rank=rank, direct=nvme_direct,  # noqa: E731
                                            fields=fields, owner=name)
        owned = sorted(host_params if shard.owned is None else host_params.intersection(shard.owned))
        keys = shard.element_keys(group_of, host_params) if rule.state_rounding == "stochastic" else None
        host, link = make_host_and_link(local, group_of, device, config=config, cores=cores, timeout=timeout,
                                        chaos=chaos, owned=owned, num_acc=host_buffers(config), disk=disk, rule=rule,
                                        name=name, keys=keys)
    except BaseException:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        raise
    shard.use_host_memory(link.alloc)  # ZeRO: the write-back's receive buffers (pinned on a GPU)
    return BuiltOptimizer(params, local, group_of, param_groups, state, config, device, shard, link, host, telemetry,
                          cores, torch_threads, frozenset(host_params), rule, name=name)


def make_parts(run: BuiltOptimizer, classes, handover, *, seed_from_host: bool, hyperparams, grad_ready) -> tuple:
    """The parts of a built optimizer over ``run`` (docs/hacking.md), from ``classes``' ``fast_path_class``,
    ``selection_class`` and ``interval_class``: ``(fast_path, selection, interval, hooks)``, with ``handover``'s
    mode decided and the backward hooks registered where the link or the sharding uses them (``hooks`` None
    elsewhere); ``hyperparams()``: the param groups' hyper-parameters as they are now. A failure stops what ``run``
    started (:func:`shutdown`) before it is raised."""
    config, link, hooks = run.config, run.link, None
    try:
        # offload: the fast path's Adam state lives in host memory and visits the device bucket by bucket around
        # the fast step (on a CPU link host memory is the device: nothing moves)
        fast_path = classes.fast_path_class(run, offload=config.offload and link.moves_state,
                                            bucket_numel=classes.OFFLOAD_BUCKET_NUMEL)
        selection = classes.selection_class(run, fast_path, seed_from_host=seed_from_host)
        # (the parts hold the optimizer's param groups and state, never the optimizer: no cycle delays its finalizer)
        interval = classes.interval_class(run, make_sums(run), overlap=config.overlap_step, hyperparams=hyperparams)
        handover.decide(*handover_mode(link, run.shard, config.device_accumulation, orderings.early_handover))
        if handover.mode == "on" or run.shard.consumes_hooks:
            hooks = grad_hooks(run.params, grad_ready, range(len(run.params)))
    except BaseException:
        shutdown(link, run.torch_threads, hooks)
        raise
    return fast_path, selection, interval, hooks


def make_host_and_link(local, group_of, device, *, config, cores: dict, timeout, chaos, owned, num_acc: int, disk,
                       rule, name: str, keys: dict[int, int] | None = None):
    """The host shard of this rank's parameters ``owned`` (laid out by the optimizer) and the link that moves data
    between it and the device: CUDA streams and pinned memory, plain CPU copies, or (``chaos``) the asynchronous
    CPU link. A failure stops the engine's threads and removes the state file made so far."""
    engine = link_module.make_engine(device, chaos=chaos, timeout=timeout)
    if engine is not None:
        engine.owner = name  # what its errors call the optimizer (CudaEngine.refuse_capture)
    host = None
    try:
        # an asynchronous link's gradients cross through a landing area, except where the sums are on the device
        host = HostShard(local, group_of, num_acc=num_acc, indices=owned, disk=disk, rule=rule, keys=keys,
                         landing=engine is not None and not config.device_accumulation,
                         **link_module.host_alloc(engine))
        link = link_module.make_link(host, engine, overlap=config.overlap_step,
                                     host_threads=host_threads(cores, device), cores=cores["host"], timeout=timeout)
    except BaseException:
        if engine is not None:
            engine.close()
        if host is not None:
            host.close()
        raise
    return host, link


def grad_hooks(params, grad_ready, indices) -> GradHooks:
    """``grad_ready(i)`` from the post-accumulate-grad hook of each of these parameters that can receive a gradient
    (``grad_ready``: a ``WeakMethod``, so the hooks do not keep the optimizer alive)."""
    hooks = GradHooks(params, grad_ready)
    hooks.ensure(indices)
    return hooks


def shutdown(link, torch_threads: int | None, hooks: GradHooks | None) -> None:
    """The optimizer's finalizer (or the undoing of a first step that failed): remove its backward hooks, stop the
    link's workers, give training its threads back."""
    try:
        if hooks is not None:
            hooks.remove()
        if link is not None:
            link.close()
    finally:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
