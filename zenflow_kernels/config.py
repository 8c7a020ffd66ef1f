"""ZenFlow configuration: every field of docs/design.md section 3, validated, with DeepSpeed-compatible input.

A :class:`ZenFlowConfig` is immutable and valid by construction: each field is checked in
``__post_init__`` and a bad value raises :class:`ZenFlowConfigError` naming the field, the value and
the allowed domain. Build one from keyword arguments, from a ``zenflow`` block (a dict), or from a
whole DeepSpeed JSON config (a dict or a path to a file; the block is read from
``zero_optimization.zenflow``). Unknown keys are an error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["ZenFlowConfig", "ZenFlowConfigError", "ZenFlowWarning", "DEFAULT_MAX_UPDATE_INTERVAL",
           "reserved_cores_perc"]

DEFAULT_MAX_UPDATE_INTERVAL = 32
"""Default bound on a Zen-auto update interval when the select interval does not bound it."""

RESERVED_CORES_PERC_CPU = 1.0
"""``pt_reserved_cores_perc="auto"`` for CPU parameters: training and the host worker share every core (the
worker takes the threads torch leaves free; docs/benchmarks.md, *Running without a GPU*)."""
RESERVED_CORES_PERC_DEVICE = 0.5
"""``pt_reserved_cores_perc="auto"`` for parameters on an accelerator: DeepSpeed's default."""


class ZenFlowConfigError(ValueError):
    """An invalid ZenFlow setting: the message names the field, the value and what is allowed."""


class ZenFlowWarning(UserWarning):
    """A legal but probably unintended ZenFlow setting (e.g. columns that will never be re-selected)."""


_SELECT_STRATEGIES = ("auto", "step", "epoch")
_IMPORTANCES = ("l2", "l1", "random")
SEMANTICS = ("zenflow_kernels", "deepspeed")
# the choices where DeepSpeed's ZenFlow differs from ours (docs/deepspeed.md): field -> (ours, DeepSpeed's, allowed);
# semantics="deepspeed" sets each of them the user did not set to DeepSpeed's
CHOICES = {
    "gradient_scale": ("raw", "interval", ("raw", "interval")),
    "host_step_count": ("updates", "steps", ("updates", "steps")),
    "reselect_state": ("carry", "reset", ("carry", "reset")),
    "vector_state": ("continuous", "reset", ("continuous", "reset")),
    "importance": ("l2", "l1", None),
    "select_anchor": ("warm_up", "absolute", ("warm_up", "absolute")),
}
# what a param group may set for its own parameters (the rest is per run: the schedule, the link, the host)
PER_GROUP_FIELDS = ("topk_ratio", "importance")


def _fail(field: str, value: Any, allowed: str) -> ZenFlowConfigError:
    return ZenFlowConfigError(f"zenflow.{field}={value!r} is invalid: allowed {allowed}")


def is_int(value: Any) -> bool:
    # bool is an int subclass in Python; a flag where a count belongs is a bug, not a 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_cpu_ids(field: str, value: Any) -> tuple[int, ...]:
    allowed = "'auto' or a non-empty list of distinct CPU ids (integers >= 0)"
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple, range)):
        raise _fail(field, value, allowed)
    ids = tuple(value)
    if not ids or len(set(ids)) != len(ids) or not all(is_int(c) and c >= 0 for c in ids):
        raise _fail(field, value, allowed)
    return tuple(int(c) for c in ids)


