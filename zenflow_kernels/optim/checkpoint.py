"""The checkpoint format of ``ZenFlow`` with any update rule (``ZenFlowAdamW`` too; docs/design.md section 2 item
7): what ``state_dict()`` writes and ``load_state_dict()`` reads, as functions over the parts of a built optimizer.

Format ``FORMAT`` (``state_dict()["zenflow"]["format"]``; dicts written before the key existed are format 1, the
same layout): ``state`` by parameter position, each entry holding the fast path's state (``selected``, the update
rule's ``state_names`` (AdamW: ``exp_avg``, ``exp_avg_sq``), ``master``, ``step``, Zen-auto's running means) and, for
the parameters whose host state this rank holds, ``host_master``, ``host_<name>`` of each state name, ``host_step``
and the interval's sums ``acc``; every
entry has ``acc_count`` and ``pending`` (a host result awaiting its write-back) and, inside ``flushed()``,
``unflushed`` (the weights training continues from). ``param_groups`` as torch writes them; ``zenflow`` the
counters, the config, the schedule, ``max_grad_norm``, ``seed_from_host``, ``built``, ``zero`` (stage, world,
rank, consolidated), ``host_params``, the parameters with host state (a frozen one has none; a dict without the
key: all of them) and ``rule`` (the update rule's ``to_dict()``; a dict without it: AdamW's). A checkpoint of one rule
is refused by an optimizer of another.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import torch

from ..config import CHOICES, ZenFlowConfig, ZenFlowWarning, check_adamw_hyperparameters
from ..schedule import Schedule
from .interval import HostInterval
from .run import BuiltOptimizer

__all__ = ["FORMAT", "COUNTERS", "header", "pack", "before_pack", "Loaded", "read", "unpack", "restore",
           "unpack_torch_adamw", "restore_torch_adamw"]

FORMAT = 2
"""The format this version writes; it reads formats 1 and 2."""

COUNTERS = ("t", "skipped_steps", "host_updates", "selections", "steps_accumulated")

_HOST_KEYS = frozenset({"host_step", "acc", "acc_count", "pending", "unflushed"})


def host_keys(rule) -> frozenset:
    """The keys of a state entry that hold host state (the rest is the fast path's)."""
    return _HOST_KEYS | {f"host_{name}" for name in ("master", *rule.state_names)}


def header(counters: dict, *, config: ZenFlowConfig, schedule: Schedule, max_grad_norm, seed_from_host: bool,
           zero_stage: int, shard, consolidated: bool, rule) -> dict:
    """The ``zenflow`` entry but ``format`` and ``built`` (:func:`pack` adds them): the optimizer's ``counters``
    (:data:`COUNTERS`), its settings, its update rule and how the ranks held the state."""
    return dict(counters, config=config_record(config), schedule=schedule.to_dict(), max_grad_norm=max_grad_norm,
                seed_from_host=seed_from_host, rule=rule.to_dict(),
                zero=dict(stage=zero_stage, world=shard.world, rank=shard.rank, consolidated=consolidated))


def config_record(config: ZenFlowConfig) -> dict:
    """The config as a checkpoint records it: every field, but DeepSpeed's choices (``config.CHOICES``, and
    ``semantics``) only where they are not ours, so a checkpoint of a run with our choices has the keys it had
    before they existed (a DCP load plans by the keys of the state dict it loads into). Under
    ``semantics="deepspeed"`` every choice is recorded: one kept at ours against it must not read back as
    DeepSpeed's."""
    record = config.to_dict()
    for name in (*CHOICES, "semantics"):
        if name != "importance" and record[name] == ZenFlowConfig.__dataclass_fields__[name].default and (
                name == "semantics" or config.semantics != "deepspeed"):
            del record[name]
    return record


def pack_groups(param_groups: list[dict], group_of: list[int]) -> list[dict]:
    """``param_groups`` as torch writes them: each group's settings and its parameters' positions."""
    groups = []
    for gi, g in enumerate(param_groups):
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [i for i, grp in enumerate(group_of) if grp == gi]
        groups.append(packed)
    return groups


@torch.no_grad()
def pack(run: BuiltOptimizer | None, interval: HostInterval | None, *, groups: list[dict], zenflow: dict,
         consolidated: bool) -> dict:
    """The state dict of an optimizer (``run``/``interval`` None before its first step). ``zenflow``: its counters
    and settings (``format`` and ``built`` are added here). The caller has drained and synchronized."""
    state: dict[int, dict] = {}
    zenflow = dict(zenflow, format=FORMAT, built=run is not None)
    if run is None:
        return {"state": state, "param_groups": groups, "zenflow": zenflow}
    zenflow["host_params"] = sorted(run.host_params)
    host, names = run.host, run.host.names  # ("master", *the rule's state names)
    # on disk: the host state and the interval's sums handed out as views of one file-backed copy, never whole in
    # memory
    snap = None if consolidated else host.snapshot(interval.sums_flat())
    for i, p in enumerate(run.params):
        st = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in run.state[p].items()}
        st.update(acc_count=interval.counted(i), pending=i in interval.pending)
        if interval.unflushed is not None and i in interval.unflushed:  # inside flushed(): what training holds
            st["unflushed"] = interval.unflushed[i]
        if consolidated and i in run.host_params:  # every parameter's host state, from the rank holding it
            st.update({f"host_{name}": run.from_host(i, name).to("cpu") for name in names})
            st.update(host_step=run.host_step(i),
                      acc=run.shard.checkpoint_tensor(i, lambda i=i: interval.sums_of(i), tuple(run.local[i].shape)))
        elif i in host.slots:
            st.update({f"host_{name}": host.view(snap[k], i) if snap is not None else host.field(name, i).clone()
                       for k, name in enumerate(names)})
            st.update(host_step=host.host_step[i],
                      acc=host.view(snap[len(names)], i) if snap is not None else interval.sums_of(i))
        state[i] = st
    return {"state": state, "param_groups": groups, "zenflow": zenflow}


