"""One rank of the ZeRO-1 near-tie test (tests/test_score_determinism.py starts one process per rank).

    python tests/score_determinism_worker.py OUT_DIR      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Runs ZenFlowAdamW with ZeRO-1 on the Triton kernels (TRITON_INTERPRET=1 on CPU tensors), this rank
forced onto its own config of the multi-tensor column-score kernel, as two processes whose autotuners
chose differently would be. Every step feeds the same gradient, which holds a near-tie at the selection
boundary (``near_tie_grad``). Saves this rank's selection after every step, and every rank's selections
gathered over gloo, to OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero_worker import HYPER, run_rank  # noqa: E402  (the ZeRO tests' AdamW numbers, a rank's process)

from zenflow_kernels import ZenFlowAdamW  # noqa: E402
from zenflow_kernels.ops import use_backend  # noqa: E402

R, C = 96, 16
BIG = (0, 1, 2)  # always selected
TIE = (5, 9)  # exactly one of them makes the top k = 4
STEPS = 4  # warm-up at t = 0, a selection at every later step
ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=1, update_interval=1, full_warm_up_rounds=1)


def near_tie_grad(seed: int = 0) -> torch.Tensor:
    """[R, C]: three large columns, small noise elsewhere, and columns TIE[0], TIE[1] holding the same
    values in reverse row order: equal sums in exact arithmetic, so their fp32 sums differ only through
    the order of the additions (within a few ulp). With seed 0, the column-score kernel that summed in
    tile-shaped order (rows folded by BLOCK_R, then a layout-dependent tree) ranked them differently under
    configs 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.rand(R, C, generator=gen) * 0.1
    g[:, list(BIG)] += 3.0
    v = torch.randn(R, generator=gen)
    g[:, TIE[0]] = v
    g[:, TIE[1]] = v.flip(0)
    return g


def near_tie_rank(rank: int, world: int, out_dir: Path) -> None:
    from zenflow_kernels.triton import column_scores as cs
    from zenflow_kernels.triton._util import force_config

    # two matrices, so that each rank owns one host shard
    params = [torch.nn.Parameter(torch.zeros(R, C)) for _ in range(2)]
    grad = near_tie_grad()
    selections = []
    kernel = cs._multi_column_scores_kernel
    with use_backend("triton"), force_config(kernel, rank) as config, ZenFlowAdamW(
            params, **HYPER, zenflow=ZEN, zero_stage=1, collective_timeout=60.0) as opt:
        for _ in range(STEPS):
            for p in params:
                p.grad = grad.clone()
            opt.step()
            selections.append([opt.state[p]["selected"].tolist() if "selected" in opt.state[p] else None
                               for p in params])
        opt.flush()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, selections)
    torch.save(dict(config=str(config), selections=selections, gathered=gathered), out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    sys.exit(run_rank(near_tie_rank, Path(sys.argv[1])))