def _check_fraction(field: str, value: Any, or_: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _fail(field, value, f"{or_}a number in [0, 1]")
    if not 0.0 <= float(value) <= 1.0:
        raise _fail(field, value, f"{or_}a number in [0, 1]")
    return float(value)


def _check_int(field: str, value: Any, minimum: int) -> int:
    if not is_int(value) or int(value) < minimum:
        raise _fail(field, value, f"an integer >= {minimum} (not a bool)")
    return int(value)


def _check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(field, value, "true or false")
    return value


@dataclass(frozen=True)
class ZenFlowConfig:
    """Every ZenFlow setting (docs/design.md sections 2-3). Field defaults follow DeepSpeed's, except the six choices
    below (ours; ``semantics="deepspeed"`` sets DeepSpeed's).

    topk_ratio: fraction of each matrix's columns on the fast path, ``k = max(1, floor(topk_ratio * C))``
        (``num_selected``); 0 turns the fast path off, 1 makes ZenFlow its plain update rule (AdamW, ...).
    select_strategy: ``"auto"`` (= ``"epoch"`` with ``select_interval = 1``), ``"step"`` or ``"epoch"``.
    select_interval: ``"auto"`` or an integer >= 1, in steps (``"step"``) or epochs (``"epoch"``).
        An integer given with ``"auto"`` is ignored with a :class:`ZenFlowWarning` at resolution.
    update_interval: integer >= 1, or ``"auto"`` (Zen-auto: the host update is triggered by
        gradient magnitudes, bounded by ``max_update_interval`` and the select interval).
    overlap_step: run the host update of interval n in the background during interval n+1.
    offload_device: where this rank's host state (fp32 master, the rule's state) lives: ``"cpu"`` (host
        memory, the default) or ``"nvme"`` (a file under ``nvme_path``, streamed through the host update:
        docs/nvme.md; one process, ZeRO-1/2 and FSDP2). DeepSpeed's
        ``zero_optimization.offload_optimizer = {"device": "nvme", "nvme_path": ...}`` sets both.
    nvme_path: the directory for the state files with ``offload_device="nvme"`` (else None).
    offload: keep the fast path's rule state in host memory, streamed to the device around the step.
    auto_ratio: Zen-auto triggers when at least this fraction of the matrices need an update.
    full_warm_up_rounds: steps of plain synchronous host updates (the rule's) before selection starts.
    steps_per_epoch: optimizer steps in an epoch (None, or an integer >= 1).
    pt_reserved_cores_perc: fraction of this rank's cores reserved for training; the host worker
        gets the rest. ``"auto"`` (the default): 1.0 when the parameters are on the CPU (a CPU-only run:
        training and the host worker share the cores), 0.5 (DeepSpeed's default) on a GPU; resolved when the
        optimizer is built (:meth:`reserved_cores_perc`). A number given is used as given, on any device.
    cores: the CPUs this rank's training threads and host worker use, split by ``pt_reserved_cores_perc``.
        ``"auto"`` (the default): this process's CPUs, one per physical core; with several ranks on the node
        (``LOCAL_WORLD_SIZE`` > 1, as torchrun sets it) and an affinity the launcher left whole, this local
        rank's share of them (whole cores, contiguous; ``cpu_ops.rank_cores``). A list of CPU ids (distinct
        integers >= 0, within this process's affinity: never widened) is used as given, in its order, for users
        who bind ranks themselves.
    importance: how columns are chosen: ``"l2"`` (top-k by sum of squares of the gradient's column),
        ``"l1"`` (sum of absolute values), ``"random"`` (a seeded uniform choice of k columns at every
        selection: the control experiment), or a callable ``scores(grad, param) -> [C] tensor`` (a
        researcher's own criterion: top-k of what it returns). A callable is given the step's gradient and
        the parameter as the rank holding them has them (docs/custom-loop.md) and must be deterministic.
    max_update_interval: bound on a Zen-auto interval, integer >= 1 (only used with ``"auto"``).
    device_accumulation: accumulate the matrices' gradients of an interval in one fp32 buffer on the
        device and copy the sum to the host once per update, instead of copying every step's gradient
        (``update_interval`` times fewer gradient copies, half that in bytes for bf16 gradients, for one
        fp32 device buffer the size of the model). With ``offload_device="nvme"`` the sums never cross
        whole: the host update fetches each block's piece as it streams the state file (no host
        accumulation buffer; with ``overlap_step`` a second device buffer takes the next interval's sums:
        docs/nvme.md). Not in DeepSpeed; the results are bit-identical.
    selection_seed: the seed of ``importance="random"`` (an integer >= 0): the columns of matrix ``i`` at
        step ``t`` are drawn from a generator seeded with ``(selection_seed, t, i)``, so a run, a resumed
        run and every rank draw the same.

    DeepSpeed's ZenFlow makes six choices differently (docs/deepspeed.md); each is a field here, ours by default:

    gradient_scale: ``"raw"``: the fast path steps on each step's gradient, the host on the mean of its interval's
        gradients. ``"interval"`` (DeepSpeed's: it divides the loss by its gradient-accumulation count, which
        ZenFlow sets to ``update_interval``): every gradient the optimizer reads is divided by ``update_interval``
        (the fast step, scores, clipping and its norm), and the host steps on the interval's sum of those (the mean
        over a full interval; an interval cut short by a re-selection gets less). Needs an integer
        ``update_interval``.
    host_step_count: the step number in the host update's bias correction: ``"updates"`` (the host updates this
        parameter has had) or ``"steps"`` (DeepSpeed's: the optimizer steps taken, this one included).
    reselect_state: at a re-selection, ``"carry"``: columns that stay on the fast path keep their rule state and
        step count, entering columns start from zero; ``"reset"`` (DeepSpeed's): every selected column starts
        from zero state and step 0.
    vector_state: vectors (biases, norms) on the fast path: ``"continuous"`` keeps one rule state for the whole run;
        ``"reset"`` (DeepSpeed's) starts it again from zero (step 0) at every selection.
    select_anchor: re-selections after the first, at step ``t``: ``"warm_up"``: every ``select_interval`` steps
        counted from the end of the warm-up; ``"absolute"`` (DeepSpeed's): where ``t`` is a multiple of
        ``select_interval``.
    semantics: ``"zenflow_kernels"`` (the default: the fields above as given) or ``"deepspeed"``: a preset that
        fills each of the five above and ``importance`` that was not set explicitly with DeepSpeed's choice
        (``importance="l1"``). A field set explicitly keeps its value, with a :class:`ZenFlowWarning` naming it
        where it differs from DeepSpeed's. DeepSpeed's ``gradient_scale="interval"`` needs an integer
        ``update_interval``.

    ``topk_ratio`` and ``importance`` may also be set per param group (``PER_GROUP_FIELDS``).
    """

    topk_ratio: float = 0.1
    select_strategy: str = "auto"
    select_interval: int | str = "auto"
    update_interval: int | str = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = 0.99
    full_warm_up_rounds: int = 0
    steps_per_epoch: int | None = None
    pt_reserved_cores_perc: float | str = "auto"
    cores: str | tuple[int, ...] = "auto"
    importance: str | Callable = "l2"
    max_update_interval: int = DEFAULT_MAX_UPDATE_INTERVAL
    device_accumulation: bool = False
    selection_seed: int = 0
    offload_device: str = "cpu"
    nvme_path: str | None = None
    gradient_scale: str = "raw"
    host_step_count: str = "updates"
    reselect_state: str = "carry"
    vector_state: str = "continuous"
    select_anchor: str = "warm_up"
    semantics: str = "zenflow_kernels"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise values once, here
        kept = self._apply_semantics()
        set_(self, "topk_ratio", _check_fraction("topk_ratio", self.topk_ratio))
        if self.select_strategy not in _SELECT_STRATEGIES:
            raise _fail("select_strategy", self.select_strategy, "one of 'auto', 'step', 'epoch'")
        si = self.select_interval
        if si != "auto" or isinstance(si, bool):
            set_(self, "select_interval", _check_int_or_auto("select_interval", si))
        if self.select_strategy == "step" and self.select_interval == "auto":
            raise ZenFlowConfigError(
                "zenflow.select_interval='auto' is invalid with select_strategy='step': allowed an integer "
                ">= 1 (a step count); use select_strategy='auto' or 'epoch' for a per-epoch interval"
            )
        ui = self.update_interval
        if ui != "auto" or isinstance(ui, bool):
            set_(self, "update_interval", _check_int_or_auto("update_interval", ui))
        set_(self, "overlap_step", _check_bool("overlap_step", self.overlap_step))
        set_(self, "offload", _check_bool("offload", self.offload))
        set_(self, "auto_ratio", _check_fraction("auto_ratio", self.auto_ratio))
        set_(self, "full_warm_up_rounds", _check_int("full_warm_up_rounds", self.full_warm_up_rounds, 0))
        if self.steps_per_epoch is not None:
            set_(self, "steps_per_epoch", _check_int("steps_per_epoch", self.steps_per_epoch, 1))
        if not (isinstance(self.pt_reserved_cores_perc, str) and self.pt_reserved_cores_perc == "auto"):
            set_(self, "pt_reserved_cores_perc",
                 _check_fraction("pt_reserved_cores_perc", self.pt_reserved_cores_perc, "'auto' or "))
        if not (isinstance(self.cores, str) and self.cores == "auto"):
            set_(self, "cores", _check_cpu_ids("cores", self.cores))
        set_(self, "importance", check_importance("importance", self.importance))
        set_(self, "max_update_interval", _check_int("max_update_interval", self.max_update_interval, 1))
        set_(self, "device_accumulation", _check_bool("device_accumulation", self.device_accumulation))
        set_(self, "selection_seed", _check_int("selection_seed", self.selection_seed, 0))
        if self.offload_device not in ("cpu", "nvme"):
            raise _fail("offload_device", self.offload_device, "'cpu' or 'nvme'")
        if self.nvme_path is not None and not isinstance(self.nvme_path, (str, os.PathLike)):
            raise _fail("nvme_path", self.nvme_path, "a directory path (str) or None")
        if self.nvme_path is not None:
            set_(self, "nvme_path", os.fspath(self.nvme_path))
        if self.offload_device == "nvme" and self.nvme_path is None:
            raise _fail("nvme_path", None, "a directory for the state files when offload_device='nvme'")
        if self.offload_device == "cpu" and self.nvme_path is not None:
            raise _fail("nvme_path", self.nvme_path, "None when offload_device='cpu' (it would be ignored)")
        if (
            self.select_strategy == "step"
            and is_int(self.update_interval)
            and self.select_interval < self.update_interval
        ):
            raise interval_order_error(self.select_interval, self.update_interval)
        if self.gradient_scale == "interval" and not is_int(self.update_interval):
            if self.semantics == "deepspeed" and "gradient_scale" not in self._given:
                raise ZenFlowConfigError(
                    f"zenflow.semantics='deepspeed' with update_interval={self.update_interval!r} is invalid: "
                    "DeepSpeed divides each gradient by its accumulation count, which ZenFlow sets to "
                    "update_interval (gradient_scale='interval'), and 'auto' fixes none. Allowed: an integer "
                    "update_interval >= 1 (DeepSpeed's gradient_accumulation_steps), or gradient_scale='raw' to keep "
                    "update_interval='auto' (or semantics='zenflow_kernels')")
            raise _fail("gradient_scale", "interval", "'raw' with update_interval='auto' ('interval' divides the "
                        "gradients by update_interval, which 'auto' does not fix)")
        # (valid: warned once, after every check passed; `explain` reports it too)
        set_(self, "notes", ("zenflow: semantics='deepspeed' fills the fields not set with DeepSpeed's choices; "
                             "these were set explicitly and keep their value: " + "; ".join(kept),) if kept else ())
        for note in self.notes:
            warnings.warn(note, ZenFlowWarning, stacklevel=4)  # (the caller of __init__)

    # ``notes`` (not a field: no annotation): what was warned of at construction (fields set explicitly against
    # semantics="deepspeed"), set by __post_init__; ``explain`` prints it
    notes = ()

    def _apply_semantics(self) -> list[str]:
        """``semantics``: checked; with "deepspeed", each of the six choices the caller did not set takes
        DeepSpeed's value. Returns those set explicitly to another value than DeepSpeed's (they keep it), described
        for the warning."""
        if not isinstance(self.semantics, str) or self.semantics not in SEMANTICS:
            raise _fail("semantics", self.semantics, "'zenflow_kernels' or 'deepspeed'")
        kept = []
        for name, (_ours, theirs, allowed) in CHOICES.items():
            value = getattr(self, name)
            if allowed is not None and (not isinstance(value, str) or value not in allowed):
                raise _fail(name, value, " or ".join(map(repr, allowed)))
            if self.semantics != "deepspeed":
                continue
            if name not in self._given:
                object.__setattr__(self, name, theirs)
            elif not (isinstance(value, str) and value == theirs):
                kept.append(f"{name}={value!r} (DeepSpeed's: {theirs!r})")
        return kept

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, source: dict | str | os.PathLike | None = None, **overrides: Any) -> ZenFlowConfig:
        """Build from a ``zenflow`` block, a ``{"zenflow": {...}}`` wrapper, a whole DeepSpeed config
        (reading ``zero_optimization.zenflow``), or a path to a JSON file holding any of these.
        Keyword ``overrides`` replace fields of the block. Unknown keys raise, naming them."""
        if source is None:
            block: dict = {}
        elif isinstance(source, (str, os.PathLike)):
            block = _zenflow_block(_read_json(source), where=str(source))
        elif isinstance(source, dict):
            block = _zenflow_block(source, where="the config dict")
        else:
            raise ZenFlowConfigError(
                f"zenflow config source of type {type(source).__name__} is invalid: allowed a dict, "
                "a path to a JSON file, or None"
            )
        merged = {**block, **overrides}
        unknown = [key for key in merged if key not in cls.field_names()]
        if unknown:
            raise ZenFlowConfigError(_unknown_keys_message(unknown, cls.field_names()))
        return cls(**merged)

    @classmethod
    def coerce(cls, value: ZenFlowConfig | dict | str | os.PathLike | None) -> ZenFlowConfig:
        """Accept what optimizers take as ``zenflow=``: a config, a dict, a JSON path, or None."""
        if isinstance(value, ZenFlowConfig):
            return value
        return cls.from_dict(value)

    def replace(self, **changes: Any) -> ZenFlowConfig:
        """A copy with some fields changed (validated again). The fields set explicitly stay so, the others are
        resolved again (a ``semantics`` changed here fills them anew)."""
        unknown = [key for key in changes if key not in self.field_names()]
        if unknown:
            raise ZenFlowConfigError(_unknown_keys_message(unknown, self.field_names()))
        given = getattr(self, "_given", self.field_names())
        return type(self)(**{name: getattr(self, name) for name in given if name not in changes}, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The ``zenflow`` block as a plain, JSON-serialisable dict."""
        return dataclasses.asdict(self)

    # -- derived values ---------------------------------------------------------------------------

    def reserved_cores_perc(self, device_type: str) -> float:
        """``pt_reserved_cores_perc`` for parameters on a device of type ``device_type`` (``"cpu"``,
        ``"cuda"``, ...): the number given, or what ``"auto"`` resolves to there (:func:`reserved_cores_perc`)."""
        return reserved_cores_perc(self.pt_reserved_cores_perc, device_type)

    def num_selected(self, num_columns: int) -> int:
        """``k`` for a matrix of ``num_columns`` columns at this config's ``topk_ratio`` (:func:`num_selected`)."""
        return num_selected(self.topk_ratio, num_columns)


def _recording_init(init: Callable) -> Callable:
    """The dataclass ``__init__``, noting first which fields the caller set explicitly (``_given``): a default cannot
    be told from a value equal to it afterwards, and ``semantics="deepspeed"`` fills only the others
    (``_apply_semantics``; ``replace`` keeps them so). Its signature stays the dataclass's (``functools.wraps``)."""

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_given", frozenset(ZenFlowConfig.field_names()[: len(args)]) | frozenset(kwargs))
        init(self, *args, **kwargs)

    return __init__


ZenFlowConfig.__init__ = _recording_init(ZenFlowConfig.__init__)


def reserved_cores_perc(value: float | str, device_type: str) -> float:
    """The ``pt_reserved_cores_perc`` a run uses: ``value`` when it is a number; for ``"auto"``,
    ``RESERVED_CORES_PERC_CPU`` (1.0) when the parameters are on the CPU, where the training thread and the
    host worker share the cores, else ``RESERVED_CORES_PERC_DEVICE`` (0.5, DeepSpeed's default)."""
    if isinstance(value, str) and value == "auto":
        return RESERVED_CORES_PERC_CPU if device_type == "cpu" else RESERVED_CORES_PERC_DEVICE
    return _check_fraction("pt_reserved_cores_perc", value, "'auto' or ")


def num_selected(topk_ratio: float, num_columns: int) -> int:
    """``k = max(1, floor(topk_ratio * C))`` when ``topk_ratio > 0`` (DeepSpeed's rule: a narrow matrix, such
    as a LoRA factor with 4 columns, still gets one fast column), 0 when ``topk_ratio == 0`` or the matrix
    has no columns. The floor is taken of the decimal the user wrote (0.29 * 100 is 29, not the 28 that
    binary floating point gives)."""
    if not is_int(num_columns) or num_columns < 0:
        raise ValueError(f"num_columns={num_columns!r} is invalid: allowed an integer >= 0")
    if topk_ratio == 0 or num_columns == 0:
        return 0
    return max(1, int(math.floor(Fraction(repr(topk_ratio)) * int(num_columns))))


_PER_RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(ZenFlowConfig)) - set(PER_GROUP_FIELDS)


