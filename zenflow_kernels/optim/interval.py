"""The host interval (docs/design.md sections 2-3): what each step adds into the interval's sums and how often
(the training thread's ledger), the host update at a boundary (synchronous, or overlapped on the worker and landing
at the next boundary), the drain, the pending write-back, ZeRO's exchange of the owners' results, and the weights
``flushed()`` keeps aside. Where the sums live is the ``sums`` object's (``sums.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._memory import host_copy
from .run import BuiltOptimizer

__all__ = ["HostInterval"]


class HostInterval:
    """One optimizer's host interval. ``hyperparams()`` gives the param groups' rule hyper-parameters as they are
    now."""

    def __init__(self, run: BuiltOptimizer, sums, *, overlap: bool, hyperparams: Callable[[], list[dict]]):
        self.run, self.sums, self.overlap, self.hyperparams = run, sums, overlap, hyperparams
        self.buf = 0  # the sums buffer this interval adds into
        # the training thread's ledger: gradients counted into each buffer this interval
        self.counts = [[0] * len(run.params) for _ in range(sums.buffers)]
        self.pending: list[int] = []  # parameters whose host result awaits its write-back
        self.inflight = None  # the overlapped host update still running (or done, not yet waited)
        self.exchange = None  # ZeRO: the owners' hand-over of the pending write-back, started by its host update
        self.received = None  # ZeRO: that hand-over's results, taken inside flushed() before their write-back
        self.unflushed: dict[int, torch.Tensor] | None = None  # inside flushed(): the weights to restore

    # -- the ledger --------------------------------------------------------------------------------

    def counted(self, i: int) -> int:
        """Gradients of parameter ``i`` in this interval's sums."""
        return self.counts[self.buf][i]

    def _take_counts(self, indices) -> dict[int, int]:
        """This interval's counts of these parameters (those with any), reset for the next use of the buffer."""
        counts = self.counts[self.buf]
        taken = {i: counts[i] for i in indices if counts[i]}
        for i in taken:
            counts[i] = 0
        return taken

    def add(self, indices: list[int], *, scale: float, fuse_min_numel: int | None = None) -> dict:
        """Add these parameters' gradients (times ``scale``) into the interval's sums and count them; see
        ``SumsInHost.add`` for ``fuse_min_numel``."""
        last = self.sums.add(indices, self.buf, scale=scale, fuse_min_numel=fuse_min_numel)
        counts = self.counts[self.buf]
        for i in indices:
            counts[i] += 1
        return last

    def sums_flat(self) -> torch.Tensor:
        """The flat buffer holding the current interval's gradient sums (device or host)."""
        return self.sums.flat(self.buf)

    def sums_of(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s sums in this interval, a host copy."""
        return self.run.host.view(self.sums_flat(), i).to("cpu", copy=True)

    # -- updates -----------------------------------------------------------------------------------

    def _sum_over_ranks(self, max_norm):
        """ZeRO with clipping: how a host update turns its shard's sum of squares into the model's."""
        return self.run.shard.sum_over_ranks() if max_norm is not None else None

    def _divisors(self, counts: dict[int, int]) -> dict[int, int]:
        """What each parameter's interval sum is divided by: its count of gradients (the mean), or with
        ``gradient_scale="interval"`` 1 (the gradients were read divided by the interval: their sum)."""
        return dict.fromkeys(counts, 1) if self.run.config.gradient_scale == "interval" else counts

    def _host_step(self) -> int | None:
        """The step number of a host update at this step (``host_step_count="steps"``: the optimizer's ``t + 1``),
        or None: each parameter's count of host updates plus one."""
        return self.run.t + 1 if self.run.config.host_step_count == "steps" else None

    def sync_update(self, counts: dict[int, int], last: dict, max_norm: float | None) -> None:
        """A host update on the training thread, once every accumulation issued has landed."""
        run = self.run
        accumulated = run.link.accumulation()
        if accumulated is not None:
            run.link.wait(accumulated)
        mine = {i: counts[i] for i in run.shard.mine(counts)}
        result = run.host.update(
            self.buf, mine, self.hyperparams(), max_norm, run.link.copy_out_guard(), last=last,
            sum_over_ranks=self._sum_over_ranks(max_norm),
            sums=self.sums.for_update(mine, self.buf, max_norm is not None), step=self._host_step(),
        )
        self.sums.updated()  # (the sums staying on the device: the update has fetched them)
        run.telemetry.host_update(result["seconds"], waited=True)

    def warmup(self, active: list[int], *, scale: float, max_norm: float | None, fuse_min_numel: int | None) -> None:
        """ZeRO-Offload: every parameter gets a synchronous host step of the rule, then all of it is copied back."""
        last = self.add(active, scale=scale, fuse_min_numel=fuse_min_numel)
        self.sums.cross(self.run.shard.mine(active), self.buf)  # (device sums in memory cross at once)
        self.sync_update(self._divisors(self._take_counts(active)), last, max_norm)
        self.write_back(active)  # nothing is selected during warm-up: whole parameters

    def boundary(self, max_norm: float | None, last: dict | None = None) -> None:
        """An update boundary: run the rule's host update now (sync) or hand it to the worker (overlap). ``last``:
        gradients of this step not yet added (synchronous CPU runs fold them in)."""
        run = self.run
        matrices = [i for i, p in enumerate(run.params) if p.dim() == 2]
        if self.overlap:
            self.drain()  # the previous interval's update is done with its accumulation buffer
        # device sums in memory cross to the host now, once (into the one accumulation buffer: the update that read
        # it last has just been drained)
        self.sums.cross([i for i in run.shard.mine(matrices) if self.counted(i)], self.buf)
        counts = self._divisors(self._take_counts(matrices))
        if not self.overlap:
            self.sync_update(counts, last or {}, max_norm)
            self.write_back(list(counts))
            return
        mine = {i: counts[i] for i in run.shard.mine(counts)}
        # the sums staying on the device are final now: their fetches (read in the background; the next interval
        # uses the other buffer) wait for this point, not behind the write-back's copies, which go the other way
        sums = self.sums.for_update(mine, self.buf, max_norm is not None)
        self.write_back(self.pending)  # the previous interval's result lands now
        accumulated, guard = run.link.accumulation(), run.link.copy_out_guard()
        hyperparams, buf, host, shard, step = self.hyperparams(), self.buf, run.host, run.shard, self._host_step()
        ranks_sum, dtypes = self._sum_over_ranks(max_norm), {i: run.params[i].dtype for i in counts}

        def job():
            if accumulated is not None:
                accumulated.wait()
            result = host.update(buf, mine, hyperparams, max_norm, wait_before_write=guard, sum_over_ranks=ranks_sum,
                                 sums=sums, step=step)
            # ZeRO: the owners' results start towards the replicas now, behind training
            result["exchange"] = shard.start_exchange(host, list(counts), dtypes)
            return result

        self.inflight = run.link.submit_update(job)
        self.pending = list(counts)
        # the next interval adds into the other buffer (device sums in memory: there is one)
        self.buf = (self.buf + 1) % len(self.counts)

    def drain(self) -> None:
        """Wait for the in-flight host update, if any (the wait counts as stall)."""
        if self.inflight is not None:
            job, self.inflight = self.inflight, None
            result = self.run.link.wait(job)
            self.sums.updated()
            self.run.telemetry.host_update(result["seconds"], waited=False)
            self.exchange = result.get("exchange")

    def settle(self) -> None:
        """Before the optimizer is rebuilt (a load): land nothing, let every rank's started broadcasts complete."""
        self.drain()
        exchange, self.exchange = self.exchange, None
        self.run.shard.settle(exchange)

    # -- write-back --------------------------------------------------------------------------------

    def _take_received(self, indices: list[int]) -> dict:
        """ZeRO: the other owners' results for these parameters (the exchange is consumed once; a flushed()
        context keeps them for the write-back at the boundary)."""
        if self.received is not None:
            received, self.received = self.received, None
            return received
        exchange, self.exchange = self.exchange, None  # ZeRO: the owners' results reach every replica first
        run = self.run
        return run.shard.received(exchange, run.host, indices, {i: run.params[i].dtype for i in indices}, run.link.wait)

    @torch.no_grad()
    def write_back(self, indices: list[int]) -> None:
        """Live weights <- the host copy-out buffers: the non-selected columns of each matrix with a selection, the
        whole parameter otherwise (vectors, warm-up)."""
        if not indices:
            return
        run = self.run
        others = self._take_received(indices)
        if self.unflushed is not None:  # inside flushed(): this write-back lands again at its boundary
            self.received = others
        items = []
        for i in indices:
            sel = (run.state.get(run.params[i]) or {}).get("selected")
            items.append((run.local[i], others[i] if i in others else run.host.out_view(i), sel))
        run.link.write_back(items)

    def flush(self) -> None:
        """Wait for the in-flight update and write back every pending result (kept: nothing is restored)."""
        self.drain()
        self.unflushed = None  # inside flushed(): these weights stay (the write-back below is the real one)
        self.write_back(self.pending)
        self.pending = []
        self.run.link.join()

    @torch.no_grad()
    def enter_flushed(self) -> None:
        """Parameters <- the flushed weights, keeping the live ones to restore (no-op when already inside)."""
        if self.unflushed is not None:
            return
        run = self.run
        self.drain()
        run.link.synchronize()  # the last write-back and fast step have landed in the live weights
        self.unflushed = {i: host_copy(run.local[i]) for i in self.pending}
        self.write_back(self.pending)  # (ZeRO: the owners' results are kept for the one at the boundary)
        run.link.join()

    @torch.no_grad()
    def restore(self) -> None:
        """Parameters <- the live weights kept by :meth:`enter_flushed`."""
        if self.unflushed is None:
            return
        kept, self.unflushed = self.unflushed, None
        self.run.link.join()
        for i, t in kept.items():
            self.run.local[i].copy_(t)
