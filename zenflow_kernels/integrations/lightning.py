"""``ZenFlowCallback`` for Lightning (``lightning.pytorch``; imported here, not by the package).

Usage::

    class Model(L.LightningModule):
        def configure_optimizers(self):
            return ZenFlowAdamW(self.parameters(), lr=..., zenflow=...)

    trainer = L.Trainer(..., callbacks=[ZenFlowCallback(), ModelCheckpoint(...)])

What it does: routes the trainer's clipping by norm (``gradient_clip_val``) into the optimizers' own
(``ZenFlowAdamW.clip_grad_norm_`` before every optimizer step, ``trainer.gradient_clip_val`` unset for the length
of ``fit``), so gradients are not rewritten after backward and keep crossing to the host during it (and, under
``precision="16-mixed"``, GradScaler unscales inside the optimizer, which Lightning otherwise refuses to combine
with clipping); before every backward, declares to every ZenFlowAdamW of the trainer whether it is a micro-batch
that a later one still adds to (``accumulate_grad_batches``; ``set_requires_gradient_sync``), so that
gradients cross to the host during the last micro-batch's backward and are not copied during the others;
gives the parameters the flushed weights (``ZenFlowAdamW.flushed()``: every host update computed so far
applied) for validation, testing and prediction (``on_*_start``) and when a checkpoint is written
(``on_save_checkpoint``: the checkpoint's model and optimizer states, collected before callbacks run, are taken
again, so the ``.ckpt`` holds the flushed weights and an optimizer state that resumes the run exactly), and
gives back the weights training continues from, bit for bit, before the next training batch
(``on_train_batch_start``); a validation inside ``fit`` runs on its own random-number state
(``isolated_rng=True``, the default: the generators as the last training batch left them are put back in
``on_validation_end``): how often a run validates or saves does not change it. It flushes and closes them
at the end of training, and at the start of training gives them the epoch length in optimizer steps,
``ceil(num_training_batches / accumulate_grad_batches)``, when they were built without one.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from .._memory import host_copy
from . import RandomState, find_zenflow, give_epoch_length

__all__ = ["ZenFlowCallback"]


def _zenflow_optimizers(trainer) -> list:
    return [z for z in (find_zenflow(o) for o in trainer.optimizers) if z is not None]


class ZenFlowCallback(Callback):
    """Flushed weights where Lightning reads them (the run unchanged), close at the end, the epoch length."""

    def on_train_start(self, trainer, pl_module) -> None:
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
        if trainer.gradient_clip_val and algorithm in (None, "norm") and _zenflow_optimizers(trainer):
            self._clip, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None
            self._trainer = trainer
        batches = trainer.num_training_batches
        batches = int(batches) if isinstance(batches, (int, float)) and batches != float("inf") else None
        give_epoch_length(_zenflow_optimizers(trainer), batches, trainer.accumulate_grad_batches, "ZenFlowCallback")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        final = not trainer.fit_loop._should_accumulate()
        for opt in _zenflow_optimizers(trainer):
            opt.set_requires_gradient_sync(final)

    def _hold(self, trainer, held: bool) -> None:
        for opt in _zenflow_optimizers(trainer):
            opt.hold_flushed(held)

    def __init__(self, isolated_rng: bool = True):
        self.isolated_rng = isolated_rng
        self._rng: RandomState | None = None
        self._clip: float | None = None  # the trainer's gradient_clip_val, routed into the optimizers
        self._trainer = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._clip is not None:
            for opt in _zenflow_optimizers(trainer):
                opt.clip_grad_norm_(self._clip)

    def _unroute_clipping(self) -> None:
        if self._trainer is not None:
            self._trainer.gradient_clip_val, self._trainer = self._clip, None
            self._clip = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._unroute_clipping()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.isolated_rng:  # (validation's data loader draws before on_validation_start: taken here)
            self._rng = RandomState()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._hold(trainer, True)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._rng is not None and getattr(trainer.state.fn, "value", None) == "fit":
            # training continues after it (and ModelCheckpoint, which runs last, records the generators)
            self._rng.restore()

    def on_test_start(self, trainer, pl_module) -> None:
        self._hold(trainer, True)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._hold(trainer, True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._hold(trainer, True)  # (already held after a validation: ModelCheckpoint saves at its end)
        # Lightning collected these before calling the callbacks: take them again, flushed; host copies of the
        # model's (its tensors are the parameters themselves, which the next batch restores, and a checkpoint
        # may be written later, by an asynchronous CheckpointIO)
        checkpoint["state_dict"] = {k: host_copy(v) if torch.is_tensor(v) else v
                                    for k, v in trainer.strategy.lightning_module_state_dict().items()}
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._hold(trainer, False)  # the weights training continues from, before this batch's forward

    def on_train_end(self, trainer, pl_module) -> None:
        self._unroute_clipping()
        for opt in _zenflow_optimizers(trainer):
            opt.set_requires_gradient_sync(True)
            opt.hold_flushed(False)
            opt.flush()
            opt.close()
