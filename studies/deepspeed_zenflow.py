"""DeepSpeed's own ZenFlow on a tiny model, recorded: the oracle of ``semantics="deepspeed"`` (docs/deepspeed.md).

Runs DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, one process over gloo, ZeRO stage 2, the optimizer state offloaded to
the CPU, fp32, no ``overlap_step``) on a fixed-seed MLP and batches, and writes the weights after every
``engine.step()`` (read from the module: the host's write-back and the fast update included)::

    DS_ACCELERATOR=cpu python -m studies.deepspeed_zenflow --update-interval 2 --select-interval 4 --warm-up 0 \\
        --out tests/fixtures/deepspeed/ui2_si4_w0.pt

DeepSpeed is not a dependency (``pip install torch==2.13.0``, then ``pip install --no-build-isolation
deepspeed==0.19.8``; its CPU Adam compiles on first use, a few minutes). tests/test_deepspeed_semantics.py replays
the recordings without it, and runs this script where ``deepspeed`` imports. As shipped, 0.19.8's ZenFlow does not
train correctly; two defects are repaired here by patching (docs/deepspeed.md):

(a) ``runtime/zero/stage_1_and_2.py`` ``_update_model_bit16_weights`` views each matrix's slice of the flat buffer as
    ``[out, in]`` while ZenFlow stores matrices transposed (``runtime/zenflow/zenflow_utils.py``): every weight is
    scrambled after ``deepspeed.initialize`` and after every host update;
(b) ``runtime/zenflow/zenflow_stage_1_and_2.py`` ``update_selected_channels`` skips a vector before advancing its read
    position, so each matrix is scored from a window shifted by the biases before it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import textwrap

import torch

DIMS = (24, 32, 16, 8)
BATCH = 8
DATA_SEED = 1234
MODEL_SEED = 0
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
TOPK_RATIO = 0.25


def make_model() -> torch.nn.Module:
    """Three Linear layers with biases (tanh between): matrices of 24, 32 and 16 columns, and three vectors."""
    torch.manual_seed(MODEL_SEED)
    return torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.Tanh(), torch.nn.Linear(DIMS[1], DIMS[2]),
                               torch.nn.Tanh(), torch.nn.Linear(DIMS[2], DIMS[3])).float()


def make_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (input, target) batches from one seeded generator (MSE regression onto noise)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return [(torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, DIMS[-1], generator=g))
            for _ in range(steps)]


def zenflow_block(update_interval: int, select_interval: int, warm_up: int) -> dict:
    """The ``zero_optimization.zenflow`` block of the run (ours takes it as ``zenflow=``, with ``semantics``)."""
    return dict(topk_ratio=TOPK_RATIO, select_strategy="step", select_interval=select_interval,
                update_interval=update_interval, full_warm_up_rounds=warm_up, overlap_step=False)


def repair_defects() -> None:
    """Patch DeepSpeed 0.19.8's two ZenFlow defects, (a) and (b) of the module docstring."""
    import deepspeed.runtime.zenflow.zenflow_stage_1_and_2 as zf
    import deepspeed.runtime.zero.stage_1_and_2 as s12

    unpatched = s12.DeepSpeedZeroOptimizer._update_model_bit16_weights

    def _update_model_bit16_weights(self, group_index):  # (a): a matrix's slice is stored [in, out]
        if not getattr(self, "zenflow", False):
            return unpatched(self, group_index)
        flat_group = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index],
                                   self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index], strict=True):
            flat = flat_group.narrow(0, offset, meta.numel())
            p.data = flat.view(meta.shape[1], meta.shape[0]).t().data if meta.dim() == 2 else flat.view(meta.shape).data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            new_index = self.round_robin_bit16_indices[group_index][param_index]
            param.data = self.round_robin_bit16_groups[group_index][new_index].data

    s12.DeepSpeedZeroOptimizer._update_model_bit16_weights = _update_model_bit16_weights

    # (b): advance the read position past a vector before skipping it (the first of the method's two loops)
    source = textwrap.dedent(inspect.getsource(zf.ZenFlowZeroOptimizer.update_selected_channels))
    skip = "        if len(param.shape) == 1:\n            continue\n"
    if source.count(skip) != 2:
        raise RuntimeError("update_selected_channels is not 0.19.8's: the repair of defect (b) does not apply")
    source = source.replace(skip, "        if len(param.shape) == 1:\n            curr_size += param.numel()\n"
                                  "            continue\n", 1)
    namespace: dict = {}
    exec(compile(source, zf.__file__ + ":update_selected_channels (repaired)", "exec"), zf.__dict__, namespace)
    zf.ZenFlowZeroOptimizer.update_selected_channels = namespace["update_selected_channels"]


def record(update_interval: int, select_interval: int, warm_up: int, steps: int, port: int) -> dict:
    """DeepSpeed's ZenFlow for ``steps`` steps: ``{"weights": {name: [steps, *shape]}, "losses", "config",
    "deepspeed_version", "torch_version"}``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    import deepspeed

    repair_defects()
    model = make_model()
    zen = zenflow_block(update_interval, select_interval, warm_up)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": update_interval,  # (ZenFlow sets it to update_interval anyway)
        "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": dict(HYPER, betas=list(HYPER["betas"]))},
        # one bucket for the whole model (the default, 5e8 elements, allocates 2 GB)
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 1_000_000,
                              "allgather_bucket_size": 1_000_000, "zenflow": zen},
        "steps_per_print": 10**9,
    }
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    weights: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    losses = []
    for x, y in make_batches(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        for name, p in engine.module.named_parameters():
            weights[name].append(p.detach().float().clone().contiguous())
        losses.append(float(loss))
    return dict(weights={name: torch.stack(w) for name, w in weights.items()}, losses=losses,
                config=dict(zenflow=zen, hyper=HYPER, steps=steps, ds_config=config),
                deepspeed_version=str(deepspeed.__version__), torch_version=str(torch.__version__))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--update-interval", 2), ("--select-interval", 4), ("--warm-up", 0), ("--steps", 16),
                          ("--port", 29517)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = record(args.update_interval, args.select_interval, args.warm_up, args.steps, args.port)
    torch.save(result, args.out)
    print(f"wrote {args.out} (deepspeed {result['deepspeed_version']})")


if __name__ == "__main__":
    main()
