"""Before renting a GPU: will ZenFlow hide the host update? (``python -m zenflow_kernels plan``, docs/planner.md)

The stall of offloaded training is set by three rates: this host's passes over the offloaded state (measured here
in a few seconds by :func:`probe_host`, with the optimizer itself), the PCIe link's bandwidths, and the device's
time per step (forward, backward and ZenFlow's fast path: the user's measurement). :func:`predict` turns them into
the stall per step of synchronous offload and of ZenFlow at given settings, the smallest ``update_interval`` that
hides the host update, and the host memory. The host holds every parameter (``P``) and its passes run over all of
them, the fast path's columns included (one flat pass is cheaper than skipping them); only the write-back is of the
columns off the fast path (``P_w = (1 - topk_ratio) * matrix parameters``). Per step of a steady state (``S``:
``update_interval``):

* the gradients cross (``g * P / d2h``): behind backward when hooks hand them over (``handover="backward"``, on
  a GPU: stall only for what exceeds backward), or after it (``"step"``: all of it is stall);
* the accumulate worker folds them into the sums (``acc * P``) beside the next step's compute: stall only for what
  exceeds that;
* every ``S`` steps the host update (``upd * P``) and the write-back (``w * P_w / h2d``, the device waits for it).
  Without ``overlap_step`` the update is stall; with it, it runs during the next interval and only what exceeds
  that interval's device time (``S`` steps) is stall, and the write-back is issued as the boundary's step starts
  (beside the gradients' crossing when they cross at ``step()``).

Synchronous offload is the same with every column on the host, updated every step without overlap. The settings
a user chooses beside these:

* ``device_accumulation``: the matrices' gradients are summed on the device; their fp32 sums (``4 * P / d2h``) cross
  once per interval beside the next step's forward and backward (that step waits for what exceeds it), and the
  update starts after them; no folds on the host (the vectors' gradients still cross and fold every step);
* bf16 state: the probe times the rule with bf16 moments (``probe_host(AdamW(state_dtype=torch.bfloat16))``) and
  ``state_bytes`` halves;
* the state on disk (``nvme_bytes_per_s``): each update reads and writes the master and the state
  (``2 * (4 + state_bytes) * P`` bytes) beside its compute, so it takes the longer of the two;
* several ranks sharing a node's cores, or another ``pt_reserved_cores_perc`` (``host_threads``): the host's passes
  scaled by the probe's threads over these, linearly (an assumption; memory bandwidth caps it).

:class:`Plan` names the lane that contributes most to the stall (``limit``) and the setting that relieves it
(``remedy``). What the model leaves out (stated so it can be checked): the host's passes contending with each other
for memory bandwidth, the selection's scoring steps, Zen-auto's data-dependent intervals, ZeRO's collectives, the
device's own fp32 accumulation with ``device_accumulation`` (in the device's step time, the user's measurement).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["HostProbe", "Plan", "predict", "probe_host", "host_bytes_per_param", "state_bytes_per_param"]


@dataclass(frozen=True)
class HostProbe:
    """This host's passes over the offloaded state, in seconds per parameter, as the optimizer runs them on the
    asynchronous link (the GPU's protocol; on CPU its stand-in, ``testing.chaos``): ``update`` (the host update,
    the rule over the master and its state and the copy-out, as the update worker runs it beside the next steps:
    ``overlap_step``), ``update_alone`` (the same while training waits for it: without ``overlap_step``),
    ``accumulate`` (the fold of one step's gradient into the sums, on the accumulate worker) and ``step_work`` (the
    training thread's own work in ``step()`` between boundaries, its waits for the gradients' copies left out: on
    the stand-in the fingerprints and copies a GPU does on the device, and whatever the folds take of the cores),
    measured on ``params`` parameters with the host worker's numba team of ``threads`` threads (for CPU parameters
    the worker takes the cores torch leaves free; beside a GPU it gets ``1 - pt_reserved_cores_perc`` of them)."""

    update_s_per_param: float
    accumulate_s_per_param: float
    step_work_s_per_param: float
    update_alone_s_per_param: float
    threads: int
    params: int
    grad_dtype: str

    def as_dict(self) -> dict:
        return asdict(self)


def probe_host(rule, params: int = 1 << 22, seconds: float = 3.0, grad_dtype: torch.dtype = torch.bfloat16,
               pause_s: float | None = None) -> HostProbe:
    """Time this host's passes with the optimizer itself for about ``seconds`` (at least 12 steps): one matrix of
    ``params`` parameters, every column on the host, ``update_interval=4`` with ``overlap_step``, on the
    asynchronous link without delays, a pause between steps standing in for the device's compute, its timeline read
    per step (:class:`HostProbe`). ``pause_s``: that pause; by default a third of the last update, so each update
    runs beside the steps as beside a GPU's. Give the device's step time where ``step_work`` must be what a step()
    does after that long idle: on a shared two-core VM a step() after 20 ms of sleep did about twice the work of one
    after 4 ms (caches and idle thread pools gone cold; ``bench/results/plan_cpu.json``, ``step_work_s_by_pause``).
    ``rule``: the ``zenflow_kernels.rules`` rule whose host update is timed (required: its passes are the rule's,
    e.g. ``rules.AdamW()``); ``grad_dtype``: the gradients' (and parameters') dtype."""
    from . import ZenFlow
    from .testing import Timeline, chaos

    if isinstance(params, bool) or not isinstance(params, int) or params < 1 << 12:
        raise ValueError(f"probe_host: params={params!r} is invalid: allowed an integer >= 4096")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"probe_host: seconds={seconds!r} is invalid: allowed a number > 0")
    if pause_s is not None and not (isinstance(pause_s, (int, float)) and not isinstance(pause_s, bool)
                                    and math.isfinite(pause_s) and pause_s >= 0):
        raise ValueError(f"probe_host: pause_s={pause_s!r} is invalid: allowed None or a number >= 0")
    cols = 1024
    rows = max(4, params // cols)
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(rows, cols, generator=generator).to(grad_dtype))
    grads = [torch.randn(rows, cols, generator=generator).to(grad_dtype) for _ in range(2)]
    zen = dict(topk_ratio=0.0, update_interval=4, overlap_step=True, select_strategy="step", select_interval=10**6)
    timeline = Timeline()
    # copies modeled at 2 GB/s: the gradients' crossing takes as long as the folds and the update, so these run after
    # it as they do beside a device, not inside a memcpy's time
    with chaos(seed=0, max_delay=0.0, timeline=timeline, d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9):
        opt = ZenFlow([weight], rule, lr=1e-4, zenflow=zen)
    from .optim.build import host_threads

    steps = []  # (start, end) of each step() between boundaries
    with opt:
        end = time.perf_counter() + 0.75 * seconds
        t, pause = 0, 0.0
        while t < 12 or (time.perf_counter() < end and t < 400):
            time.sleep(pause)
            weight.grad = grads[t % 2]
            start = time.perf_counter()
            opt.step()
            if t >= 4 and (t + 1) % 4:  # the first interval builds the state
                steps.append((start, time.perf_counter()))
            if pause_s is None:
                updates = [b - a for lane, _, a, b, _ in timeline.spans if lane == "update"]
                pause = max(updates[-3:], default=0.0) / 3
            else:
                pause = pause_s
            t += 1
        threads = host_threads(opt.run.cores, weight.device)
    # without overlap: a boundary's step() takes the update and the write-back more than a step between boundaries
    with chaos(seed=0, max_delay=0.0, d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9):
        opt = ZenFlow([weight], rule, lr=1e-4,
                      zenflow=dict(zen, overlap_step=False))
    walls = {True: [], False: []}
    with opt:
        end = time.perf_counter() + 0.25 * seconds
        t = 0
        while t < 12 or (time.perf_counter() < end and t < 400):
            weight.grad = grads[t % 2]
            start = time.perf_counter()
            opt.step()
            if t >= 4:
                walls[(t + 1) % 4 == 0].append(time.perf_counter() - start)
            t += 1
    write_back = weight.numel() * weight.element_size() / 2e9
    alone = statistics.median(walls[True]) - statistics.median(walls[False]) - write_back
    work = []
    for start, stop in steps:
        waits = sum(b - a for lane, _, a, b, _ in timeline.between(start, stop) if lane == "wait")
        work.append((stop - start) - waits)
    update = [b - a for lane, _, a, b, _ in timeline.spans if lane == "update"][1:]
    fold = [b - a for lane, _, a, b, _ in timeline.spans if lane == "accumulate"][4:]
    n = rows * cols
    return HostProbe(update_s_per_param=statistics.median(update) / n,
                     accumulate_s_per_param=statistics.median(fold) / n,
                     step_work_s_per_param=statistics.median(work) / n, update_alone_s_per_param=max(0.0, alone) / n,
                     threads=threads, params=n,
                     grad_dtype=str(grad_dtype).removeprefix("torch."))


def state_bytes_per_param(rule) -> int:
    """Host bytes per parameter of ``rule``'s state: 4 per state tensor in fp32, 2 in bf16 (its ``state_names`` and
    ``state_dtype``; AdamW's two fp32 moments: 8, Lion's one: 4)."""
    return len(rule.state_names) * rule.state_dtype.itemsize


def host_bytes_per_param(*, state_bytes: int, grad_bytes: int = 2, param_bytes: int = 2,
                         overlap_step: bool = True, device_accumulation: bool = False, on_gpu: bool = True) -> int:
    """Host bytes per offloaded parameter (docs/design.md section 9): the fp32 master (4), the rule's state
    (``state_bytes``, :func:`state_bytes_per_param`: 4 per state tensor in fp32, 2 in bf16; AdamW 8), the fp32 sums
    (4; two buffers with ``overlap_step``; one with ``device_accumulation``, where the device's sums land), the
    copy-out in the parameters' dtype and, on a GPU, the landing area in the gradients' dtype (none with
    ``device_accumulation``)."""
    sums = 4 if device_accumulation else 4 * (2 if overlap_step else 1)
    landing = grad_bytes if on_gpu and not device_accumulation else 0
    return 4 + state_bytes + sums + param_bytes + landing


@dataclass(frozen=True)
class Plan:
    """What :func:`predict` says, in seconds per step (stall: the device idle) and bytes. ``limit``: the lane that
    contributes most to ZenFlow's stall ("crossing", "folds", "sums", "update", "disk", "write_back", or "none"),
    ``remedy``: the setting that relieves it."""

    sync_offload_stall_s: float
    zenflow_stall_s: float
    zenflow_lanes: dict
    smallest_hiding_update_interval: int | None
    host_bytes: int
    host_params: int
    limit: str = "none"
    remedy: str = ""
    disk_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


REMEDIES = {
    "crossing": "the gradients' crossing: device_accumulation=True (one fp32 crossing per interval) or a faster link",
    "folds": "the host's folds of every step's gradient: device_accumulation=True (no folds on the host) or more "
             "host threads (a smaller pt_reserved_cores_perc, fewer ranks per node)",
    "sums": "the sums' crossing at each boundary (device_accumulation): a longer update_interval",
    "update": "the host update: a longer update_interval, more host threads (a smaller pt_reserved_cores_perc, "
              "fewer ranks per node) or bf16 state (rules' state_dtype=torch.bfloat16)",
    "disk": "the state's disk traffic (offload_device='nvme'): a longer update_interval or a faster disk",
    "write_back": "the write-back of the host's columns: a longer update_interval",
    "none": "nothing: the device's own compute sets the step",
}


def _stall(matrix: float, vector: float, written_back: float, probe: HostProbe, device_step_s: float,
           backward_s: float, d2h_bytes_per_s: float, h2d_bytes_per_s: float, grad_bytes: int, param_bytes: int,
           update_interval: int, overlap_step: bool, handover: str, device_accumulation: bool = False,
           disk_bytes_per_param: float = 0.0, nvme_bytes_per_s: float | None = None,
           host_speed: float = 1.0) -> dict:
    host_params = matrix + vector
    # with device_accumulation only the vectors' gradients cross (and are folded) every step; the matrices' fp32
    # sums cross once per interval
    per_step = vector if device_accumulation else host_params
    d2h = grad_bytes * per_step / d2h_bytes_per_s
    crossing = max(0.0, d2h - backward_s) if handover == "backward" else d2h
    accumulate = probe.accumulate_s_per_param * per_step / host_speed
    compute = (probe.update_s_per_param if overlap_step else probe.update_alone_s_per_param) * host_params / host_speed
    disk = disk_bytes_per_param * host_params / nvme_bytes_per_s if nvme_bytes_per_s else 0.0
    update = max(compute, disk)  # the streamed update reads, steps and writes its blocks side by side
    sums = 4 * matrix / d2h_bytes_per_s if device_accumulation else 0.0
    write_back = param_bytes * written_back / h2d_bytes_per_s
    step = device_step_s + crossing  # the device's time per step, with the crossing it waits for
    fold_excess = max(0.0, accumulate - step)
    # the sums cross beside the next step's forward and backward; that step waits for the rest before its own
    # accumulation (on disk the update's reader fetches them block by block, inside the update)
    streamed_sums = nvme_bytes_per_s is not None
    sums_wait = 0.0 if streamed_sums else max(0.0, sums - step)
    if streamed_sums:
        update = max(update, sums)
    before_update = 0.0 if streamed_sums else sums
    # with overlap the update of interval n runs during interval n+1 (after interval n's last fold and the sums'
    # crossing); without, the device waits for all of it
    window = update_interval * (step + fold_excess) if overlap_step else 0.0
    if overlap_step:
        update_wait = max(0.0, before_update + update + accumulate - window - sums_wait)
    else:
        update_wait = before_update + update
        sums_wait = 0.0  # (inside update_wait)
    # with overlap the write-back is issued as the boundary's step starts: when the gradients cross at step() it
    # runs beside their crossing, on the other copy engine; otherwise the device waits for all of it
    write_back_wait = max(0.0, write_back - d2h) if overlap_step and handover == "step" else write_back
    stall = crossing + fold_excess + (sums_wait + update_wait + write_back_wait) / update_interval
    lanes = dict(crossing=crossing, folds=fold_excess, sums=sums_wait / update_interval,
                 update=update_wait / update_interval, write_back=write_back_wait / update_interval)
    if update_wait > 0 and disk > compute:
        lanes["disk"], lanes["update"] = lanes.pop("update"), 0.0
    limit = max(lanes, key=lanes.get) if stall > 0 else "none"
    return dict(stall_s=stall, crossing_s=crossing, fold_excess_s=fold_excess, update_s=update,
                update_compute_s=compute, disk_s=disk, sums_crossing_s=sums, sums_wait_s=sums_wait,
                update_wait_s=update_wait, write_back_s=write_back, write_back_wait_s=write_back_wait,
                accumulate_s=accumulate, limit=limit, stall_by_lane_s=lanes)


def _check_positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        allowed = "None or a number > 0" if allow_none else "a number > 0"
        raise ValueError(f"predict: {name}={value!r} is invalid: allowed {allowed}")


def predict(*, matrix_params: int, vector_params: int = 0, device_step_s: float, d2h_bytes_per_s: float,
            h2d_bytes_per_s: float | None = None, probe: HostProbe, topk_ratio: float = 0.1,
            update_interval: int = 4, overlap_step: bool = True, handover: str = "backward",
            backward_share: float = 2 / 3, grad_bytes: int = 2, param_bytes: int = 2, state_bytes: int,
            max_update_interval: int = 64, device_accumulation: bool = False,
            nvme_bytes_per_s: float | None = None, host_threads: int | None = None) -> Plan:
    """The stall per step of synchronous offload and of ZenFlow at these settings (see the module docstring).

    ``device_step_s``: forward, backward and the fast path on the device, per step; ``backward_share``: backward's
    share of it (the window the gradients' crossing hides in with ``handover="backward"``); ``topk_ratio`` of each
    matrix's columns stays on the device (vectors too), the rest is the host's; ``state_bytes``: the update rule's
    host state per parameter (:func:`state_bytes_per_param`; the probe is the one to time that rule, bf16 state
    included). ``device_accumulation``: the matrices' gradients summed on the device, their fp32 sums crossing
    once per interval (no folds on the host). ``nvme_bytes_per_s``: the master and state on disk
    (``offload_device="nvme"``), read and written once per update at that rate, beside the update's compute.
    ``host_threads``: the host worker's threads where they differ from the probe's (several ranks sharing a node's
    cores, another ``pt_reserved_cores_perc``): the host's passes are scaled by ``probe.threads / host_threads``,
    linear in the threads (an assumption: memory bandwidth caps it on a real host, so more threads than probed
    give an optimistic stall)."""
    for name, value in (("matrix_params", matrix_params), ("vector_params", vector_params)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"predict: {name}={value!r} is invalid: allowed an integer >= 0")
    _check_positive("device_step_s", device_step_s)
    _check_positive("d2h_bytes_per_s", d2h_bytes_per_s)
    _check_positive("nvme_bytes_per_s", nvme_bytes_per_s, allow_none=True)
    if not 0.0 <= topk_ratio <= 1.0:
        raise ValueError(f"predict: topk_ratio={topk_ratio!r} is invalid: allowed a number in [0, 1]")
    if isinstance(update_interval, bool) or not isinstance(update_interval, int) or update_interval < 1:
        raise ValueError(f"predict: update_interval={update_interval!r} is invalid: allowed an integer >= 1")
    if handover not in ("backward", "step"):
        raise ValueError(f"predict: handover={handover!r} is invalid: allowed 'backward' or 'step'")
    if not isinstance(device_accumulation, bool):
        raise ValueError(f"predict: device_accumulation={device_accumulation!r} is invalid: allowed True or False")
    if host_threads is not None and (isinstance(host_threads, bool) or not isinstance(host_threads, int)
                                     or host_threads < 1):
        raise ValueError(f"predict: host_threads={host_threads!r} is invalid: allowed None or an integer >= 1")
    h2d = h2d_bytes_per_s if h2d_bytes_per_s is not None else d2h_bytes_per_s
    backward_s = backward_share * device_step_s
    disk_per_param = 2 * (4 + state_bytes) if nvme_bytes_per_s else 0  # master and state, read and written
    common = dict(probe=probe, device_step_s=device_step_s, backward_s=backward_s, d2h_bytes_per_s=d2h_bytes_per_s,
                  h2d_bytes_per_s=h2d, grad_bytes=grad_bytes, param_bytes=param_bytes, handover=handover,
                  disk_bytes_per_param=disk_per_param, nvme_bytes_per_s=nvme_bytes_per_s,
                  host_speed=(host_threads / probe.threads) if host_threads else 1.0)
    everything = matrix_params + vector_params
    sync = _stall(matrix_params, vector_params, everything, update_interval=1, overlap_step=False, **common)
    written_back = round((1.0 - topk_ratio) * matrix_params)
    zen = dict(common, device_accumulation=device_accumulation)
    lanes = _stall(matrix_params, vector_params, written_back, update_interval=update_interval,
                   overlap_step=overlap_step, **zen)
    hiding = next((s for s in range(1, max_update_interval + 1)
                   if _stall(matrix_params, vector_params, written_back, update_interval=s, overlap_step=True,
                             **zen)["update_wait_s"] == 0.0), None)
    per_param = host_bytes_per_param(state_bytes=state_bytes, grad_bytes=grad_bytes, param_bytes=param_bytes,
                                     overlap_step=overlap_step, device_accumulation=device_accumulation)
    on_disk = 4 + state_bytes if nvme_bytes_per_s else 0
    if nvme_bytes_per_s and device_accumulation:
        per_param -= 4  # on disk the update's reader fetches the device's sums block by block: no host sums
    return Plan(sync_offload_stall_s=sync["stall_s"], zenflow_stall_s=lanes["stall_s"], zenflow_lanes=lanes,
                smallest_hiding_update_interval=hiding, host_bytes=(per_param - on_disk) * everything,
                host_params=everything, limit=lanes["limit"], remedy=REMEDIES[lanes["limit"]],
                disk_bytes=on_disk * everything)
