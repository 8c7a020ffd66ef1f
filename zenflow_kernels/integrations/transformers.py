"""``ZenFlowCallback`` for the Hugging Face ``Trainer`` (transformers is imported here, not by the package).

Usage::

    trainer = Trainer(model, args, train_dataset=..., optimizers=(ZenFlowAdamW(model.parameters(), ...), None),
                      callbacks=[ZenFlowCallback()])
    # or optimizer_cls_and_kwargs=(ZenFlowAdamW, dict(lr=..., zenflow=...))

What it does, and why: with ``gradient_accumulation_steps > 1`` it lets the optimizer read, at every backward,
whether that micro-batch is the last before the optimizer step (the Trainer sets accelerate's
``GradientState.sync_gradients`` before each one), so gradients are not copied to the host during the others
(``ZenFlowAdamW.set_requires_gradient_sync``). The Trainer saves checkpoints
(``checkpoint-N/model.safetensors``) and evaluates right after an optimizer step, and nothing in it knows that
ZenFlow's non-selected columns are written back one interval late, so it would save and evaluate weights up to
``update_interval`` steps stale. The callback flushes the optimizer in ``on_step_end`` / ``on_epoch_end``
whenever the Trainer is about to save or evaluate (the default flow callback has decided by then), flushes and
closes it at the end of training (``trainer.save_model()`` afterwards saves current weights), and at the start
of training gives it the epoch length in optimizer steps, ``ceil(len(train_dataloader) /
gradient_accumulation_steps)``, when it was built without one. A closed optimizer cannot step again: a second
``trainer.train()`` needs a new one.
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from . import find_zenflow, give_epoch_length

__all__ = ["ZenFlowCallback"]


class ZenFlowCallback(TrainerCallback):
    """Flush ZenFlowAdamW before every save and evaluation and at the end of training, close it at the
    end, and give it the epoch length (see the module docstring)."""

    def _optimizer(self, kwargs):
        opt = find_zenflow(kwargs.get("optimizer"))
        if opt is None and kwargs.get("optimizer") is not None and not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn("ZenFlowCallback: the Trainer's optimizer is not a ZenFlowAdamW; the callback does nothing",
                          stacklevel=3)
        return opt

    def on_train_begin(self, args, state, control, **kwargs):
        opt = self._optimizer(kwargs)
        if opt is not None and args.gradient_accumulation_steps > 1:
            from accelerate.state import GradientState

            gradients = GradientState()  # shared state: reads what the Trainer set for this micro-batch
            opt._sync_source = lambda: gradients.sync_gradients
        loader = kwargs.get("train_dataloader")
        if opt is not None and loader is not None:
            try:
                batches = len(loader)
            except TypeError:  # an iterable dataset: no epoch length to give
                batches = None
            give_epoch_length([opt], batches, args.gradient_accumulation_steps, "ZenFlowCallback")

    def _flush_if_needed(self, control, kwargs):
        if control.should_save or control.should_evaluate:
            opt = self._optimizer(kwargs)
            if opt is not None:
                opt.flush()

    def on_step_end(self, args, state, control, **kwargs):
        self._flush_if_needed(control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._flush_if_needed(control, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        opt = self._optimizer(kwargs)
        if opt is not None:
            opt._sync_source = None
            opt.flush()
            opt.close()
