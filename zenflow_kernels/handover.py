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
* Gradients changed between backward and ``step()`` (clipping or unscaling in place): a step where most of
  the bytes hooks copied changed before ``step()`` (their fingerprints differ) is wasted work; after
  ``REWRITES_BEFORE_OFF`` such steps in a row (consecutive steps: a step in between whose copies were used, or
  whose hooks copied nothing, breaks the row), hooks stop copying for the run (``mode`` "off"): gradients then
  cross at ``step()``. Occasional changes (a repaired NaN, clipping on a spike) leave it on. Copies a later
  backward's hooks copied over (undeclared micro-batches whose number varies) and copies of a dropped batch are
  not rewrites: nothing changed the gradient after its last hook.

A batch skipped with ``zero_grad()`` before ``step()`` or a skipped step leaves the mode as it is.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator

__all__ = ["GradHooks", "HandOver", "grad_ready_hook", "handover_mode", "release_hooks"]


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
        self._rewrites: list[tuple[int, int, int]] = []  # the row of rewritten steps: (step, changed, copied)
        self._rewrites_off = False  # the policy switched hooks off (rewrites), for the rest of the run

    def decide(self, mode: str, why: str) -> None:
        """The mode a build decides from the link and the sharding (:func:`handover_mode`); a mode the policy
        switched off (:meth:`stepped`) stays off when the same optimizer is built again (a reload, a new layout)."""
        if not self._rewrites_off:
            self.mode, self.why = mode, why

    def declare(self, requires_sync, where: str = "ZenFlow.set_requires_gradient_sync") -> None:
        """``ZenFlowAdamW.set_requires_gradient_sync``: True, False, or a callable answering it at each backward
        (``where``: what an error calls the method)."""
        if isinstance(requires_sync, bool):
            self.requires_sync, self.sync_source = requires_sync, None
        elif callable(requires_sync):
            self.requires_sync, self.sync_source = True, requires_sync
        else:
            raise TypeError(f"{where}: requires_gradient_sync={requires_sync!r} is "
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

    def stepped(self, t: int, copied: int, changed: int) -> None:
        """Step ``t`` consumed (or skipped) the gradients: learn its backward count, and whether the hooks'
        copies were worth it (``copied``: the bytes of each gradient's last hook copy; ``changed`` of them: gradients
        that changed after their hook, their fingerprint at ``step()`` differing from the one taken there)."""
        if self._fires:
            self.backwards = max(self._fires.values())
        self._fires.clear()
        if not (copied and 2 * changed > copied):
            self._rewrites.clear()  # a step whose copies were used (or that had none) ends the row
            return
        self._rewrites.append((t, changed, copied))
        if self.mode == "on" and len(self._rewrites) >= self.REWRITES_BEFORE_OFF:
            row = self._rewrites[-self.REWRITES_BEFORE_OFF:]
            seen = ", ".join(f"step {s}: {c} of {n} bytes" for s, c, n in row)
            self.mode, self._rewrites_off = "off", True
            self.why = (f"step {t}: gradients changed between backward and step() (their fingerprints at step() "
                        f"differed from those taken at their hooks) in {self.REWRITES_BEFORE_OFF} consecutive steps "
                        f"({seen}): clipping or unscaling in place, most likely; they cross at step() from now on. "
                        "Clip with max_grad_norm or opt.clip_grad_norm_() and let GradScaler unscale inside the "
                        "optimizer to keep them crossing during backward (docs/custom-loop.md)")


def handover_mode(link, shard, device_accumulation: bool, early: bool) -> tuple[str, str]:
    """Whether a run's gradients cross from backward's hooks (``"on"``/``"off"``), and why: where the link is
    asynchronous, the step's gradient is final at backward (ZeRO-1 averages it in ``step()``) and crosses at every
    step (not summed on the device); ``early``: the ordering switch (``orderings.early_handover``)."""
    copies = link.asynchronous and shard.final_at_backward and not device_accumulation
    why = ("ZeRO-2 reduces gradients to their owners first" if shard.consumes_hooks else
           "a synchronous link (nothing to overlap)" if not link.asynchronous else
           "ZeRO-1 averages gradients in step()" if not shard.final_at_backward else
           "device_accumulation: gradients are summed on the device and cross once per update"
           if device_accumulation else
           "orderings.early_handover is False" if not early else
           "gradients cross from backward's hooks (each checked at step() against its fingerprint)")
    return ("on" if copies and early else "off"), why


_HOOKS_OF = "_zenflow_grad_hooks"
"""The attribute naming, on a parameter, the :class:`GradHooks` whose hook it carries (a weak reference)."""


class GradHooks:
    """One optimizer's post-accumulate-grad hooks, by parameter index: only on parameters that can receive a
    gradient (``requires_grad``; torch refuses a hook on any other), added for a parameter once it can
    (:meth:`ensure`: unfrozen mid-run), removed by :meth:`remove` (``close()``, the finalizer, a reload).

    A parameter carries the hook of one optimizer at a time: the newest that hooked it. A second optimizer over the
    same parameters (the first replaced but still referenced, by its LR scheduler say, and never closed) takes the
    first's hooks off them, so the replaced one copies nothing any more (its ``step()``, if it is ever called
    again, still reads every gradient at ``step()``, and hooks them again)."""

    def __init__(self, params, ready: weakref.WeakMethod):
        self.params, self.ready = params, ready
        self.handles: dict = {}  # index -> torch's RemovableHandle
        self._index = {id(p): i for i, p in enumerate(params)}

    def ensure(self, indices) -> None:
        """Hook these parameters where not yet hooked and able to receive a gradient."""
        for i in set(indices).difference(self.handles):
            p = self.params[i]
            if not p.requires_grad:
                continue  # frozen: no gradient arrives, and torch refuses the hook
            holder = getattr(p, _HOOKS_OF, None)
            holder = holder() if holder is not None else None
            if holder is not None and holder is not self:
                holder.release(p)  # the optimizer this one replaces stops copying this parameter
            self.handles[i] = p.register_post_accumulate_grad_hook(grad_ready_hook(self.ready, i))
            setattr(p, _HOOKS_OF, weakref.ref(self))

    def release(self, p) -> None:
        """Take this optimizer's hook off parameter ``p`` (another optimizer hooks it now)."""
        i = self._index.get(id(p))
        if i is not None and i in self.handles:
            self.handles.pop(i).remove()

    def remove(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()


def release_hooks(params) -> None:
    """Take another optimizer's hooks off these parameters (a new optimizer over them replaces it from its
    construction on: the old one, if still referenced, copies nothing in the backward passes before the new one's
    first step)."""
    for p in params:
        holder = getattr(p, _HOOKS_OF, None)
        holder = holder() if holder is not None else None
        if holder is not None:
            holder.release(p)


def grad_ready_hook(method: weakref.WeakMethod, i: int):
    """Parameter ``i``'s post-accumulate-grad hook: calls ``method(i)`` (the optimizer's, weakly held: the hook
    must not keep it alive) once backward has finished the gradient."""

    def hook(p) -> None:
        autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # (imported by whoever enables it)
        if autograd is not None and autograd.in_compiled_autograd_region:
            name = getattr(getattr(method(), "__self__", None), "display_name", "ZenFlow")
            raise RuntimeError(
                f"{name}: a backward traced by compiled autograd (torch._dynamo.config.compiled_autograd) is "
                "not supported: the optimizer's gradient hooks copy to the host and keep books in Python, which a "
                "graph cannot hold. Run backward eagerly; torch.compile(model) still compiles forward and backward")
        ready = method()
        if ready is not None:
            ready(i)

    return hook
