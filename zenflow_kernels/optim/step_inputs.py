"""What a step reads besides the gradients: GradScaler's scale (the fused-optimizer protocol), the clipping norm in
force, the param groups' update-rule hyper-parameters as they are now, and the one-pass check of every gradient."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..config import check_group_settings
from .build import PARAM_DTYPES, display_name

__all__ = ["ClipRequests", "grad_scaler", "check_group", "group_hyperparams", "GradChecks", "StepInputs", "read_step"]


def grad_scaler(opt, divide: int = 1) -> tuple[float, float, bool]:
    """``(scale, its float32 reciprocal, overflow)`` of this step: what a GradScaler set on ``opt`` (its
    ``grad_scale`` and ``found_inf``; ``1.0, 1.0, False`` without one). The reciprocal is GradScaler's own (float64,
    then float32), which multiplies each gradient as the scaler's in-place unscale would: for a power-of-two scale
    (its growth and backoff by 2) exactly. ``divide``: the gradients are read divided by it too (the scale times it;
    ``gradient_scale="interval"``: the update interval)."""
    scale, found = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
    amp = 1.0 if scale is None else float(scale)
    if not (math.isfinite(amp) and amp > 0):
        name = getattr(opt, "display_name", "ZenFlow")
        raise ValueError(f"{name}.step(): grad_scale={amp!r} (set by a GradScaler) is invalid: allowed a "
                         "finite number > 0")
    amp *= divide
    return amp, float(np.float32(1.0 / amp)), found is not None and float(found) != 0.0


class ClipRequests:
    """``clip_grad_norm_()`` calls since the last step: the smallest norm asked, and the tensors handed out that
    ``step()`` fills with the gradient norm. ``name``: what the errors call the optimizer."""

    def __init__(self, name: str = "ZenFlow"):
        self.name = name
        self.request: float | None = None
        self.norms: list[torch.Tensor] = []

    def ask(self, max_norm: float, norm_type: float, device) -> torch.Tensor:
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"{self.name}.clip_grad_norm_: max_norm={max_norm!r} is invalid: allowed a number > 0 "
                             "(inf: no clipping)")
        if norm_type != 2:
            raise ValueError(f"{self.name}.clip_grad_norm_: norm_type={norm_type!r} is invalid: allowed 2 (the "
                             "optimizer clips by the global L2 norm)")
        if math.isfinite(max_norm):
            self.request = min(float(max_norm), self.request or math.inf)
        norm = torch.full((), math.nan, dtype=torch.float32, device=device)
        self.norms.append(norm)
        return norm

    def take(self, max_grad_norm: float | None) -> tuple[float | None, list[torch.Tensor]]:
        """This step's clipping norm (``max_grad_norm`` and a request, the smaller; None: no clipping) and the
        tensors to write its gradient norm into; the request is used up."""
        request, norms = self.request, self.norms
        self.drop()
        limits = [x for x in (max_grad_norm, request) if x is not None]
        return (min(limits) if limits else None), norms

    def drop(self) -> None:
        """The batch was skipped (``zero_grad()``): no request applies."""
        self.request, self.norms = None, []


def check_group(g: dict, gi: int, rule, name: str | None = None) -> None:
    """Param group ``gi``'s update-rule hyper-parameters and ZenFlow settings, or an error naming the optimizer
    (``name``, ``build.display_name``; by default ``ZenFlow(<rule name>)``) and the group."""
    name = name or display_name(rule)
    rule.check_group(g, f"{name} group {gi}")
    check_group_settings(g, f"{name} param group {gi}")


def group_hyperparams(param_groups: list[dict], rule, name: str | None = None) -> list[dict]:
    """Each param group's update-rule hyper-parameters as they are now (a scheduler may have changed them;
    ``rule.hyperparams``), checked: the kernels are called without per-tensor validation."""
    out = []
    for gi, g in enumerate(param_groups):
        check_group(g, gi, rule, name)
        out.append(rule.hyperparams(g))
    return out


def check_grad(i: int, g: torch.Tensor, p: torch.Tensor, device: torch.device, name: str = "ZenFlow") -> None:
    """Parameter ``i``'s gradient ``g``: dense, an allowed dtype, ``p``'s shape, on ``device``; or an error."""
    if g.is_sparse or g.shape != p.shape or g.device != device or g.dtype not in PARAM_DTYPES:
        raise ValueError(
            f"{name}: gradient of parameter {i} ({tuple(g.shape)}, {g.dtype}, {g.device}, "
            f"sparse={g.is_sparse}) is invalid: allowed a dense float32, bfloat16 or float16 gradient of "
            f"shape {tuple(p.shape)} on {device}"
        )


class GradChecks:
    """One pass over a step's gradients: dense, on the device, an allowed dtype, the parameter's shape; otherwise
    the first that is not is named. The parameters' shapes are kept per set of indices."""

    def __init__(self, local: list[torch.Tensor], device: torch.device, name: str = "ZenFlow"):
        self.local, self.device, self.name = local, device, name
        self._shapes: tuple[list[int], list] | None = None

    def one(self, i: int, g: torch.Tensor) -> None:
        check_grad(i, g, self.local[i], self.device, self.name)

    def all(self, grads: list[tuple[int, torch.Tensor]]) -> None:
        indices = [i for i, _ in grads]
        if self._shapes is None or self._shapes[0] != indices:
            self._shapes = (indices, [self.local[i].shape for i in indices])
        if not {(g.device, g.dtype, g.layout) for _, g in grads} <= {
                (self.device, dtype, torch.strided) for dtype in PARAM_DTYPES} or (
                [g.shape for _, g in grads] != self._shapes[1]):
            for i, g in grads:
                self.one(i, g)


