"""How the ranks hold gradients and host state: the seam between ZenFlow's algorithm and data parallelism
(docs/design.md, "The seam").

``optim/`` holds the algorithm once. What differs between one process, ZeRO-1, ZeRO-2 and FSDP2 is
behind :class:`Sharding`: which parameters this rank's host shard holds, where a step's (averaged)
gradient of a parameter comes from, and how column scores, the selected columns' gradients, the
gradient norm, host state and the write-back cross ranks. One process is the base class itself.

=================  =============  ======================  ===================  ===========================
                   one process    ZeRO-1                  ZeRO-2               FSDP2 (fsdp2.py)
=================  =============  ======================  ===================  ===========================
host shard         every param    own run of params       own run of params    every param's local rows
step's gradient    ``.grad``      ``.grad`` all-reduced   owner: reduced from  FSDP2's reduce-scattered
                                  (averaged)              backward hooks       local shard
column scores      local          local (same on every    owner's, all-reduced partial (local rows),
                                  rank)                                        all-reduced (summed)
selected columns'  ``.grad``      ``.grad``               owners' summed        local rows, no collective
gradients
gradient norm      local          local                   all-reduced          all-reduced
host state         local          broadcast by its owner  broadcast by owner   local
write-back         local          owners broadcast        owners broadcast     local (FSDP2 all-gathers)
=================  =============  ======================  ===================  ===========================

FSDP2 covers HSDP too (``fully_shard`` on a 2-D replicate x shard mesh): the same, with every collective over
the shard dimension only (the replicas hold the same gradients and identical copies of the host state).

Modules, each importing only those above it: ``base`` (:class:`Sharding`, one process), ``collectives``
(timed collectives shared by ZeRO and FSDP2), ``zero_context`` (ZeRO's ownership, exchanges and buckets),
``zero`` (:class:`Zero1`, :class:`Zero2`), ``fsdp2`` (:class:`FSDP2`). ``optim/`` imports this package;
nothing here imports ``optim/``.
"""

from __future__ import annotations

from .base import Sharding, column_scores, is_dtensor, sum_of_squares
from .collectives import Collectives, ZeroCollectiveError, world_of
from .fsdp2 import FSDP2, fsdp2_mesh
from .zero import Zero1, Zero2

__all__ = [
    "FSDP2", "Collectives", "Sharding", "Zero1", "Zero2", "ZeroCollectiveError", "column_scores", "fsdp2_mesh",
    "is_dtensor", "sum_of_squares", "world_of",
]
