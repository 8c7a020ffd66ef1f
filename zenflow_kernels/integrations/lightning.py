"""``ZenFlowCallback`` for Lightning (``lightning.pytorch``; imported here, not by the package).

Usage::

    class Model(L.LightningModule):
        def configure_optimizers(self):
            return ZenFlowAdamW(self.parameters(), lr=..., zenflow=...)

    trainer = L.Trainer(..., callbacks=[ZenFlowCallback(), ModelCheckpoint(...)])

What it does: before every backward, declares to every ZenFlowAdamW of the trainer whether it is a micro-batch
that a later one still adds to (``accumulate_grad_batches``; ``set_requires_gradient_sync``), so that
gradients cross to the host during the last micro-batch's backward and are not copied during the others;
flushes them before validation, testing and prediction (``on_*_start``) and when a checkpoint is written
(``on_save_checkpoint``: the checkpoint's model and optimizer states, collected before callbacks run, are
taken again after the flush, so the ``.ckpt`` holds current weights), flushes and closes them at the end of
training, and at the start of training gives them the epoch length in optimizer steps,
``ceil(num_training_batches / accumulate_grad_batches)``, when they were built without one.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from . import find_zenflow, give_epoch_length

__all__ = ["ZenFlowCallback"]


def _zenflow_optimizers(trainer) -> list:
    return [z for z in (find_zenflow(o) for o in trainer.optimizers) if z is not None]


class ZenFlowCallback(Callback):
    """Flush ZenFlowAdamW where Lightning reads weights, close it at the end, give it the epoch length."""

    def on_train_start(self, trainer, pl_module) -> None:
        batches = trainer.num_training_batches
        batches = int(batches) if isinstance(batches, (int, float)) and batches != float("inf") else None
        give_epoch_length(_zenflow_optimizers(trainer), batches, trainer.accumulate_grad_batches, "ZenFlowCallback")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        final = not trainer.fit_loop._should_accumulate()
        for opt in _zenflow_optimizers(trainer):
            opt.set_requires_gradient_sync(final)

    def _flush(self, trainer) -> None:
        for opt in _zenflow_optimizers(trainer):
            opt.flush()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._flush(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._flush(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._flush(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._flush(trainer)
        # Lightning collected these before calling the callbacks: take them again, current
        checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]

    def on_train_end(self, trainer, pl_module) -> None:
        for opt in _zenflow_optimizers(trainer):
            opt.set_requires_gradient_sync(True)
            opt.flush()
            opt.close()