@dataclasses.dataclass
class StepInputs:
    """What a step reads before it changes anything: GradScaler's scale and its float32 reciprocal, the clipping norm
    in force, the indices of the parameters with a gradient, and the global gradient norm (unscaled; under ZeRO of
    the averaged gradients). ``grads``: each active parameter's own gradient as :meth:`Sharding.own_grad` gave it,
    read once for the step (averaging under ZeRO writes into these tensors; ZeRO-2's released matrices are absent).
    ``skip``: an overflow or a non-finite norm; the step changes nothing."""

    amp: float
    inv_amp: float
    max_norm: float | None
    active: list[int]
    grads: dict[int, torch.Tensor]
    norm: float
    skip: bool

    @property
    def coef(self) -> float | None:
        """The fast path's clipping coefficient (None: no clipping)."""
        return None if self.max_norm is None else min(1.0, self.max_norm / (self.norm + 1e-6))


def read_step(opt, shard, clips: ClipRequests, checks: GradChecks) -> StepInputs:
    """Check the step's gradients, gather them where the sharding needs it, compute their norm and fill the tensors
    ``clip_grad_norm_()`` handed out with it (``opt``: what a GradScaler set, see :func:`grad_scaler`)."""
    config = opt.config
    amp, inv_amp, overflow = grad_scaler(opt, config.update_interval if config.gradient_scale == "interval" else 1)
    max_norm, norms_out = clips.take(opt.max_grad_norm)
    active = shard.active()
    own = [(i, g) for i in active if (g := shard.own_grad(i)) is not None]
    checks.all(own)
    # the user's scaler.unscale_(opt) ran (GradScaler's protocol: found_inf set, grad_scale None)
    shard.user_unscaled = getattr(opt, "found_inf", None) is not None and getattr(opt, "grad_scale", None) is None
    shard.gather(active)
    # (every active parameter's gradient read once; ZeRO-2's released matrices are not among them: it uses its own)
    norm = shard.grad_norm(active, [g for _, g in own] if len(own) == len(active) else None) / amp
    for out in norms_out:
        out.fill_(norm)
    if not overflow and not math.isfinite(norm) and getattr(opt, "found_inf", None) is not None:
        # the ranks' gradient holds an inf or NaN that this rank's GradScaler did not see (it checked this rank's
        # own gradients before they were averaged, or only those ZeRO-2 had not let go): the step is skipped on
        # every rank, and this rank's scaler must back off as well, as one process's scaler fed the average does
        tell_scaler_found_inf(opt)
    return StepInputs(amp, inv_amp, max_norm, active, dict(own), norm, overflow or not math.isfinite(norm))


def tell_scaler_found_inf(opt) -> None:
    """Make the ``torch.amp.GradScaler`` stepping ``opt`` now count this step as an overflow (its ``update()``
    then backs off the scale). The scaler is the caller of ``step()`` (``GradScaler.step``, found on the stack);
    its per-device ``found_inf`` of ``opt`` is set to 1."""
    import sys

    from torch.amp.grad_scaler import GradScaler

    frame = sys._getframe(1)
    while frame is not None:
        scaler = frame.f_locals.get("self")
        if isinstance(scaler, GradScaler) and frame.f_locals.get("optimizer") is opt:
            for found in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
                found.fill_(1.0)
            return
        frame = frame.f_back
    name = getattr(opt, "display_name", type(opt).__name__)
    raise RuntimeError(
        f"{name}.step(): the gradient averaged over the ranks holds an inf or NaN that this rank's "
        "GradScaler did not find, and the scaler stepping this optimizer is not torch.amp.GradScaler.step: its "
        "scale would now differ from the other ranks'. Step with torch.amp.GradScaler, or check for infs yourself")