def before_pack(run: BuiltOptimizer, interval: HostInterval) -> None:
    """Before :func:`pack`: a failed host update refused (it may have left half its result: no torn state handed
    out), the in-flight one drained (its result stays pending), the accumulation, write-backs and offloaded state
    landed."""
    run.link.check()
    interval.drain()
    run.link.synchronize()


@dataclasses.dataclass
class Loaded:
    """A checked state dict, ready to apply: the settings, each param group's values to update, the counters,
    whether the saved optimizer was built and ``restore(run, interval, to_state)`` to write its state into the
    rebuilt one."""

    config: ZenFlowConfig
    schedule: Schedule | dict  # the loading optimizer's own, or the checkpoint's record to make one from
    max_grad_norm: float | None
    seed_from_host: bool
    groups: list[dict]
    counters: dict[str, int]
    built: bool
    restore: Callable[[BuiltOptimizer, HostInterval, Callable], None]
    changed: list[str]  # settings of the checkpoint that differ from the loading optimizer's
    host_params: set[int]  # the parameters that had host state (they keep it whatever requires_grad says now)


def check_form(state_dict, n_groups: int, group_sizes: list[int], name: str = "ZenFlow") -> None:
    """A state dict with ``state`` and ``param_groups`` matching this optimizer's groups, or an error naming the
    optimizer (``name``: ``build.display_name``)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) or not \
            isinstance(state_dict.get("state"), dict):
        raise ValueError(
            f"{name}.load_state_dict: expected a state dict with 'state' and 'param_groups' (from "
            f"{name}.state_dict() or torch.optim.AdamW/Adam.state_dict()), got {type(state_dict).__name__}"
            + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else "")
        )
    groups = state_dict["param_groups"]
    if len(groups) != n_groups:
        raise ValueError(
            f"{name}.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
            f"{n_groups}: the param groups do not match this optimizer's"
        )
    for gi, (saved, size) in enumerate(zip(groups, group_sizes, strict=True)):
        if len(saved.get("params", ())) != size:
            raise ValueError(f"{name}.load_state_dict: param group {gi} holds {len(saved.get('params', ()))} "
                             f"parameters in the state dict, {size} in this optimizer: the param groups do not match")


def read(state_dict, *, params: list[torch.Tensor], group_of: list[int], group_sizes: list[int], shard,
         config: ZenFlowConfig, schedule: Schedule, max_grad_norm, rule, name: str | None = None) -> Loaded:
    """Check a state dict for the loading optimizer (its ``params``, their param groups, its ``shard``ing and
    settings): a ZenFlow one (:func:`unpack`), a torch AdamW/Adam one (:func:`unpack_torch_adamw`: rules.AdamW
    only), or an error.
    FSDP2: the dict is in torch.distributed.checkpoint's form first. ``name``: what errors call the optimizer
    (``build.display_name``; by default ``ZenFlow(<rule name>)``)."""
    name = name or f"ZenFlow({rule.name})"
    state_dict = shard.import_state_dict(state_dict)
    check_form(state_dict, len(group_sizes), group_sizes, name)
    if "zenflow" not in state_dict:  # a torch AdamW/Adam run to continue
        if rule.name != "AdamW":
            raise ValueError(f"{name}.load_state_dict: the state dict has no 'zenflow' entry (a torch "
                             "optimizer's): continuing a torch optimizer's run is supported for rules.AdamW only")
        return unpack_torch_adamw(state_dict, params, config, schedule, max_grad_norm, name)
    saved_rule = state_dict["zenflow"].get("rule", {"name": "AdamW", "state_names": ["exp_avg", "exp_avg_sq"]})
    if saved_rule.get("name") != rule.name or tuple(saved_rule.get("state_names", ())) != rule.state_names:
        raise ValueError(f"{name}.load_state_dict: the state dict was saved by an optimizer with the "
                         f"update rule {saved_rule.get('name')!r} ({saved_rule}); this one's is {rule!r}: its "
                         "state (the host and fast-path fields) cannot continue another rule's run")
    return unpack(state_dict, config=config, max_grad_norm=max_grad_norm, local=[shard.local(p) for p in params],
                  will_hold=shard.will_hold(params, group_of), rank=shard.rank, world=shard.world, name=name)


def unpack(state_dict: dict, *, config: ZenFlowConfig, max_grad_norm, local: list[torch.Tensor],
           will_hold: list[int], rank: int, world: int, name: str = "ZenFlow") -> Loaded:
    """Check a ZenFlow state dict against the loading optimizer (its ``config``, ``max_grad_norm``, the
    tensors ``local`` it updates and the parameters ``will_hold`` whose host state this rank will hold)."""
    zenflow = state_dict["zenflow"]
    version = int(zenflow.get("format", 1))
    if version > FORMAT:
        raise ValueError(f"{name}.load_state_dict: the state dict has format {version}, this version of "
                         f"zenflow_kernels reads formats 1 to {FORMAT}: load it with the version that saved it")
    # where the host state lives and which CPUs run it are this optimizer's, not the checkpoint's (memory <-> disk
    # both ways; another machine)
    # (a field kept against semantics="deepspeed" was reported when the saved run's config was made: not again)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZenFlowWarning)
        saved_config = ZenFlowConfig.from_dict({**zenflow["config"], "offload_device": config.offload_device,
                                                "nvme_path": config.nvme_path, "cores": config.cores})
    schedule = dict(zenflow["schedule"])  # the optimizer makes it (make_schedule: its schedule_class)
    saved_state = state_dict["state"]
    held = set(zenflow.get("host_params", range(len(local))))
    for idx, st in saved_state.items():
        p = local[int(idx)]
        for key in ("host_master", "unflushed"):
            if key in st and tuple(st[key].shape) != tuple(p.shape):
                raise ValueError(
                    f"{name}.load_state_dict: parameter {idx} was saved with shape "
                    f"{tuple(st[key].shape)} ({key}), this one is {tuple(p.shape)}"
                )
    if zenflow.get("built"):
        # ZeRO: this rank needs the host state of the parameters it will hold (a consolidated dict, or a dict saved
        # by the same rank at the same world size, has it)
        missing = [i for i in will_hold
                   if i in held and "host_master" not in saved_state.get(i, saved_state.get(str(i), {}))]
        if missing:
            saved = zenflow.get("zero", {})
            raise ValueError(
                f"{name}.load_state_dict: the state dict (saved by rank {saved.get('rank', 0)} of "
                f"{saved.get('world', 1)}) holds no host state for parameters {missing[:8]}, which rank "
                f"{rank} of {world} holds: load each rank's own state_dict() at the same world size, or a "
                "consolidated_state_dict() at any world size"
            )
    changed = [f"zenflow.{k}={v!r} (this optimizer: {getattr(config, k)!r})"
               for k, v in saved_config.to_dict().items() if getattr(config, k) != v]
    if zenflow["max_grad_norm"] != max_grad_norm:
        changed.append(f"max_grad_norm={zenflow['max_grad_norm']!r} (this optimizer: {max_grad_norm!r})")
    # (a tensor setting, such as a tensor lr a scheduler writes into, is copied: the optimizer must not share storage
    # with the caller's state dict)
    groups = [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
              for g in state_dict["param_groups"]]
    return Loaded(saved_config, schedule, zenflow["max_grad_norm"], bool(zenflow.get("seed_from_host", False)), groups,
                  {name: int(zenflow[name]) for name in COUNTERS}, bool(zenflow.get("built")),
                  functools.partial(restore, saved_state), changed, held if zenflow.get("built") else set())


@torch.no_grad()
def restore(saved_state: dict, run: BuiltOptimizer, interval: HostInterval, to_state: Callable) -> None:
    """Write a checked state dict's entries into a freshly built optimizer: the host state of this rank's
    parameters, the interval's sums, counts and pending results, the fast path's state (``to_state`` places it),
    and inside-``flushed()`` weights into the parameters. A parameter the state holds no host state of (frozen when
    it was saved, trained now) keeps the fresh shard's: its live weights, zero moments."""
    host, names = run.host, run.host.names
    held_keys, fast_keys = host_keys(run.rule), {*run.rule.state_names, "master"}
    writes = []  # the host fields, written in one pass (on disk: each block of the file once)
    for idx, st in saved_state.items():
        i = int(idx)
        if i in host.slots and "host_master" in st:  # ZeRO: the host state of this rank's parameters only
            writes += [(name, i, st[f"host_{name}"]) for name in names]
            host.view(interval.sums_flat(), i).copy_(st["acc"])
            host.host_step[i] = int(st["host_step"])
            if st["pending"]:
                host.out_view(i).copy_(st["host_master"])  # what the finished update wrote
        interval.counts[interval.buf][i] = int(st["acc_count"])
        if st["pending"]:
            interval.pending.append(i)
        if "unflushed" in st:  # saved inside flushed(): the model holds the flushed weights, training these
            run.local[i].copy_(st["unflushed"])
        fast = {k: v for k, v in st.items() if k not in held_keys}
        run.replace_state(i, {
            # copies: the optimizer must not share storage with the caller's state dict
            k: (to_state(v.clone()) if k in fast_keys else v.to(run.device, copy=True))
            if torch.is_tensor(v) else v
            for k, v in fast.items()
        })
    host.set_fields(writes)


