"""``ZenFlowCallback`` for the Hugging Face ``Trainer`` (transformers is imported here, not by the package).

Usage::

    trainer = Trainer(model, args, train_dataset=..., optimizers=(ZenFlowAdamW(model.parameters(), ...), None),
                      callbacks=[ZenFlowCallback()])
    # or optimizer_cls_and_kwargs=(ZenFlowAdamW, dict(lr=..., zenflow=...))

What it does, and why: the Trainer clips gradients in place after every backward (``max_grad_norm``, 1.0 by
default), or rescales them by 1 only to log their norm (``max_grad_norm=0``), and with ``fp16=True`` unscales
them in place first. Each rewrites every gradient after backward's hooks copied it to the host, so they would
cross again at ``step()``, after backward (exact, but the stall ZenFlow removes). The callback routes the
Trainer's clipping into the optimizer's own (``ZenFlowAdamW.clip_grad_norm_``: the global norm, applied in the
fast path's kernel and the host update, as ``max_grad_norm`` does; docs/huggingface.md says how that differs from
clipping ``.grad``), which returns the gradient norm the Trainer logs, and GradScaler then unscales inside the
optimizer: gradients cross during backward. (It finds the Trainer from the call of ``on_train_begin``, and
replaces ``trainer.accelerator.clip_grad_norm_`` for the length of ``train()``; where it cannot, it says so and
the Trainer clips as before.) With ``gradient_accumulation_steps > 1`` it lets the optimizer read, at every
backward, whether that micro-batch is the last before the optimizer step (the Trainer sets accelerate's
``GradientState.sync_gradients`` before each one), so gradients are not copied to the host during the others
(``ZenFlowAdamW.set_requires_gradient_sync``). The Trainer saves checkpoints
(``checkpoint-N/model.safetensors``)
and evaluates right after an optimizer step, and nothing in it knows that ZenFlow's non-selected columns are
written back one interval late, so it would save and evaluate weights up to ``update_interval`` steps stale.
Whenever the Trainer is about to save or evaluate (``on_step_end`` / ``on_epoch_end``: the default flow
callback has decided by then) the callback gives the parameters the flushed weights
(``ZenFlowAdamW.flushed()``), and gives back the weights training continues from, bit for bit, after the save
(``on_save``), after an evaluation not followed by a save (``on_evaluate``), or at the latest before the next
step's first forward (``on_step_begin`` / ``on_epoch_begin``): how often a run saves or evaluates does not
change it, and its optimizer checkpoint resumes it exactly. An evaluation runs on its own random-number state
(``isolated_rng=True``, the default): the generators are put back in ``on_evaluate``, before a checkpoint
records them, since the evaluation's data loader draws from torch's global generator and, with dropout, any
optimizer's run would otherwise depend on how often it evaluates. At the last step it flushes for good (the end of
training: before the Trainer loads a best model, if asked to), closes the optimizer at the end
(``trainer.save_model()`` afterwards saves current weights), and at the start of training gives it the epoch
length in optimizer steps, ``ceil(len(train_dataloader) / gradient_accumulation_steps)``, when it was built
without one. A closed optimizer cannot step again: a second
``trainer.train()`` needs a new one.
"""

from __future__ import annotations

import sys
import warnings

from transformers import Trainer, TrainerCallback

from . import RandomState, find_zenflow, give_epoch_length

__all__ = ["ZenFlowCallback"]