def check_importance(field: str, value: Any) -> str | Callable:
    """``importance``: one of 'l2', 'l1', 'random', or a callable scorer."""
    if callable(value) or (isinstance(value, str) and value in _IMPORTANCES):
        return value
    raise _fail(field, value, "'l2', 'l1', 'random' or a callable scores(grad, param) -> [C] tensor")


def check_group_settings(group: dict, where: str) -> None:
    """A param group's ZenFlow settings: ``topk_ratio`` and ``importance`` are its own (validated as the
    config's); any other ZenFlow field is per run and refused, naming it."""
    per_run = [k for k in group if k in _PER_RUN_FIELDS]
    if per_run:
        raise ZenFlowConfigError(
            f"{where}: {', '.join(map(repr, per_run))} cannot be set per param group: allowed per group "
            f"{', '.join(map(repr, PER_GROUP_FIELDS))} (the other ZenFlow settings are per run: zenflow=...)")
    try:
        if "topk_ratio" in group:
            _check_fraction("topk_ratio", group["topk_ratio"])
        if "importance" in group:
            check_importance("importance", group["importance"])
    except ZenFlowConfigError as exc:
        raise ZenFlowConfigError(f"{where}: {exc}") from None


def _check_int_or_auto(field: str, value: Any) -> int | str:
    if value == "auto" and isinstance(value, str):
        return value
    if not is_int(value) or int(value) < 1:
        raise _fail(field, value, "'auto' or an integer >= 1 (not a bool)")
    return int(value)


