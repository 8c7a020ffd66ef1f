"""What the parts of one built optimizer share (the parameters, their state, the sharding, the link, the host
shard), and reads of the host state every part may make."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import torch

from .._memory import gather_columns
from ..config import ZenFlowConfig, num_selected
from ..host import HostShard
from ..rules import UpdateRule
from ..sharding import Sharding
from .telemetry import Telemetry

__all__ = ["BuiltOptimizer"]


@dataclasses.dataclass
class BuiltOptimizer:
    """One built optimizer's shared context. ``params`` are the optimizer's parameters (the keys of ``state``),
    ``local`` the tensors the algorithm reads and writes (the parameters, or under FSDP2 this rank's rows);
    ``param_groups`` and ``state`` are the optimizer's own (live) objects."""

    params: list[torch.Tensor]
    local: list[torch.Tensor]
    group_of: list[int]
    param_groups: list[dict]
    state: dict
    config: ZenFlowConfig
    device: torch.device
    shard: Sharding
    link: Any
    host: HostShard
    telemetry: Telemetry
    cores: dict  # {"train": CPUs, "host": CPUs, "why": ...}: training's and the host worker's (build.split_cores)
    torch_threads: int | None  # training's torch thread count before the build changed it (None: unchanged)
    host_params: frozenset  # the parameters with host state, on some rank (build.trained): the others are frozen
    rule: UpdateRule  # the update rule (rules): the names of its per-element state, its step and kernels
    t: int = 0  # the optimizer's step number (steps taken before this one), set by step() before the parts run
    name: str = "ZenFlow"  # what messages call the optimizer: ZenFlowAdamW, ZenFlow(Lion), ... (build.display_name)

    def setting(self, i: int, name: str):
        """Parameter ``i``'s ``topk_ratio`` or ``importance``: its param group's, else the optimizer's."""
        return self.param_groups[self.group_of[i]].get(name, getattr(self.config, name))

    def topk(self, i: int) -> int:
        """Matrix ``i``'s number of selected columns (its ``topk_ratio`` of its columns)."""
        return num_selected(self.setting(i, "topk_ratio"), self.params[i].shape[1])

    def fast_state(self, i: int) -> MappingProxyType:
        """Parameter ``i``'s ``state`` entry (the fast path's rule state, its selected columns, the auto vote), read
        only: :meth:`set_state` and :meth:`replace_state` are its only writers."""
        return MappingProxyType(self.state[self.params[i]])

    def set_state(self, i: int, **entries) -> None:
        """Write ``entries`` into parameter ``i``'s ``state`` entry: the one way the parts (selection's column moves
        and votes, the fast path's vectors and step counts) change it, so that what it holds is said here."""
        self.state[self.params[i]].update(entries)

    def count_vector_steps(self, states: list[dict]) -> None:
        """One more fast-path step for each of ``states``, vectors' ``state`` entries (their ``step`` is an int; a
        matrix's per-column counts are a tensor the fast path advances in place). One call a step instead of a
        :meth:`set_state` per vector: that was a tenth of ``step()``'s Python at 600 tensors."""
        for st in states:
            st["step"] += 1

    def replace_state(self, i: int, entries: dict) -> None:
        """Parameter ``i``'s ``state`` entry becomes ``entries`` (a checkpoint's, restored)."""
        self.state[self.params[i]] = entries

    def from_host(self, i: int, name: str, cols: torch.Tensor | None = None, transient: bool = False) -> torch.Tensor:
        """A copy of parameter ``i``'s host ``master`` or rule state field ``name`` (fp32, parameter shape;
        ``cols``: those columns only), on the device. ZeRO: its owner broadcasts it. ``transient``: a
        temporary (the columns are gathered into transient memory where it is made: see _memory)."""
        host, p = self.host, self.local[i]

        def make():
            t = host.field(name, i)
            if cols is None:
                return t.clone()
            return gather_columns(t, cols.cpu()) if transient else t[:, cols.cpu()]

        shape = tuple(p.shape) if cols is None else (p.shape[0], cols.numel())
        return self.shard.from_host(i, make, shape, torch.float32)

    def host_step(self, i: int) -> int:
        """Parameter ``i``'s host step count (ZeRO: its owner's)."""
        make = lambda: torch.tensor([self.host.host_step[i]])  # noqa: E731
        return int(self.shard.from_host(i, make, (1,), torch.int64))
