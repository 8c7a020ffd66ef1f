"""ZenFlowAdamW: the drop-in ``torch.optim`` optimizer (docs/design.md sections 2-3, oracle: reference.py).

Every step, on the parameters' device: one fused multi-tensor AdamW over the selected columns of
every matrix and over every vector parameter (``ops.multi_selective_adamw_``), and the step's
gradient added into the host accumulation buffer. At an update boundary the host runs AdamW over
the flat fp32 master (``HostShard.update``, numba) with the interval's mean gradient, and the
non-selected columns of each matrix are overwritten from it: at once (``overlap_step=False``) or,
with ``overlap_step=True``, by a background worker whose result lands at the next boundary (one
interval stale, never more). The training thread waits for the host only at that write-back, at a
re-selection (the in-flight update is drained before columns change hands) and when saving; every
wait is timed (``stats()["stall_s"]``).

This module is the algorithm. Moving gradients to the host, weights back, and the fast-path state
with ``offload`` is the link's (``link.py``: CUDA streams and pinned buffers, plain CPU copies, or the
asynchronous CPU test link); this module holds no stream, event or pinned buffer. The bookkeeping the
algorithm decides with (what was accumulated in this interval, how often, what is pending) lives
here, on the training thread.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from . import cpu_ops, ops
from ._memory import gather_columns, host_copy
from .config import ZenFlowConfig, ZenFlowWarning, check_adamw_hyperparameters, check_group_settings, num_selected
from .cpu_ops.accumulate import accumulate_unchecked
from .device_model import current_chaos
from .handover import HandOver
from .host import HostWorkerError
from .link import make_link
from .schedule import Schedule, resolve_schedule
from .sharding import FSDP2, Sharding, Zero1, Zero2, fsdp2_mesh, world_of
from .streamed_adam import DeviceSums

__all__ = ["ZenFlowAdamW", "HostWorkerError"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's split: top-k columns on the device every step, the rest on the host.

    Args:
        params: parameters or param groups (each group may set ``lr``, ``betas``, ``eps``,
            ``weight_decay``, and its own ZenFlow ``topk_ratio`` and ``importance``: see
            docs/custom-loop.md). fp32, bf16 or fp16, all on one device (CPU or one CUDA device); or the
            parameters of a model sharded with FSDP2 (docs/fsdp2.md).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        zenflow: a :class:`ZenFlowConfig`, a ``zenflow`` dict, or a DeepSpeed JSON (dict or path).
        max_grad_norm: clip by global norm (fast path: the step's gradient; host: the mean
            accumulated gradient), or None.
        steps_per_epoch, dataloader: the epoch length for ``select_strategy="epoch"``/``"auto"``.
        host_timeout: longest wait in seconds for one host update before an error (None: no limit;
            a dead worker is detected regardless).
        zero_stage: 0, 1 or 2: ZeRO under ``torch.distributed`` (docs/torchrun.md). Each rank's host holds
            the fp32 master, moments and accumulation of its own run of parameters, and the optimizer
            averages the gradients itself (do not wrap the model in DDP): stage 1 all-reduces them,
            stage 2 reduces each matrix's gradient to its owner only, from backward hooks, in buckets.
            With one rank (or without ``torch.distributed``) every stage runs as 0. Several ranks need
            a stage.
        release_gradients: stage 2 only (its default: True): a matrix's ``.grad`` is set to None as its
            bucket's reduction starts, during backward, so a rank holds only its own range of the
            gradient; do not read or change the matrices' gradients between backward and ``step()``
            (clip with ``max_grad_norm``; use bf16 autocast rather than a GradScaler). False keeps
            every ``.grad`` (the local, un-averaged one) at the cost of a whole gradient per rank.
        process_group: the ranks to partition over (default: the default group).
        collective_timeout: longest wait in seconds for one collective; a rank that fails or stops
            stepping ends the others with an error naming the collective instead of a hang.

    With gradient accumulation, run every backward but the last inside :meth:`no_sync` (or
    :meth:`set_requires_gradient_sync`): on a GPU the last one's gradients then cross to the host during
    backward (docs/design.md section 5.1; ``stats()["handover"]`` says whether they do).
    ``step()`` reads ``p.grad``; parameters whose ``.grad`` is None take no part in that step. Save and
    evaluate inside :meth:`flushed` (the flushed weights, then the ones training continues from, bit for
    bit), use :meth:`flush` to land the last host update at the end of training or before an export, and
    :meth:`close` (or ``with ZenFlowAdamW(...) as opt:``) to stop the background worker.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        zenflow: ZenFlowConfig | dict | str | None = None,
        max_grad_norm: float | None = None,
        steps_per_epoch: int | None = None,
        dataloader: Any = None,
        host_timeout: float | None = 600.0,
        zero_stage: int = 0,
        process_group: Any = None,
        collective_timeout: float = 300.0,
        release_gradients: bool | None = None,
    ):
        check_adamw_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm)
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
        world = world_of(process_group)
        self._built = False
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.config = ZenFlowConfig.coerce(zenflow)
        self._rank_cores()  # a cores list outside this process's CPUs is an error now, not at the first step
        self.schedule: Schedule = resolve_schedule(self.config, steps_per_epoch=steps_per_epoch, dataloader=dataloader)
        self.max_grad_norm = max_grad_norm
        self.host_timeout = host_timeout
        self.zero_stage = zero_stage
        self.release_gradients = zero_stage == 2 and release_gradients is not False
        # this step's selected columns' gradients where only those exist ({i: [R, k]}; ZeRO-2 released)
        self._compact: dict[int, torch.Tensor] | None = None
        self._exchange = None  # the owners' hand-over of the pending write-back, started by its host update
        self._received = None  # ZeRO: that hand-over's results, taken inside flushed() before their write-back
        self._unflushed: dict[int, torch.Tensor] | None = None  # inside flushed(): the weights to restore
        self._flushed_depth = 0  # flushed() contexts open
        self._flushed_held = False  # an integration holds the flushed weights (_hold_flushed)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._check_params()
        # how the ranks hold gradients and host state (sharding/): the one thing that differs between one
        # process, ZeRO and FSDP2; the algorithm below is the same for all
        self._shard: Sharding = self._sharding(world, process_group, float(collective_timeout))
        self._shard.accept(self._params)
        self.t = 0
        self.skipped_steps = 0
        self.host_updates = 0
        self.selections = 0
        self.steps_accumulated = 0
        self._closed = False
        self._chaos = current_chaos()  # testing.chaos: a CPU run uses the asynchronous test link
        self._inflight = None  # the overlapped host update still running (or done, not yet waited)
        self._plan = None  # the fast step's per-selection lists (_fast_plan)
        self._split: tuple[list[int], list[int], list[int]] | None = None  # (active, its matrices, its vectors)
        self._shapes: tuple[list[int], list] | None = None  # (indices, their parameters' shapes): step()'s check
        # after loading a torch.optim.AdamW/Adam state dict: a matrix's first selection takes its columns'
        # Adam state from the host (the imported moments and step) instead of starting them from zero
        self._seed_from_host = False
        self._pending: list[int] = []  # parameters whose host result awaits its write-back
        self._stats = _Telemetry()
        # whether gradients cross to the host from backward's hooks (docs/design.md section 5.1; handover.py): the
        # mode is set at the first step, when the link is known
        self._handover = HandOver("on", "no step yet")
        # this step's numbers: GradScaler's scale and its float32 reciprocal (the fused-optimizer protocol), and
        # the clipping norm in force (max_grad_norm, or a clip_grad_norm_() request for this step, the smaller)
        self._amp, self._inv_amp, self._max_norm = 1.0, 1.0, max_grad_norm
        self._clip_request: float | None = None  # clip_grad_norm_() since the last step (the smallest asked)
        self._clip_norms: list[torch.Tensor] = []  # the tensors it returned: step() writes the norm into them
        self._warned: set[str] = set()

    # -- set-up ------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(
                "ZenFlowAdamW.add_param_group after the first step() is not supported: the host buffers are laid out "
                "at the first step; create the optimizer with every param group instead"
            )
        super().add_param_group(param_group)
        try:
            g = self.param_groups[-1]
            check_adamw_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"], where="ZenFlowAdamW group")
            check_group_settings(g, f"ZenFlowAdamW param group {len(self.param_groups) - 1}")
            if hasattr(self, "_params"):  # a group added after __init__ but before the first step
                params = [p for grp in self.param_groups for p in grp["params"]]
                self._check_params(params)
                self._shard.accept(params)
                self._params = params
                self._group_of = [gi for gi, grp in enumerate(self.param_groups) for _ in grp["params"]]
        except Exception:
            self.param_groups.pop()  # a refused group leaves nothing behind
            raise

    def _sharding(self, world: int, process_group, timeout: float) -> Sharding:
        """One process, ZeRO-1/2 over ``torch.distributed`` or FSDP2 (DTensor parameters)."""
        mesh = fsdp2_mesh(self._params)
        if mesh is not None:
            if self.zero_stage:
                raise ValueError(
                    f"ZenFlowAdamW: zero_stage={self.zero_stage} with FSDP2 (DTensor) parameters is invalid: allowed 0 "
                    "(FSDP2 already shards the parameters and gradients; the host state follows its shards)")
            if process_group is not None:
                raise ValueError("ZenFlowAdamW: process_group with FSDP2 (DTensor) parameters is invalid: allowed "
                                 "None (the parameters' device mesh is the group)")
            return FSDP2(mesh, timeout)
        if world == 1:
            return Sharding()
        if self.zero_stage == 0:
            raise ValueError(
                f"ZenFlowAdamW: torch.distributed runs {world} ranks and zero_stage=0: pick zero_stage=1 or 2 (each "
                "rank holds 1/world of the host state; the optimizer averages the gradients itself, without DDP)"
            )
        if self.zero_stage == 1:
            return Zero1(process_group, timeout)
        return Zero2(process_group, timeout, release=self.release_gradients, bucket_numel=self.ZERO_BUCKET_NUMEL)

    def _rank_cores(self) -> tuple[list[int], str]:
        """The CPUs this rank's training and host worker share out (``zenflow.cores``), and why."""
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        if self.config.cores != "auto":
            outside = sorted(set(self.config.cores) - affinity)
            if outside:
                raise ValueError(f"ZenFlowAdamW: zenflow.cores={list(self.config.cores)!r} is invalid: CPUs {outside} "
                                 f"are outside this process's affinity {sorted(affinity)} (allowed: a subset of it; "
                                 "never widened)")
            return list(self.config.cores), "zenflow.cores as given"
        cores, why = cpu_ops.rank_cores(affinity)
        return cpu_ops.physical_cores(cores), why

    def _check_params(self, params=None) -> None:
        params = self._params if params is None else params
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"ZenFlowAdamW: parameters on several devices {sorted(map(str, devices))}: allowed one")
        for p in params:
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"ZenFlowAdamW: parameter dtype {p.dtype} is invalid: allowed float32, bfloat16, float16"
                )
        if len({id(p) for p in params}) != len(params):
            raise ValueError("ZenFlowAdamW: a parameter appears more than once")

    def _build(self) -> None:
        """Lay out the host shard, pick the link and start the workers (at the first step, like torch's
        lazy state)."""
        self.device = self._params[0].device if self._params else torch.device("cpu")
        overlap = self.config.overlap_step
        rank_cores, why = self._rank_cores()
        train_cores, host_cores = cpu_ops.split_cores(self.config.reserved_cores_perc(self.device.type), rank_cores)
        self._cores = dict(train=train_cores, host=host_cores, why=why)
        self._saved_torch_threads = None
        self._shard.start(self._params, self._group_of, self.device, self._chaos)
        # the tensors the algorithm reads and writes: the parameters themselves, or (FSDP2) this rank's rows
        self._local = [self._shard.local(p) for p in self._params]
        self._shapes = None
        for p in self._params:  # a built optimizer has state: torch.distributed.checkpoint would otherwise
            self.state.setdefault(p, {})  # run a (learning rate 0) step to create it
        host_threads = len(host_cores)
        if self.device.type == "cpu" and set(train_cores) & set(host_cores):
            # CPU-only, cores shared with training: a worker takes only what torch leaves free. A numba
            # team started from a second thread joins torch's OpenMP runtime (numba binds to the libgomp
            # torch loaded); once its threads and torch's exceed the cores, libgomp stops idle threads
            # from spinning and every parallel op of the training thread pays a wake-up (measured on 2
            # cores: forward + backward 20-40% slower). One thread starts no team.
            host_threads = max(1, len(set(train_cores) | set(host_cores)) - torch.get_num_threads())
        if overlap and set(train_cores) != set(host_cores):
            self._saved_torch_threads = torch.get_num_threads()
            torch.set_num_threads(max(1, len(train_cores)))
        self._link = make_link(
            self._local,
            self._group_of,
            self.device,
            overlap=overlap,
            host_threads=host_threads,
            cores=host_cores,
            timeout=self.host_timeout,
            chaos=self._chaos,
            indices=self._shard.owned,
            # double-buffered accumulation only where the host accumulates while an update reads; none where
            # the sums stay on the device until a streamed update fetches them block by block
            num_acc=0 if self._sums_stay else 2 if overlap and not self.config.device_accumulation else 1,
            disk=self._state_files(),
            # where the sums are on the device, no gradient crosses per step: no landing area
            landing=not self.config.device_accumulation,
        )
        self._host = self._link.host
        self._shard.use_host_memory(self._link.alloc)  # ZeRO: the write-back's receive buffers (pinned on a GPU)
        # offload: the fast path's Adam state lives in host memory and visits the device bucket by bucket
        # around the fast step (on a CPU link host memory is the device: nothing moves)
        self._offload = self.config.offload and self._link.moves_state
        self._acc_buf = 0
        # device_accumulation: the interval's matrix gradients are summed here (fp32, laid out like the
        # host shard) and uploaded once per update; only the training thread's device work touches it. With
        # the state on disk the update fetches them from here block by block: with overlap a second buffer
        # takes the next interval's sums meanwhile (docs/nvme.md)
        self._device_accs = [
            torch.zeros(self._host.numel, dtype=torch.float32, device=self.device)
            for _ in range(2 if self._sums_stay and overlap else 1 if self.config.device_accumulation else 0)
        ]
        self._sums_read: list[torch.Tensor] = []  # sums an in-flight update reads: zeroed once it is done
        # the training thread's ledger: gradients counted into each accumulation buffer this interval
        self._counts = [[0] * len(self._params) for _ in self._host.acc or self._device_accs]
        # an asynchronous link starts each gradient's copy as soon as backward produces it, where that is the
        # step's gradient (ZeRO averages it in step() first) and it crosses at every step (not summed on the
        # device); ZeRO-2's reductions start from the hooks
        copies = self._link.asynchronous and self._shard.final_at_backward and not self.config.device_accumulation
        why = ("ZeRO-2 reduces gradients to their owners first" if self._shard.consumes_hooks else
               "a synchronous link (nothing to overlap)" if not self._link.asynchronous else
               "ZeRO-1 averages gradients in step()" if not self._shard.final_at_backward else
               "device_accumulation: gradients are summed on the device and cross once per update"
               if self.config.device_accumulation else
               "EARLY_HANDOVER is False" if not self.EARLY_HANDOVER else
               "gradients cross from backward's hooks (each checked at step() against its fingerprint)")
        self._handover.mode = "on" if copies and self.EARLY_HANDOVER else "off"
        self._handover.why = why
        hooks = []
        if self._handover.mode == "on" or self._shard.consumes_hooks:
            ref = weakref.ref(self)
            hooks = [p.register_post_accumulate_grad_hook(_grad_ready_hook(ref, i)) for i, p in enumerate(self._params)]
        # no thread outlives its optimizer: the finalizer (also run at interpreter exit) stops them
        self._finalizer = weakref.finalize(self, _shutdown, self._link, self._saved_torch_threads, hooks)
        self._built = True

    @property
    def _sums_stay(self) -> bool:
        """``device_accumulation`` with the state on disk: the interval's sums never cross to host memory whole
        (no host accumulation buffer); the streamed update fetches each block's piece of them."""
        return self.config.device_accumulation and self.config.offload_device == "nvme"

    @property
    def _device_acc(self) -> torch.Tensor | None:
        """``device_accumulation``: the buffer this interval's sums are added into (None without it), once the
        last boundary's crossing has read and zeroed it (the link orders the caller after that)."""
        if not self._device_accs:
            return None
        self._link.sums_ready()
        return self._device_accs[self._acc_buf]

    def _state_files(self):
        """offload_device="nvme": how the host shard makes its state file (None: host memory)."""
        if self.config.offload_device != "nvme":
            return None
        from .state_files import StateFiles

        path, rank = self.config.nvme_path, self._shard.rank
        block, direct = self.NVME_BLOCK_NUMEL, self.NVME_DIRECT
        return lambda numel: StateFiles(path, numel, block_numel=block, rank=rank, direct=direct)

    NVME_BLOCK_NUMEL = 1 << 20
    """offload_device="nvme": elements per block of the state file (12 MiB a block; the update streams
    three blocks at a time)."""
    NVME_DIRECT = True
    """offload_device="nvme" opens the state file with O_DIRECT (the page cache does not hold it;
    bench.nvme). False (on the class or an instance, before the first step) uses the page cache."""

    def _grad_ready(self, i: int, p: torch.Tensor) -> None:
        """Backward finished parameter ``i``'s gradient: start its copy to the host if the host path will need
        it at the coming step (every parameter in warm-up, matrices after) and the hand-over policy says so
        (the last backward of a step, declared or learned: handover.py). ``step()`` checks it is still what
        was copied, and copies again what is not (docs/design.md section 5.1)."""
        if self._closed:
            return
        final = self._handover.final()
        if self._shard.consumes_hooks:  # ZeRO-2: the gradient goes to its owner first, averaged
            self._shard.grad_ready(i, self._check_grad, final)
            return
        if not final or not (self._params[i].dim() == 2 or self.schedule.is_warmup(self.t)):
            return  # declared: a later backward still adds to it; or a vector after warm-up (device only)
        if self._handover.copy_now(i):
            self._link.stage(i, self._shard.own_grad(i))

    EARLY_HANDOVER = True
    """Gradients cross to the host from backward's hooks (docs/design.md section 5.1). False (on the class or an
    instance, before the first step) copies them at step(), after backward: for comparison (bench.overlap)."""

    ZERO_BUCKET_NUMEL = 1 << 23
    """ZeRO-2 reduces matrices' gradients in buckets of at most this many elements (one owner, one dtype)."""

    # -- the public surface ------------------------------------------------------------------------

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "ZenFlowAdamW cannot be copied or pickled (copy.copy, copy.deepcopy, pickle, torch.save(opt)): it owns "
            "background threads, host buffers and, on a GPU, streams. Save opt.state_dict() and load it into a new "
            "ZenFlowAdamW with load_state_dict() instead"
        )

    def __repr__(self) -> str:
        base = super().__repr__()  # "ZenFlowAdamW (\nParameter Group 0\n    ...\n)"
        zen = "".join(f"    {k}: {v!r}\n" for k, v in self.config.to_dict().items())
        return f"{base[:-1]}ZenFlow\n{zen}    max_grad_norm: {self.max_grad_norm!r}\n)"

    def set_requires_gradient_sync(self, requires_gradient_sync: bool | Callable[[], bool]) -> None:
        """Declare whether the coming backward passes are the last before ``step()`` (True, the default) or
        micro-batches whose gradients a later backward still adds to (False), as FSDP2's
        ``set_requires_gradient_sync`` does for its reduce-scatter; or give a callable that answers it at each
        backward (the Hugging Face callback passes accelerate's ``sync_gradients``). Backward hooks copy nothing
        to the host while it is False, so only the last micro-batch's gradients cross, during its backward
        (docs/design.md section 5.1). Results never depend on it: undeclared micro-batches are exact too (the
        optimizer learns how many backward passes a step has), declaring only saves copies."""
        if isinstance(requires_gradient_sync, bool):
            self._handover.requires_sync, self._handover.sync_source = requires_gradient_sync, None
        elif callable(requires_gradient_sync):
            self._handover.requires_sync, self._handover.sync_source = True, requires_gradient_sync
        else:
            raise TypeError(f"ZenFlowAdamW.set_requires_gradient_sync: requires_gradient_sync="
                            f"{requires_gradient_sync!r} is invalid: allowed True, False or a callable returning one")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` for the block, as DDP's ``no_sync()``: run every micro-batch's
        backward but the last inside it::

            for k, batch in enumerate(micro_batches):
                with opt.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss_fn(model(batch)).backward()
            opt.step()
        """
        before = self._handover.requires_sync
        self._handover.requires_sync = False
        try:
            yield
        finally:
            self._handover.requires_sync = before

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Give the epoch length, in optimizer steps (batches divided by gradient-accumulation steps,
        rounded up), when it was not known at construction: ``select_strategy="epoch"``/``"auto"`` then
        re-selects columns every ``select_interval`` epochs instead of never. The schedule is resolved again
        (boundaries count from step 0); the ``ZenFlowCallback`` integrations call this for you."""
        self.schedule = resolve_schedule(self.config, steps_per_epoch=steps_per_epoch)

    def close(self) -> None:
        """Land any in-flight host update and stop the background workers (idempotent)."""
        if self._closed:
            return
        try:
            if self._built and not self._link.failed and not self._shard.failed:
                self.flush()
        finally:
            self._closed = True
            if self._built:
                self._finalizer()

    @torch.compiler.disable
    @torch.no_grad()
    def flush(self) -> None:
        """Wait for any in-flight host update and write back every pending result, so the live weights
        hold everything the host has computed, from now on (the end of training, export). The pending
        result then lands one interval early and the run continues from it: to save or evaluate mid-run
        without changing the run, use :meth:`flushed`. Inside :meth:`flushed` it keeps the flushed weights
        (nothing is restored at the context's end)."""
        if not self._built:
            return
        self._drain()
        self._unflushed = None  # inside flushed(): these weights stay (the write-back below is the real one)
        self._write_back(self._pending)
        self._pending = []
        self._link.join()

    @contextlib.contextmanager
    def flushed(self) -> Iterator[ZenFlowAdamW]:
        """A context in which the parameters hold the flushed weights (what :meth:`flush` gives: every host
        update computed so far applied) and after which they hold again, bit for bit, the weights training
        continues from: save and evaluate inside it, and the run ends as it would without them
        (docs/design.md section 5.2)::

            with opt.flushed():
                evaluate(model); torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)

        ``state_dict()`` inside it records, for each parameter with a pending host result, the weights it
        held before (``"unflushed"``), and ``load_state_dict`` writes them back into the parameters: load the
        model first, then the optimizer (as torch.distributed.checkpoint, the Hugging Face Trainer and
        Lightning do), and the resumed run is bit-identical to the uninterrupted one. Costs: host memory for
        one copy of the parameters with a pending result (their dtype: 2 bytes per parameter in bf16,
        freed at exit), no device memory; one device-to-host copy of them at entry, the pending write-back
        (done again at its boundary), one host-to-device copy at exit. ``step()`` and ``load_state_dict()``
        inside it are errors; contexts nest (the outermost restores)."""
        self._enter_flushed()
        self._flushed_depth += 1
        try:
            yield self
        finally:
            self._flushed_depth -= 1
            self._leave_flushed()

    @torch.no_grad()
    def _enter_flushed(self) -> None:
        """Parameters <- the flushed weights, keeping the live ones to restore (no-op when already inside)."""
        if self._unflushed is not None or not self._built or self._closed:
            return
        self._drain()
        self._link.synchronize()  # the last write-back and fast step have landed in the live weights
        self._unflushed = {i: host_copy(self._local[i]) for i in self._pending}
        self._write_back(self._pending)  # (ZeRO: the owners' results are kept for the one at the boundary)
        self._link.join()

    @torch.no_grad()
    def _leave_flushed(self) -> None:
        """Restore the live weights kept at entry, once no context holds them any more."""
        if self._flushed_depth or self._flushed_held or self._unflushed is None:
            return
        kept, self._unflushed = self._unflushed, None
        self._link.join()
        for i, t in kept.items():
            self._local[i].copy_(t)

    def _hold_flushed(self, held: bool) -> None:
        """The integrations' form of :meth:`flushed`: from a callback before a save or an evaluation until one
        after it (or the next batch's start)."""
        if held:
            self._enter_flushed()
            self._flushed_held = self._unflushed is not None  # (not built yet, or closed: nothing to hold)
        else:
            self._flushed_held = False
            self._leave_flushed()

    def selected_columns(self, param: torch.Tensor) -> torch.Tensor | None:
        """The columns of a matrix parameter currently on the fast path (int64, sorted ascending, on the
        parameter's device; a copy), or None when it has none yet (before its first selection, during
        warm-up, or for a vector parameter). Raises ValueError for a tensor this optimizer does not own."""
        if not any(param is p for p in self._params):
            raise ValueError("selected_columns: the tensor is not a parameter of this optimizer")
        sel = self.state.get(param, {}).get("selected")
        return None if sel is None else sel.clone()

    def stats(self) -> dict:
        """Telemetry of the run so far.

        ``stall_s``: time the training thread spent on the host path instead of training: synchronous
        host updates, gradient accumulation it does itself (CPU runs; ``accumulate_s``) and waits for the
        background worker (``worker_wait_s``). ``stall_fraction``: that over the wall time from the first
        ``step()`` to the end of the last, forward and backward included. ``overlap_fraction``: share of
        the background host-update time the training thread did not wait for. Also per-step fast-path
        time, host-update times, skipped steps, the share of score mass the selected columns captured
        at each selection, and the Jaccard overlap of each new selection with the previous one. Under ZeRO,
        ``collective_bytes`` (and ``collective_bytes_per_step``): the payload bytes each kind of collective
        carried (docs/torchrun.md). ``host_bytes``: see :meth:`host_bytes`.
        """
        return self._stats.summary(self)

    def explain(self, steps: int = 20) -> str:
        """What this optimizer will do, as ``python -m zenflow_kernels explain`` prints it for a config (the
        resolved schedule over the first ``steps`` steps), the CPUs of training and of the host worker (and why:
        ``zenflow.cores``), and, per param group, its own ``topk_ratio`` and ``importance`` and each matrix's ``k``
        of ``C`` columns on the fast path."""
        from .__main__ import explain

        lines = [explain(self.config, self.schedule, steps)]
        if self._built:
            train, host, why = self._cores["train"], self._cores["host"], self._cores["why"]
        else:  # what the first step will pick
            cores, why = self._rank_cores()
            device = self._params[0].device.type if self._params else "cpu"
            train, host = cpu_ops.split_cores(self.config.reserved_cores_perc(device), cores)
        lines += [f"cores: training {train}, host worker {host} ({why})", "param groups:"]
        for gi, g in enumerate(self.param_groups):
            ratio, importance = g.get("topk_ratio", self.config.topk_ratio), g.get("importance", self.config.importance)
            own = [k for k in ("topk_ratio", "importance") if k in g]
            name = getattr(importance, "__name__", None) or repr(importance) if callable(importance) else importance
            lines.append(f"  group {gi}: topk_ratio={ratio!r}, importance={name}"
                         + (f" (its own: {', '.join(own)})" if own else " (the optimizer's)"))
            for p in g["params"]:
                if p.dim() == 2:
                    C = p.shape[1]
                    k = num_selected(ratio, C)
                    what = "host only" if k == 0 else "every column on the device (AdamW)" if k == C else \
                        f"{k} of {C} columns on the device"
                    lines.append(f"    matrix {tuple(p.shape)}: {what}")
            vectors = sum(1 for p in g["params"] if p.dim() != 2)
            if vectors:
                lines.append(f"    {vectors} vector parameter(s): on the device every step")
        return "\n".join(lines)

    def host_bytes(self) -> dict:
        """The optimizer's host memory, by buffer, in bytes as allocated (each buffer's storage; ``{}``
        before the first step): ``master``, ``exp_avg``, ``exp_avg_sq``, ``accumulation`` (one or two
        buffers), ``copy_out`` (one per parameter dtype, sized by that dtype's parameters), ``landing`` (an
        asynchronous link's landing area, laid out like the copy-out: a step's gradients in their dtype until
        ``step()`` folds them into the sums; 0 on the synchronous link and with ``device_accumulation``),
        ``receive`` (ZeRO: the other ranks' copy-out buffers as this rank receives them for the write-back, reused;
        0 on one rank), their sum ``total`` and ``per_parameter`` (over the parameters this rank's host holds:
        under ZeRO its own run). Beside them, not in ``total``:
        ``fast_state`` (the fast path's Adam state in host memory: on a CPU run, or offloaded) and
        ``device_sums`` (``device_accumulation``'s buffer when the device is the CPU), and with
        ``offload_device="nvme"`` ``disk`` (the state file: master and moments, 12 bytes per parameter; then
        ``master``, ``exp_avg`` and ``exp_avg_sq`` are 0 and the update's block buffers are not counted; with
        ``device_accumulation`` ``accumulation`` is 0 and ``sums_blocks``, in ``total``, the blocks the update
        fetches the device's sums into). On a GPU also
        ``pinned_requested`` and ``pinned_reserved`` (the page-locked bytes of those buffers: whole pages of
        their own; docs/design.md section 9)."""
        if not self._built:
            return {}
        out = self._link.host_bytes()
        out["receive"] = self._shard.host_bytes()  # ZeRO: the other ranks' copy-out as this rank receives it
        total = sum(v for k, v in out.items() if k != "disk")  # memory only: the state file's bytes are beside it
        held = sum(self._local[i].numel() for i in self._host.slots)
        storages = {}  # views share their storage (the flat step counts): each counted once
        for st in self.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.device.type == "cpu":
                    storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        fast = sum(storages.values())
        out.update(total=total, per_parameter=total / held if held else 0.0, fast_state=fast,
                   device_sums=sum(t.untyped_storage().nbytes() for t in self._device_accs if t.device.type == "cpu"))
        out.update(self._link.pinned_bytes())
        return out

    # -- the step ----------------------------------------------------------------------------------

    # torch.compile(opt.step) runs the step eagerly, as torch's own optimizers' host-side work does: it
    # drives threads, streams and numba kernels, nothing a graph can hold
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError("ZenFlowAdamW.step() after close()")
        loss = None
        if self._flushed_depth:
            raise RuntimeError(
                "ZenFlowAdamW.step() inside opt.flushed(): the parameters hold the flushed weights, which training "
                "does not continue from; step after the with-block")
        if self._flushed_held:  # an integration missed the hook that restores before the next forward
            self._warn_once("held", "ZenFlowAdamW.step(): the weights flushed for a save or an evaluation were still "
                            "in place when this step's forward ran (no callback restored them); restored now. The run "
                            "differs from one without the save/evaluation from here on")
            self._hold_flushed(False)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._built:
            self._build()
        self._link.check()
        amp, inv_amp, overflow = self._grad_scaler()
        max_norm, norms_out = self._take_clip_request()
        active = self._shard.active()
        own_grad, local = self._shard.own_grad, self._local
        grads = [(i, g) for i in active if (g := own_grad(i)) is not None]
        # one pass over every gradient: dense, on the device, an allowed dtype, the parameter's shape;
        # otherwise _check_grad names the first that is not (the parameters' shapes kept per set of indices)
        indices = [i for i, _ in grads]
        if self._shapes is None or self._shapes[0] != indices:
            self._shapes = (indices, [local[i].shape for i in indices])
        if not {(g.device, g.dtype, g.layout) for _, g in grads} <= {
                (self.device, dtype, torch.strided) for dtype in _PARAM_DTYPES} or (
                [g.shape for _, g in grads] != self._shapes[1]):
            for i, g in grads:
                self._check_grad(i, g)
        self._compact = None
        self._shard.gather(active)
        norm = self._shard.grad_norm(active) / amp  # (a power-of-two scale divides exactly)
        for out in norms_out:
            out.fill_(norm)
        if overflow or not math.isfinite(norm):
            self.skipped_steps += 1
            self._link.discard()  # nothing of this step reached the host sums: nothing to take back
            self._handover.stepped(self.t, *self._link.step_bytes())
            return loss
        self._amp, self._inv_amp, self._max_norm = amp, inv_amp, max_norm
        coef = None if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
        t0 = time.perf_counter()
        if self._stats.first_step_start is None:
            self._stats.first_step_start = t0
        if self.schedule.is_warmup(self.t):
            self._warmup_step(active)
        else:
            self._zenflow_step(self.t, active, coef)
        self._link.join()  # the write-backs of this step are visible to whatever runs next
        self._handover.stepped(self.t, *self._link.step_bytes())
        self._stats.last_step_end = time.perf_counter()
        self._stats.step_seconds.append(self._stats.last_step_end - t0)
        self.t += 1
        return loss

    # GradScaler's protocol for optimizers that unscale inside their step (torch.amp.GradScaler.step): the scaler
    # does not rewrite the gradients; it sets ``grad_scale`` and ``found_inf`` on the optimizer for the length of
    # step() (``grad_scale`` None after the user's own ``scaler.unscale_(opt)``), and never skips step() itself
    _step_supports_amp_scaling = True

    def _grad_scaler(self) -> tuple[float, float, bool]:
        """``(scale, its float32 reciprocal, overflow)`` of this step: what a GradScaler set (``1.0, 1.0, False``
        without one). The reciprocal is GradScaler's own (float64, then float32), which multiplies each gradient
        as the scaler's in-place unscale would: for a power-of-two scale (its growth and backoff by 2) exactly."""
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        amp = 1.0 if scale is None else float(scale)
        if not (math.isfinite(amp) and amp > 0):
            raise ValueError(f"ZenFlowAdamW.step(): grad_scale={amp!r} (set by a GradScaler) is invalid: allowed a "
                             "finite number > 0")
        return amp, float(np.float32(1.0 / amp)), found is not None and float(found) != 0.0

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the coming ``step()``'s gradients by their global norm inside the optimizer, as ``max_grad_norm``
        does (the fast path by this step's gradient norm; a host update at this step by the interval's mean
        gradient norm), instead of rewriting ``.grad`` as ``torch.nn.utils.clip_grad_norm_`` does: the
        gradients stay what backward produced, so they keep crossing to the host during backward. The smaller of
        this and ``max_grad_norm`` applies; ``max_norm=inf`` clips nothing (the norm only). The trainer
        integrations route the Hugging Face ``max_grad_norm`` and Lightning's ``gradient_clip_val`` here.

        Returns a 0-dim float32 tensor on the parameters' device that ``step()`` fills with the global L2 norm of
        the step's gradients (unscaled under a GradScaler, averaged under ZeRO): read it after ``step()`` (the
        Hugging Face Trainer logs it then); NaN until then, or if no ``step()`` follows. Only ``norm_type=2``."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"ZenFlowAdamW.clip_grad_norm_: max_norm={max_norm!r} is invalid: allowed a number > 0 "
                             "(inf: no clipping)")
        if norm_type != 2:
            raise ValueError(f"ZenFlowAdamW.clip_grad_norm_: norm_type={norm_type!r} is invalid: allowed 2 (the "
                             "optimizer clips by the global L2 norm)")
        if math.isfinite(max_norm):
            self._clip_request = min(float(max_norm), self._clip_request or math.inf)
        device = self._local[0].device if self._built else self._params[0].device if self._params else "cpu"
        norm = torch.full((), math.nan, dtype=torch.float32, device=device)
        self._clip_norms.append(norm)
        return norm

    def _take_clip_request(self) -> tuple[float | None, list[torch.Tensor]]:
        """This step's clipping norm (``max_grad_norm`` and a ``clip_grad_norm_`` request, the smaller; None: no
        clipping) and the tensors to write its gradient norm into; the request is used up."""
        request, norms = self._clip_request, self._clip_norms
        self._clip_request, self._clip_norms = None, []
        limits = [x for x in (self.max_grad_norm, request) if x is not None]
        return (min(limits) if limits else None), norms

    def _check_grad(self, i: int, g: torch.Tensor) -> None:
        p = self._local[i]
        if g.is_sparse or g.shape != p.shape or g.device != self.device or g.dtype not in _PARAM_DTYPES:
            raise ValueError(
                f"ZenFlowAdamW: gradient of parameter {i} ({tuple(g.shape)}, {g.dtype}, {g.device}, "
                f"sparse={g.is_sparse}) is invalid: allowed a dense float32, bfloat16 or float16 gradient of "
                f"shape {tuple(p.shape)} on {self.device}"
            )

    def _hyper(self) -> list[dict]:
        """Each param group's AdamW numbers as they are now (a scheduler may have changed them), checked:
        the kernels are called without per-tensor validation."""
        out = []
        for gi, g in enumerate(self.param_groups):
            lr = float(g["lr"])
            check_adamw_hyperparameters(lr, g["betas"], g["eps"], g["weight_decay"], where=f"ZenFlowAdamW group {gi}")
            check_group_settings(g, f"ZenFlowAdamW param group {gi}")
            out.append(dict(lr=lr, beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                            weight_decay=g["weight_decay"]))
        return out

    FUSE_MIN_NUMEL = 1 << 16
    """A synchronous CPU update folds a parameter's last gradient into its AdamW pass (saving a pass over
    the accumulation buffer) when it has at least this many elements; below, one merged AdamW call per
    run of parameters costs less than a fused call per parameter."""

    def _accumulate(self, indices: list[int], *, fuse: bool = False) -> dict[int, torch.Tensor]:
        """Add these parameters' gradients into the current accumulation buffer (through the link) and
        count them. With ``fuse`` (a synchronous update follows at once) a CPU link may hand large
        gradients back un-accumulated, ``{index: grad}``, for ``HostShard.update(last=...)``."""
        buf = self._acc_buf
        fuse_min = self.FUSE_MIN_NUMEL if fuse and self._max_norm is None and self._inv_amp == 1.0 else None
        mine = self._shard.mine(indices)
        last = self._link.accumulate([(i, self._shard.grad(i)) for i in mine], buf, scale=self._inv_amp,
                                     fuse_min_numel=fuse_min)
        self._count(indices)
        return last

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ZenFlowWarning, stacklevel=4)

    def _accumulate_on_device(self, indices: list[int]) -> None:
        """``device_accumulation``: add these gradients into the device-side sums of the interval."""
        host, acc = self._host, self._device_acc
        mine = self._shard.mine(indices)
        sums, grads = [host.view(acc, i) for i in mine], [self._shard.grad(i) for i in mine]
        if acc.device.type == "cpu" and all(g.is_contiguous() for g in grads):
            # the numba pass widens each gradient as it reads it (the bits of torch's add); torch's mixed-dtype
            # add makes an fp32 copy of every bf16/fp16 gradient first: per-step temporaries (see _memory)
            accumulate_unchecked(sums, grads, scale=self._inv_amp)
        elif self._inv_amp == 1.0:
            torch._foreach_add_(sums, grads)
        else:  # (a power-of-two scale: exact whether or not the device fuses the multiply into the add)
            torch._foreach_add_(sums, grads, alpha=self._inv_amp)
        self._count(indices)

    def _count(self, indices: list[int]) -> None:
        """The ledger: one more gradient of each of these parameters in the current interval."""
        counts = self._counts[self._acc_buf]
        for i in indices:
            counts[i] += 1

    def _take_counts(self, indices) -> dict[int, int]:
        """This interval's counts of these parameters (those with any), reset for the next use of the buffer."""
        counts = self._counts[self._acc_buf]
        taken = {i: counts[i] for i in indices if counts[i]}
        for i in taken:
            counts[i] = 0
        return taken

    def _sync_host_update(self, counts: dict[int, int], last: dict[int, torch.Tensor]) -> None:
        """A host update on the training thread, once every accumulation issued has landed."""
        accumulated = self._link.accumulation()
        if accumulated is not None:
            self._link.wait(accumulated)
        mine = {i: counts[i] for i in self._shard.mine(counts)}
        result = self._host.update(
            self._acc_buf, mine, self._hyper(), self._max_norm, self._link.copy_out_guard(), last=last,
            sum_over_ranks=self._sum_over_ranks(), sums=self._fetched_sums(mine),
        )
        self._zero_sums_read()  # (the sums staying on the device: the update has fetched them)
        self._stats.host_seconds.append(result["seconds"])
        self._stats.sync_host_seconds += result["seconds"]  # synchronous: the training thread waited

    def _sum_over_ranks(self):
        """ZeRO with clipping: how a host update turns its shard's sum of squares into the model's."""
        return self._shard.sum_over_ranks() if self._max_norm is not None else None

    def _fetched_sums(self, mine) -> DeviceSums | None:
        """The sums staying on the device: this interval's buffer for the update of ``mine`` to fetch from (its
        parameters' sums zeroed once that update is done: :meth:`_zero_sums_read`); otherwise None."""
        if not self._sums_stay:
            return None
        acc = self._device_acc
        self._sums_read = [self._host.view(acc, i) for i in mine]
        fetched = sum(t.numel() for t in self._sums_read) * 4
        self._link.d2h_bytes += fetched * (2 if self._max_norm is not None else 1)  # (clipping reads twice)
        return self._link.device_sums(acc)

    def _zero_sums_read(self) -> None:
        """The sums a finished update fetched from the device start the buffer's next interval from zero (on the
        device, behind the fetches, which that update waited for)."""
        if self._sums_read:
            torch._foreach_zero_(self._sums_read)
            self._sums_read = []

    def _warmup_step(self, active: list[int]) -> None:
        """ZeRO-Offload: every parameter gets a synchronous host AdamW step, then all of it is copied back."""
        last = {}
        if self._device_accs:  # the step's gradients are added on the device, as after warm-up
            self._accumulate_on_device(active)
            if not self._sums_stay:  # ... and cross at once (the update on disk fetches them itself)
                acc = self._device_acc
                self._link.upload([(i, self._host.view(acc, i)) for i in self._shard.mine(active)], self._acc_buf)
        else:
            last = self._accumulate(active, fuse=True)
        self._sync_host_update(self._take_counts(active), last)
        self._write_back(active)  # nothing is selected during warm-up: whole parameters
        self.host_updates += 1

    def _zenflow_step(self, t: int, active: list[int], coef: float | None) -> None:
        state = self.state
        if self._split is None or self._split[0] != active:  # (the same parameters step at most steps)
            self._split = (active, [i for i in active if self._params[i].dim() == 2],
                           [i for i in active if self._params[i].dim() != 2])
        _, matrices, vectors = self._split
        for i in vectors:
            if "exp_avg" not in state[self._params[i]]:
                self._init_vector(i)
        boundary = self.schedule.is_select_boundary(t)
        if boundary:
            self.flush()  # drain: ownership must not change under an in-flight host update
            self.selections += 1
        reselect = [i for i in matrices if boundary or "selected" not in state[self._params[i]]]
        if reselect:
            self._reselect(reselect)
        # the selected columns' gradients as every replica's fast step reads them
        if self._shard.exchanges_selected:
            self._compact = self._shard.selected_gradients(
                [(i, state[self._params[i]]["selected"]) for i in matrices])

        t0 = time.perf_counter()
        self._fast_step(set(active), self._hyper(), coef)
        self._stats.fast_seconds.append(time.perf_counter() - t0)

        self.steps_accumulated += 1
        trigger = self._auto_vote(matrices) if self.schedule.is_auto else False
        boundary = self.schedule.is_update_boundary(t, steps_accumulated=self.steps_accumulated, auto_trigger=trigger)
        if self._device_accs:
            self._accumulate_on_device(matrices)
        elif boundary and not self.config.overlap_step:
            self._host_update(last=self._accumulate(matrices, fuse=True))
            return
        else:
            self._accumulate(matrices)
        if boundary:
            self._host_update()

    # -- fast path ---------------------------------------------------------------------------------

    OFFLOAD_BUCKET_NUMEL = 1 << 26
    """With ``offload``, the fast-path state moves to the device in buckets of at most this many elements."""

    def _to_state(self, t: torch.Tensor) -> torch.Tensor:
        """Where fast-path Adam state is kept: the device, or host memory (the link's) with ``offload``."""
        return self._link.new_host_state(t) if self._offload else t.to(self.device)

    def _from_host(self, i: int, name: str, cols: torch.Tensor | None = None, transient: bool = False) -> torch.Tensor:
        """A copy of parameter ``i``'s host ``master``/``exp_avg``/``exp_avg_sq`` (fp32, parameter shape;
        ``cols``: those columns only), on the device. ZeRO: its owner broadcasts it. ``transient``: a
        temporary (the columns are gathered into transient memory where it is made: see _memory)."""
        host, p = self._host, self._local[i]

        def make():
            t = host.field(name, i)
            if cols is None:
                return t.clone()
            return gather_columns(t, cols.cpu()) if transient else t[:, cols.cpu()]

        shape = tuple(p.shape) if cols is None else (p.shape[0], cols.numel())
        return self._shard.from_host(i, make, shape, torch.float32)

    def _host_step(self, i: int) -> int:
        """Parameter ``i``'s host step count (ZeRO: its owner's)."""
        make = lambda: torch.tensor([self._host.host_step[i]])  # noqa: E731
        return int(self._shard.from_host(i, make, (1,), torch.int64))

    def _init_vector(self, i: int) -> None:
        """A vector joins the fast path with the Adam state the host gave it during warm-up."""
        p = self._local[i]
        st = self.state[self._params[i]]
        n = p.numel()
        st["exp_avg"] = self._to_state(self._from_host(i, "exp_avg").reshape(1, n))
        st["exp_avg_sq"] = self._to_state(self._from_host(i, "exp_avg_sq").reshape(1, n))
        st["step"] = self._host_step(i)
        if p.dtype != torch.float32:
            st["master"] = self._to_state(self._from_host(i, "master").reshape(1, n))
        self._plan = None

    @torch.no_grad()
    def _reselect(self, indices: list[int]) -> None:
        """New top-k columns for these matrices; state moves with the columns that stay."""
        importances = [self._setting(i, "importance") for i in indices]
        if self._amp != 1.0:  # a scorer of one's own sees the gradient unscaled, as it would without GradScaler
            importances = [_unscaled(f, self._inv_amp) if callable(f) else f for f in importances]
        scores = self._shard.scores(indices, importances)
        ks = [num_selected(self._setting(i, "topk_ratio"), self._params[i].shape[1]) for i in indices]
        chosen = self._choose(indices, importances, scores, ks)
        host = self._host
        jaccards, captured, total = [], 0.0, 0.0
        returning = []  # columns leaving the fast path for the host master (on disk: after the loop, in one pass)
        for i, new, s in zip(indices, chosen, scores, strict=True):
            p, st = self._local[i], self.state[self._params[i]]
            R, k = p.shape[0], new.numel()
            owned = i in host.slots  # ZeRO: this rank holds the matrix's host state
            old = st.get("selected")
            carry = old is not None and old.numel() > 0
            # the same k, the state where the fast step reads it: the new state is written over the old through
            # transient [R, k] temporaries (a second fast-path state freed, or heap temporaries of this size,
            # would stay in the process's RSS: see _memory)
            in_place = carry and not self._offload and tuple(st["exp_avg"].shape) == (R, k)
            # a low-precision matrix keeps an fp32 master of its selected columns; entering columns take
            # the host master's value (the live weight is that value, rounded)
            master = self._from_host(i, "master", new, transient=in_place) if p.dtype != torch.float32 else None
            if carry:
                # sorted index sets: position of each new column in the old set, if it was there
                pos = torch.searchsorted(old, new).clamp_(max=old.numel() - 1)
                stay = old[pos] == new
                old_master = st["master"].to(self.device) if master is not None else None
                gone = ~torch.isin(old, new)
                if owned and gone.any():  # ownership returns to the host, value included
                    src = (gather_columns(old_master, gone.nonzero().view(-1)) if master is not None
                           else gather_columns(p, old[gone]))
                    returning.append(("master", i, old[gone].cpu(), src.to("cpu", torch.float32)))
                    if host.disk is None:  # in memory: at once (nothing to batch, no copy kept)
                        host.set_columns(returning)
                        returning = []
                jaccards.append(float(stay.sum()) / max(1, int(torch.unique(torch.cat([old, new])).numel())))
            if in_place:  # staying columns move to their new positions; entering ones start as below
                for name in ("exp_avg", "exp_avg_sq"):
                    st[name].copy_(gather_columns(st[name], pos).masked_fill_(~stay, 0))
                if master is not None:
                    torch.where(stay, gather_columns(old_master, pos), master, out=st["master"])
                st["selected"], st["step"] = new, st["step"][pos].masked_fill_(~stay, 0)
            else:
                m = torch.zeros(R, k, dtype=torch.float32, device=self.device)
                v = torch.zeros_like(m)
                steps = torch.zeros(k, dtype=torch.int64, device=self.device)
                if old is None and self._seed_from_host:  # continuing an imported AdamW run
                    m.copy_(self._from_host(i, "exp_avg", new))
                    v.copy_(self._from_host(i, "exp_avg_sq", new))
                    steps.fill_(self._host_step(i))
                if carry:
                    old_m, old_v = st["exp_avg"].to(self.device), st["exp_avg_sq"].to(self.device)
                    m[:, stay] = old_m[:, pos[stay]]
                    v[:, stay] = old_v[:, pos[stay]]
                    steps[stay] = st["step"][pos[stay]]
                    if master is not None:
                        master[:, stay] = old_master[:, pos[stay]]
                st["selected"], st["exp_avg"], st["exp_avg_sq"], st["step"] = (
                    new,
                    self._to_state(m),
                    self._to_state(v),
                    steps,
                )
                if master is not None:
                    st["master"] = self._to_state(master)
            captured += float(s[new].sum()) if k else 0.0
            total += float(s.sum())
        host.set_columns(returning)
        self._stats.record_selection(self.t, jaccards, captured / total if total > 0 else float("nan"))
        self._plan = None

    def _setting(self, i: int, name: str):
        """Parameter ``i``'s ``topk_ratio`` or ``importance``: its param group's, else the optimizer's."""
        return self.param_groups[self._group_of[i]].get(name, getattr(self.config, name))

    def _choose(self, indices: list[int], importances: list, scores: list[torch.Tensor], ks: list[int]) -> list:
        """The selected columns of each matrix (sorted int64 on the device): top-k of its scores (one
        multi-tensor launch for all), or for ``importance="random"`` k columns drawn uniformly from a
        generator seeded with (selection_seed, step, parameter index): the same on every rank and after a
        resume."""
        top = [n for n, importance in enumerate(importances) if importance != "random"]
        chosen: list = [None] * len(indices)
        picked = ops.multi_topk_columns([scores[n] for n in top], [ks[n] for n in top], check_data=False)
        for n, columns in zip(top, picked, strict=True):
            chosen[n] = columns
        for n, importance in enumerate(importances):
            if importance == "random":
                rng = np.random.default_rng([self.config.selection_seed, self.t, indices[n]])
                draw = np.sort(rng.choice(self._params[indices[n]].shape[1], size=ks[n], replace=False))
                chosen[n] = torch.from_numpy(draw.astype(np.int64)).to(self.device)
        return chosen

    def _fast_plan(self) -> tuple[list, torch.Tensor | None, dict]:
        """What the fast step needs of each parameter on the fast path, built once per selection (not per
        step): ``(index, param [R, C] or [1, n], is_matrix, state, group)`` for every parameter with fast-path
        state, one int64 tensor holding the per-column step counts of all those matrices (each
        matrix's ``state["step"]`` becomes a view of it, so one ``add_`` advances them all), and the launch
        caches of the fast step's multi-tensor calls (``LaunchItems``: laid out once per selection)."""
        if self._plan is not None:
            return self._plan
        entries, steps = [], []
        for i, (key, p) in enumerate(zip(self._params, self._local, strict=True)):
            st = self.state.get(key)
            if not st or "exp_avg" not in st:
                continue
            if p.dim() != 2:
                entries.append((i, p.view(1, -1), False, st, self._group_of[i]))
            elif st["selected"].numel():
                entries.append((i, p, True, st, self._group_of[i]))
                steps.append(st)
        flat = None
        if steps:
            flat = torch.cat([st["step"] for st in steps])
            offset = 0
            for st in steps:
                k = st["step"].numel()
                st["step"] = flat[offset : offset + k]
                offset += k
        self._plan = (entries, flat, {})
        return self._plan

    def _fast_step(self, active: set[int], hyper: list[dict], coef: float | None) -> None:
        """One fused multi-tensor AdamW over the selected columns of every active matrix and every active
        vector (one launch set per distinct (beta1, beta2, eps) of the param groups: usually one). With every
        parameter active, each launch is laid out once per selection (``LaunchItems``)."""
        from .launch_plan import LaunchItems

        entries, flat_steps, launches = self._fast_plan()
        if len(active) < len(self._params):
            entries = [e for e in entries if e[0] in active]
            for _, _, is_matrix, st, _ in entries:
                if is_matrix:
                    st["step"].add_(1)
            launches = None  # not the plan's list of tensors: laid out at this step
        elif flat_steps is not None:
            flat_steps.add_(1)
        if self._compact is not None or self._offload:
            launches = None  # tensors made at this step (gathered columns, state visiting the device)
        own_grad = self._shard.own_grad
        numbers = [(h["lr"], h["weight_decay"]) for h in hyper]
        group_keys = [(h["beta1"], h["beta2"], h["eps"]) for h in hyper]
        items, keys, gathered = [], [], []
        for i, pv, is_matrix, st, gi in entries:
            if is_matrix and self._compact is not None:
                # released gradients: only the selected columns' [R, k] exist; a dense update of the
                # gathered columns, scattered back after (the same arithmetic as the indexed update)
                idx = st["selected"]
                grad, cols = self._compact[i], pv.detach().index_select(1, idx)
                gathered.append((pv, idx, cols))
                pv, idx = cols, None
            elif is_matrix:
                grad, idx = own_grad(i), st["selected"]
            else:
                st["step"] += 1
                grad, idx = own_grad(i)[None], None  # [1, n], as the parameter's view
            items.append((pv, grad, idx, st["exp_avg"], st["exp_avg_sq"], st.get("master"), st["step"], *numbers[gi]))
            keys.append(group_keys[gi])
        grad_scale = self._amp if coef is None else self._amp / coef  # GradScaler's scale, clipping
        distinct = dict.fromkeys(keys)
        for key in distinct:
            chosen = items if len(distinct) == 1 else [item for item, kk in zip(items, keys, strict=True) if kk == key]
            if launches is not None:
                chosen = LaunchItems(chosen, launches.setdefault(key, {}), same_tensors=True)
            for bucket in self._buckets(chosen):
                if self._offload:  # stream this bucket's state in; it goes back out after the update
                    moved = [
                        (p, g, idx, *(None if t is None else self._link.to_device(t) for t in (m, v, w)), *rest)
                        for p, g, idx, m, v, w, *rest in bucket
                    ]
                else:
                    moved = bucket
                ops.multi_selective_adamw_items_(moved, beta1=key[0], beta2=key[1], eps=key[2],
                                                 grad_scale=grad_scale)
                if self._offload:
                    for home, there in zip(bucket, moved, strict=True):
                        for dst, src in zip(home[3:6], there[3:6], strict=True):
                            if dst is not None:
                                self._link.to_host_(dst, src)
        with torch.no_grad():
            for p, idx, cols in gathered:
                p.index_copy_(1, idx, cols)

    def _buckets(self, items: list[tuple]) -> list[list[tuple]]:
        """All at once, or (offload) buckets of at most OFFLOAD_BUCKET_NUMEL state elements."""
        if not self._offload:
            return [items]
        buckets, size = [[]], 0
        for item in items:
            numel = item[3].numel()
            if buckets[-1] and size + numel > self.OFFLOAD_BUCKET_NUMEL:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += numel
        return buckets

    def _auto_vote(self, matrices: list[int]) -> bool:
        """Zen-auto (see reference.py): do at least ``auto_ratio`` of the matrices need a host update?"""
        voters = needing = 0
        eligible = []
        for i in matrices:
            p = self._params[i]
            k = self.state[p]["selected"].numel()
            if k == p.shape[1]:
                continue
            voters += 1
            if k == 0:
                needing += 1
            else:
                eligible.append(i)
        if eligible:
            params = [self._params[i] for i in eligible]
            # the magnitudes of the gradient's columns: l1 sums for "l1", l2 norms otherwise (a "random" or
            # callable selection still votes on the gradient)
            norms = ["l1" if self._setting(i, "importance") == "l1" else "l2" for i in eligible]
            scores = self._shard.scores(eligible, norms)
            pairs = []
            for p, s, norm in zip(params, scores, norms, strict=True):
                mags = s.sqrt() if norm == "l2" else s
                sel = self.state[p]["selected"]
                sel_sum = mags[sel].sum()
                pairs.append(torch.stack([sel_sum / sel.numel(), (mags.sum() - sel_sum) / (p.shape[1] - sel.numel())]))
            # (under a GradScaler the gradients are scaled: its power-of-two scale divides the magnitudes exactly)
            means = (torch.stack(pairs).double() / self._amp).tolist()  # one device sync for all matrices
            for p, (sel_mean, unsel_mean) in zip(params, means, strict=True):
                st = self.state[p]
                st["auto_selected"] = st.get("auto_selected", 0.0) + sel_mean
                st["auto_unselected"] = st.get("auto_unselected", 0.0) + unsel_mean
                st["auto_count"] = st.get("auto_count", 0) + 1
                if st["auto_unselected"] >= st["auto_selected"] / st["auto_count"]:
                    needing += 1
        return voters > 0 and needing >= self.config.auto_ratio * voters

    # -- host path ---------------------------------------------------------------------------------

    @torch.compiler.disable
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Between a backward and its ``step()`` it skips that batch: what
        backward's hooks copied to the host is dropped (none of it reached the sums), the hand-over stays as it
        was, and no clipping requested for the step applies."""
        if self._built:
            if self._handover.fired:  # a batch dropped before step() (a gradient-norm guard, say): a skip
                self._link.discard()
                self._link.step_bytes()  # (not a step: nothing to learn from its copies)
                self._handover.skipped()
            if not set_to_none:
                self._link.before_grad_write()  # copies still reading the gradients finish first
        self._clip_request, self._clip_norms = None, []
        super().zero_grad(set_to_none=set_to_none)

    def _host_update(self, last: dict[int, torch.Tensor] | None = None) -> None:
        """An update boundary: run the host AdamW now (sync) or hand it to the worker (overlap).
        ``last``: gradients of this step not yet accumulated (synchronous CPU runs fuse them in)."""
        matrices = [i for i, p in enumerate(self._params) if p.dim() == 2]
        overlap = self.config.overlap_step
        if overlap:
            self._drain()  # the previous interval's update is done with its accumulation buffer
        if self._device_accs and not self._sums_stay:  # the interval's sums cross to the host now,
            # once (into the one accumulation buffer: the update that read it last has just been drained)
            counted = self._counts[self._acc_buf]
            self._link.upload([(i, self._host.view(self._device_acc, i)) for i in self._shard.mine(matrices)
                               if counted[i]],
                              self._acc_buf)
        counts = self._take_counts(matrices)
        for p in self._params:
            st = self.state.get(p)
            if st and "auto_count" in st:
                st.update(auto_selected=0.0, auto_unselected=0.0, auto_count=0)
        if not overlap:
            self._sync_host_update(counts, last or {})
            self._write_back(list(counts))
        else:
            mine = {i: counts[i] for i in self._shard.mine(counts)}
            # the sums staying on the device are final now: their fetches (read in the background; the next
            # interval uses the other buffer) wait for this point, not behind the write-back's copies, which go
            # the other way over PCIe
            sums = self._fetched_sums(mine)
            self._write_back(self._pending)  # the previous interval's result lands now
            accumulated, guard = self._link.accumulation(), self._link.copy_out_guard()
            hyper, buf, host, max_norm = self._hyper(), self._acc_buf, self._host, self._max_norm
            ranks_sum, shard, dtypes = self._sum_over_ranks(), self._shard, {i: self._params[i].dtype for i in counts}

            def job():
                if accumulated is not None:
                    accumulated.wait()
                result = host.update(buf, mine, hyper, max_norm, wait_before_write=guard, sum_over_ranks=ranks_sum,
                                     sums=sums)
                # ZeRO: the owners' results start towards the replicas now, behind training
                result["exchange"] = shard.start_exchange(host, list(counts), dtypes)
                return result

            self._inflight = self._link.submit_update(job)
            self._pending = list(counts)
            # the next interval accumulates into the other buffer (device accumulation in memory: there is one)
            self._acc_buf = (self._acc_buf + 1) % len(self._counts)
        self.host_updates += 1
        self.steps_accumulated = 0

    def _drain(self) -> None:
        """Wait for the in-flight host update, if any (the wait counts as stall)."""
        if self._inflight is not None:
            job, self._inflight = self._inflight, None
            result = self._link.wait(job)
            self._zero_sums_read()
            self._stats.host_seconds.append(result["seconds"])
            self._exchange = result.get("exchange")

    def _take_received(self, indices: list[int]) -> dict:
        """ZeRO: the other owners' results for these parameters (the exchange is consumed once; a
        :meth:`flushed` context keeps them for the write-back at the boundary)."""
        if self._received is not None:
            received, self._received = self._received, None
            return received
        exchange, self._exchange = self._exchange, None  # ZeRO: the owners' results reach every replica first
        return self._shard.received(exchange, self._host, indices, {i: self._params[i].dtype for i in indices},
                                    self._link.wait)

    @torch.no_grad()
    def _write_back(self, indices: list[int]) -> None:
        """Live weights <- the host copy-out buffers: the non-selected columns of each matrix with a
        selection, the whole parameter otherwise (vectors, warm-up)."""
        if not indices:
            return
        others = self._take_received(indices)
        if self._unflushed is not None:  # inside flushed(): this write-back lands again at its boundary
            self._received = others
        items = []
        for i in indices:
            p = self._local[i]
            sel = (self.state.get(self._params[i]) or {}).get("selected")
            items.append((p, others[i] if i in others else self._host.out_view(i), sel))
        self._link.write_back(items)

    # -- checkpoints -------------------------------------------------------------------------------

    def _interval_sums(self) -> torch.Tensor:
        """The flat buffer holding the current interval's gradient sums (device or host)."""
        return self._device_acc if self._device_acc is not None else self._host.acc[self._acc_buf]

    _COUNTERS = ("t", "skipped_steps", "host_updates", "selections", "steps_accumulated")

    @torch.no_grad()
    def state_dict(self, *, consolidated: bool = False) -> dict:
        """Everything needed to continue exactly (docs/design.md section 2 item 7); drains any in-flight host
        update first (its result stays pending, as it would without the save). Under ZeRO each rank's dict
        holds the host state of its own parameters (load it on the same rank at the same world size); see
        :meth:`consolidated_state_dict` for one dict of all of them."""
        groups = []
        for gi, g in enumerate(self.param_groups):
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [i for i, grp in enumerate(self._group_of) if grp == gi]
            groups.append(packed)
        state: dict[int, dict] = {}
        zenflow = {name: getattr(self, name) for name in self._COUNTERS}
        zenflow.update(config=self.config.to_dict(), schedule=self.schedule.to_dict(), max_grad_norm=self.max_grad_norm,
                       seed_from_host=self._seed_from_host)
        zenflow["zero"] = dict(stage=self.zero_stage, world=self._shard.world, rank=self._shard.rank,
                               consolidated=consolidated)
        if self._built:
            self._link.check()  # a failed host update may have left half its result: no torn state handed out
            self._drain()
            self._link.synchronize()  # accumulation, write-backs and offloaded state have all landed
            host = self._host
            # on disk: the host state and the interval's sums handed out as views of one file-backed copy, never
            # whole in memory
            snap = None if consolidated else host.snapshot(self._interval_sums())
            for i, p in enumerate(self._params):
                st = {
                    k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in self.state[p].items()
                }
                st.update(acc_count=self._counts[self._acc_buf][i], pending=i in self._pending)
                if self._unflushed is not None and i in self._unflushed:  # inside flushed(): what training holds
                    st["unflushed"] = self._unflushed[i]
                if consolidated:  # every parameter's host state, from the rank holding it
                    fields = {
                        name: self._from_host(i, name).to("cpu") for name in ("master", "exp_avg", "exp_avg_sq")
                    }
                    st.update(host_master=fields["master"], host_exp_avg=fields["exp_avg"],
                              host_exp_avg_sq=fields["exp_avg_sq"], host_step=self._host_step(i),
                              acc=self._shard.checkpoint_tensor(i, lambda i=i: self._interval_sums_of(i),
                                                                tuple(self._local[i].shape)))
                elif i in host.slots:
                    fields = ([host.view(snap[k], i) for k in range(3)] if snap is not None else
                              [host.field(name, i).clone() for name in ("master", "exp_avg", "exp_avg_sq")])
                    st.update(
                        host_master=fields[0],
                        host_exp_avg=fields[1],
                        host_exp_avg_sq=fields[2],
                        host_step=host.host_step[i],
                        acc=host.view(snap[3], i) if snap is not None else self._interval_sums_of(i),
                    )
                state[i] = st
        zenflow["built"] = self._built
        return self._shard.export_state_dict({"state": state, "param_groups": groups, "zenflow": zenflow}, self)

    def consolidated_state_dict(self) -> dict:
        """Under ZeRO: one state dict holding every rank's host state, loadable by ``load_state_dict`` at
        any world size (1 included). Collective: every rank calls it and gets the whole dict (save it
        from rank 0). Without ZeRO it is :meth:`state_dict`."""
        return self.state_dict(consolidated=True)

    def _interval_sums_of(self, i: int) -> torch.Tensor:
        return self._host.view(self._interval_sums(), i).to("cpu", copy=True)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` (config, schedule and counters included: the saved run continues;
        a saved config or ``max_grad_norm`` that differs from this optimizer's is reported with a
        :class:`ZenFlowWarning` first). A ``torch.optim.AdamW`` (or ``Adam``) state dict starts ZenFlow
        from its moments and step counts instead (see :meth:`_load_adam`). Anything else is an error, and
        nothing is changed before every check passed."""
        if self._unflushed is not None:
            raise RuntimeError("ZenFlowAdamW.load_state_dict() inside opt.flushed() (or while an integration holds the "
                               "flushed weights): leave the context first")
        state_dict = self._shard.import_state_dict(state_dict, self)  # FSDP2: torch.distributed.checkpoint's form
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) or not \
                isinstance(state_dict.get("state"), dict):
            raise ValueError(
                "ZenFlowAdamW.load_state_dict: expected a state dict with 'state' and 'param_groups' (from "
                f"ZenFlowAdamW.state_dict() or torch.optim.AdamW/Adam.state_dict()), got {type(state_dict).__name__}"
                + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else "")
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"ZenFlowAdamW.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
                f"{len(self.param_groups)}: the param groups do not match this optimizer's"
            )
        for gi, (saved, g) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(saved.get("params", ())) != len(g["params"]):
                raise ValueError(f"ZenFlowAdamW.load_state_dict: param group {gi}'s size does not match")
        if "zenflow" not in state_dict:
            self._load_adam(state_dict)
            return
        zenflow = state_dict["zenflow"]
        # where the host state lives and which CPUs run it are this optimizer's, not the checkpoint's (memory <->
        # disk both ways; another machine)
        config = ZenFlowConfig.from_dict({**zenflow["config"], "offload_device": self.config.offload_device,
                                          "nvme_path": self.config.nvme_path, "cores": self.config.cores})
        schedule = Schedule.from_dict(zenflow["schedule"])
        saved_state = state_dict["state"]
        for idx, st in saved_state.items():
            p = self._shard.local(self._params[int(idx)])
            for key in ("host_master", "unflushed"):
                if key in st and tuple(st[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"ZenFlowAdamW.load_state_dict: parameter {idx} was saved with shape "
                        f"{tuple(st[key].shape)} ({key}), this one is {tuple(p.shape)}"
                    )
        if zenflow.get("built"):
            # ZeRO: this rank needs the host state of the parameters it will hold (a consolidated dict, or a
            # dict saved by the same rank at the same world size, has it)
            mine = self._shard.will_hold(self._params, self._group_of)
            missing = [i for i in mine if "host_master" not in saved_state.get(i, saved_state.get(str(i), {}))]
            if missing:
                saved = zenflow.get("zero", {})
                raise ValueError(
                    f"ZenFlowAdamW.load_state_dict: the state dict (saved by rank {saved.get('rank', 0)} of "
                    f"{saved.get('world', 1)}) holds no host state for parameters {missing[:8]}, which rank "
                    f"{self._shard.rank} of {self._shard.world} holds: load each rank's own state_dict() at the same "
                    "world size, or a consolidated_state_dict() at any world size"
                )
        changed = [f"zenflow.{k}={v!r} (this optimizer: {getattr(self.config, k)!r})"
                   for k, v in config.to_dict().items() if getattr(self.config, k) != v]
        if zenflow["max_grad_norm"] != self.max_grad_norm:
            changed.append(f"max_grad_norm={zenflow['max_grad_norm']!r} (this optimizer: {self.max_grad_norm!r})")
        if changed:
            warnings.warn(
                "ZenFlowAdamW.load_state_dict: the checkpoint's settings replace this optimizer's: "
                + "; ".join(changed) + ". The saved run continues as it was configured",
                ZenFlowWarning,
                stacklevel=2,
            )
        self._reset()
        self.config, self.schedule, self.max_grad_norm = config, schedule, zenflow["max_grad_norm"]
        self._seed_from_host = bool(zenflow.get("seed_from_host", False))
        for saved, g in zip(groups, self.param_groups, strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for name in self._COUNTERS:
            setattr(self, name, int(zenflow[name]))
        if not zenflow.get("built"):
            return
        self._build()
        host = self._host
        writes = []  # the host fields, written in one pass (on disk: each block of the file once)
        for idx, st in saved_state.items():
            i = int(idx)
            p = self._params[i]
            if i in host.slots:  # ZeRO: the host state of this rank's parameters only
                writes += [(name, i, st[f"host_{name}"]) for name in ("master", "exp_avg", "exp_avg_sq")]
                host.view(self._interval_sums(), i).copy_(st["acc"])
                host.host_step[i] = int(st["host_step"])
                if st["pending"]:
                    host.out_view(i).copy_(st["host_master"])  # what the finished update wrote
            self._counts[self._acc_buf][i] = int(st["acc_count"])
            if st["pending"]:
                self._pending.append(i)
            if "unflushed" in st:  # saved inside flushed(): the model holds the flushed weights, training these
                self._local[i].copy_(st["unflushed"])
            fast = {k: v for k, v in st.items() if k not in _HOST_KEYS}
            self.state[p] = {
                # copies: the optimizer must not share storage with the caller's state dict
                k: (self._to_state(v.clone()) if k in _FAST_STATE_KEYS else v.to(self.device, copy=True))
                if torch.is_tensor(v) else v
                for k, v in fast.items()
            }
        host.set_fields(writes)

    def _reset(self) -> None:
        """A clean slate before a load: land nothing, keep nothing, stop the workers."""
        if self._built:
            self._drain()
            self._exchange, exchange = None, self._exchange
            self._shard.settle(exchange)  # every rank started these broadcasts: let them complete
            self._stats.retire(self._link)
            self._finalizer()
            # the old buffers go before the new link is built: never two links' host memory at once
            self._link = self._host = None
            self._device_accs, self._sums_read = [], []
            self._built, self._inflight = False, None
        self.state.clear()
        self._pending = []
        self._received = None
        self._plan = None

    def _load_adam(self, state_dict: dict) -> None:
        """Continue a ``torch.optim.AdamW`` (or ``Adam``) run: the host takes its moments and step counts as
        if warm-up had produced them, vectors join the fast path with them, and each matrix's first
        selection takes its columns' moments and steps from the host, so that ``topk_ratio=1`` (or one
        selection with ``update_interval=1``) continues exactly as AdamW would. The param groups'
        hyper-parameters are the saved ones, as torch's own ``load_state_dict`` does; ZenFlow's schedule
        starts at step 0 (warm-up rounds included)."""
        where = "ZenFlowAdamW.load_state_dict"
        groups = state_dict["param_groups"]
        for gi, g in enumerate(groups):
            missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in g]
            if missing:
                raise ValueError(f"{where}: param group {gi} has no {missing}: neither a ZenFlowAdamW nor a "
                                 "torch.optim.AdamW/Adam state dict")
            for flag in ("amsgrad", "maximize"):
                if g.get(flag):
                    raise ValueError(f"{where}: param group {gi} was saved with {flag}=True, which ZenFlowAdamW "
                                     f"does not do: only plain AdamW/Adam state can be continued")
            if not g.get("decoupled_weight_decay", True) and g["weight_decay"] != 0:
                raise ValueError(
                    f"{where}: param group {gi} is torch.optim.Adam with weight_decay={g['weight_decay']} (an L2 "
                    "term in the gradient); ZenFlowAdamW decays decoupled (AdamW) and cannot continue it exactly: "
                    "continue from a torch.optim.AdamW run, or an Adam run without weight decay"
                )
            check_adamw_hyperparameters(float(g["lr"]), g["betas"], g["eps"], g["weight_decay"],
                                        where=f"{where} group {gi}")
        order = [i for g in groups for i in g["params"]]
        imported = {}
        for idx, st in state_dict["state"].items():
            if idx not in order:
                raise ValueError(f"{where}: state of parameter {idx!r}, which no param group lists")
            i = order.index(idx)
            p = self._params[i]
            if not isinstance(st, dict) or not {"exp_avg", "exp_avg_sq", "step"} <= set(st):
                held = sorted(st) if isinstance(st, dict) else repr(st)
                raise ValueError(f"{where}: the state of parameter {i} holds {held}, not AdamW's exp_avg, "
                                 "exp_avg_sq and step")
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[key].shape) != tuple(p.shape):
                    raise ValueError(f"{where}: parameter {i}'s {key} has shape {tuple(st[key].shape)}, the "
                                     f"parameter {tuple(p.shape)}")
            step = int(st["step"].item() if torch.is_tensor(st["step"]) else st["step"])
            imported[i] = (st["exp_avg"], st["exp_avg_sq"], step)
        self._reset()
        for saved, g in zip(groups, self.param_groups, strict=True):
            g.update(lr=saved["lr"], betas=tuple(saved["betas"]), eps=saved["eps"], weight_decay=saved["weight_decay"])
        for name in self._COUNTERS:
            setattr(self, name, 0)
        self._build()
        host = self._host
        writes = []
        for i, (m, v, step) in imported.items():
            if i not in host.slots:  # ZeRO: another rank holds it
                continue
            writes += [("exp_avg", i, m), ("exp_avg_sq", i, v)]
            host.host_step[i] = step
        host.set_fields(writes)
        self._seed_from_host = True


_FAST_STATE_KEYS = frozenset({"exp_avg", "exp_avg_sq", "master"})
_HOST_KEYS = frozenset({"host_master", "host_exp_avg", "host_exp_avg_sq", "host_step", "acc", "acc_count", "pending",
                        "unflushed"})


def _unscaled(scorer, inv_scale: float):
    """A selection scorer called with the gradient times ``inv_scale`` (GradScaler's reciprocal)."""

    @functools.wraps(scorer)
    def scores(grad, param):
        return scorer(grad * inv_scale, param)

    return scores


def _grad_ready_hook(ref: weakref.ref, i: int):
    def hook(p: torch.Tensor) -> None:
        autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # (imported by whoever enables it)
        if autograd is not None and autograd.in_compiled_autograd_region:
            raise RuntimeError(
                "ZenFlowAdamW: a backward traced by compiled autograd (torch._dynamo.config.compiled_autograd) is "
                "not supported: the optimizer's gradient hooks copy to the host and keep books in Python, which a "
                "graph cannot hold. Run backward eagerly; torch.compile(model) still compiles forward and backward")
        opt = ref()  # a weak reference: the hook must not keep the optimizer alive
        if opt is not None:
            opt._grad_ready(i, p)

    return hook


def _shutdown(link, torch_threads: int | None, hooks) -> None:
    for handle in hooks:
        handle.remove()
    link.close()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)


