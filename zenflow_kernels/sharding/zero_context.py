"""ZeRO-1/2 for ZenFlow over ``torch.distributed`` (docs/design.md section 7, docs/torchrun.md).

Ownership. The parameters, in the host layout's order (param group, matrices before vectors), are
cut into ``world`` contiguous runs of whole parameters holding about the same number of elements;
rank ``r``'s host shard (fp32 master, Adam moments, accumulation buffers) holds run ``r`` only, laid
out flat and aligned like a single-rank shard. World size 1 is the same code with one run.

One step, on every rank:

* stage 1: the step's gradients are all-reduced (averaged) in one flat buffer per dtype, so the fast
  step, the clipping norm, the selection and the zen-auto vote agree on every rank without further
  collectives (the selection scores the averaged gradient, as one rank on the whole batch does);
* stage 2 (:class:`BucketReducer`): each matrix's gradient is reduced to its owner only, in buckets
  started from backward hooks, and (``release``, the default) its ``.grad`` let go as its bucket starts;
  the owners score their matrices and the score vectors are all-reduced (the selection); the vectors
  are all-reduced, and the selected columns' averaged gradients summed from their owners (zeros from
  the other ranks; without ``release``, the local selected columns averaged);
* each rank accumulates only the matrices it owns; at an update boundary its host worker steps only
  them (a clipping norm is the sum of every rank's share: one all-reduce of a float64 on the
  worker's own gloo group);
* a write-back first hands every owner's updated weights to the other replicas (one broadcast per
  rank and dtype of the span holding its pending parameters, host to host, started by the thread that
  ran the host update right after it), then each replica overwrites its non-selected columns;
* state the fast path takes from the host (a vector's moments after warm-up, a low-precision matrix's
  fp32 master of entering columns, an imported AdamW run's moments) is broadcast by its owner.

Every collective runs on groups this module creates (the training thread's; a gloo group for the host
worker, so two threads never interleave calls on one group; a gloo group for the per-step check of
which gradients exist), waits at most ``timeout`` seconds, and fails with a
:class:`ZeroCollectiveError` naming this rank, the collective and what it carried. Bytes are counted
per kind for ``stats()``.
"""


from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import ops
from ..device_model import Chaos
from ..host import ALIGN, layout, out_sizes
from .collectives import Collectives

__all__ = ["BucketReducer", "Exchange", "ZeroContext", "check_not_ddp", "owner_runs", "owners"]