def interval_order_error(select_interval: int, update_interval: int) -> ZenFlowConfigError:
    return ZenFlowConfigError(
        f"zenflow.select_interval resolves to {select_interval} steps, which is below "
        f"zenflow.update_interval={update_interval}: allowed select_interval >= update_interval "
        "(an accumulation interval may not straddle a re-selection)"
    )


def _unknown_keys_message(unknown: list[str], known: tuple[str, ...]) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=_SUGGEST_CUTOFF)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown zenflow key(s): {', '.join(parts)}; allowed keys: {', '.join(known)}"


def _read_json(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ZenFlowConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ZenFlowConfigError(f"config file {str(path)!r} is a directory, not a JSON file") from None
    except json.JSONDecodeError as exc:
        raise ZenFlowConfigError(
            f"config file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ZenFlowConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ZenFlowConfigError(f"config file {str(path)!r} holds a JSON {type(data).__name__}: allowed a JSON object")
    return data


# the top-level keys of a DeepSpeed config (besides zero_optimization) that a zenflow block never holds: a dict with
# one of them and no zero_optimization is a DeepSpeed config without ZenFlow, not a zenflow block with unknown keys
DEEPSPEED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "prescale_gradients",
    "gradient_predivide_factor", "zero_allow_untested_optimizer", "activation_checkpointing", "flops_profiler",
    "communication_data_type", "tensorboard", "wandb", "csv_monitor", "comms_logger", "aio", "checkpoint",
    "data_types", "compression_training", "elasticity", "pipeline", "sparse_attention", "dump_state",
})
_WRAPPERS = ("zero_optimization", "zenflow")
_SUGGEST_CUTOFF = 0.8  # difflib similarity for "did you mean": typos, not merely related names