def unpack_torch_adamw(state_dict: dict, params: list[torch.Tensor], config, schedule, max_grad_norm,
                       name: str) -> Loaded:
    """Check a ``torch.optim.AdamW`` (or ``Adam``) state dict, for an optimizer with ``rules.AdamW`` (``name``: what
    errors call it, ``build.display_name``): the host takes its moments and step counts as if
    warm-up had produced them, vectors join the fast path with them, and each matrix's first selection takes its
    columns' moments and steps from the host (``seed_from_host``). The param groups' hyper-parameters are the saved
    ones, as torch's own ``load_state_dict`` does; ZenFlow's schedule starts at step 0 (warm-up rounds included)."""
    where = f"{name}.load_state_dict"
    groups = state_dict["param_groups"]
    for gi, g in enumerate(groups):
        missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in g]
        if missing:
            raise ValueError(f"{where}: param group {gi} has no {missing}: neither a {name} nor a "
                             "torch.optim.AdamW/Adam state dict")
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(f"{where}: param group {gi} was saved with {flag}=True, which {name} "
                                 f"does not do: only plain AdamW/Adam state can be continued")
        if not g.get("decoupled_weight_decay", True) and g["weight_decay"] != 0:
            raise ValueError(
                f"{where}: param group {gi} is torch.optim.Adam with weight_decay={g['weight_decay']} (an L2 "
                f"term in the gradient); {name} decays decoupled (AdamW) and cannot continue it exactly: "
                "continue from a torch.optim.AdamW run, or an Adam run without weight decay"
            )
        check_adamw_hyperparameters(float(g["lr"]), g["betas"], g["eps"], g["weight_decay"],
                                    where=f"{where} group {gi}")
    order = [i for g in groups for i in g["params"]]
    imported = {}
    for idx, st in state_dict["state"].items():
        if idx not in order:
            raise ValueError(f"{where}: state of parameter {idx!r}, which no param group lists")
        i = order.index(idx)
        p = params[i]
        if not isinstance(st, dict) or not {"exp_avg", "exp_avg_sq", "step"} <= set(st):
            held = sorted(st) if isinstance(st, dict) else repr(st)
            raise ValueError(f"{where}: the state of parameter {i} holds {held}, not AdamW's exp_avg, "
                             "exp_avg_sq and step")
        for key in ("exp_avg", "exp_avg_sq"):
            if tuple(st[key].shape) != tuple(p.shape):
                raise ValueError(f"{where}: parameter {i}'s {key} has shape {tuple(st[key].shape)}, the "
                                 f"parameter {tuple(p.shape)}")
        step = int(st["step"].item() if torch.is_tensor(st["step"]) else st["step"])
        imported[i] = (st["exp_avg"], st["exp_avg_sq"], step)
    updates = [dict(lr=g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"], betas=tuple(g["betas"]), eps=g["eps"],
                    weight_decay=g["weight_decay"]) for g in groups]
    return Loaded(config, schedule, max_grad_norm, True, updates, dict.fromkeys(COUNTERS, 0), True,
                  lambda run, interval, to_state: restore_torch_adamw(imported, run), [], set(imported))


def restore_torch_adamw(imported: dict[int, tuple], run: BuiltOptimizer) -> None:
    """The host takes a torch AdamW/Adam run's moments and step counts (:func:`unpack_torch_adamw`'s) as if warm-up
    had produced them."""
    host = run.host
    writes = []
    for i, (m, v, step) in imported.items():
        if i not in host.slots:  # ZeRO: another rank holds it
            continue
        writes += [("exp_avg", i, m), ("exp_avg_sq", i, v)]
        host.host_step[i] = step
    host.set_fields(writes)
