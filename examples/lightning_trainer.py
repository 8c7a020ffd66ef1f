"""ZenFlowAdamW under Lightning: ``configure_optimizers`` returns it, ZenFlowCallback keeps checkpoints current.

    pip install lightning                          # or: pip install -e ".[integrations]"
    python examples/lightning_trainer.py           # a few seconds on CPU
    python examples/lightning_trainer.py --steps 8 # shorter (the test suite runs it like this)
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.integrations.lightning import ZenFlowCallback


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        # no steps_per_epoch here: ZenFlowCallback hands it over once Lightning knows the loader's length
        return ZenFlowAdamW(self.parameters(), lr=3e-3, zenflow=dict(topk_ratio=0.1, update_interval=4,
                                                                     overlap_step=True, select_strategy="epoch",
                                                                     select_interval=1))


def data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 8, generator=torch.Generator().manual_seed(99)))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    out = tempfile.mkdtemp()
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ZenFlowCallback(), ModelCheckpoint(dirpath=out, save_last=True)],
    )
    module = Regression()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*never re-selected.*")  # the callback gives the epoch length
        trainer.fit(module, data(256, 0), data(64, 1))
    opt = trainer.optimizers[0]
    (metrics,) = trainer.validate(module, data(64, 1), verbose=False)  # flushed weights, as in the checkpoint
    print(f"val loss {metrics['val_loss']:.4f} after {args.steps} steps; ZenFlow re-selects every "
          f"{opt.schedule.select_interval} steps (one epoch); checkpoint {trainer.checkpoint_callback.last_model_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
