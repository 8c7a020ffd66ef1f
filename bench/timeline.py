"""A timeline model of one training step: synchronous ZeRO-Offload against ZenFlow.

Used by ``notebooks/timeline_model.ipynb``. Every quantity is per data-parallel rank: with ZeRO-2
each of ``n_gpus`` ranks owns ``P = n_params / n_gpus`` parameters' optimizer state in host memory.

ZeRO-Offload (serial): the GPU computes forward and backward (``gpu_step_s``), the rank's gradient
partition crosses PCIe to the host (``grad_bytes * P``), the CPU runs Adam over ``P`` parameters, the
updated weights cross back (``param_bytes * P``), then the next step starts::

    step = gpu + d2h + cpu_adam + h2d          (d2h hidden behind backward when overlap_d2h)

ZenFlow (``topk_ratio = k``, ``update_interval = S``, overlap on): the GPU also updates the top-k
columns itself (``fast``: a memory-bound Adam over ``k * P`` parameters in HBM). The other
``(1 - k) * P`` gradients are accumulated over ``S`` steps; every ``S`` steps the CPU runs Adam over
them and the result crosses back, all while the GPU computes the next interval. Where the
accumulation happens is a choice (``accumulate_on``):

- ``"host"`` (the paper's description, docs/design.md 2.5 and this library): the gradients cross PCIe
  every step in the background and the CPU adds them into its buffer, ``S`` passes per interval;
- ``"gpu"``: the GPU sums them in its gradient buffer and they cross once per interval (how we read
  DeepSpeed's ``zenflow_stage_1_and_2.py``: the host buffer is *copied* into at the boundary).

In steady state the slowest lane sets the pace::

    step = max(gpu + fast, d2h_per_step, (cpu_accumulate + cpu_adam + h2d) / S)

and whatever exceeds ``gpu + fast`` is stall. The accumulation pass is costed relative to Adam
(``accumulate_ratio``: seconds to accumulate one parameter over seconds to Adam-update one). By bytes
moved, if both are memory-bound, it is 10/28 (accumulating a 16-bit gradient into fp32: read acc
and g, write acc; Adam: read p, g, m, v and write p, m, v in fp32); the notebook measures it. These
are modelling assumptions, stated so they can be changed.
"""

from __future__ import annotations

from dataclasses import dataclass

ADAM_BYTES = 28
ACCUMULATE_BYTES = 10


@dataclass
class Setup:
    """Hardware and workload of one data-parallel training run."""

    n_params: float  # model parameters
    n_gpus: int
    gpu_step_s: float  # forward + backward (+ GPU-side overheads) per step, no offload
    pcie_gbps: float  # effective host<->device bandwidth per GPU, GB/s, each direction
    cpu_adam_mparams_per_s: float  # CPU Adam throughput available to ONE rank, M params/s
    hbm_gbps: float = 1500.0  # GPU memory bandwidth (fast-path Adam), GB/s
    grad_bytes: int = 2  # bf16 gradients
    param_bytes: int = 2  # bf16 weights
    accumulate_ratio: float = ACCUMULATE_BYTES / ADAM_BYTES  # accumulate time / Adam time, per param

    @property
    def per_rank(self) -> float:
        return self.n_params / self.n_gpus


def zero_offload_step(s: Setup, overlap_d2h: bool = False) -> dict:
    """Seconds per step of synchronous ZeRO-Offload, by component (see the module docstring)."""
    P = s.per_rank
    d2h = s.grad_bytes * P / (s.pcie_gbps * 1e9)
    cpu = P / (s.cpu_adam_mparams_per_s * 1e6)
    h2d = s.param_bytes * P / (s.pcie_gbps * 1e9)
    step = s.gpu_step_s + (0.0 if overlap_d2h else d2h) + cpu + h2d
    return dict(gpu_s=s.gpu_step_s, d2h_s=d2h, cpu_adam_s=cpu, h2d_s=h2d, step_s=step, stall_s=step - s.gpu_step_s,
                pcie_bytes_per_step=(s.grad_bytes + s.param_bytes) * P)