def _section(zero: dict, key: str, where: str) -> dict:
    """``zero_optimization.<key>`` (offload_param / offload_optimizer): an object, or {} where absent (or null)."""
    value = zero.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ZenFlowConfigError(
            f"zero_optimization.{key}={value!r} in {where} is invalid: allowed an object such as "
            '{"device": "cpu"} (DeepSpeed\'s form; a bare string is not read as a device)')
    return value


def _device(section: dict, key: str, where: str, allowed: tuple[str, ...], why: str) -> str | None:
    """``zero_optimization.<key>.device``, lower-cased: one of ``allowed``, None where absent, or an error naming it."""
    device = section.get("device")
    if device is None:
        return None
    if not isinstance(device, str) or device.lower() not in allowed:
        raise ZenFlowConfigError(
            f"zero_optimization.{key}.device={device!r} in {where} is not supported: allowed "
            f"{' or '.join(map(repr, allowed))} ({why})")
    return device.lower()


def _deepspeed_zero(zero: Any, where: str) -> dict:
    """The zenflow block of a DeepSpeed config's ``zero_optimization``, with what ZenFlow reads of the rest (the
    offload devices and ``stage``) checked: a setting it cannot honour is refused, naming it, rather than read as
    something else."""
    if not isinstance(zero, dict) or "zenflow" not in zero:
        raise ZenFlowConfigError(f"{where} is a DeepSpeed config without a zero_optimization.zenflow block")
    stage = zero.get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2)):
        raise ZenFlowConfigError(
            f"zero_optimization.stage={stage!r} in {where} is not supported: allowed 0, 1 or 2 (ZenFlow's ZeRO-1/2 "
            "is the optimizer's zero_stage argument, docs/torchrun.md; for ZeRO-3's sharded parameters use FSDP2, "
            "docs/fsdp2.md)")
    _device(_section(zero, "offload_param", where), "offload_param", where, ("cpu", "none"),
            "ZenFlow keeps the parameters on the device; NVMe would otherwise be silently ignored. The "
            "optimizer's state can go to NVMe: offload_optimizer.device=\"nvme\"")
    optimizer = _section(zero, "offload_optimizer", where)
    device = _device(optimizer, "offload_optimizer", where, ("cpu", "nvme"),
                     "ZenFlow keeps the optimizer's state in host memory, or with \"nvme\" in files under nvme_path; "
                     "it cannot keep it on the device")
    block = dict(zero["zenflow"]) if isinstance(zero["zenflow"], dict) else zero["zenflow"]
    if isinstance(block, dict) and device == "nvme":
        # DeepSpeed's form of offload_device="nvme" (the zenflow block's own keys win)
        block.setdefault("offload_device", "nvme")
        block.setdefault("nvme_path", optimizer.get("nvme_path"))
    return block


