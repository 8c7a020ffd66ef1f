"""What a run did: the step, fast-path and host-update times, selections, what the link moved (``stats()``), and the
optimizer's host memory by buffer (``host_bytes()``). Outlives links: a ``load_state_dict`` keeps the old link's
counters."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from ..rules.compiled import paths

__all__ = ["Telemetry", "host_bytes"]

_LINK_COUNTERS = ("waited_s", "accumulate_s", "fold_s", "d2h_bytes", "h2d_bytes", "early_bytes", "unused_bytes",
                  "landed_checked_bytes")


class Telemetry:
    def __init__(self):
        self.step_seconds: list[float] = []
        self.fast_seconds: list[float] = []
        self.host_seconds: list[float] = []
        self.sync_host_seconds = 0.0  # host updates run on the training thread
        self.link_totals = dict.fromkeys(_LINK_COUNTERS, 0.0)  # of links replaced by load_state_dict
        self.first_step_start: float | None = None  # wall clock of the run: training, not only step()
        self.last_step_end: float | None = None
        self.selection_steps: list[int] = []
        self.jaccard: list[float] = []
        self.captured: list[float] = []
        self.concentration: dict[str, list[float]] = {"top1": [], "top10": [], "selected": []}
        self.matrix_concentration: dict[int, dict] = {}  # parameter index -> its shares at its last selection

    @contextlib.contextmanager
    def timed_step(self) -> Iterator[None]:
        """Time a step that changes the state (a skipped or failed step is not counted); the first one starts the
        run's wall clock."""
        t0 = time.perf_counter()
        if self.first_step_start is None:
            self.first_step_start = t0
        yield
        self.last_step_end = time.perf_counter()
        self.step_seconds.append(self.last_step_end - t0)

    @contextlib.contextmanager
    def timed_fast_step(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.fast_seconds.append(time.perf_counter() - t0)

    def retire(self, link) -> None:
        """Keep a link's counters before it is replaced."""
        for name in _LINK_COUNTERS:
            self.link_totals[name] += getattr(link, name)

    def record_selection(self, t: int, jaccards: list[float], captured: float, shares: dict | None = None) -> None:
        """A selection at step ``t``; ``shares``: ``concentration.concentration``'s, with the matrices' ``indices``."""
        self.selection_steps.append(t)
        self.jaccard.append(sum(jaccards) / len(jaccards) if jaccards else float("nan"))
        self.captured.append(captured)
        if shares is not None:
            for name, values in self.concentration.items():
                values.append(shares[name])
            for i, row in zip(shares["indices"], shares["per_matrix"], strict=True):
                self.matrix_concentration[i] = row

    def host_update(self, seconds: float, *, waited: bool) -> None:
        """A host update took ``seconds``; ``waited``: on the training thread (synchronous), so all of it stall."""
        self.host_seconds.append(seconds)
        if waited:
            self.sync_host_seconds += seconds

    def summary(self, *, counters: dict, link, overlap: bool, host_bytes: dict, handover, cores: dict,
                collective_bytes: dict, rule) -> dict:
        """``ZenFlowAdamW.stats()``: ``counters`` are the optimizer's (:data:`checkpoint.COUNTERS`); ``link`` the
        live one (None before the first step); ``rule`` the update rule (``rule_paths``: which path it runs on the
        host and on the fast path, its own kernel, compiled or eager, and why:
        :func:`zenflow_kernels.rules.compiled.paths`).

        ``stall_s``: time the training thread spent on the host path instead of training: synchronous
        host updates, gradient accumulation it does itself (CPU runs; ``accumulate_s``) and waits for the
        background worker (``worker_wait_s``). ``stall_fraction``: that over the wall time from the first
        ``step()`` to the end of the last, forward and backward included. ``overlap_fraction``: share of
        the background host-update time the training thread did not wait for. Also per-step fast-path
        time, host-update times, skipped steps, the share of score mass the selected columns captured
        at each selection, and the Jaccard overlap of each new selection with the previous one. Under ZeRO,
        ``collective_bytes`` (and ``collective_bytes_per_step``): the payload bytes each kind of collective
        carried (docs/torchrun.md). ``host_bytes``: see :func:`host_bytes`."""
        def mean(xs):
            return sum(xs) / len(xs) if xs else 0.0

        t = counters["t"]
        wall = self.last_step_end - self.first_step_start if self.first_step_start is not None else 0.0
        moved = {name: total + (getattr(link, name) if link else 0) for name, total in self.link_totals.items()}
        waited, accumulated = moved["waited_s"], moved["accumulate_s"]
        # stall: the training thread did host work itself or waited for it, instead of training
        stall = self.sync_host_seconds + accumulated + waited
        host_total = sum(self.host_seconds)
        hidden = max(0.0, host_total - waited) if overlap else 0.0
        return {
            "rule_paths": paths(rule),
            "steps": t,
            "skipped_steps": counters["skipped_steps"],
            "host_updates": counters["host_updates"],
            "selections": counters["selections"],
            "wall_s": wall,
            "step_s_mean": mean(self.step_seconds),  # inside step()
            "fast_path_s_mean": mean(self.fast_seconds),
            "fast_path_s": list(self.fast_seconds),
            "host_update_s_mean": mean(self.host_seconds),
            "host_update_s": list(self.host_seconds),
            "stall_s": stall,
            "accumulate_s": accumulated,
            # the accumulate worker's time folding the landing area into the sums (asynchronous link; beside
            # training, not stall: waits for it are in worker_wait_s)
            "fold_s": moved["fold_s"],
            "worker_wait_s": waited,
            # of the wall time from the first step() to the end of the last: forward and backward included
            "stall_fraction": stall / wall if wall > 0 else 0.0,
            "overlap_fraction": hidden / host_total if host_total > 0 else 0.0,
            "score_mass_captured": list(self.captured),
            # the gradient's energy shares at each selection (zenflow_kernels.concentration): in the top 1% and 10%
            # of each matrix's columns and in the selected ones, over all matrices; per matrix at its last
            "concentration": {**{k: list(v) for k, v in self.concentration.items()},
                              "per_matrix": dict(self.matrix_concentration)},
            "selection_jaccard": list(self.jaccard),
            "selection_steps": list(self.selection_steps),
            # what the link moved: gradients device -> host, weights host -> device (on a CPU link the
            # same logical bytes, copied within host memory)
            "link": link.kind if link is not None else None,
            "d2h_bytes": int(moved["d2h_bytes"]),
            "h2d_bytes": int(moved["h2d_bytes"]),
            "d2h_bytes_per_step": moved["d2h_bytes"] / t if t else 0.0,
            # of them, gradient bytes that crossed during backward (copied by backward's hooks, used by step()),
            # and bytes hooks copied that were not used (copied again after a change or by a later backward's
            # hook, or dropped with a skipped step or batch): docs/design.md section 5.1
            "d2h_bytes_in_backward": int(moved["early_bytes"]),
            "d2h_bytes_unused": int(moved["unused_bytes"]),
            # hook copies of gradients written in place during their backward: what landed was fingerprinted on the
            # host at step() (copied again where it differed): docs/design.md section 5.1
            "d2h_bytes_landed_checked": int(moved["landed_checked_bytes"]),
            "h2d_bytes_per_step": moved["h2d_bytes"] / t if t else 0.0,
            # ZeRO: payload bytes each kind of collective carried (gradients, gradient presence, write-back,
            # host state, clipping norm, checkpoint); empty on one rank
            "host_bytes": host_bytes,
            # gradients crossing during backward (docs/design.md section 5.1): "on" or "off", and why
            "handover": handover.mode,
            "handover_why": handover.why,
            # the CPUs of training's threads and of the host worker, and why (zenflow.cores); {} before the first step
            "cores": cores,
            "collective_bytes": dict(collective_bytes),
            "collective_bytes_per_step": {k: v / t for k, v in collective_bytes.items()} if t else {},
        }


def host_bytes(run, device_sums: list[torch.Tensor]) -> dict:
    """``ZenFlowAdamW.host_bytes()`` of a built optimizer: its host memory, by buffer, in bytes as allocated (each
    buffer's storage): ``master`` and each of the update rule's state fields (AdamW: ``exp_avg``, ``exp_avg_sq``;
    Lion: ``exp_avg``; SGD with momentum: ``momentum_buffer``), ``accumulation`` (one or two
    buffers), ``copy_out`` (one per parameter dtype, sized by that dtype's parameters), ``landing`` (an
    asynchronous link's landing area, laid out like the copy-out: a step's gradients in their dtype until
    ``step()`` folds them into the sums; 0 on the synchronous link and with ``device_accumulation``),
    ``receive`` (ZeRO: the other ranks' copy-out buffers as this rank receives them for the write-back, reused;
    0 on one rank), their sum ``total`` and ``per_parameter`` (over the parameters this rank's host holds:
    under ZeRO its own run). Beside them, not in ``total``:
    ``fast_state`` (the fast path's Adam state in host memory: on a CPU run, or offloaded) and
    ``device_sums`` (``device_accumulation``'s buffer when the device is the CPU), and with
    ``offload_device="nvme"`` ``disk`` (the state file: master and rule state, 12 bytes per parameter for AdamW;
    then the master's and the rule state's entries are 0 and the update's block buffers are not counted; with
    ``device_accumulation`` ``accumulation`` is 0 and ``sums_blocks``, in ``total``, the blocks the update
    fetches the device's sums into). On a GPU also
    ``pinned_requested`` and ``pinned_reserved`` (the page-locked bytes of those buffers: whole pages of
    their own; docs/design.md section 9)."""
    link, host, local, state = run.link, run.host, run.local, run.state
    out = link.host_bytes()
    out["receive"] = run.shard.host_bytes()  # ZeRO: the other ranks' copy-out as this rank receives it
    total = sum(v for k, v in out.items() if k != "disk")  # memory only: the state file's bytes are beside it
    held = sum(local[i].numel() for i in host.slots)
    storages = {}  # views share their storage (the flat step counts): each counted once
    for st in state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.device.type == "cpu":
                storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    fast = sum(storages.values())
    out.update(total=total, per_parameter=total / held if held else 0.0, fast_state=fast,
               device_sums=sum(t.untyped_storage().nbytes() for t in device_sums if t.device.type == "cpu"))
    out.update(link.pinned_bytes())
    return out
