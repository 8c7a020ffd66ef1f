"""The host side of ZenFlow: flat, aligned fp32 buffers for one shard.

``HostShard`` lays the parameters of one shard out in flat fp32 buffers (master weights, the update rule's
state (AdamW: both moments; ``rules``), one or two gradient-accumulation buffers, none where
``device_accumulation``'s sums stay on the device with the state on disk) plus one flat copy-out buffer per parameter
dtype (the updated weights, rounded, ready for the host-to-device copy) and, for an asynchronous link, one
landing buffer per parameter dtype laid out like it (a step's gradients, copied in their own dtype, until
``step()`` has checked them and folds them into the sums: docs/design.md section 5.1). Within each param group the
matrices come first and the vectors after, every parameter starting on a 64-byte boundary, so a host
update is one numba call per run of parameters that share hyper-parameters and step count (usually
one call per param group). A single-process run is world size 1, shard 0; ZeRO-1/2 partitioning
hands each rank the parameters of its own shard and the layout is the same.

The background thread the host jobs run on is :class:`zenflow_kernels.link.worker.HostWorker`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cpu_ops.accumulate import SUM_CHUNK, accumulate_unchecked, sum_squares_chunks_unchecked, sum_squares_unchecked
from .host_fields import FieldsInMemory, FieldsOnDisk
from .rules import UpdateRule
from .streamed_host import DeviceSums, RangeStep

__all__ = ["HostShard", "Slot", "layout"]

ALIGN = 16  # fp32 elements: every parameter starts on a 64-byte cache line


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat host buffers."""

    index: int  # position in the optimizer's flat parameter list
    group: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in the fp32 buffers (master, moments, accumulation)
    numel: int
    out_offset: int  # in the copy-out buffer of its dtype, which holds only the parameters of that dtype

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2


def _zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


def layout(
    params: Sequence[torch.Tensor], groups: Sequence[int], indices: Sequence[int] | None = None
) -> tuple[list[int], dict[int, Slot], int]:
    """The flat layout of a shard holding ``indices`` (default: every parameter): ``(order, slots,
    numel)``, where ``order`` lists the indices by flat offset (param group, matrices before vectors,
    then the optimizer's order) and ``slots[i]`` says where parameter ``i`` lives. Every rank computes
    every rank's layout from the parameters alone (ZeRO hands each rank a contiguous run of ``order``)."""
    chosen = None if indices is None else set(indices)
    order = [
        i for i in sorted(range(len(params)), key=lambda i: (groups[i], params[i].dim() != 2, i))
        if chosen is None or i in chosen
    ]
    slots: dict[int, Slot] = {}
    offset = 0
    out_offsets: dict[torch.dtype, int] = {}
    for i in order:
        p = params[i]
        padded = math.ceil(p.numel() / ALIGN) * ALIGN
        out_offset = out_offsets.get(p.dtype, 0)
        slots[i] = Slot(i, groups[i], tuple(p.shape), p.dtype, offset, p.numel(), out_offset)
        offset += padded
        out_offsets[p.dtype] = out_offset + padded
    return order, slots, offset


def out_sizes(slots: dict[int, Slot]) -> dict[torch.dtype, int]:
    """Elements of each dtype's copy-out buffer: the padded sizes of that dtype's parameters only (a bf16
    model with fp32 norms gets a small fp32 one, not a second shard-sized buffer)."""
    sizes: dict[torch.dtype, int] = {}
    for s in slots.values():
        sizes[s.dtype] = max(sizes.get(s.dtype, 0), s.out_offset + math.ceil(s.numel / ALIGN) * ALIGN)
    return sizes


