"""Timed collectives over ``torch.distributed`` for ZeRO and FSDP2: groups of their own, a timeout, chaos
delays, errors naming the rank, the collective and what it carried (:class:`Collectives`)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..device_model import Chaos, Delays

__all__ = ["Collectives", "ZeroCollectiveError", "world_of"]


class ZeroCollectiveError(RuntimeError):
    """A collective failed or timed out (another rank failed, hung or left)."""


def world_of(process_group, name: str) -> int:
    """The number of ranks the optimizer (``name``, for the message) partitions over: 1 without
    ``torch.distributed``."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError(f"{name}: process_group was given but torch.distributed is not initialised")
        return 1
    return dist.get_world_size(process_group)



class Collectives:
    """Timed collectives over the ranks of ``process_group`` on groups of their own: the training
    thread's, a gloo group for the host worker (two threads never interleave calls on one group) and a
    gloo group for small per-step checks. Each waits at most ``timeout`` seconds and raises
    :class:`ZeroCollectiveError` naming this rank, the collective and what it carried; bytes are counted
    per kind.

    Args:
        process_group: the group to run over (None: the default group).
        timeout: seconds any one collective may take.
        chaos: ``testing.chaos`` settings: each rank sleeps a seeded random time (its own sequence) before
            starting each collective, so the ranks arrive out of step and an asynchronous collective
            completes late: a result read before its wait then differs on CPU.
        name: the optimizer as built, for messages (``ZenFlowAdamW``, ``ZenFlow(Lion)``).
        partition: the ranks of every group of a partition of the world, ``process_group``'s among them
            (HSDP: each replica's shard group). ``dist.new_group`` is collective over every rank of the world,
            so every rank creates every group of the partition, in the same order, and keeps its own.

    Every rank of ``process_group`` (with ``partition``: every rank of the world) must create it at the same
    point: creating its groups is collective.
    """

    def __init__(self, *, process_group, timeout: float, name: str, chaos: Chaos | None = None,
                 partition: Sequence[Sequence[int]] | None = None):
        self.name = name
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.timeout = timeout
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        every = None if partition is None else [sorted(int(r) for r in group) for group in partition]
        if every is not None and (ranks is None or sorted(ranks) not in every):
            raise ValueError(f"{name}: ranks {ranks} are not one of the groups {every}")
        self.where = "" if every is None else f" (of global ranks {sorted(ranks)})"
        delta = datetime.timedelta(seconds=timeout)

        def own(**kwargs):
            if every is None:
                return dist.new_group(ranks, timeout=delta, **kwargs)
            mine = None
            for group in every:  # every rank creates every group, in the same order
                made = dist.new_group(group, timeout=delta, **kwargs)
                if group == sorted(ranks):
                    mine = made
            return mine

        self._train = own()
        self._host = own(backend="gloo")
        # stage 2 checks which gradients exist while reductions the hooks started are in flight on _train
        self._meta = own(backend="gloo")
        self.bytes: dict[str, int] = {}
        self.failed = False  # a collective failed: the ranks are out of step, no further collective
        # one delay sequence per rank (with a partition, per rank of the world: HSDP's replicas draw their own)
        # and per calling thread (training thread, host worker)
        self._delays = None
        if chaos is not None and chaos.max_delay > 0:
            seed_rank = self.rank if every is None else dist.get_rank()
            self._delays = {name: Delays(Chaos(seed=chaos.seed * 7919 + 2 * seed_rank + k, max_delay=chaos.max_delay))
                            for k, name in enumerate(("train", "host"))}

    # -- one collective ----------------------------------------------------------------------------

    def _fail(self, kind: str, op: str, nbytes: int, exc: Exception) -> ZeroCollectiveError:
        self.failed = True
        return ZeroCollectiveError(
            f"{self.name} rank {self.rank} of {self.world}{self.where}: {op} of {kind} ({nbytes} bytes) failed or "
            f"took longer than {self.timeout:g} s; another rank probably failed or stopped calling step() "
            f"({type(exc).__name__}: {exc})"
        )

    def start(self, kind: str, op: str, tensor: torch.Tensor, call, *, host: bool = False, group=None) -> tuple:
        """Start a collective (``call()`` returns its work on ``group``, default the training group);
        :meth:`finish` waits for it. ``host``: it runs on the host worker's group (and draws the host
        worker's chaos delays)."""
        group = self._host if host else (self._train if group is None else group)
        nbytes = tensor.numel() * tensor.element_size()
        if self._delays is not None:
            time.sleep(sum(self._delays["host" if host else "train"].draw()))
        try:
            work = call()
        except Exception as exc:  # gloo/NCCL raise RuntimeError (or DistBackendError) for a dead peer
            raise self._fail(kind, op, nbytes, exc) from exc
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        return (work, kind, op, nbytes, dist.get_backend(group) == "nccl")

    def finish(self, handle: tuple) -> None:
        work, kind, op, nbytes, nccl = handle
        try:
            if nccl:
                # Work.wait(timeout) on NCCL polls a CPU core until the collective completes; without one it
                # orders the current stream after it (no host wait) and the group's own timeout (given at
                # new_group) ends a hung collective through NCCL's watchdog
                work.wait()
            else:  # gloo: a blocking wait, bounded here
                work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as exc:
            raise self._fail(kind, op, nbytes, exc) from exc

    def _run(self, kind: str, op: str, tensor: torch.Tensor, call, *, host: bool = False, group=None) -> None:
        self.finish(self.start(kind, op, tensor, call, host=host, group=group))

    def all_reduce_(self, tensor: torch.Tensor, kind: str, *, host: bool = False) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (``host``: on the host worker's group)."""
        group = self._host if host else self._train
        self._run(kind, "all_reduce", tensor, lambda: dist.all_reduce(tensor, group=group, async_op=True), host=host)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int, kind: str) -> torch.Tensor:
        """``tensor`` <- rank ``src``'s (``src`` is a rank of the partitioned group)."""
        src_global = dist.get_global_rank(self._train, src)
        self._run(kind, "broadcast", tensor,
                  lambda: dist.broadcast(tensor, src=src_global, group=self._train, async_op=True))
        return tensor

    @property
    def train_group(self):
        """The group the training ranks' own collectives run on (the gradients' reductions)."""
        return self._train

    # -- what the optimizer asks for ---------------------------------------------------------------

    def check_presence(self, active: Sequence[int], num_params: int,
                       flags: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every rank must have a gradient for the same parameters: one missing on some rank would leave
        the ranks' collectives mismatched. One all-reduce of an int32 per parameter (its own group), which also
        carries ``flags`` (int32, this rank's votes on the step: ZeRO-2's buckets to send again, a loop to
        refuse), so the ranks decide together; returns the flags summed over the ranks (None without)."""
        mask = torch.zeros(num_params + (0 if flags is None else flags.numel()), dtype=torch.int32)
        mask[list(active)] = 1
        if flags is not None:
            mask[num_params:] = flags
        group = self._meta
        self._run("gradient presence", "all_reduce", mask, lambda: dist.all_reduce(mask, group=group, async_op=True),
                  group=group)
        bad = ((mask[:num_params] != 0) & (mask[:num_params] != self.world)).nonzero().flatten().tolist()
        if bad:
            self.failed = True
            raise ValueError(
                f"{self.name} rank {self.rank}: parameters {bad[:8]} have a gradient on some ranks and not on "
                "others; under ZeRO every rank must produce a gradient for the same parameters each step "
                "(set unused parameters' .grad to zeros, or to None on every rank)"
            )
        return None if flags is None else mask[num_params:]

    def average_(self, grads: Sequence[torch.Tensor], kind: str) -> None:
        """Average these tensors over the ranks, in place: one flat all-reduce per dtype."""
        self.sum_(grads, kind, divide=True)

    def sum_(self, tensors: Sequence[torch.Tensor], kind: str, *, divide: bool = False) -> None:
        """Sum (``divide``: average) these tensors over the ranks, in place: one flat all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(same)
            self.all_reduce_(flat, kind)
            if divide:
                flat.div_(self.world)
            for t, total in zip(same, torch._utils._unflatten_dense_tensors(flat, same), strict=True):
                t.copy_(total)

    def sum_host(self, value: float) -> float:
        """A float summed over the ranks, from the host worker (the clipping norm's squares)."""
        t = torch.tensor([value], dtype=torch.float64)
        return float(self.all_reduce_(t, "clipping norm", host=True))
