"""When a step's gradients cross to the host during backward (docs/design.md section 5.1): the policy.

The link moves gradients (``AsyncLink.stage`` copies one into the landing area from its backward hook, with its
fingerprint; ``step()`` checks each against its fingerprint and copies again whatever changed). Correctness does
not depend on anything here: whatever happens to a gradient between its hook and ``step()``, the host sums get
what ``step()`` sees. What this object decides is only *whether copying from a hook is worth it*, which costs
bytes over PCIe (and a fingerprint on the device) when the copy will be replaced:

* Declared micro-batches (``ZenFlowAdamW.no_sync()`` / ``set_requires_gradient_sync(False)``, the integrations):
  hooks of a backward a later one still adds to copy nothing.
* Undeclared micro-batches: a step's hooks fire once per backward. The number of backward passes of the last
  step is learned, and a hook copies from that firing on (the last micro-batch's), so the earlier ones cross
  nothing; a step with fewer (the short last step of an epoch) copies its gradients at ``step()``.
* Gradients rewritten between backward and ``step()`` (clipping or unscaling in place): a step where most of
  the bytes hooks copied had to be copied again is wasted work; after ``REWRITES_BEFORE_OFF`` such steps in a
  row, hooks stop copying for the run (``mode`` "off"): gradients then cross at ``step()``. Occasional changes
  (a repaired NaN, clipping on a spike) leave it on.

A batch skipped with ``zero_grad()`` before ``step()`` or a skipped step leaves the mode as it is.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator

__all__ = ["HandOver", "grad_ready_hook", "handover_mode"]


class HandOver:
    """Whether backward's hooks copy gradients to the host (``mode`` "on"/"off", and ``why``), and at which
    firing of a step's hooks."""

    REWRITES_BEFORE_OFF = 3
    """Steps in a row in which most of what the hooks copied had to be copied again before hooks stop copying."""

    def __init__(self, mode: str, why: str):
        self.mode, self.why = mode, why
        self.requires_sync = True  # set_requires_gradient_sync / no_sync: False while a later backward still adds
        self.sync_source: Callable[[], bool] | None = None  # an integration's "is this backward the last?"
        self.backwards = 1  # backward passes per step, learned from the last step
        self._fires: dict[int, int] = {}  # parameter -> its hook's final firings since the last step
        self._rewrites = 0

    def declare(self, requires_sync) -> None:
        """``ZenFlowAdamW.set_requires_gradient_sync``: True, False, or a callable answering it at each backward."""
        if isinstance(requires_sync, bool):
            self.requires_sync, self.sync_source = requires_sync, None
        elif callable(requires_sync):
            self.requires_sync, self.sync_source = True, requires_sync
        else:
            raise TypeError(f"ZenFlowAdamW.set_requires_gradient_sync: requires_gradient_sync={requires_sync!r} is "
                            "invalid: allowed True, False or a callable returning one")

    @contextlib.contextmanager
    def not_final(self) -> Iterator[None]:
        """``ZenFlowAdamW.no_sync``: the backward passes of the block are not the last before ``step()``."""
        before, self.requires_sync = self.requires_sync, False
        try:
            yield
        finally:
            self.requires_sync = before

    def final(self) -> bool:
        """The backward running now is, as declared, the last before ``step()``."""
        return self.requires_sync and (self.sync_source is None or self.sync_source())

    def copy_now(self, i: int) -> bool:
        """Parameter ``i``'s hook fired in a final backward: whether to copy its gradient now (from the learned
        last firing of the step on; a later firing copies again, over it)."""
        n = self._fires[i] = self._fires.get(i, 0) + 1
        return self.mode == "on" and n >= self.backwards

    @property
    def fired(self) -> bool:
        """A hook fired since the last step (a ``zero_grad()`` now skips that batch)."""
        return bool(self._fires)

    def skipped(self) -> None:
        """The batch was dropped before ``step()`` (``zero_grad()``): nothing to learn from it."""
        self._fires.clear()

    def stepped(self, t: int, copied: int, unused: int) -> None:
        """Step ``t`` consumed (or skipped) the gradients: learn its backward count, and whether the hooks'
        copies were worth it (``copied`` bytes from hooks, ``unused`` of them: copied again or dropped)."""
        if self._fires:
            self.backwards = max(self._fires.values())
        self._fires.clear()
        if copied == 0:
            return
        self._rewrites = self._rewrites + 1 if 2 * unused > copied else 0
        if self.mode == "on" and self._rewrites >= self.REWRITES_BEFORE_OFF:
            self.mode = "off"
            self.why = (f"step {t}: gradients were rewritten between backward and step() in "
                        f"{self.REWRITES_BEFORE_OFF} steps in a row (clipping or unscaling in place): they cross "
                        "at step(); clip with max_grad_norm or opt.clip_grad_norm_() and let GradScaler unscale "
                        "inside the optimizer to keep them crossing during backward (docs/custom-loop.md)")


def handover_mode(link, shard, device_accumulation: bool, early: bool) -> tuple[str, str]:
    """Whether a run's gradients cross from backward's hooks (``"on"``/``"off"``), and why: where the link is
    asynchronous, the step's gradient is final at backward (ZeRO-1 averages it in ``step()``) and crosses at every
    step (not summed on the device); ``early``: the ablation switch (``ablations.early_handover``)."""
    copies = link.asynchronous and shard.final_at_backward and not device_accumulation
    why = ("ZeRO-2 reduces gradients to their owners first" if shard.consumes_hooks else
           "a synchronous link (nothing to overlap)" if not link.asynchronous else
           "ZeRO-1 averages gradients in step()" if not shard.final_at_backward else
           "device_accumulation: gradients are summed on the device and cross once per update"
           if device_accumulation else
           "ablations.early_handover is False" if not early else
           "gradients cross from backward's hooks (each checked at step() against its fingerprint)")
    return ("on" if copies and early else "off"), why


def grad_ready_hook(method: weakref.WeakMethod, i: int):
    """Parameter ``i``'s post-accumulate-grad hook: calls ``method(i)`` (the optimizer's, weakly held: the hook
    must not keep it alive) once backward has finished the gradient."""

    def hook(p) -> None:
        autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # (imported by whoever enables it)
        if autograd is not None and autograd.in_compiled_autograd_region:
            raise RuntimeError(
                "ZenFlowAdamW: a backward traced by compiled autograd (torch._dynamo.config.compiled_autograd) is "
                "not supported: the optimizer's gradient hooks copy to the host and keep books in Python, which a "
                "graph cannot hold. Run backward eagerly; torch.compile(model) still compiles forward and backward")
        ready = method()
        if ready is not None:
            ready(i)

    return hook