class HostShard:
    """Flat host buffers for the parameters of one shard (world size 1 and shard 0: all of them).

    Args:
        params: the parameters, in the optimizer's order.
        groups: ``groups[i]`` is the param-group index of ``params[i]``.
        num_acc: 1, or 2 for double-buffered accumulation (overlap); 0 where the sums never reach host memory
            whole (``device_accumulation`` with the state on disk: :meth:`update` fetches them block by block).
        alloc: ``alloc(numel, dtype)`` returns a zeroed flat host tensor (the link's: pinned memory
            when the parameters are on a GPU).
        landing: allocate the landing buffers (an asynchronous link's), one per parameter dtype.
        indices: the parameters this shard holds (ZeRO: this rank's run; default all of them).
            ``slots``, the views and every buffer cover these only; indices stay the optimizer's.
        rule: the update rule (``rules``; required: the shard's fields and its step are the rule's, whichever it
            is): its ``state_names`` are the fields beside ``master`` (``fields``), and :meth:`update` runs its host
            kernel.
        keys: ``keys[i]`` is the stochastic-rounding key of parameter i's element 0 (``zenflow_kernels.rounding``;
            ``Sharding.element_keys``: the same element has the same key in one process and on every rank); default
            the flat offsets of this shard.

    The shard holds data only. Which parameters were accumulated how often in an interval is the
    training thread's bookkeeping, handed to :meth:`update` as ``counts``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        groups: Sequence[int],
        *,
        num_acc: int,
        rule: UpdateRule,
        alloc: Callable[[int, torch.dtype], torch.Tensor] = _zeros,
        indices: Sequence[int] | None = None,
        disk: Callable[[int], Any] | None = None,
        landing: bool = False,
        keys: dict[int, int] | None = None,
    ):
        self.rule = rule
        self.names = ("master", *rule.state_names)  # the fp32 fields, in the state file's order
        order, slots, offset = layout(params, groups, indices)
        self.numel = offset
        self.slots = slots  # by parameter index
        self.order = [slots[i] for i in order]  # by flat offset
        self._indices = frozenset(s.index for s in self.order)
        # stochastic rounding's element keys (zenflow_kernels.rounding): parameter i's element j has key keys[i] + j,
        # kept as its shift from the flat offset; a run spans parameters of one shift only (its keys contiguous)
        self._key_shift = {i: (s.offset if keys is None else keys[i]) - s.offset for i, s in slots.items()}
        self._layout_runs: list[list[Slot]] | None = None  # (_runs: the usual interval's, merged once)
        # where the fields live, chosen once (host_fields): flat buffers in memory, or (disk, offload_device="nvme")
        # a state file, never whole in memory; every access goes through the store
        self.store = (FieldsOnDisk(disk(offset), self.names) if disk is not None else
                      FieldsInMemory(self.names, offset, alloc, rule.state_dtype))
        self.disk = self.store.files  # the state file (StateFiles), or None in memory
        self.fields: dict[str, torch.Tensor | None] = self.store.buffers  # in memory: each field's flat buffer
        self.acc = [alloc(offset, torch.float32) for _ in range(num_acc)]
        self.out = {dt: alloc(numel, dt) for dt, numel in out_sizes(slots).items()}
        self.landing = {dt: alloc(numel, dt) for dt, numel in out_sizes(slots).items()} if landing else {}
        # views into the buffers above, made at first use and kept (a step reads every parameter's: no view per
        # parameter per step); the buffers live as long as the shard
        self._landing_views: dict[int, torch.Tensor] = {}
        self._acc_views: list[dict[int, torch.Tensor]] = [{} for _ in self.acc]
        self.host_step = [0] * len(params)  # owned like the master: by the host update in flight
        try:
            with torch.no_grad():  # (on disk: one pass over the new file, whatever the number of tensors)
                self.store.write_many([("master", slots[i].offset, params[i]) for i in order], fresh=True)
        except BaseException:
            self.close()  # (a state file made above is removed)
            raise

    def __getattr__(self, name: str):
        # host.master, host.exp_avg, ...: the flat buffer of a field (None on disk)
        fields = self.__dict__.get("fields")
        if fields is not None and name in fields:
            return fields[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def field(self, name: str, index: int) -> torch.Tensor:
        """Parameter ``index``'s field ``name`` (``master`` or one of the rule's ``state_names``; its shape, fp32):
        a view of the buffer in memory (a copy where the rule keeps its state in bf16), or a copy read from the
        disk."""
        s = self.slots[index]
        return self.store.read(name, s.offset, s.numel).view(s.shape)

    def set_field(self, name: str, index: int, value: torch.Tensor) -> None:
        """Parameter ``index``'s field ``name`` <- ``value`` (its shape, any float dtype)."""
        self.set_fields([(name, index, value)])

    def set_fields(self, items) -> None:
        """Several ``(name, index, value)`` of :meth:`set_field` at once: on disk, one pass over the blocks they
        touch (loading a checkpoint), each block's piece converted at a time (no whole fp32 copy)."""
        self.store.write_many([(name, self.slots[index].offset, value) for name, index, value in items])

    def snapshot(self, extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """On disk: every field as it is now, ``[len(names), numel]`` (``names`` order; ``extra``, a flat buffer
        of the shard's size such as the gradient sums, as a last row), backed by a file (``StateFiles.snapshot``);
        in memory: None (the buffers themselves are the state)."""
        return self.store.snapshot(extra)

    def set_columns(self, items) -> None:
        """Several ``(name, index, cols, value)``: columns ``cols`` of matrix ``index``'s field <- ``value`` ([R,
        len(cols)]). On disk, one pass over the blocks they touch, each read and written once (re-selection)."""
        self.store.set_columns([(name, self.slots[index].offset, self.slots[index].shape, cols, value)
                                for name, index, cols, value in items])

    def close(self) -> None:
        """Remove the state file from ``nvme_path`` (offload_device="nvme"; still readable, e.g. by
        ``state_dict()``, until this shard is collected, which gives its space back); in memory, nothing to do."""
        self.store.close()

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s view (its shape) into one of the flat buffers."""
        s = self.slots[index]
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    def out_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view (its shape) into the copy-out buffer of its dtype."""
        s = self.slots[index]
        return self.out[s.dtype][s.out_offset : s.out_offset + s.numel].view(s.shape)

    def landing_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view (its shape) into the landing buffer of its dtype (made once)."""
        view = self._landing_views.get(index)
        if view is None:
            s = self.slots[index]
            view = self._landing_views[index] = self.landing[s.dtype][s.out_offset : s.out_offset + s.numel].view(
                s.shape)
        return view

    def acc_view(self, buf: int, index: int) -> torch.Tensor:
        """Parameter ``index``'s view (its shape) into accumulation buffer ``buf`` (made once)."""
        view = self._acc_views[buf].get(index)
        if view is None:
            view = self._acc_views[buf][index] = self.view(self.acc[buf], index)
        return view

    def fold(self, buf: int, indices: Sequence[int], scale: float = 1.0) -> None:
        """acc[buf] += landing * ``scale`` for these parameters (one multi-tensor launch per dtype, the calling
        worker thread's numba threads). Parameters next to each other in the layout are one range in both
        buffers (the copy-out layout follows the fp32 one, dtype by dtype), added as one tensor (their padding
        holds zeros in both)."""
        runs: list[list[Slot]] = []
        for s in sorted((self.slots[i] for i in indices), key=lambda s: s.offset):
            last = runs[-1][-1] if runs else None
            padded = 0 if last is None else math.ceil(last.numel / ALIGN) * ALIGN
            if last is not None and last.dtype == s.dtype and s.offset == last.offset + padded and (
                    s.out_offset == last.out_offset + padded):
                runs[-1].append(s)
            else:
                runs.append([s])
        accs, srcs = [], []
        for run in runs:
            lo, hi, out_lo = run[0].offset, run[-1].offset + run[-1].numel, run[0].out_offset
            accs.append(self.acc[buf][lo:hi])
            srcs.append(self.landing[run[0].dtype][out_lo : out_lo + hi - lo])
        accumulate_unchecked(accs, srcs, scale=scale)

    def update(
        self,
        buf: int,
        counts: dict[int, int],
        hyperparams: Sequence[dict],
        max_grad_norm: float | None,
        wait_before_write: Any = None,
        last: dict[int, torch.Tensor] | None = None,
        sum_over_ranks: Callable[[float], float] | None = None,
        sums: DeviceSums | None = None,
        step: int | None = None,
    ) -> dict:
        """The rule's host step on the host master of the parameters in ``counts`` with the mean of
        acc[buf] (``counts[i]`` divides parameter i's sum).

        ``counts[i]`` (>= 1) is the number of gradients parameter ``i`` received in this interval, the one
        in ``last`` included (the training thread's count, taken when it requested the update). Clips by
        the global norm of those mean gradients when ``max_grad_norm`` is set, writes the updated weights
        into the copy-out buffers, zeroes the accumulation and returns timings. ``hyperparams[g]`` holds the
        hyper-parameters of param group g (``rule.hyperparams``, captured when the update was requested).
        ``wait_before_write`` (a completion with ``wait()``: the last write-back's) guards the copy-out
        buffers while a previous write-back copy may still read them.

        ``last`` maps parameters to the interval's last gradient (CPU tensors) not yet accumulated, added
        in the same pass as the step, which also zeroes the buffer (the rule's ``host_accumulate_step_``, AdamW's
        ``accumulate_adam_``: one pass instead of three; a rule without such a kernel adds it first). Only without
        clipping: the clipping norm needs the whole sum first.

        ``sum_over_ranks`` (ZeRO: every rank's shard holds part of the model) turns this shard's sum of
        squares into the model's for the clipping norm; every rank calls ``update`` at each boundary.

        ``sums`` (state on disk with ``device_accumulation``; ``buf`` is then ignored): the interval's sums stay
        on the device and are fetched block by block (twice with clipping: once for the norm), not zeroed.
        The clipping norm's float64 partial sums are taken over the same ``SUM_CHUNK`` pieces either way, so
        it has the bits of the in-memory update's.

        ``step``: the step number of this update for every parameter in it (``host_step_count="steps"``); None:
        each parameter's count of host updates plus one.
        """
        t0 = time.perf_counter()
        acc = self.acc[buf] if sums is None else None
        last = last or {}
        if last and max_grad_norm is not None:
            raise ValueError("HostShard.update: last= cannot be combined with max_grad_norm (accumulate it first)")
        if sums is not None and (not self.store.on_disk or last):
            raise ValueError("HostShard.update: sums= (fetched from the device) needs the state on disk and no last=")
        todo = list(counts)
        todo_set = set(todo)
        if step is not None:  # (each count is advanced to it below)
            for i in todo:
                self.host_step[i] = step - 1
        coef = 1.0
        if max_grad_norm is not None:
            total = 0.0
            for i in todo:
                total += self._sum_squares(acc, sums, i) / counts[i] ** 2
            if sum_over_ranks is not None:
                total = sum_over_ranks(total)
            coef = min(1.0, max_grad_norm / (math.sqrt(total) + 1e-6))
        if wait_before_write is not None:
            wait_before_write.wait()
        rule, state_names = self.rule, self.rule.state_names
        if last and (self.store.on_disk or not rule.fuses_last):
            # streamed, or a rule without a fused kernel: the last gradient joins the sums first (the same fp32 add)
            accumulate_unchecked([self.view(acc, i).view(-1) for i in last], [g.reshape(-1) for g in last.values()])
            last = {}
        for i, grad in last.items():  # fused: acc + last gradient, step, copy-out, acc = 0
            s = self.slots[i]
            self.host_step[i] += 1
            rounding = rule.rounding(self.host_step[i], s.offset + self._key_shift[i])
            rule.host_accumulate_step_(
                self.view(self.master, i).view(-1),
                self.view(acc, i).view(-1),
                grad.reshape(-1),
                [self.view(self.fields[name], i).view(-1) for name in state_names],
                step=self.host_step[i],
                grad_scale=counts[i],
                out=self.out_view(i).view(-1),
                zero_acc=True,
                **({} if rounding is None else {"rounding": rounding}),
                **hyperparams[s.group],
            )
        runs = self._runs(todo, todo_set, last, counts)
        steps = []  # the rule's host kernel over each run (zero_grad: never a torch op here, see cpu_adam_'s)
        for run in runs:
            lo, hi = run[0].offset, run[-1].offset + run[-1].numel
            out_lo = run[0].out_offset  # flat neighbours of one dtype are neighbours in its copy-out buffer too
            first = run[0].index
            step = self.host_step[first] + 1
            rounding = rule.rounding(step, lo + self._key_shift[first])  # (passed only where it rounds stochastically)
            steps.append(RangeStep(lo, hi, self.out[run[0].dtype][out_lo : out_lo + hi - lo],
                             dict(step=step, grad_scale=counts[first] / coef, **hyperparams[run[0].group],
                                  **({} if rounding is None else {"rounding": rounding}))))
            for s in run:
                self.host_step[s.index] = step
        self.store.step_runs(rule, acc, steps, sums)  # (on disk: every run in one pass over the file)
        return {"seconds": time.perf_counter() - t0, "params": len(todo), "runs": len(runs), "fused": len(last)}

    def _runs(self, todo: list[int], todo_set: set[int], last: dict, counts: dict[int, int]) -> list[list[Slot]]:
        """The update's runs: flat neighbours that share group, dtype, step and count. The usual interval (every
        parameter of the shard, one count, one step) has the layout's runs, merged once and kept: the merge is Python
        per parameter, and this runs on the host worker holding the GIL."""
        shift = self._key_shift
        if not last and todo_set == self._indices and len(set(counts.values())) == 1 and len(
                set(map(self.host_step.__getitem__, todo))) == 1:
            if self._layout_runs is None:
                self._layout_runs = self._merge(self.order, lambda s: (s.group, s.dtype, shift[s.index]))
            return self._layout_runs
        step = self.host_step
        members = [s if s.index in todo_set and s.index not in last else None for s in self.order]
        return self._merge(members, lambda s: (s.group, s.dtype, step[s.index], counts[s.index], shift[s.index]))

    @staticmethod
    def _merge(members: list, key: Callable) -> list[list[Slot]]:
        """``members`` (slots in flat order, None for one left out) merged into runs of neighbours of equal
        ``key``; a slot left out ends a run (a run is one contiguous range)."""
        runs: list[list[Slot]] = []
        prev_key = None
        for s in members:
            if s is None:
                prev_key = None
                continue
            k = key(s)
            if prev_key is not None and k == prev_key:
                runs[-1].append(s)
            else:
                runs.append([s])
            prev_key = k
        return runs

    def _sum_squares(self, acc: torch.Tensor | None, sums: DeviceSums | None, index: int) -> float:
        """The float64 sum of squares of parameter ``index``'s gradient sums, in ``SUM_CHUNK`` pieces summed in
        order (independent of the thread count): from ``acc``, or fetched from ``sums`` a few chunks at a time."""
        if sums is None:
            return sum_squares_unchecked([self.view(acc, index).view(-1)])
        s = self.slots[index]
        partials = np.empty(-(-s.numel // SUM_CHUNK), dtype=np.float64)
        piece = sums.buffers[0]
        # pieces start on chunk boundaries: the same partials (a piece shorter than a chunk holds a whole shard)
        step = max(piece.numel() // SUM_CHUNK, 1) * SUM_CHUNK
        for lo in range(0, s.numel, step):
            hi = min(s.numel, lo + step)
            sums.get(piece[: hi - lo], s.offset + lo, s.offset + hi)
            sum_squares_chunks_unchecked(piece[: hi - lo], partials[lo // SUM_CHUNK : -(-hi // SUM_CHUNK)])
        return float(partials.sum())
