"""The switches that put back a former order of work (the library's orderings, for benchmarks to measure): one
documented place.

Each switch names an ordering the library chose because it is faster; turning it off restores the order it
replaced, with the same results (every switch is about *when* work runs, never about *what* is computed: the
tests compare both settings bit for bit). Benchmarks set them to measure what each choice is worth::

    from zenflow_kernels.orderings import orderings

    with orderings.changed(early_handover=False):   # read when the optimizer is built: its first step()
        opt = ZenFlowAdamW(model.parameters(), ...)
        train(opt, steps)

When each is read:

``early_handover`` (default True)
    Gradients cross to the host from backward's hooks (docs/design.md section 5.1). False: at ``step()``, after
    backward. Read once per optimizer, at its first ``step()`` (``stats()["handover_why"]`` says it was off).
``fetch_beside_read`` (default True)
    ``device_accumulation`` on disk: a block's sums start crossing from the device before the block's state is
    read from the file, so both run side by side. False: read, then fetch (the former order). Read at every block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

__all__ = ["Orderings", "orderings"]


@dataclasses.dataclass
class Orderings:
    """The ordering switches (see the module's docstring); :data:`orderings` is the one instance the library reads."""

    early_handover: bool = True
    fetch_beside_read: bool = True

    def __setattr__(self, name: str, value) -> None:
        if name not in {f.name for f in dataclasses.fields(self)}:
            allowed = ", ".join(f.name for f in dataclasses.fields(self))
            raise AttributeError(f"Orderings: {name!r} is not a switch: allowed {allowed}")
        if not isinstance(value, bool):
            raise TypeError(f"Orderings: {name}={value!r} is invalid: allowed True or False")
        super().__setattr__(name, value)

    @contextlib.contextmanager
    def changed(self, **switches: bool) -> Iterator[Orderings]:
        """Set these switches for the block and put the former values back after it (also on an error). Every
        switch is checked before any is set: a bad name or value changes nothing."""
        for name, value in switches.items():
            Orderings().__setattr__(name, value)  # (a scratch instance: checks without touching this one)
        before = {name: getattr(self, name) for name in switches}
        try:
            for name, value in switches.items():
                setattr(self, name, value)
            yield self
        finally:
            for name, value in before.items():
                setattr(self, name, value)


orderings = Orderings()
"""The switches every part of the library reads (benchmarks change them here)."""