class ZenFlowCallback(TrainerCallback):
    """Save and evaluate ZenFlowAdamW's flushed weights without changing the run, flush and close it at the end
    of training, and give it the epoch length (see the module docstring)."""

    def _optimizer(self, kwargs):
        opt = find_zenflow(kwargs.get("optimizer"))
        if opt is None and kwargs.get("optimizer") is not None and not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn("ZenFlowCallback: the Trainer's optimizer is not a ZenFlow optimizer (ZenFlowAdamW, or "
                          "ZenFlow with an update rule); the callback does nothing",
                          stacklevel=3)
        return opt

    def on_train_begin(self, args, state, control, **kwargs):
        opt = self._optimizer(kwargs)
        if opt is not None:
            self._route_clipping(opt, kwargs.get("optimizer"))
        if opt is not None and args.gradient_accumulation_steps > 1:
            from accelerate.state import GradientState

            gradients = GradientState()  # shared state: reads what the Trainer set for this micro-batch
            opt.set_requires_gradient_sync(lambda: gradients.sync_gradients)
        loader = kwargs.get("train_dataloader")
        if opt is not None and loader is not None:
            try:
                batches = len(loader)
            except TypeError:  # an iterable dataset: no epoch length to give
                batches = None
            give_epoch_length([opt], batches, args.gradient_accumulation_steps, "ZenFlowCallback")

    def __init__(self, isolated_rng: bool = True):
        self.isolated_rng = isolated_rng
        self._rng: RandomState | None = None
        self._routed = None  # the accelerator whose clip_grad_norm_ is routed into the optimizer

    def _route_clipping(self, opt, wrapped) -> None:
        """``trainer.accelerator.clip_grad_norm_`` (the Trainer's clipping, and its logged norm) becomes the
        optimizer's own for the length of ``train()``: the gradients are not rewritten, nor unscaled in place."""
        trainer = _calling_trainer(self)
        if trainer is None:
            warnings.warn("ZenFlowCallback: could not find the Trainer calling on_train_begin, so its gradient "
                          "clipping (max_grad_norm) is not routed into the optimizer: gradients are rewritten after "
                          "backward and cross to the host at step() (exact, slower)", stacklevel=3)
            return
        accelerator = trainer.accelerator
        native = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            if norm_type != 2:  # only the global L2 norm is the optimizer's
                return native(parameters, max_norm, norm_type=norm_type)
            return opt.clip_grad_norm_(max_norm)  # filled by step(); the Trainer logs it after

        accelerator.clip_grad_norm_ = clip_grad_norm_
        self._routed = accelerator

    def _unroute_clipping(self) -> None:
        if self._routed is not None:
            self._routed.__dict__.pop("clip_grad_norm_", None)
            self._routed = None

    def _before_save_or_evaluate(self, args, control, kwargs):
        if control.should_evaluate and self.isolated_rng:
            self._rng = RandomState()  # put back after the evaluation, before a checkpoint records it
        if control.should_training_stop:  # the last step: flush for good before anything reads the weights
            # (a best model loaded at the end must not get this run's pending update written over it)
            opt = self._optimizer(kwargs)
            if opt is not None:
                opt.hold_flushed(False)
                opt.flush()
        elif control.should_save or control.should_evaluate:
            opt = self._optimizer(kwargs)
            if opt is not None:
                opt.hold_flushed(True)

    def _restore(self, kwargs):
        opt = find_zenflow(kwargs.get("optimizer"))
        if opt is not None:
            opt.hold_flushed(False)

    def on_step_end(self, args, state, control, **kwargs):
        self._before_save_or_evaluate(args, control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._before_save_or_evaluate(args, control, kwargs)

    def on_save(self, args, state, control, **kwargs):
        self._restore(kwargs)

    def on_evaluate(self, args, state, control, **kwargs):
        if self._rng is not None:
            self._rng, rng = None, self._rng
            rng.restore()
        # a save may follow (should_save already set, or save_strategy="best" deciding from these metrics):
        # on_save, or the next step's start, restores then
        if not control.should_save and str(getattr(args.save_strategy, "value", args.save_strategy)) != "best":
            self._restore(kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._restore(kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._restore(kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._unroute_clipping()
        opt = self._optimizer(kwargs)
        if opt is not None:
            opt.set_requires_gradient_sync(True)
            opt.hold_flushed(False)
            opt.flush()
            opt.close()


def _calling_trainer(callback) -> Trainer | None:
    """The ``Trainer`` whose ``callback_handler`` is calling ``callback`` now (found on the call stack: a callback
    is not given its Trainer), or None."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
            return owner
        frame = frame.f_back
    return None
