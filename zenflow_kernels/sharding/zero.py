"""ZeRO-1/2 behind the seam: :class:`Zero1` and :class:`Zero2` (the collectives and ownership are in
zero_context.py; docs/design.md section 7)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import ops
from ..link.asynchronous import at_backward_end
from .base import Sharding, column_scores, sum_of_squares
from .zero_context import BucketReducer, ZeroContext, check_not_ddp, owners

__all__ = ["Zero1", "Zero2"]


class Zero1(Sharding):
    """ZeRO-1: every gradient averaged on every rank (one flat all-reduce per dtype); each rank's host holds
    its own run of parameters (zero_context.py), and owners broadcast what only they hold."""

    stage = 1
    final_at_backward = False

    def __init__(self, process_group, timeout: float):
        super().__init__()
        self._group, self._timeout = process_group, timeout
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.ctx: ZeroContext | None = None

    def accept(self, params) -> None:
        super().accept(params)
        check_not_ddp(params, self.name)

    def start(self, params, groups, device, chaos) -> None:
        super().start(params, groups, device, chaos)
        if self.ctx is None:  # once: creating its groups is collective (a reload keeps it)
            self.ctx = ZeroContext(params, groups, process_group=self._group, timeout=self._timeout,
                                   chaos=chaos if device.type == "cpu" else None, name=self.name)
            self.bytes = self.ctx.bytes
        self.owned = self.ctx.owned

    def hold(self, host_params) -> None:
        self.ctx.hold(host_params)

    def use_host_memory(self, alloc) -> None:
        self.ctx.use_host_memory(alloc)

    def host_bytes(self) -> int:
        return self.ctx.receive_bytes if self.ctx is not None else 0

    @property
    def failed(self) -> bool:
        return self.ctx is not None and self.ctx.failed

    def gather(self, active: list[int]) -> None:
        self.ctx.check_presence(active, len(self.params))
        self.ctx.average_([self.params[i].grad for i in active], "gradients")

    def mine(self, indices) -> list[int]:
        owned = set(self.owned)
        return [i for i in indices if i in owned]

    def from_host(self, i, make, shape, dtype, kind="host state") -> torch.Tensor:
        return self.ctx.from_owner(i, make, shape, dtype, self.device, kind)

    def sum_over_ranks(self):
        return self.ctx.sum_host

    def start_exchange(self, host, indices, dtypes):
        return self.ctx.start_exchange(host, indices, dtypes)

    def received(self, exchange, host, indices, dtypes, wait) -> dict:
        if exchange is None:  # a synchronous update: hand them over now
            exchange = self.ctx.start_exchange(host, indices, dtypes)
        return wait(exchange)

    def settle(self, exchange) -> None:
        if exchange is not None:
            exchange.wait()

    def holds(self, i: int) -> bool:
        return self.ctx.owner[i] == self.rank

    def will_hold(self, params, groups) -> list[int]:
        return [i for i, r in enumerate(owners(params, groups, self.world)) if r == self.rank]

    def checkpoint_tensor(self, i, make, shape) -> torch.Tensor:
        t = make() if self.holds(i) else torch.empty(shape, dtype=torch.float32)
        return self.ctx.broadcast_(t.to(self.device), self.ctx.owner[i], "checkpoint").to("cpu")


class Zero2(Zero1):
    """ZeRO-2: each matrix's gradient reduced to its owner only, in buckets started from backward hooks
    (``release``: its ``.grad`` let go as its bucket starts); owners score their matrices and the scores
    are all-reduced; vectors averaged on every rank; the selected columns' averaged gradients summed from
    their owners (or, keeping ``.grad``, the local selected columns averaged)."""

    stage = 2
    consumes_hooks = True
    exchanges_selected = True

    def __init__(self, process_group, timeout: float, *, release: bool, bucket_numel: int):
        super().__init__(process_group, timeout)
        self.release, self._bucket_numel = release, bucket_numel
        self._averaged: dict[int, torch.Tensor] = {}
        # release: the vectors' gradients as the last backward left them ((indices, fingerprints), taken when it
        # ended), to tell whether the loop changed gradients after the matrices' were let go
        self._vectors_at_backward: tuple[list[int], torch.Tensor] | None = None
        self._end_queued = False
        self._key = int.from_bytes(os.urandom(8), "little")

    def start(self, params, groups, device, chaos) -> None:
        super().start(params, groups, device, chaos)
        # frozen matrices stay out of the buckets (a bucket starts once all of its matrices have their gradient);
        # one that gets a gradient anyway is reduced at step() (BucketReducer.finish)
        order = [i for i in self.ctx.order if params[i].dim() == 2 and params[i].requires_grad]
        self.reducer = BucketReducer(self.ctx, params, order[::-1], self._bucket_numel, release=self.release)

    def grad_ready(self, i, check, final=True) -> None:
        p = self.params[i]
        if self.release and not self._end_queued:
            self._end_queued = at_backward_end(self._note_vectors)
        if p.dim() == 2 and p.grad is not None:  # (None: a hook of the user's before ours took it)
            check(i, p.grad)  # now: step() will not see it (release), and its fingerprint reads it
            if not self.release and not final:  # declared: a later micro-batch changes it; step() reduces it
                return
            self.reducer.grad_ready(i)

    def _note_vectors(self) -> None:
        """At the end of a backward (release): the vectors' gradients, fingerprinted."""
        self._end_queued = False
        vectors = [i for i, p in enumerate(self.params) if p.dim() != 2 and p.grad is not None]
        grads = [self.params[i].grad for i in vectors]
        self._vectors_at_backward = (vectors, ops.multi_fingerprint(grads, self._key) if grads else None)

    def _loop_changed_gradients(self) -> bool:
        """release: whether gradients changed between backward and ``step()`` after matrices' gradients were let
        go during backward (the loop's ``unscale_``, clipping, NaN repair or edits cannot have reached those)."""
        if not self.reducer.arrivals:
            return False  # nothing let go before step(): the buckets carry the gradients as step() sees them
        if self.user_unscaled:
            return True
        if self._vectors_at_backward is None:
            return False
        vectors, fingerprints = self._vectors_at_backward
        now = [i for i, p in enumerate(self.params) if p.dim() != 2 and p.grad is not None]
        if now != vectors:
            return True
        return bool(now) and not torch.equal(ops.multi_fingerprint([self.params[i].grad for i in now], self._key),
                                             fingerprints)

    def drop_step(self) -> None:
        # a batch dropped before step() (every rank drops it: the ranks' reductions stay matched)
        self._vectors_at_backward = None
        if self.reducer is not None and self.reducer.pending():
            self.reducer.abandon()

    def active(self) -> list[int]:
        # released gradients: a matrix whose bucket the hooks started has .grad None
        arrived = self.reducer.arrivals
        return [i for i, p in enumerate(self.params) if p.grad is not None or i in arrived]

    def gather(self, active: list[int]) -> None:
        # one collective decision a step: which buckets any rank saw change (sent again by every rank), and
        # whether any rank's loop changed gradients the hooks had let go already (the step refused on every rank)
        chosen = set(active)
        refuse = self.release and self._loop_changed_gradients()
        votes = torch.cat([torch.tensor([int(refuse)], dtype=torch.int32),
                           torch.zeros(len(self.reducer.buckets), dtype=torch.int32) if self.release
                           else self.reducer.changed(chosen)])
        summed = self.ctx.check_presence(active, len(self.params), votes)
        self._vectors_at_backward = None
        if int(summed[0]):
            self.reducer.abandon()
            raise ValueError(
                f"{self.name} rank {self.rank}: the loop changed gradients between backward and step() (GradScaler's "
                "unscale_, clip_grad_norm_, a NaN repair or an edit of .grad) on some rank, but ZeRO-2 with "
                "release_gradients=True let go of the matrices' gradients during backward (each went to its owner "
                "as its bucket's reduction started), so the change cannot reach them and the step would be "
                "silently wrong. Nothing was applied. Ways out: release_gradients=False (every .grad kept; such "
                "loops are exact), clipping with max_grad_norm= or opt.clip_grad_norm_() (clips the averaged "
                "gradient inside the optimizer), a GradScaler without unscale_ (scaler.step(opt) unscales inside "
                "the optimizer), or bf16 autocast without a GradScaler")
        self._averaged = self.reducer.finish(chosen, summed[1:])
        self.ctx.average_([self.params[i].grad for i in active if self.params[i].dim() != 2], "vector gradients")

    def grad(self, i: int) -> torch.Tensor:
        averaged = self._averaged.get(i)
        return averaged if averaged is not None else self.params[i].grad

    def grad_norm(self, active: list[int], own=None) -> float:
        # owners' matrices, and the vectors once (rank 0), summed over the ranks
        grads = [self._averaged[i] for i in active if i in self._averaged]
        if self.rank == 0:
            grads += [self.params[i].grad for i in active if self.params[i].dim() != 2]
        return float(self.ctx.all_reduce_(sum_of_squares(grads, self.device), "gradient norm").sqrt())

    def scores(self, indices, importances) -> list[torch.Tensor]:
        # each owner scores its own matrices, exactly; one all-reduce hands every rank every score vector
        kind = dict(zip(indices, importances, strict=True))
        mine = [i for i in indices if i in self._averaged]
        own = dict(zip(mine, column_scores([self._averaged[i] for i in mine], [self.params[i] for i in mine],
                                           [kind[i] for i in mine], self.name), strict=True))
        flat = torch.cat([
            own[i].float() if i in own else torch.zeros(self.params[i].shape[1], device=self.device)
            for i in indices
        ]) if indices else torch.zeros(0, device=self.device)
        self.ctx.all_reduce_(flat, "selection scores")
        return list(flat.split([self.params[i].shape[1] for i in indices]))

    def selected_gradients(self, chosen):
        chosen = [(i, sel) for i, sel in chosen if sel.numel()]
        if self.release:  # each owner's averaged columns, zeros elsewhere, summed
            compact = [
                self._averaged[i][:, sel] if i in self._averaged
                else torch.zeros(self.params[i].shape[0], sel.numel(), device=self.device,
                                 dtype=self.reducer.grad_dtype.get(i, self.params[i].dtype))
                for i, sel in chosen
            ]
            self.ctx.sum_(compact, "selected columns")
            return {i: c for (i, _), c in zip(chosen, compact, strict=True)}
        compact = [self.params[i].grad[:, sel] for i, sel in chosen]
        self.ctx.average_(compact, "selected columns")
        for (i, sel), avg in zip(chosen, compact, strict=True):
            self.params[i].grad[:, sel] = avg
        return None