def _zenflow_block(data: dict, where: str) -> dict:
    """The zenflow block of a DeepSpeed config, a {"zenflow": ...} wrapper, or the block itself."""
    if "zero_optimization" in data:
        block = _deepspeed_zero(data["zero_optimization"], where)
    elif "zenflow" in data:
        block = data["zenflow"]
    else:
        for key in data:  # a misspelt wrapper would otherwise read as a zenflow block with unknown keys
            close = difflib.get_close_matches(str(key), _WRAPPERS, n=1, cutoff=_SUGGEST_CUTOFF)
            if close:
                raise ZenFlowConfigError(
                    f"unknown key {key!r} in {where} (did you mean {close[0]!r}?): allowed a DeepSpeed config with a "
                    "zero_optimization.zenflow block, a {'zenflow': ...} wrapper, or the zenflow block itself")
        deepspeed = sorted(str(key) for key in data if key in DEEPSPEED_KEYS)
        if deepspeed:
            raise ZenFlowConfigError(
                f"{where} is a DeepSpeed config (it has {', '.join(map(repr, deepspeed))}) without a "
                "zero_optimization block: allowed a DeepSpeed config with a zero_optimization.zenflow block, a "
                "{'zenflow': ...} wrapper, or the zenflow block itself")
        block = data
    if not isinstance(block, dict):
        raise ZenFlowConfigError(
            f"the zenflow block in {where} is a {type(block).__name__}: allowed a JSON object / dict"
        )
    return dict(block)


