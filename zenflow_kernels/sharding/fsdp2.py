"""ZenFlow on FSDP2 (``torch.distributed.fsdp.fully_shard``): one more way of holding gradients behind
the seam (sharding/; docs/fsdp2.md).

FSDP2 shards every parameter along dim 0 on a 1-D device mesh: a rank holds a block of rows of each
``[out, in]`` weight (``p.to_local()``, a view of FSDP2's sharded storage: writing it under ``no_grad``
changes what the next forward all-gathers) and, after backward, the reduce-scattered mean gradient of
those rows (``p.grad.to_local()``). ZenFlow's columns cross every rank's block, so:

* a column's score is the sum of the ranks' partial scores over their rows: one all-reduce of ``C`` floats
  per matrix, all matrices in one flat buffer; every rank then selects the same columns;
* the fast path updates this rank's rows of the selected columns, with no collective;
* the host shard is this rank's rows of every parameter (1/world of the model), the write-back writes
  them, and FSDP2 all-gathers at the next forward as it always does;
* the gradient norm (clipping, the non-finite skip) and the host update's clipping norm are sums of
  squares over the ranks, so every rank decides the same.

HSDP (``fully_shard`` on a 2-D mesh ``(replicate, shard)``; parameters placed ``(Replicate(), Shard(0))``) is
the same within each replica: FSDP2 reduce-scatters over the shard dimension and all-reduces over the
replicate dimension, so the replicas hold the same mean gradient of the same rows. Every collective above
then runs over the shard dimension only (the replicas compute the same sums and select the same columns),
and each replica's ranks hold identical copies of their rows' host state.

The collectives run on groups of their own over the mesh's (shard) ranks (collectives.Collectives: timed,
chaos delays, errors naming the collective), not on the mesh's groups, which FSDP2's own collectives use.
Under HSDP every rank creates every replica's shard groups, in the same order (creating a group is
collective over the whole world).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._memory import host_copy
from .base import Sharding, column_scores, is_dtensor, sum_of_squares
from .collectives import Collectives

__all__ = ["FSDP2", "fsdp2_mesh"]


def fsdp2_mesh(params: Sequence[torch.Tensor], name: str):
    """The device mesh FSDP2 shards these parameters over, or None when none is a DTensor: a 1-D mesh (every
    parameter placed ``(Shard(0),)`` on it) or HSDP's 2-D mesh (every parameter placed ``(Replicate(),
    Shard(0))``: replicate x shard). Any other mix or placement is an error naming what was found (and the
    optimizer, ``name``)."""
    found = [p for p in params if is_dtensor(p)]
    if not found:
        return None
    from torch.distributed.tensor import Replicate, Shard

    if len(found) != len(params):
        raise ValueError(f"{name}: some parameters are DTensors (FSDP2) and others are not: allowed all of one "
                         "kind (a model wrapped with fully_shard throughout, or plain parameters)")
    mesh = found[0].device_mesh
    allowed = {1: (Shard(0),), 2: (Replicate(), Shard(0))}
    for i, p in enumerate(found):
        if tuple(p.placements) != allowed.get(p.device_mesh.ndim):
            raise ValueError(
                f"{name}: parameter {i} (shape {tuple(p.shape)}) is a DTensor placed {tuple(p.placements)} on a "
                f"{p.device_mesh.ndim}-D mesh: allowed FSDP2's (Shard(0),) on a 1-D mesh or HSDP's (Replicate(), "
                "Shard(0)) on a 2-D (replicate, shard) mesh (fully_shard; tensor parallelism and other placements "
                "are not supported)")
        if p.device_mesh != mesh:
            raise ValueError(f"{name}: parameter {i} is sharded over another device mesh than parameter 0: "
                             "allowed one mesh")
    return mesh


class FSDP2(Sharding):
    """FSDP2's sharded parameters: this rank's rows of every parameter (module docstring); under HSDP the
    collectives run over the shard dimension (``world`` and ``rank`` are within it)."""

    def __init__(self, mesh, timeout: float, name: str):
        super().__init__()
        self.name = name
        self.mesh, self._timeout = mesh, timeout
        self.hsdp = mesh.ndim == 2  # replicate x shard: the collectives run over the shard dimension only
        self._group = mesh.get_group(1) if self.hsdp else mesh.get_group()
        # HSDP: every replica's shard ranks (the rows of the mesh), for creating every replica's groups
        self._partition = [row.tolist() for row in mesh.mesh] if self.hsdp else None
        if self.hsdp and mesh.mesh.numel() != dist.get_world_size():
            raise ValueError(f"{name}: HSDP's mesh {mesh.mesh.tolist()} covers {mesh.mesh.numel()} of the "
                             f"{dist.get_world_size()} ranks: allowed a mesh over every rank")
        # world and rank: within the shard group (a replica's ranks), which the host state is split over
        self.world, self.rank = dist.get_world_size(self._group), dist.get_rank(self._group)
        self.ctx: Collectives | None = None

    def accept(self, params) -> None:
        fsdp2_mesh(params, self.name)  # raises for mixed kinds or other placements

    def start(self, params, groups, device, chaos) -> None:
        super().start(params, groups, device, chaos)
        if self.ctx is None:  # once: creating its groups is collective (a reload keeps it)
            self.ctx = Collectives(process_group=self._group, timeout=self._timeout,
                                   chaos=chaos if device.type == "cpu" else None, partition=self._partition,
                                   name=self.name)
            self.bytes = self.ctx.bytes

    @property
    def failed(self) -> bool:
        return self.ctx is not None and self.ctx.failed

    def local(self, p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return p.to_local()

    def element_keys(self, groups, host_params) -> dict[int, int]:
        # (the layout of the DTensors' global shapes, plus the first element of this rank's rows)
        keys = super().element_keys(groups, host_params)
        for i in keys:
            p = self.params[i]
            keys[i] += self._rows(p)[0] * math.prod(p.shape[1:])
        return keys

    def own_grad(self, i: int) -> torch.Tensor | None:
        g = self.params[i].grad
        return None if g is None else g.to_local()

    def grad_norm(self, active: list[int], own=None) -> float:
        grads = [g for g in (self.own_grad(i) for i in active) if g.numel()]
        return float(self.ctx.all_reduce_(sum_of_squares(grads, self.device), "gradient norm").sqrt())

    def scores(self, indices, importances) -> list[torch.Tensor]:
        # partial scores over this rank's rows (a callable scorer sees those rows too), summed over the ranks
        # in one flat all-reduce
        kind = dict(zip(indices, importances, strict=True))
        rows = [i for i in indices if self.own_grad(i).shape[0]]
        scored = column_scores([self.own_grad(i) for i in rows], [self.local(self.params[i]) for i in rows],
                               [kind[i] for i in rows], self.name)
        part = dict(zip(rows, scored, strict=True))
        widths = [self.params[i].shape[1] for i in indices]
        flat = torch.cat([
            part[i].float() if i in part else torch.zeros(c, device=self.device)
            for i, c in zip(indices, widths, strict=True)
        ]) if indices else torch.zeros(0, device=self.device)
        self.ctx.all_reduce_(flat, "selection scores")
        return list(flat.split(widths))

    def sum_over_ranks(self):
        return self.ctx.sum_host

    # -- checkpoints: torch.distributed.checkpoint's form ---------------------------------------------
    #
    # get_optimizer_state_dict / set_optimizer_state_dict keep only "state" (keyed by FQN) and
    # "param_groups", save DTensors shard by shard (resharded at load: another world size works) and plain
    # tensors once, and load into a template of the same keys and shapes (the loading optimizer's own
    # state_dict()). So: ZenFlow's own entries go into param_groups[0]["zenflow"]; every sharded entry is a
    # DTensor in its parameter's global shape ([R, C], or [R, k] for the selected columns' state; vectors
    # [n]); the selection and its per-column step counts are plain tensors (the same on every rank); and
    # every trainable parameter always has every key (a matrix before its first selection: "has_fast" 0, selected
    # -1), so a template taken at any step (or after the dummy step DCP runs on a fresh optimizer) has them all.
    #
    # Frozen parameters. The template is made before DCP reads the checkpoint, by an optimizer that knows only which
    # parameters are frozen now (requires_grad False: no host state after DCP's dummy step), and
    # set_optimizer_state_dict hands load_state_dict no entry for a frozen parameter (torch's
    # _split_optim_state_dict leaves them out). So an entry's form follows requires_grad at the save, not whether
    # the parameter has host state: a trainable one has the full form above ("host_step" None while it has no host
    # state yet: unfrozen since the last step; its tensors are then zeros, unused); a frozen one an empty entry (no
    # copy of a frozen backbone in the checkpoint). What the frozen parameters need travels in the header instead,
    # where some parameter is frozen (only there: a key the older checkpoints lack would make them unloadable):
    # zenflow["frozen"], a tuple (DCP keeps it as one value) of ``_FROZEN`` and a dict: the step count "t" (a
    # template's own value left by a partial load is not the checkpoint's), the parameters with host state
    # ("host") and the trainable ones ("trainable"), by position, and "whole": the host state of each parameter
    # frozen again after training (it keeps its host state: build.trained), every rank's rows gathered, so a
    # loading rank slices its own at any world size. Saving it is collective (one all_gather_object).
    #
    # Resuming with another frozen set: a parameter frozen now that was trainable with host state when saved has
    # its state in the checkpoint but none in the template, so the load is refused naming it, before anything
    # changes. A parameter trainable now and frozen when saved has keys the checkpoint lacks: DCP's planner refuses
    # it (missing key ``<fqn>.host_master``); and where nothing was frozen when saved, a template with a frozen
    # parameter has a key the checkpoint lacks (``zenflow.frozen``).

    _FROZEN = "zenflow: frozen parameters"

    @staticmethod
    def _keys(zenflow: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The row-sharded host keys and the fast path's tensor keys of the update rule the ``zenflow`` header
        names (a header without one: AdamW's), ``master`` last."""
        names = tuple(zenflow.get("rule", {}).get("state_names", ("exp_avg", "exp_avg_sq")))
        return ("host_master", *(f"host_{n}" for n in names), "acc"), (*names, "master")

    def _sharded(self, local: torch.Tensor, like: torch.Tensor, columns: int | None = None) -> torch.Tensor:
        """``local`` (this rank's rows, on the host) as a DTensor sharded by rows like parameter ``like``, of
        global shape ``like.shape`` or ``[R, columns]``: built in place, not moved to the mesh's device."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        shape = tuple(like.shape) if columns is None else (like.shape[0], columns)
        stride = torch.empty(shape, device="meta").stride()
        spec = DTensorSpec(like.device_mesh, like.placements,
                           tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
        return DTensor(local.contiguous(), spec, requires_grad=False)

    @staticmethod
    def _rows(p: torch.Tensor) -> tuple[int, int]:
        """The first global row of this rank's shard of DTensor ``p`` and how many rows it holds."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return int(offset[0]), int(shape[0])

    def _entry(self, i: int, st: dict, local, topk, sharded, fast) -> dict:
        """Parameter ``i``'s full form from its packed state ``st`` (this rank's rows; consumed)."""
        p = self.params[i]
        out = {k: self._sharded(st.pop(k), p) for k in sharded}
        out.update(host_step=int(st.pop("host_step")), acc_count=int(st.pop("acc_count")),
                   pending=int(st.pop("pending")))
        # always present (torch.distributed.checkpoint loads only the keys a fresh optimizer's dict has): the
        # weights training continues from when saved inside flushed(), else a copy of the live ones, unused
        unflushed = st.pop("unflushed", None)
        out["has_unflushed"] = int(unflushed is not None)
        out["unflushed"] = self._sharded(host_copy(local[i]) if unflushed is None else unflushed, p)
        held = fast if p.dtype != torch.float32 else fast[:-1]  # (an fp32 parameter has no fast master)
        if p.dim() == 2:  # a placeholder of the k of this matrix's param group (its own topk_ratio, if set)
            k = topk(i)
            rows = local[i].shape[0]
            out["has_fast"] = int("selected" in st)
            out["selected"] = st.pop("selected", torch.full((k,), -1, dtype=torch.int64))
            out["step"] = st.pop("step", torch.zeros(k, dtype=torch.int64))
            for name in held:
                out[name] = self._sharded(st.pop(name, torch.zeros(rows, k)), p, columns=k)
            for name, zero in (("auto_selected", 0.0), ("auto_unselected", 0.0), ("auto_count", 0)):
                out[name] = st.pop(name, zero)
        else:
            rows = local[i].numel()
            out["has_fast"] = int("step" in st)
            out["step"] = int(st.pop("step", 0))
            for name in held:
                out[name] = self._sharded(st.pop(name, torch.zeros(1, rows)).reshape(-1), p)
        return out

    def _gather(self, entries: dict[int, dict]) -> dict[int, tuple[dict, dict]]:
        """Each of these full-form entries whole: ``(rows, values)``, every rank's rows of its DTensors concatenated
        (plain tensors) and the rest as they are (the same on every rank); one all_gather_object over the shard
        group (the training thread's gloo group)."""
        mine = {i: (self._rows(self.params[i])[0], {k: v.to_local() for k, v in e.items() if is_dtensor(v)})
                for i, e in entries.items()}
        every: list = [None] * self.world
        try:
            dist.all_gather_object(every, mine, group=self.ctx._meta)
        except Exception as exc:
            raise self.ctx._fail("frozen parameters' host state", "all_gather_object", 0, exc) from exc
        out = {}
        for i, e in entries.items():
            parts = sorted((part[i] for part in every), key=lambda part: part[0])
            out[i] = ({k: torch.cat([part[1][k] for part in parts]) for k in parts[0][1]},
                      {k: v for k, v in e.items() if not is_dtensor(v)})
        return out

    def export_state_dict(self, state_dict: dict, local, topk) -> dict:
        groups = [dict(g) for g in state_dict["param_groups"]]
        # no format key: torch.distributed.checkpoint loads the keys of the loading optimizer's template and refuses
        # a checkpoint that lacks one, so a key older checkpoints lack would make them unloadable (the DCP form's
        # format is its key set; load_state_dict reads a dict without the key as format 1)
        # (host_params likewise: the parameters with host state are those with a "host_step" that is not None, and
        # the header's "frozen" record's)
        # (the rule likewise when it is AdamW, the rule of the checkpoints made before the key: a dict without it is
        # AdamW's; another rule's dict has the key, and its state keys differ from AdamW's)
        left_out = ("format", "host_params") + (("rule",) if state_dict["zenflow"].get("rule", {}).get(
            "name") == "AdamW" else ())
        zenflow = groups[0]["zenflow"] = {k: v for k, v in state_dict["zenflow"].items() if k not in left_out}
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        built = state_dict["zenflow"].get("built")
        frozen = len(trainable) < len(self.params)
        if frozen:
            host = sorted(i for i, st in state_dict["state"].items() if "host_master" in st) if built else []
            zenflow["frozen"] = (self._FROZEN, dict(t=zenflow.get("t"), host=host, trainable=trainable, whole={}))
        if not built:
            return {"state": {}, "param_groups": groups}
        sharded, fast = self._keys(state_dict["zenflow"])
        state, again = {}, {}
        for i, st in state_dict["state"].items():
            p, st = self.params[i], dict(st)
            if not p.requires_grad:  # frozen: an empty entry (its host state, if any, whole in the header)
                state[i] = {}
                if "host_master" in st:
                    again[i] = self._entry(i, st, local, topk, sharded, fast)
                continue
            if "host_master" not in st:  # trainable, no host state yet: the full form's keys, unused
                zeros = {k: torch.zeros(local[i].shape) for k in sharded}
                state[i] = dict(self._entry(i, dict(zeros, host_step=0, acc_count=0, pending=0), local, topk, sharded,
                                            fast), host_step=None)
                continue
            state[i] = self._entry(i, st, local, topk, sharded, fast)
        if again:
            zenflow["frozen"][1]["whole"] = self._gather(again)
        return {"state": state, "param_groups": groups}

    def _whole_rows(self, i: int, whole: tuple[dict, dict]) -> dict:
        """Parameter ``i``'s entry (this rank's rows) from its host state whole (:meth:`_gather`)."""
        first, count = self._rows(self.params[i])
        return {**whole[1], **{k: v[first:first + count] for k, v in whole[0].items()}}

    def import_state_dict(self, state_dict: dict) -> dict:
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not (isinstance(groups, list) and groups and isinstance(groups[0], dict) and "zenflow" in groups[0]):
            return state_dict  # not this form (an AdamW dict, or something load_state_dict will refuse)
        groups = [dict(g) for g in groups]
        zenflow = dict(groups[0].pop("zenflow"))
        record = zenflow.pop("frozen", None)
        # the saving optimizer's record of its frozen parameters (not a template's own, which a partial load leaves
        # where the checkpoint has none: its step count is the loading optimizer's)
        frozen = record[1] if (isinstance(record, tuple) and len(record) == 2 and record[0] == self._FROZEN
                               and record[1].get("t") == zenflow.get("t")) else None
        sharded, fast = self._keys(zenflow)
        # keys are positions (state_dict()) or FQNs (set_optimizer_state_dict): either way listed by the groups
        # in this optimizer's parameter order
        keys = [key for g in groups for key in g["params"]]
        position = {key: n for n, key in enumerate(keys)}
        start = 0
        for g in groups:
            g["params"], start = list(range(start, start + len(g["params"]))), start + len(g["params"])
        state = {}
        for key, st in state_dict["state"].items():
            i = position[key]
            if frozen is not None and i not in frozen["trainable"]:  # frozen when saved: the header has its state
                if i not in frozen["whole"]:
                    state[i] = dict(acc_count=0, pending=False)
                    continue
                st = self._whole_rows(i, frozen["whole"][i])
            elif not st or st.get("host_step", 0) is None or (
                    "host_master" in st and tuple(st["host_master"].shape) == (0,) and self.params[i].numel()):
                # no host state: frozen when saved, or trainable but not yet stepped (the older form: placeholders of
                # global shape [0]; a rank holding none of a parameter's rows has an empty local shard of the real
                # thing: the global shape tells them apart, the same on every rank)
                state[i] = dict(acc_count=0, pending=False)
                continue
            state[i] = self._local_entry(st, self.params[i].dim(), sharded, fast)
        if frozen is not None:
            # frozen now, so absent (set_optimizer_state_dict leaves out a frozen parameter's entry): frozen again
            # when saved, its state is in the header; trainable then with host state, it is in the checkpoint but
            # was not loaded (the template, this optimizer's own state dict, has no key for it)
            for i, whole in frozen["whole"].items():
                if i not in state:
                    state[i] = self._local_entry(self._whole_rows(i, whole), self.params[i].dim(), sharded, fast)
            lost = [keys[i] for i in frozen["host"]
                    if i not in state and i in frozen["trainable"] and not self.params[i].requires_grad]
            if lost:
                names = [key if isinstance(key, str) else f"parameter {key}" for key in lost]
                raise ValueError(
                    f"{self.name}.load_state_dict: {names} had host state when the checkpoint was saved (trainable "
                    "then) and are frozen now (requires_grad=False): torch.distributed.checkpoint loads only the keys "
                    "of this optimizer's own state dict, which holds none for a frozen parameter, so their state was "
                    "not loaded. Resume with them trainable, as saved (make them trainable before "
                    "get_optimizer_state_dict() and set_optimizer_state_dict(), and freeze them after: they keep "
                    "their host state while frozen, as in one process)")
        if zenflow.get("built"):
            zenflow = dict(zenflow, host_params=[i for i, st in state.items() if "host_master" in st])
        return {"state": state, "param_groups": groups, "zenflow": zenflow}

    @staticmethod
    def _local_entry(st: dict, dim: int, sharded, fast) -> dict:
        """A full-form entry (DTensors or this rank's rows) as load_state_dict reads a parameter's state."""
        st = {k: (v.to_local() if is_dtensor(v) else v) for k, v in st.items()}
        out = {k: st[k] for k in sharded}
        out.update(host_step=int(st["host_step"]), acc_count=int(st["acc_count"]), pending=bool(st["pending"]))
        if int(st.get("has_unflushed", 0)):
            out["unflushed"] = st["unflushed"]
        if int(st["has_fast"]):
            names = [n for n in fast if n in st]
            if dim == 2:
                out.update({n: st[n] for n in names}, selected=st["selected"], step=st["step"])
                out.update({n: st[n] for n in ("auto_selected", "auto_unselected", "auto_count")})
            else:
                out.update({n: st[n].reshape(1, -1) for n in names}, step=int(st["step"]))
        return out
