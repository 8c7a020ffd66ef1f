"""zenflow_kernels: kernels and a drop-in optimizer for ZenFlow (importance-aware, stall-free offloading).

The public API, loaded on first use so that ``import zenflow_kernels`` stays light (triton and numba
are imported only by the pieces that need them):

Configuration and schedule (pure Python)
    ZenFlowConfig, ZenFlowConfigError, ZenFlowWarning    -- every ZenFlow field, validated
    resolve_schedule, Schedule                           -- select/update boundaries (docs/design.md section 3)

The algorithm
    ReferenceZenFlow   -- the slow, readable oracle of docs/design.md sections 2-3
    ZenFlowAdamW       -- the drop-in torch.optim optimizer (fast path on device, host update behind;
                          ZeRO-1/2 over torch.distributed with zero_stage=1|2, docs/torchrun.md)
    ZenFlow            -- the same for any update rule: ZenFlow(params, rules.Lion(), lr=1e-4)
    rules              -- the update rules: AdamW, Adam, Lion, SGD, and UpdateRule for one's own
    StochasticRounding, round_to_bf16
                       -- bf16 host state rounded stochastically and deterministically (a rule's
                          state_rounding="stochastic"): the bits of a pass, and the torch reference
    ZeroCollectiveError -- a collective failed or timed out (another rank failed or stopped stepping)
    gradient_concentration, concentration_report
                       -- ZenFlow's premise measured: the gradient energy in the top 1% / 10% of each matrix's
                          columns and in the selected ones (recorded at every selection: stats()["concentration"])
    planner            -- before renting a GPU: probe_host() times this host's passes, predict() the stall of
                          synchronous offload and of ZenFlow (``python -m zenflow_kernels plan``, docs/planner.md)

Device kernels (CUDA -> Triton; CPU -> torch; TRITON_INTERPRET=1 -> Triton on CPU), see ``ops``
    column_scores, topk_columns, selective_adamw_
    multi_column_scores, multi_topk_columns, multi_selective_adamw_
    multi_fingerprint  -- a 64-bit fingerprint of each tensor's bits (whether a gradient changed)
    use_backend        -- force "torch" or "triton" for a block of code

Host kernels (numba, multithreaded, release the GIL), see ``cpu_ops``
    cpu_adam_, cpu_lion_, cpu_sgd_, accumulate_, multi_accumulate_, accumulate_adam_, sum_squares,
    multi_sum_squares, split_cores

Testing (``zenflow_kernels.testing``)
    chaos(seed, max_delay, d2h_bytes_per_s=, h2d_bytes_per_s=, timeline=)
                           -- optimizers created inside run the GPU's asynchronous protocol on CPU,
                              with seeded random delays (``link/`` holds that protocol), and, with
                              bandwidths, a modeled device whose copies take bytes / bandwidth
    Timeline               -- the modeled device's lanes (copies, accumulation, updates, waits)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ZenFlowConfig": "zenflow_kernels.config",
    "ZenFlowConfigError": "zenflow_kernels.config",
    "ZenFlowWarning": "zenflow_kernels.config",
    "Schedule": "zenflow_kernels.schedule",
    "resolve_schedule": "zenflow_kernels.schedule",
    "ReferenceZenFlow": "zenflow_kernels.reference",
    "ZenFlowAdamW": "zenflow_kernels.optim",
    "ZenFlow": "zenflow_kernels.optim",
    "rules": None,  # the module zenflow_kernels.rules
    "StochasticRounding": "zenflow_kernels.rounding",
    "round_to_bf16": "zenflow_kernels.rounding",
    "planner": None,  # the module zenflow_kernels.planner
    "ZeroCollectiveError": "zenflow_kernels.sharding",
    "gradient_concentration": "zenflow_kernels.concentration",
    "concentration_report": "zenflow_kernels.concentration",
    "column_scores": "zenflow_kernels.ops",
    "topk_columns": "zenflow_kernels.ops",
    "selective_adamw_": "zenflow_kernels.ops",
    "multi_column_scores": "zenflow_kernels.ops",
    "multi_topk_columns": "zenflow_kernels.ops",
    "multi_selective_adamw_": "zenflow_kernels.ops",
    "multi_fingerprint": "zenflow_kernels.ops",
    "use_backend": "zenflow_kernels.ops",
    "cpu_adam_": "zenflow_kernels.cpu_ops",
    "cpu_lion_": "zenflow_kernels.cpu_ops",
    "cpu_sgd_": "zenflow_kernels.cpu_ops",
    "accumulate_": "zenflow_kernels.cpu_ops",
    "multi_accumulate_": "zenflow_kernels.cpu_ops",
    "accumulate_adam_": "zenflow_kernels.cpu_ops",
    "sum_squares": "zenflow_kernels.cpu_ops",
    "multi_sum_squares": "zenflow_kernels.cpu_ops",
    "split_cores": "zenflow_kernels.cpu_ops",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zenflow_kernels' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f"zenflow_kernels.{name}") if module is None else getattr(
        importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__():
    return __all__
