"""ZenFlow and ZenFlowAdamW: the drop-in ``torch.optim`` optimizers (docs/design.md sections 2-3, oracle: reference.py).
``ZenFlow`` takes an update rule (``zenflow_kernels.rules``: AdamW, Adam, Lion, SGD or one's own); ``ZenFlowAdamW`` is
``ZenFlow`` with ``rules.AdamW``, with torch's AdamW signature.

A facade over parts that each own their state (docs/hacking.md): ``selection.py`` (which columns are on the fast path),
``fast_path.py`` (the device's multi-tensor step of the rule), ``interval.py`` with ``sums.py`` (the host interval:
sums, counts, the host update, the write-back), ``handover.py`` (gradients crossing during backward), ``flushed.py``
(who holds the flushed weights), ``step_inputs.py`` (a step's scale, clipping norm and gradient checks),
``checkpoint.py`` (the format) and ``telemetry.py``. This class holds the torch ``Optimizer`` surface and ``step()``'s
order of calls.
Moving data is the link's (``zenflow_kernels.link``); this package holds no stream, event or pinned buffer.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import ZenFlowConfig, ZenFlowWarning
from ..device_model import current_chaos
from ..explain import explain_optimizer
from ..handover import HandOver
from ..rules import UpdateRule
from ..schedule import Schedule, make_schedule
from ..sharding import Sharding, world_of
from . import build, checkpoint
from .fast_path import FastPath
from .flushed import FlushedWeights
from .interval import HostInterval
from .selection import Selection
from .step_inputs import ClipRequests, GradChecks, check_group, group_hyperparams, read_step
from .telemetry import Telemetry, host_bytes

__all__ = ["ZenFlow"]


def compile_disabled(fn):
    """``torch.compiler.disable(fn)``, made at the first call (as torch's own optimizers do with
    ``torch._disable_dynamo``): making it imports ``torch._dynamo``, which would otherwise cost every ``import
    zenflow_kernels`` about 1.4 s (40% of it), also in processes that never step."""
    disabled = []

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return eager


class ZenFlow(build.Tunables, torch.optim.Optimizer):
    """An update rule with ZenFlow's split: top-k columns on the device every step, the rest on the host.

    Args:
        params: parameters or param groups (each group may set ``lr`` and the rule's hyper-parameters (AdamW:
            ``betas``, ``eps``, ``weight_decay``), and its own ZenFlow ``topk_ratio`` and ``importance``: see
            docs/custom-loop.md). fp32, bf16 or fp16, all on one device (CPU or one CUDA device); or the
            parameters of a model sharded with FSDP2 (docs/fsdp2.md).
        rule: the update rule (``zenflow_kernels.rules``: ``AdamW``, ``Adam``, ``Lion``, ``SGD`` or a subclass of
            ``UpdateRule``); its hyper-parameters are the param groups' defaults.
        lr: the learning rate: a number >= 0, or a 1-element float tensor (as ``torch.optim.AdamW`` takes it).
        zenflow: a :class:`ZenFlowConfig`, a ``zenflow`` dict, or a DeepSpeed JSON (dict or path).
        max_grad_norm: clip by global norm (fast path: the step's gradient; host: the interval's mean), or None.
        steps_per_epoch, dataloader: the epoch length for ``select_strategy="epoch"``/``"auto"``.
        host_timeout: seconds one host update may take before an error (> 0), or None: no limit.
        zero_stage: 0, 1 or 2: ZeRO under ``torch.distributed`` (docs/torchrun.md): each rank's host holds its own
            run of parameters; the optimizer averages the gradients itself (no DDP): stage 1 all-reduces them,
            stage 2 reduces each matrix's to its owner from backward hooks. One rank runs as stage 0.
        release_gradients: stage 2 (default True): a matrix's ``.grad`` is let go as its bucket's reduction starts,
            so a rank holds only its range; a loop that then changes gradients (``unscale_``, clipping in place)
            is refused at ``step()``. False keeps every ``.grad``, at a whole gradient per rank.
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

    The parts (docs/hacking.md) are made at the first step from ``selection_class``, ``fast_path_class`` and
    ``interval_class``; the schedule as ``schedule_class``, only by :meth:`make_schedule` (it survives a load).
    """

    facade_name: str | None = None  # messages' name for the class (None: ``ZenFlow(Lion)``; ``display_name``)

    selection_class = Selection
    fast_path_class = FastPath
    interval_class = HostInterval
    schedule_class = Schedule

    def make_schedule(self, *, steps_per_epoch: int | None = None, dataloader: Any = None,
                      saved: dict | None = None) -> Schedule:
        """The schedule, as ``schedule_class``: from ``self.config`` (and the epoch length), or a checkpoint's."""
        return make_schedule(self.schedule_class, self.config, steps_per_epoch, dataloader, saved)

    def __init__(
        self,
        params,
        rule: UpdateRule,
        lr: float = 1e-3,
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
        self.display_name = name = build.display_name(rule, self.facade_name)  # what every message calls it
        build.check_arguments(rule, lr, max_grad_norm, zero_stage, collective_timeout, release_gradients, host_timeout,
                              name)
        world = world_of(process_group, name)
        self._built = False
        self.rule = rule  # (before torch's __init__: add_param_group checks each group with it)
        super().__init__(params, dict(lr=lr, **rule.group_defaults()))
        self.config = ZenFlowConfig.coerce(zenflow)
        build.rank_cores(self.config, name)  # a cores list outside this process's CPUs is an error now, not at a step
        build.check_nvme_path(self.config, rule, name)  # (so is an nvme_path that cannot hold the state files)
        self.schedule: Schedule = self.make_schedule(steps_per_epoch=steps_per_epoch, dataloader=dataloader)
        self.max_grad_norm = max_grad_norm
        self.host_timeout = host_timeout
        self.zero_stage = zero_stage
        self.release_gradients = zero_stage == 2 and release_gradients is not False
        self._params, self._group_of = build.take_params(self.param_groups, name)
        # how the ranks hold gradients and host state (sharding/): the one thing that differs between one process,
        # ZeRO and FSDP2; the algorithm is the same for all
        self._shard: Sharding = build.choose_sharding(
            self._params, world=world, zero_stage=zero_stage, process_group=process_group,
            timeout=float(collective_timeout), release=self.release_gradients, bucket_numel=self.ZERO_BUCKET_NUMEL,
            name=name)
        self._shard.accept(self._params)
        self.t = self.skipped_steps = self.host_updates = self.selections = self.steps_accumulated = 0
        self._closed = False
        self._chaos = current_chaos()  # testing.chaos: a CPU run uses the asynchronous test link
        self._held: set[int] = set()  # parameters with host state whatever requires_grad says (build.trained)
        self._hooks = None  # the backward hooks (handover.GradHooks), where the link or the sharding uses them
        self._seed_from_host = False  # after loading a torch AdamW state dict (Selection.seed_from_host)
        self._stats = Telemetry()
        # the parts (BuiltOptimizer, Selection, FastPath, HostInterval), made lazily at the first step (_build)
        self.run = self.selection = self.fast_path = self.interval = None
        # whether gradients cross to the host from backward's hooks (handover.py): decided at the first step
        self.handover = HandOver("on", "no step yet")
        # this step's numbers: GradScaler's scale and its float32 reciprocal (the fused-optimizer protocol), and
        # the clipping norm in force (max_grad_norm, or a clip_grad_norm_() request for this step, the smaller)
        self._amp, self._inv_amp, self._max_norm = 1.0, 1.0, max_grad_norm
        self._clips = ClipRequests(name)
        self.flushed_weights = FlushedWeights(name)  # who holds the flushed weights: flushed() contexts, hold_flushed

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(
                f"{self.display_name}.add_param_group after the first step() is not supported: the host buffers are "
                "laid out at the first step; create the optimizer with every param group instead"
            )
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1], len(self.param_groups) - 1, self.rule, self.display_name)
            if hasattr(self, "_params"):  # a group added after __init__ but before the first step
                params, group_of = build.take_params(self.param_groups, self.display_name)
                self._shard.accept(params)
                self._params, self._group_of = params, group_of
        except Exception:
            self.param_groups.pop()  # a refused group leaves nothing behind
            raise

    def _build(self) -> None:
        """Lay out the host shard, pick the link, make the parts and start the workers (at the first step); a build
        that fails leaves no thread, hook or state file behind, and the optimizer unbuilt."""
        self.run = run = build.make_run(self._params, self._group_of, self.param_groups, self.state, self.config,
                                        self._shard, self._stats, timeout=self.host_timeout, chaos=self._chaos,
                                        nvme_block=self.NVME_BLOCK_NUMEL, nvme_direct=self.NVME_DIRECT,
                                        host_params=build.trained(self._params, self._held), rule=self.rule,
                                        name=self.display_name)
        self.device, self._grad_checks = run.device, GradChecks(run.local, run.device, self.display_name)
        try:  # (the parts hold the param groups and state, never the optimizer: no cycle delays its finalizer)
            parts = build.make_parts(run, type(self), self.handover, seed_from_host=self._seed_from_host,
                                     hyperparams=functools.partial(group_hyperparams, self.param_groups, self.rule,
                                                                   self.display_name),
                                     grad_ready=weakref.WeakMethod(self._grad_ready))
        except BaseException:
            self.run = None
            raise
        self.fast_path, self.selection, self.interval, self._hooks = parts
        # no thread outlives its optimizer: the finalizer (also run at interpreter exit) stops them
        self._finalizer = weakref.finalize(self, build.shutdown, run.link, run.torch_threads, self._hooks)
        self._built = True

    def _admit(self, active: list[int]) -> None:
        """This step's parameters all have host state (one frozen at the layout and trained now gets it: the shard is
        laid out again, the rest carried over as a checkpoint carries it) and a hook wherever one can go."""
        if not self.run.host_params.issuperset(active):
            checkpoint.before_pack(self.run, self.interval)
            saved = checkpoint.pack(self.run, self.interval, groups=[], zenflow={}, consolidated=False)["state"]
            self._held = set(self.run.host_params).union(active)
            self._reset()
            self._build()
            checkpoint.restore(saved, self.run, self.interval, self.fast_path.to_state)
        if self._hooks is not None:
            self._hooks.ensure(active)

    def _grad_ready(self, i: int) -> None:
        """Backward finished parameter ``i``'s gradient: start its copy to the host if the host path will need it at
        the coming step (every parameter in warm-up, matrices after) and the hand-over says so (the last backward of
        a step, declared or learned: handover.py). ``step()`` checks it is still what was copied."""
        if self._closed:
            return
        final = self.handover.final()
        if self._shard.consumes_hooks:  # ZeRO-2: the gradient goes to its owner first, averaged
            self._shard.grad_ready(i, self._grad_checks.one, final)
        elif final and (self._params[i].dim() == 2 or self.schedule.is_warmup(self.t)):
            grad = self._shard.own_grad(i)  # None: a hook of the user's before ours took it; it sits out the step
            if grad is not None and self.handover.copy_now(i):
                self.run.link.stage(i, grad)

    # -- the public surface ------------------------------------------------------------------------

    def __enter__(self) -> ZenFlow:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        name = getattr(self, "display_name", "ZenFlow")
        raise TypeError(
            f"{name} cannot be copied or pickled (copy.copy, copy.deepcopy, pickle, torch.save(opt)): it owns "
            "background threads, host buffers and, on a GPU, streams. Save opt.state_dict() and load it into a new "
            f"{name} with load_state_dict() instead"
        )

    def __repr__(self) -> str:
        base = super().__repr__()  # "ZenFlowAdamW (\nParameter Group 0\n    ...\n)"
        zen = "".join(f"    {k}: {v!r}\n" for k, v in self.config.to_dict().items())
        return f"{base[:-1]}ZenFlow\n    rule: {self.rule!r}\n{zen}    max_grad_norm: {self.max_grad_norm!r}\n)"

    # what tools and benchmarks may look at (read-only): built (the first step laid out the host state, made the
    # parts, started the workers), closed, the link and the host shard (None before the first step), the sharding
    built = property(lambda self: self._built)
    closed = property(lambda self: self._closed)
    link = property(lambda self: self.run.link if self._built else None)
    host_shard = property(lambda self: self.run.host if self._built else None)
    sharding = property(lambda self: self._shard)
    host_update_in_flight = property(lambda self: self._built and self.interval.inflight is not None,
                                     doc="An overlapped host update was handed to the worker and not yet waited for.")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool | Callable[[], bool]) -> None:
        """Declare whether the coming backward passes are the last before ``step()`` (True, the default) or
        micro-batches whose gradients a later backward still adds to (False), as FSDP2's
        ``set_requires_gradient_sync`` does for its reduce-scatter; or give a callable that answers it at each
        backward (the Hugging Face callback passes accelerate's ``sync_gradients``). Backward hooks copy nothing
        to the host while it is False, so only the last micro-batch's gradients cross, during its backward
        (docs/design.md section 5.1). Results never depend on it: undeclared micro-batches are exact too (the
        optimizer learns how many backward passes a step has), declaring only saves copies."""
        self.handover.declare(requires_gradient_sync, where=f"{self.display_name}.set_requires_gradient_sync")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` for the block, as DDP's ``no_sync()``: run every micro-batch's
        backward but the last inside it::

            for k, batch in enumerate(micro_batches):
                with opt.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss_fn(model(batch)).backward()
            opt.step()
        """
        with self.handover.not_final():
            yield

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Give the epoch length, in optimizer steps (batches divided by gradient-accumulation steps,
        rounded up), when it was not known at construction: ``select_strategy="epoch"``/``"auto"`` then
        re-selects columns every ``select_interval`` epochs instead of never. The schedule is resolved again
        (boundaries count from step 0); the ``ZenFlowCallback`` integrations call this for you."""
        self.schedule = self.make_schedule(steps_per_epoch=steps_per_epoch)

    def close(self) -> None:
        """Land any in-flight host update and stop the background workers (idempotent)."""
        if self._closed:
            return
        try:
            if self._built and not self.run.link.failed and not self._shard.failed:
                self.flush()
        finally:
            self._closed = True
            if self._built:
                self._finalizer()

    @compile_disabled
    @torch.no_grad()
    def flush(self) -> None:
        """Wait for any in-flight host update and write back every pending result, so the live weights
        hold everything the host has computed, from now on (the end of training, export). The pending
        result then lands one interval early and the run continues from it: to save or evaluate mid-run
        without changing the run, use :meth:`flushed`. Inside :meth:`flushed` it keeps the flushed weights
        (nothing is restored at the context's end)."""
        if self._built:
            self.interval.flush()

    @contextlib.contextmanager
    def flushed(self) -> Iterator[ZenFlow]:
        """A context in which the parameters hold the flushed weights (what :meth:`flush` gives: every host
        update computed so far applied) and after which they hold again, bit for bit, the weights training
        continues from: save and evaluate inside it, and the run ends as it would without them
        (docs/design.md section 5.2)::

            with opt.flushed():
                evaluate(model); torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)

        ``state_dict()`` inside it records, for each parameter with a pending host result, the weights it
        held before (``"unflushed"``), and ``load_state_dict`` writes them back into the parameters: load the
        model first, then the optimizer, and the resumed run is bit-identical to the uninterrupted one (what it
        costs: docs/checkpoints.md). ``step()`` and ``load_state_dict()`` inside it are errors; contexts nest
        (the outermost restores)."""
        with self.flushed_weights.context(self.interval, closed=self._closed):
            yield self

    def hold_flushed(self, held: bool) -> None:
        """:meth:`flushed` for trainer integrations, whose save or evaluation runs between two callbacks:
        ``hold_flushed(True)`` before it, ``hold_flushed(False)`` after it (or at the next batch's start)."""
        self.flushed_weights.hold(held, self.interval, closed=self._closed)

    def selected_columns(self, param: torch.Tensor) -> torch.Tensor | None:
        """The columns of a matrix parameter currently on the fast path (int64, sorted ascending, on the
        parameter's device; a copy), or None when it has none yet (before its first selection, during
        warm-up, or for a vector parameter). Raises ValueError for a tensor this optimizer does not own."""
        if not any(param is p for p in self._params):
            raise ValueError("selected_columns: the tensor is not a parameter of this optimizer")
        sel = self.state.get(param, {}).get("selected")
        return None if sel is None else sel.clone()

    def stats(self) -> dict:
        """Telemetry of the run so far: stall and overlap, step, fast-path and host-update times, selections, what
        crossed between device and host and between ranks; the keys are listed at
        :meth:`zenflow_kernels.optim.telemetry.Telemetry.summary`."""
        counters = {name: getattr(self, name) for name in checkpoint.COUNTERS}
        cores = dict(self.run.cores) if self._built else {}
        return self._stats.summary(counters=counters, link=self.link, overlap=self.config.overlap_step,
                                   host_bytes=self.host_bytes(), handover=self.handover, cores=cores,
                                   collective_bytes=self._shard.bytes, rule=self.rule)

    def explain(self, steps: int = 20) -> str:
        """What this optimizer will do, as ``python -m zenflow_kernels explain`` prints it for a config (the
        resolved schedule over the first ``steps`` steps), the CPUs of training and of the host worker (and why:
        ``zenflow.cores``), and, per param group, its own ``topk_ratio`` and ``importance`` and each matrix's ``k``
        of ``C`` columns on the fast path."""
        cores = self.run.cores if self._built else build.first_cores(self.config, self.param_groups)
        return explain_optimizer(self, steps, cores)

    def host_bytes(self) -> dict:
        """The optimizer's host memory, by buffer, in bytes as allocated (``{}`` before the first step): the keys
        are listed at :func:`zenflow_kernels.optim.telemetry.host_bytes` (docs/design.md section 9)."""
        return host_bytes(self.run, self.interval.sums.device_tensors()) if self._built else {}

    # -- the step ----------------------------------------------------------------------------------

    # torch.compile(opt.step) runs the step eagerly, as torch's own optimizers' host-side work does: it
    # drives threads, streams and numba kernels, nothing a graph can hold
    @compile_disabled
    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError(f"{self.display_name}.step() after close()")
        self.flushed_weights.before_step(self.interval)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._built:
            self._build()
        link = self.run.link
        link.check()
        inputs = read_step(self, self._shard, self._clips, self._grad_checks)
        if inputs.skip:  # an overflow under a GradScaler, or a non-finite gradient norm
            self.skipped_steps += 1
            link.discard()  # nothing of this step reached the host sums: nothing to take back
            self.handover.stepped(self.t, *link.step_bytes())
            return loss
        self._admit(inputs.active)  # (it may lay the host state out again: a new link)
        link = self.run.link
        self.run.t = self.t  # (the parts' view of the step number)
        self._amp, self._inv_amp, self._max_norm = inputs.amp, inputs.inv_amp, inputs.max_norm
        # a synchronous CPU update may fold a large last gradient into its AdamW pass (not under clipping or a scale)
        fuse = self.FUSE_MIN_NUMEL if inputs.max_norm is None and inputs.inv_amp == 1.0 else None
        with self._stats.timed_step():
            if self.schedule.is_warmup(self.t):
                self.interval.warmup(inputs.active, scale=inputs.inv_amp, max_norm=inputs.max_norm,
                                     fuse_min_numel=fuse)
                self.host_updates += 1
            else:
                self._zenflow_step(inputs.active, inputs.grads, inputs.coef, fuse)
            link.join()  # the write-backs of this step are visible to whatever runs next
            self.handover.stepped(self.t, *link.step_bytes())
        self.t += 1
        return loss

    def _zenflow_step(self, active: list[int], grads: dict[int, torch.Tensor], coef: float | None,
                      fuse: int | None) -> None:
        """After warm-up: re-select at a selection boundary, the fast step, the sums, and at an update boundary
        the host update. ``grads``: the step's own gradients (``StepInputs.grads``)."""
        t = self.t
        matrices, vectors = self.fast_path.split(active)
        self.fast_path.join(vectors)  # a vector's first step on the fast path: its state from the host
        select_all = self.schedule.is_select_boundary(t)
        if select_all:
            self.flush()  # drain: ownership must not change under an in-flight host update
            self.selections += 1
            if self.config.vector_state == "reset":
                self.fast_path.reset_vectors()
        reselect = matrices if select_all else self.selection.unselected(matrices)
        if reselect:
            self.selection.reselect(t, reselect, self._amp, self._inv_amp)
        compact = self.selection.compact_gradients(matrices)  # (ZeRO-2's released gradients)
        grad_scale = self._amp if coef is None else self._amp / coef  # GradScaler's scale, clipping
        with self._stats.timed_fast_step():
            self.fast_path.step(active, grads, group_hyperparams(self.param_groups, self.rule, self.display_name),
                                grad_scale=grad_scale, compact=compact)
        self.steps_accumulated += 1
        trigger = self.selection.auto_vote(matrices, self._amp) if self.schedule.is_auto else False
        boundary = self.schedule.is_update_boundary(t, steps_accumulated=self.steps_accumulated, auto_trigger=trigger)
        fold = boundary and not self.config.overlap_step and self.interval.sums.fuses
        last = self.interval.add(matrices, scale=self._inv_amp, fuse_min_numel=fuse if fold else None)
        if boundary:
            self.selection.reset_votes()
            self.interval.boundary(self._max_norm, last)
            self.host_updates += 1
            self.steps_accumulated = 0

    # GradScaler's protocol for optimizers that unscale inside their step (torch.amp.GradScaler.step): the scaler
    # does not rewrite the gradients; it sets ``grad_scale`` and ``found_inf`` on the optimizer for the length of
    # step() (``grad_scale`` None after the user's own ``scaler.unscale_(opt)``), and never skips step() itself
    _step_supports_amp_scaling = True

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
        return self._clips.ask(max_norm, norm_type, self.run.device if self._built else build.device_of(self._params))

    @compile_disabled
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Between a backward and its ``step()`` it skips that batch: what
        backward's hooks copied to the host is dropped (none of it reached the sums), the hand-over stays as it
        was, and no clipping requested for the step applies."""
        if self._built:
            self._shard.drop_step()  # (ZeRO-2: reductions a dropped batch's backward started)
            if self.handover.fired:  # a batch dropped before step() (a gradient-norm guard, say): a skip
                self.run.link.discard()
                self.run.link.step_bytes()  # (not a step: nothing to learn from its copies)
                self.handover.skipped()
            if not set_to_none:
                self.run.link.before_grad_write()  # copies still reading the gradients finish first
        self._clips.drop()
        super().zero_grad(set_to_none=set_to_none)

    # -- checkpoints (the format: checkpoint.py) ----------------------------------------------------

    @torch.no_grad()
    def state_dict(self, *, consolidated: bool = False) -> dict:
        """Everything needed to continue exactly (docs/design.md section 2 item 7); drains any in-flight host
        update first (its result stays pending, as it would without the save). Under ZeRO each rank's dict
        holds the host state of its own parameters (load it on the same rank at the same world size); see
        :meth:`consolidated_state_dict` for one dict of all of them. torch's ``register_state_dict_pre_hook`` and
        ``register_state_dict_post_hook`` hooks run around it, as for torch's optimizers."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        zenflow = checkpoint.header({name: getattr(self, name) for name in checkpoint.COUNTERS}, config=self.config,
                                    schedule=self.schedule, max_grad_norm=self.max_grad_norm,
                                    seed_from_host=self._seed_from_host, zero_stage=self.zero_stage,
                                    shard=self._shard, consolidated=consolidated, rule=self.rule)
        if self._built:
            checkpoint.before_pack(self.run, self.interval)
        packed = checkpoint.pack(self.run if self._built else None, self.interval, consolidated=consolidated,
                                 groups=checkpoint.pack_groups(self.param_groups, self._group_of), zenflow=zenflow)
        out = self._shard.export_state_dict(packed, self.run.local if self._built else None,
                                            self.run.topk if self._built else None)
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, out) or out
        return out

    def consolidated_state_dict(self) -> dict:
        """Under ZeRO: one state dict holding every rank's host state, loadable by ``load_state_dict`` at
        any world size (1 included). Collective: every rank calls it and gets the whole dict (save it
        from rank 0). Without ZeRO it is :meth:`state_dict`."""
        return self.state_dict(consolidated=True)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` (config, schedule and counters included: the saved run continues;
        a saved config or ``max_grad_norm`` that differs from this optimizer's is reported with a
        :class:`ZenFlowWarning` first). A ``torch.optim.AdamW`` (or ``Adam``) state dict starts ZenFlow from its
        moments and step counts instead: the host takes them as if warm-up had produced them, vectors join the fast
        path with them, and each matrix's first selection takes its columns' moments and steps from the host, so
        ``topk_ratio=1`` continues exactly as AdamW would (the saved hyper-parameters apply; the schedule starts at
        step 0). Anything else is an error, and nothing is changed before every check passed. torch's
        ``register_load_state_dict_pre_hook`` (which may return a new dict) and ``..._post_hook`` hooks run around
        it."""
        if self._built and self.interval.unflushed is not None:
            raise RuntimeError(f"{self.display_name}.load_state_dict() inside opt.flushed() (or while an integration "
                               "holds the flushed weights): leave the context first")
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        loaded = checkpoint.read(state_dict, params=self._params, group_of=self._group_of,
                                 group_sizes=[len(g["params"]) for g in self.param_groups], shard=self._shard,
                                 config=self.config, schedule=self.schedule, max_grad_norm=self.max_grad_norm,
                                 rule=self.rule, name=self.display_name)
        if loaded.changed:
            warnings.warn(f"{self.display_name}.load_state_dict: the checkpoint's settings replace this optimizer's: "
                          + "; ".join(loaded.changed) + ". The saved run continues as it was configured",
                          ZenFlowWarning, stacklevel=2)
        self._reset()
        self.config, self.max_grad_norm = loaded.config, loaded.max_grad_norm
        if isinstance(loaded.schedule, dict):  # a ZenFlow checkpoint's record, made as this optimizer makes one
            self.schedule = self.make_schedule(saved=loaded.schedule)
        self._seed_from_host = loaded.seed_from_host
        for saved, g in zip(loaded.groups, self.param_groups, strict=True):
            g.update(saved)
        for name, value in loaded.counters.items():
            setattr(self, name, value)
        self._held = loaded.host_params
        if loaded.built:
            self._build()
            loaded.restore(self.run, self.interval, self.fast_path.to_state)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _reset(self) -> None:
        """A clean slate before a load: land nothing, keep nothing, stop the workers."""
        if self._built:
            self.interval.settle()
            self._stats.retire(self.run.link)
            self._finalizer()
            # the old buffers go before the new link is built: never two links' host memory at once
            self.run = self.selection = self.fast_path = self.interval = None
            self._built = False
        self.state.clear()


