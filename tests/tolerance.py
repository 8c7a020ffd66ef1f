"""The numeric guarantee of docs/design.md ("Numeric guarantees"), as one assertion the tests share.

Where two runs are not bit-identical (several ranks against one process, a checkpoint resumed at another
world size) they differ because a whole-batch mean and a mean of rank means round differently in the last
bits. Adam passes such a difference on at the size it came in, except where an element's gradient and its
moments are themselves of rounding-noise size: an entering column's first step, ``lr * g / (|g| + eps)``
with zero moments, turns -1.5e-9 and -6.0e-8 into updates of 0.13 and 0.86 lr. So the statement is two
parts, and so is the assertion:

- all but a few elements agree within ``typical`` (1e-5): the last bits, carried along;
- none differs by more than the derived bound, ``typical + 2 * lr * steps``: each run moves an element by
  at most about ``lr`` a step (the bias-corrected first step exactly: ``lr * |g| / (|g| + eps) < lr``),
  and decoupled weight decay multiplies an existing difference by ``1 - lr * weight_decay <= 1``, so a
  difference grows by at most about ``2 * lr`` per step whose update rounding noise decided. ``steps``
  counts those steps; a test that cannot tell which they were passes every step run (an upper count).

"A few" is ``max_outliers`` elements (1: torchtune's case was one element) or ``max_outlier_fraction`` of
them (0.1%), whichever allows more. The multi-rank comparisons' gradients have no rounding-noise element
(their differences stay last bits); the allowance is what the statement admits, not slack for a test.
"""

from __future__ import annotations

import torch

TYPICAL = 1e-5
MAX_OUTLIER_FRACTION = 0.001
MAX_OUTLIERS = 1


def stated_bound(lr: float, steps: int, typical: float = TYPICAL) -> float:
    """The most an element may differ after ``steps`` steps at learning rate ``lr`` (at most): ``typical + 2 *
    lr * steps``."""
    if lr < 0 or steps < 0:
        raise ValueError(f"lr and steps must be >= 0, got lr={lr}, steps={steps}")
    return typical + 2.0 * lr * steps


def differences(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| elementwise, in float64 (so the difference itself is not rounded)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {tuple(actual.shape)} and {tuple(expected.shape)}")
    return (actual.detach().double() - expected.detach().double()).abs()


def assert_within_stated_bound(actual: torch.Tensor, expected: torch.Tensor, *, lr: float, steps: int,
                               typical: float = TYPICAL, max_outlier_fraction: float = MAX_OUTLIER_FRACTION,
                               max_outliers: int = MAX_OUTLIERS, what: str = "") -> dict:
    """Assert that ``actual`` and ``expected`` agree as docs/design.md states: all but a few elements within
    ``typical``, none beyond :func:`stated_bound` (``typical + 2 * lr * steps``). A few: at most
    ``max(max_outliers, floor(max_outlier_fraction * numel))`` elements beyond ``typical``.

    ``lr``: the largest learning rate of the steps compared; ``steps``: the steps whose update rounding noise
    may have decided (the steps run, when the test cannot tell). NaN or inf where the other has a finite value
    fails. Returns what was measured: ``max``, ``outliers`` (elements beyond ``typical``), ``allowed``,
    ``bound``, ``numel``.
    """
    a, e = actual.detach(), expected.detach()
    diff = differences(a, e)
    same_nonfinite = ~torch.isfinite(a.double()) & ~torch.isfinite(e.double()) & (a.double() == e.double())
    diff = torch.where(same_nonfinite, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    bound = stated_bound(lr, steps, typical)
    numel = diff.numel()
    allowed = max(max_outliers, int(max_outlier_fraction * numel))
    over = diff > typical
    outliers = int(over.sum())
    worst = float(diff.max()) if numel else 0.0
    measured = dict(max=worst, outliers=outliers, allowed=allowed, bound=bound, numel=numel)
    if outliers <= allowed and worst <= bound:
        return measured
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if numel else ()
    head = f"{what}: " if what else ""
    problems = []
    if worst > bound:
        beyond = int((diff > bound).sum())
        problems.append(f"{beyond} element(s) beyond the stated bound {bound:.3g} (typical {typical:g} + 2 * lr "
                        f"{lr:g} * {steps} steps)")
    if outliers > allowed:
        problems.append(f"{outliers} of {numel} elements beyond {typical:g}, more than the {allowed} allowed")
    first = torch.nonzero(over)[:5].tolist()
    raise AssertionError(
        f"{head}{'; '.join(problems)}; max diff {worst:.3e} at {where} (actual {float(a[where]):.9g}, expected "
        f"{float(e[where]):.9g}); first elements beyond {typical:g}: {first}; docs/design.md, Numeric guarantees")


def assert_all_within_stated_bound(actual, expected, *, lr: float, steps: int, what: str = "", **kwargs) -> list[dict]:
    """:func:`assert_within_stated_bound` over pairs of tensors (a model's parameters); ``what`` names each
    pair with its index."""
    pairs = list(zip(actual, expected, strict=True))
    return [assert_within_stated_bound(a, e, lr=lr, steps=steps, what=f"{what} param {i}".strip(), **kwargs)
            for i, (a, e) in enumerate(pairs)]
