"""Update rules for :class:`zenflow_kernels.ZenFlow`: ZenFlow's importance split for AdamW, Adam, Lion and SGD, or a
rule of one's own (subclass :class:`UpdateRule`, write ``step_`` in plain torch: docs/hacking.md)::

    from zenflow_kernels import ZenFlow, rules
    opt = ZenFlow(model.parameters(), rules.Lion(betas=(0.9, 0.99), weight_decay=0.1), lr=1e-4)
"""

from .adamw import Adam, AdamW, adamw_step_
from .base import UpdateRule
from .lion import Lion
from .sgd import SGD

__all__ = ["Adam", "AdamW", "Lion", "SGD", "UpdateRule", "adamw_step_"]
