"""Update rules for :class:`zenflow_kernels.ZenFlow`: ZenFlow's importance split for AdamW, Adam, Lion and SGD, a
torch optimizer's own step (:func:`from_torch`), or a rule of one's own (subclass :class:`UpdateRule`, write
``step_`` in plain torch: docs/hacking.md)::

    from zenflow_kernels import ZenFlow, rules
    opt = ZenFlow(model.parameters(), rules.Lion(betas=(0.9, 0.99), weight_decay=0.1), lr=1e-4)
    opt = ZenFlow(model.parameters(), rules.from_torch(torch.optim.RMSprop, alpha=0.99), lr=1e-3)

The built-ins run hand-written kernels (numba on the host, Triton or numba on the fast path); a rule with only a
plain-torch ``step_`` runs it compiled in both places (:mod:`zenflow_kernels.rules.compiled`: Inductor's C++ on the
host, Triton on a GPU), or eager where that is off or impossible (``stats()["rule_paths"]`` says which).

Also here: :func:`check_rule` (the rule contract, checked when an optimizer is made), the argument checks the
built-in rules use (:func:`check_real`, :func:`check_betas`, :func:`check_state_dtype`), and :func:`unpack_item`
(a fast-path item by name, :class:`FastItem`).
"""

from . import compiled
from .adamw import Adam, AdamW, adamw_step_
from .base import FastItem, UpdateRule, check_betas, check_real, check_rule, check_state_dtype, unpack_item
from .compiled import RuleCompileWarning
from .from_torch import from_torch
from .lion import Lion
from .sgd import SGD

__all__ = ["Adam", "AdamW", "FastItem", "Lion", "RuleCompileWarning", "SGD", "UpdateRule", "adamw_step_",
           "check_betas", "check_real", "check_rule", "check_state_dtype", "compiled", "from_torch", "unpack_item"]