def zenflow_step(s: Setup, topk_ratio: float, update_interval: int, accumulate_on: str = "host") -> dict:
    """Steady-state seconds per step of ZenFlow with overlap, by lane (see the module docstring)."""
    if not 0.0 <= topk_ratio <= 1.0 or update_interval < 1:
        raise ValueError("topk_ratio must be in [0, 1] and update_interval >= 1")
    if accumulate_on not in ("host", "gpu"):
        raise ValueError(f"accumulate_on must be 'host' or 'gpu', got {accumulate_on!r}")
    P, k, S = s.per_rank, topk_ratio, update_interval
    host_params = (1.0 - k) * P
    fast = ADAM_BYTES * k * P / (s.hbm_gbps * 1e9)
    crossings = 1.0 if accumulate_on == "host" else 1.0 / S  # gradient transfers per step
    d2h_step = crossings * s.grad_bytes * host_params / (s.pcie_gbps * 1e9)
    adam = host_params / (s.cpu_adam_mparams_per_s * 1e6)
    accumulate = S * s.accumulate_ratio * adam if accumulate_on == "host" else 0.0
    cpu_interval = accumulate + adam
    h2d_interval = s.param_bytes * host_params / (s.pcie_gbps * 1e9)
    compute = s.gpu_step_s + fast
    host_lane = (cpu_interval + h2d_interval) / S
    step = max(compute, d2h_step, host_lane)
    return dict(gpu_s=s.gpu_step_s, fast_path_s=fast, d2h_per_step_s=d2h_step, cpu_per_interval_s=cpu_interval,
                h2d_per_interval_s=h2d_interval, host_lane_per_step_s=host_lane, step_s=step, stall_s=step - compute,
                bound_by="gpu" if step == compute else ("pcie" if step == d2h_step else "cpu"),
                pcie_bytes_per_step=crossings * s.grad_bytes * host_params + s.param_bytes * host_params / S)


def compare(s: Setup, topk_ratio: float, update_interval: int, overlap_d2h: bool = False,
            accumulate_on: str = "host") -> dict:
    """Speed-up, PCIe-traffic ratio and stall reduction of ZenFlow over ZeRO-Offload."""
    zo = zero_offload_step(s, overlap_d2h)
    zf = zenflow_step(s, topk_ratio, update_interval, accumulate_on)
    return dict(zero_offload=zo, zenflow=zf, speedup=zo["step_s"] / zf["step_s"],
                pcie_traffic_ratio=zo["pcie_bytes_per_step"] / zf["pcie_bytes_per_step"],
                stall_reduction=1.0 - zf["stall_s"] / zo["stall_s"] if zo["stall_s"] > 0 else float("nan"),
                zero_offload_idle_fraction=zo["stall_s"] / zo["step_s"])


def calibrate_cpu_rate(n_params: float, n_gpus: int, gpu_step_s: float, offload_step_s: float, pcie_gbps: float,
                       grad_bytes: int = 2, param_bytes: int = 2) -> float:
    """The per-rank CPU Adam throughput (M params/s) that makes the serial ZeRO-Offload model take
    ``offload_step_s`` per step (for calibrating against a reported step time)."""
    P = n_params / n_gpus
    transfer = (grad_bytes + param_bytes) * P / (pcie_gbps * 1e9)
    cpu = offload_step_s - gpu_step_s - transfer
    if cpu <= 0:
        raise ValueError("the reported offload step is no slower than compute plus transfers: nothing to calibrate")
    return P / cpu / 1e6


def read_cpu_adam(payload: dict, candidate: str = "zenflow") -> dict:
    """From ``bench/results/cpu_adam.json``: the candidate's M params/s at the largest size measured,
    per thread count, and per core (at 1 thread)."""
    rows = [r for r in payload.get("adam", []) if r.get("candidate") == candidate]
    if not rows:
        raise ValueError(f"no {candidate!r} rows in the cpu_adam results")
    size = max(r["size"] for r in rows)
    by_threads = {r["threads"]: r["mparams_per_s"] for r in rows if r["size"] == size}
    return {"size": size, "by_threads": by_threads, "per_core": by_threads.get(1, min(by_threads.values()))}