def check_adamw_hyperparameters(
    lr: Any, betas: Any, eps: Any, weight_decay: Any, max_grad_norm: Any = None, where: str = "ZenFlowAdamW"
) -> None:
    """Validate AdamW hyper-parameters (shared by the optimizer and the reference); raise ValueError."""

    def bad(name: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"{where}: {name}={value!r} is invalid: allowed {allowed}")

    def real(value: Any) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    check_lr(lr, where)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(real(b) and 0 <= b < 1 for b in betas):
        raise bad("betas", betas, "a pair of numbers in [0, 1)")
    if not real(eps) or eps < 0:
        raise bad("eps", eps, "a finite number >= 0")
    if not real(weight_decay) or weight_decay < 0:
        raise bad("weight_decay", weight_decay, "a finite number >= 0")
    check_max_grad_norm(max_grad_norm, where)


LR_ALLOWED = "a finite number >= 0, or a 1-element floating-point tensor holding one (as torch.optim takes it)"


def check_lr(lr: Any, where: str) -> float:
    """A learning rate as ``torch.optim.AdamW`` takes it: a finite real number >= 0, or a 1-element floating-point
    tensor holding one (a scheduler then writes into it in place). Its value as a float, or a ValueError naming
    ``lr``, its value and what is allowed (for every update rule and the AdamW facade alike)."""
    value = lr
    torch = sys.modules.get("torch")  # (a tensor exists only if torch was imported: no import here)
    if torch is not None and isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.dtype.is_floating_point or lr.is_complex():
            raise ValueError(f"{where}: lr={lr!r} is invalid: allowed {LR_ALLOWED}")
        value = float(lr)
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{where}: lr={lr!r} is invalid: allowed {LR_ALLOWED}")
    return float(value)


def check_max_grad_norm(max_grad_norm: Any, where: str) -> None:
    """``max_grad_norm`` None or a finite number > 0, or a ValueError naming it (for any update rule)."""
    ok = max_grad_norm is None or (isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool)
                                   and math.isfinite(max_grad_norm) and max_grad_norm > 0)
    if not ok:
        raise ValueError(f"{where}: max_grad_norm={max_grad_norm!r} is invalid: allowed None or a finite number > 0")