def owner_runs(sizes: Sequence[int], world: int) -> list[int]:
    """The owner rank of each parameter, in layout order, given their aligned sizes: contiguous runs,
    balanced by elements (a parameter goes to the rank whose equal share holds its midpoint)."""
    total = sum(sizes)
    owners, start = [], 0
    for size in sizes:
        mid = start + size / 2
        owners.append(min(world - 1, int(mid * world // total)) if total else 0)
        start += size
    return owners


def owners(params: Sequence[torch.Tensor], groups: Sequence[int], world: int) -> list[int]:
    """The rank holding each parameter's host state (indexed like ``params``)."""
    order, slots, _ = layout(params, groups)
    sizes = [math.ceil(slots[i].numel / ALIGN) * ALIGN for i in order]
    owner = [0] * len(params)
    for i, r in zip(order, owner_runs(sizes, world), strict=True):
        owner[i] = r
    return owner


def check_not_ddp(params: Sequence[torch.Tensor], name: str) -> None:
    """Refuse parameters of a module wrapped in DistributedDataParallel: DDP already averages the
    gradients in backward, and the optimizer's own reduction would then run on top of it."""
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and any(id(p) in ids for p in obj.module.parameters()):
            raise ValueError(
                f"{name}(zero_stage>0): the parameters belong to a model wrapped in DistributedDataParallel. "
                f"{name} reduces the gradients itself; with DDP they would be reduced twice. Pass the "
                "unwrapped model's parameters (model.module.parameters()) and do not wrap it in DDP"
            )


class ZeroContext(Collectives):
    """The ranks, the owner of every parameter, the other ranks' shard layouts and the collectives.

    Args:
        params, groups: the optimizer's flat parameter list and each parameter's param-group index.
        process_group, timeout, name, chaos: as :class:`Collectives`.

    Every rank of ``process_group`` must build its context at the same point (the first ``step()``),
    since creating the module's groups is itself collective.
    """

    def __init__(self, params: Sequence[torch.Tensor], groups: Sequence[int], *, process_group, timeout: float,
                 name: str, chaos: Chaos | None = None):
        super().__init__(process_group=process_group, timeout=timeout, name=name, chaos=chaos)
        order = self.order = layout(params, groups)[0]  # every parameter, host layout order
        self.owner = owners(params, groups, self.world)
        self.owned = [i for i in order if self.owner[i] == self.rank]  # this rank's shard, layout order
        self._params, self._groups = params, groups
        self.hold(set(range(len(params))))
        # the other ranks' copy-out buffers as this rank receives them, one per rank and dtype (made at first use)
        self._receive: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._alloc: Callable[[int, torch.dtype], torch.Tensor] = lambda n, dtype: torch.zeros(n, dtype=dtype)

    def hold(self, host_params: set[int]) -> None:
        """Each rank's shard layout (offsets within its flat buffers, for the write-back broadcasts): its own
        parameters of ``host_params`` (the others are frozen: no host state anywhere)."""
        order, params, groups = self.order, self._params, self._groups
        self.layouts = [layout(params, groups, [i for i in order if self.owner[i] == r and i in host_params])[1]
                        for r in range(self.world)]
        self._receive = {}

    def use_host_memory(self, alloc: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        """The write-back's receive buffers come from ``alloc`` (the link's: page-locked on a GPU, so the
        host-to-device copy from them is asynchronous; a copy from pageable memory blocks the training thread until
        the GPU's queue drains), one per other rank and dtype, reused by every exchange: an exchange writes them
        only after its host update waited for the last write-back (the copy-out guard), which read them last."""
        self._alloc, self._receive = alloc, {}

    @property
    def receive_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._receive.values())

    def _receive_span(self, r: int, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        buf = self._receive.get((r, dtype))
        if buf is None:
            buf = self._receive[(r, dtype)] = self._alloc(out_sizes(self.layouts[r])[dtype], dtype)
        return buf[lo:hi]

    def from_owner(self, i: int, make, shape: tuple[int, ...], dtype: torch.dtype, device, kind: str) -> torch.Tensor:
        """Parameter ``i``'s owner computes ``make()``; every rank returns it (a tensor on ``device``)."""
        if self.owner[i] == self.rank:
            t = make().to(device=device, dtype=dtype).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        return self.broadcast_(t, self.owner[i], kind)

    def start_exchange(self, host, indices: Sequence[int], dtypes: dict[int, torch.dtype]) -> Exchange:
        """Start handing every owner's copy-out of the parameters in ``indices`` to the other ranks: one
        broadcast per rank and dtype of the span holding its parameters, host to host on the host
        worker's gloo group (the write-back then copies to the device as on one rank). Called by the
        thread that ran the host update, right after it, so the bytes move while training goes on."""
        wanted = set(indices)
        exchange = Exchange(self)
        for r in range(self.world):
            slots = self.layouts[r]
            by_dtype: dict[torch.dtype, list] = {}
            for i in slots:
                if i in wanted:
                    by_dtype.setdefault(dtypes[i], []).append(slots[i])
            for dtype, chosen in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
                lo = min(s.out_offset for s in chosen)
                hi = max(s.out_offset + s.numel for s in chosen)
                # the owner sends from its copy-out buffer, which the next host update writes only after
                # this write-back completed (its copy-out guard)
                span = host.out[dtype][lo:hi] if r == self.rank else self._receive_span(r, dtype, lo, hi)
                src = dist.get_global_rank(self._host, r)
                exchange.handles.append(self.start(
                    "write-back", "broadcast", span,
                    lambda span=span, src=src: dist.broadcast(span, src=src, group=self._host, async_op=True),
                    host=True))
                if r != self.rank:
                    for s in chosen:
                        exchange.received[s.index] = span[s.out_offset - lo : s.out_offset - lo + s.numel].view(
                            s.shape)
        return exchange


class Exchange:
    """The broadcasts of one write-back: :meth:`wait` returns ``{i: weights}`` for the parameters other
    ranks own."""

    def __init__(self, ctx: ZeroContext):
        self.ctx = ctx
        self.handles: list[tuple] = []
        self.received: dict[int, torch.Tensor] = {}

    def wait(self) -> dict[int, torch.Tensor]:
        for handle in self.handles:
            self.ctx.finish(handle)
        self.handles = []
        return self.received


class BucketReducer:
    """ZeRO-2: each matrix's gradient goes to its owner only, averaged (a reduce per bucket: whole
    matrices of one owner and dtype, up to ``bucket_numel`` elements, in reverse layout order, the
    order backward usually produces them).

    Backward hooks call :meth:`grad_ready`; a bucket starts as soon as all of its matrices have their
    gradient and every earlier bucket has started, so every rank starts the same reductions in the
    same order whatever order its hooks fire in. :meth:`finish` (in ``step()``) starts what the hooks
    did not, waits for all, and returns the averaged gradients of this rank's matrices (the other
    ranks' are not kept).

    ``release`` (the default with ``zero_stage=2``): a bucket's gradients are copied into
    its reduction and their ``.grad`` set to None as it starts, so a rank holds its own range of the
    gradient, the buckets not yet started and those in flight, never the whole gradient. Another
    micro-batch's backward then starts a second round of the buckets, which the owner adds up.
    Without ``release`` every ``.grad`` stays (the local, un-averaged gradient, for code that reads it)
    and a bucket whose gradients changed after it started (another micro-batch, unscaling, a ``.data``
    write, an in-place edit on one rank) is reduced again in :meth:`finish`. What changed is told by a
    fingerprint of each gradient's bits taken as its bucket starts (``_version`` misses ``.data`` writes and
    GradScaler's unscale, and moves on a no-op edit), and decided together: :meth:`changed` gives this
    rank's view, the ranks sum their views in one all-reduce (``Collectives.check_presence``), and every rank
    sends again the buckets any rank saw change, so the reductions stay matched.
    """

    def __init__(self, ctx: ZeroContext, params: Sequence[torch.Tensor], matrices: Sequence[int],
                 bucket_numel: int, *, release: bool = False):
        self.ctx, self.params, self.release = ctx, params, release
        self.buckets: list[list[int]] = []
        size = 0
        for i in matrices:  # reverse layout order
            p, last = params[i], self.buckets[-1] if self.buckets else None
            same = last is not None and ctx.owner[last[-1]] == ctx.owner[i] and params[last[-1]].dtype == p.dtype
            if not same or size + p.numel() > bucket_numel:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += p.numel()
        self.bucketed = {i for bucket in self.buckets for i in bucket}
        self.grad_dtype: dict[int, torch.dtype] = {}  # release: each matrix's gradient dtype, as last seen
        self._key = int.from_bytes(os.urandom(8), "little")  # the fingerprints' weights (ops.multi_fingerprint)
        self.started_in_backward = 0  # buckets the hooks started (overlapping backward)
        self.restarted = 0  # buckets started again because a gradient changed after its start
        self._reset()

    def _reset(self) -> None:
        self._ready: set[int] = set()
        self._next = 0  # the first bucket not started by the hooks (release: of the current round)
        self._started: dict[int, tuple] = {}  # bucket -> (handle, flat, members, fingerprints of their grads)
        # release: gradients seen per matrix this step, the current round, each bucket's reductions
        self.arrivals: dict[int, int] = {}
        self._round = 0
        self._sent: dict[int, list[tuple]] = {}  # bucket -> [(handle, flat or None once complete off-owner)]

    def held_numel(self) -> dict[str, int]:
        """Gradient elements this reducer holds now (release): ``own``, the sums of this rank's range it
        receives (one per micro-batch until ``step()``); ``in_flight``, other ranks' buckets whose
        reduction has not completed yet (their input is let go when it has)."""
        self._drop_completed()
        held = {"own": 0, "in_flight": 0}
        for b, sent in self._sent.items():
            key = "own" if self.ctx.owner[self.buckets[b][0]] == self.ctx.rank else "in_flight"
            held[key] += sum(flat.numel() for _, flat in sent if flat is not None)
        return held

    def grad_ready(self, i: int) -> None:
        """Matrix ``i``'s gradient is complete for this backward: start every bucket that can start."""
        if self.release:
            self.arrivals[i] = self.arrivals.get(i, 0) + 1
            while self.buckets and all(self.arrivals.get(j, 0) > self._round for j in self.buckets[self._next]):
                self._send(self._next)
                self.started_in_backward += 1
            return
        self._ready.add(i)
        while self._next < len(self.buckets) and all(j in self._ready for j in self.buckets[self._next]):
            self._start(self._next, self.buckets[self._next])
            self._next += 1
            self.started_in_backward += 1

    def _start(self, b: int, members: list[int]) -> None:
        grads = [self.params[i].grad for i in members]
        # always a copy (flatten_dense_tensors returns a view of a lone tensor): the reduction writes into
        # its buffer (and may use it as scratch off the owner), and the local gradient is read again later
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._started[b] = (self._reduce(flat, members), flat, members, ops.multi_fingerprint(grads, self._key))

    def changed(self, active: set[int]) -> torch.Tensor:
        """Without ``release``: this rank's view of which started buckets must be sent again at ``step()``, an
        int32 flag per bucket (its active matrices are not those it started with, or a gradient's bits differ
        from when it started)."""
        flags = torch.zeros(len(self.buckets), dtype=torch.int32)
        for b, (_, _, was, fingerprints) in self._started.items():
            now = [self.params[i].grad for i in was]
            flags[b] = int(was != [i for i in self.buckets[b] if i in active] or any(g is None for g in now)
                           or not torch.equal(ops.multi_fingerprint(now, self._key), fingerprints))
        return flags

    def pending(self) -> bool:
        """Whether reductions of this step were started (by the hooks) and not finished."""
        return bool(self._started or self._sent or self._ready or self.arrivals)

    def abandon(self) -> None:
        """Let every reduction in flight complete, unused, and forget the step (a refused step: every rank calls
        it at the same point, so the ranks stay matched)."""
        try:
            for started in self._started.values():
                self.ctx.finish(started[0])
            for sent in self._sent.values():
                for handle, _ in sent:
                    self.ctx.finish(handle)
        finally:
            self._reset()

    def _reduce(self, flat: torch.Tensor, members: list[int]) -> tuple:
        group = self.ctx.train_group
        dst = dist.get_global_rank(group, self.ctx.owner[members[0]])
        return self.ctx.start("gradients", "reduce", flat,
                              lambda: dist.reduce(flat, dst=dst, group=group, async_op=True))

    def _send(self, b: int) -> None:
        """release: start bucket ``b``'s reduction for the current round (a matrix without a gradient
        sends zeros, so every rank's reduction has the same size) and let go of its gradients."""
        members = self.buckets[b]
        params = self.params
        flat = torch.cat([
            (params[i].grad if params[i].grad is not None
             else torch.zeros_like(params[i], dtype=self.grad_dtype.get(i, params[i].dtype))).reshape(-1)
            for i in members
        ])
        handle = self._reduce(flat, members)
        for i in members:
            if params[i].grad is not None:
                self.grad_dtype[i] = params[i].grad.dtype
            params[i].grad = None
        self._drop_completed()
        self._sent.setdefault(b, []).append((handle, flat))
        self._next += 1
        if self._next == len(self.buckets):
            self._next, self._round = 0, self._round + 1

    def _drop_completed(self) -> None:
        """Off the owner a bucket's buffer is only its reduction's input: let go of it once complete."""
        for b, sent in self._sent.items():
            if self.ctx.owner[self.buckets[b][0]] != self.ctx.rank:
                for n, (handle, flat) in enumerate(sent):
                    if flat is not None and handle[0].is_completed():
                        sent[n] = (handle, None)

    def finish(self, active: set[int], resend: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Reduce every active matrix's gradient to its owner; returns ``{i: averaged gradient}`` for
        the matrices this rank owns (an active matrix in no bucket, frozen when the buckets were made, is
        reduced alone, after the buckets). ``resend`` (without ``release``): the ranks' summed :meth:`changed`
        flags; a started bucket any rank flagged is sent again."""
        try:
            outside = sorted(i for i in active if self.params[i].dim() == 2 and i not in self.bucketed)
            if self.release:
                return self._finish_released(active) | self._reduce_alone(outside)
            for b, bucket in enumerate(self.buckets):
                members = [i for i in bucket if i in active]
                started = self._started.get(b)
                if started is not None:
                    if resend is None or not int(resend[b]):
                        continue
                    self.ctx.finish(started[0])  # superseded: the ranks still complete it in order
                    del self._started[b]
                    self.restarted += 1
                if members:
                    self._start(b, members)
            averaged: dict[int, torch.Tensor] = {}
            for b in sorted(self._started):
                handle, flat, members, _ = self._started[b]
                self.ctx.finish(handle)
                if self.ctx.owner[members[0]] == self.ctx.rank:
                    flat.div_(self.ctx.world)
                    parts = flat.split([self.params[i].numel() for i in members])
                    for i, avg in zip(members, parts, strict=True):
                        averaged[i] = avg.view(self.params[i].shape)
            return averaged | self._reduce_alone(outside)
        finally:
            self._reset()

    def _reduce_alone(self, matrices: list[int]) -> dict[int, torch.Tensor]:
        """Each of these matrices' gradient reduced to its owner on its own (every rank, in the same order); the
        owner's averaged ones. ``release``: their ``.grad`` let go, as a bucket's."""
        averaged: dict[int, torch.Tensor] = {}
        for i in matrices:
            p = self.params[i]
            flat = p.grad.reshape(-1).clone()
            self.ctx.finish(self._reduce(flat, [i]))
            if self.ctx.owner[i] == self.ctx.rank:
                averaged[i] = flat.div_(self.ctx.world).view(p.shape)
            if self.release:
                p.grad = None
        return averaged

    def _finish_released(self, active: set[int]) -> dict[int, torch.Tensor]:
        # what the hooks did not start: the rest of the current round, and a further round while some
        # gradient is still held (set without backward, or after the hooks' last round)
        matrices = [i for bucket in self.buckets for i in bucket]
        while self._next != 0 or any(self.params[i].grad is not None for i in matrices):
            self._send(self._next)
        averaged: dict[int, torch.Tensor] = {}
        for b in sorted(self._sent):
            sent = self._sent[b]
            for handle, _ in sent:
                self.ctx.finish(handle)
            members = self.buckets[b]
            if self.ctx.owner[members[0]] != self.ctx.rank:
                continue
            total = sent[0][1]
            for _, flat in sent[1:]:  # the micro-batches' rounds, in order
                total.add_(flat)
            total.div_(self.ctx.world)
            parts = total.split([self.params[i].numel() for i in members])
            for i, avg in zip(members, parts, strict=True):
                if i in active:
                    averaged[i] = avg.view(self.params[i].shape)
        return averaged