_LINK_COUNTERS = ("waited_s", "accumulate_s", "fold_s", "d2h_bytes", "h2d_bytes", "early_bytes", "unused_bytes")


class _Telemetry:
    def __init__(self):
        self.step_seconds: list[float] = []
        self.fast_seconds: list[float] = []
        self.host_seconds: list[float] = []
        self.sync_host_seconds = 0.0  # host updates run on the training thread
        self.link_totals = dict.fromkeys(_LINK_COUNTERS, 0.0)  # of links replaced by load_state_dict
        self.first_step_start: float | None = None  # wall clock of the run: training, not only step()
        self.last_step_end: float | None = None
        self.selection_steps: list[int] = []
        self.jaccard: list[float] = []
        self.captured: list[float] = []

    def retire(self, link) -> None:
        """Keep a link's counters before it is replaced."""
        for name in _LINK_COUNTERS:
            self.link_totals[name] += getattr(link, name)

    def record_selection(self, t: int, jaccards: list[float], captured: float) -> None:
        self.selection_steps.append(t)
        self.jaccard.append(sum(jaccards) / len(jaccards) if jaccards else float("nan"))
        self.captured.append(captured)

    def summary(self, opt: ZenFlowAdamW) -> dict:
        def mean(xs):
            return sum(xs) / len(xs) if xs else 0.0

        wall = self.last_step_end - self.first_step_start if self.first_step_start is not None else 0.0
        link = opt._link if opt._built else None
        moved = {name: total + (getattr(link, name) if link else 0) for name, total in self.link_totals.items()}
        waited, accumulated = moved["waited_s"], moved["accumulate_s"]
        # stall: the training thread did host work itself or waited for it, instead of training
        stall = self.sync_host_seconds + accumulated + waited
        host_total = sum(self.host_seconds)
        overlapped = opt.config.overlap_step
        hidden = max(0.0, host_total - waited) if overlapped else 0.0
        return {
            "steps": opt.t,
            "skipped_steps": opt.skipped_steps,
            "host_updates": opt.host_updates,
            "selections": opt.selections,
            "wall_s": wall,
            "step_s_mean": mean(self.step_seconds),  # inside step()
            "fast_path_s_mean": mean(self.fast_seconds),
            "fast_path_s": list(self.fast_seconds),
            "host_update_s_mean": mean(self.host_seconds),
            "host_update_s": list(self.host_seconds),
            "stall_s": stall,
            "accumulate_s": accumulated,
            # the accumulate worker's time folding the landing area into the sums (asynchronous link; beside
            # training, not stall: waits for it are in worker_wait_s)
            "fold_s": moved["fold_s"],
            "worker_wait_s": waited,
            # of the wall time from the first step() to the end of the last: forward and backward included
            "stall_fraction": stall / wall if wall > 0 else 0.0,
            "overlap_fraction": hidden / host_total if host_total > 0 else 0.0,
            "score_mass_captured": list(self.captured),
            "selection_jaccard": list(self.jaccard),
            "selection_steps": list(self.selection_steps),
            # what the link moved: gradients device -> host, weights host -> device (on a CPU link the
            # same logical bytes, copied within host memory)
            "link": link.kind if link is not None else None,
            "d2h_bytes": int(moved["d2h_bytes"]),
            "h2d_bytes": int(moved["h2d_bytes"]),
            "d2h_bytes_per_step": moved["d2h_bytes"] / opt.t if opt.t else 0.0,
            # of them, gradient bytes that crossed during backward (copied by backward's hooks, used by step()),
            # and bytes hooks copied that were not used (copied again after a change or by a later backward's
            # hook, or dropped with a skipped step or batch): docs/design.md section 5.1
            "d2h_bytes_in_backward": int(moved["early_bytes"]),
            "d2h_bytes_unused": int(moved["unused_bytes"]),
            "h2d_bytes_per_step": moved["h2d_bytes"] / opt.t if opt.t else 0.0,
            # ZeRO: payload bytes each kind of collective carried (gradients, gradient presence, write-back,
            # host state, clipping norm, checkpoint); empty on one rank
            "host_bytes": opt.host_bytes(),
            # gradients crossing during backward (docs/design.md section 5.1): "on" or "off", and why
            "handover": opt._handover.mode,
            "handover_why": opt._handover.why,
            # the CPUs of training's threads and of the host worker, and why (zenflow.cores); {} before the first step
            "cores": dict(opt._cores) if opt._built else {},
            "collective_bytes": dict(opt._shard.bytes),
            "collective_bytes_per_step": {k: v / opt.t for k, v in opt._shard.bytes.items()} if opt.t else {},
        }
