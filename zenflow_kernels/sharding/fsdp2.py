"""ZenFlowAdamW on FSDP2 (``torch.distributed.fsdp.fully_shard``): one more way of holding gradients behind
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

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._memory import host_copy
from .base import Sharding, column_scores, is_dtensor, sum_of_squares
from .collectives import Collectives

__all__ = ["FSDP2", "fsdp2_mesh"]


def fsdp2_mesh(params: Sequence[torch.Tensor]):
    """The device mesh FSDP2 shards these parameters over, or None when none is a DTensor: a 1-D mesh (every
    parameter placed ``(Shard(0),)`` on it) or HSDP's 2-D mesh (every parameter placed ``(Replicate(),
    Shard(0))``: replicate x shard). Any other mix or placement is an error naming what was found."""
    found = [p for p in params if is_dtensor(p)]
    if not found:
        return None
    from torch.distributed.tensor import Replicate, Shard

    if len(found) != len(params):
        raise ValueError("ZenFlowAdamW: some parameters are DTensors (FSDP2) and others are not: allowed all of one "
                         "kind (a model wrapped with fully_shard throughout, or plain parameters)")
    mesh = found[0].device_mesh
    allowed = {1: (Shard(0),), 2: (Replicate(), Shard(0))}
    for i, p in enumerate(found):
        if tuple(p.placements) != allowed.get(p.device_mesh.ndim):
            raise ValueError(
                f"ZenFlowAdamW: parameter {i} (shape {tuple(p.shape)}) is a DTensor placed {tuple(p.placements)} on a "
                f"{p.device_mesh.ndim}-D mesh: allowed FSDP2's (Shard(0),) on a 1-D mesh or HSDP's (Replicate(), "
                "Shard(0)) on a 2-D (replicate, shard) mesh (fully_shard; tensor parallelism and other placements "
                "are not supported)")
        if p.device_mesh != mesh:
            raise ValueError(f"ZenFlowAdamW: parameter {i} is sharded over another device mesh than parameter 0: "
                             "allowed one mesh")
    return mesh


class FSDP2(Sharding):
    """FSDP2's sharded parameters: this rank's rows of every parameter (module docstring); under HSDP the
    collectives run over the shard dimension (``world`` and ``rank`` are within it)."""

    def __init__(self, mesh, timeout: float):
        super().__init__()
        self.mesh, self._timeout = mesh, timeout
        self.hsdp = mesh.ndim == 2  # replicate x shard: the collectives run over the shard dimension only
        self._group = mesh.get_group(1) if self.hsdp else mesh.get_group()
        # HSDP: every replica's shard ranks (the rows of the mesh), for creating every replica's groups
        self._partition = [row.tolist() for row in mesh.mesh] if self.hsdp else None
        if self.hsdp and mesh.mesh.numel() != dist.get_world_size():
            raise ValueError(f"ZenFlowAdamW: HSDP's mesh {mesh.mesh.tolist()} covers {mesh.mesh.numel()} of the "
                             f"{dist.get_world_size()} ranks: allowed a mesh over every rank")
        # world and rank: within the shard group (a replica's ranks), which the host state is split over
        self.world, self.rank = dist.get_world_size(self._group), dist.get_rank(self._group)
        self.ctx: Collectives | None = None

    def accept(self, params) -> None:
        fsdp2_mesh(params)  # raises for mixed kinds or other placements

    def start(self, params, groups, device, chaos) -> None:
        super().start(params, groups, device, chaos)
        if self.ctx is None:  # once: creating its groups is collective (a reload keeps it)
            self.ctx = Collectives(process_group=self._group, timeout=self._timeout,
                                   chaos=chaos if device.type == "cpu" else None, partition=self._partition)
            self.bytes = self.ctx.bytes

    @property
    def failed(self) -> bool:
        return self.ctx is not None and self.ctx.failed

    def local(self, p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return p.to_local()

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
                               [kind[i] for i in rows])
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
    # every parameter always has every key (a matrix before its first selection: "has_fast" 0, selected -1),
    # so a template taken at any step (or after the dummy step DCP runs on a fresh optimizer) has them all. A
    # frozen parameter (no host state: build.trained) has every key too, each tensor an empty placeholder of global
    # shape [0] (no copy of a frozen backbone in the checkpoint): the loading optimizer's template has the same
    # where the same parameters are frozen.

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

    def _placeholder(self, like: torch.Tensor) -> torch.Tensor:
        """An empty DTensor (global shape [0]) standing for a frozen parameter's state, placed like ``like``."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(like.device_mesh, like.placements, tensor_meta=TensorMeta(torch.Size((0,)), (1,),
                                                                                     torch.float32))
        return DTensor(torch.zeros(0), spec, requires_grad=False)

    def export_state_dict(self, state_dict: dict, local, topk) -> dict:
        groups = [dict(g) for g in state_dict["param_groups"]]
        # no format key: torch.distributed.checkpoint loads the keys of the loading optimizer's template and refuses
        # a checkpoint that lacks one, so a key older checkpoints lack would make them unloadable (the DCP form's
        # format is its key set; load_state_dict reads a dict without the key as format 1)
        # (host_params likewise: the parameters with host state are those whose state is not a placeholder)
        # (the rule likewise when it is AdamW, the rule of the checkpoints made before the key: a dict without it is
        # AdamW's; another rule's dict has the key, and its state keys differ from AdamW's)
        left_out = ("format", "host_params") + (("rule",) if state_dict["zenflow"].get("rule", {}).get(
            "name") == "AdamW" else ())
        groups[0]["zenflow"] = {k: v for k, v in state_dict["zenflow"].items() if k not in left_out}
        if not state_dict["zenflow"].get("built"):
            return {"state": {}, "param_groups": groups}
        sharded, fast = self._keys(state_dict["zenflow"])
        state = {}
        for i, st in state_dict["state"].items():
            p, st = self.params[i], dict(st)
            if "host_master" not in st:  # frozen: no host state, and nothing of the fast path's either
                out = {k: self._placeholder(p) for k in (*sharded, "unflushed", *fast)}
                out.update(host_step=0, acc_count=0, pending=0, has_unflushed=0, has_fast=0, step=0)
                if p.dim() == 2:
                    out.update(selected=torch.zeros(0, dtype=torch.int64), auto_selected=0.0, auto_unselected=0.0,
                               auto_count=0)
                state[i] = out
                continue
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
            state[i] = out
        return {"state": state, "param_groups": groups}

    def import_state_dict(self, state_dict: dict) -> dict:
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not (isinstance(groups, list) and groups and isinstance(groups[0], dict) and "zenflow" in groups[0]):
            return state_dict  # not this form (an AdamW dict, or something load_state_dict will refuse)
        groups = [dict(g) for g in groups]
        zenflow = groups[0].pop("zenflow")
        sharded, fast = self._keys(zenflow)
        # keys are positions (state_dict()) or FQNs (set_optimizer_state_dict): either way listed by the groups
        # in this optimizer's parameter order
        position = {key: n for n, key in enumerate(key for g in groups for key in g["params"])}
        start = 0
        for g in groups:
            g["params"], start = list(range(start, start + len(g["params"]))), start + len(g["params"])
        state = {}
        for key, st in state_dict["state"].items():
            i = position[key]
            # a frozen parameter's placeholders: global shape [0] (a rank holding none of a parameter's rows has an
            # empty local shard of the real thing: the global shape tells them apart, the same on every rank)
            if tuple(st["host_master"].shape) == (0,) and self.params[i].numel():
                state[i] = dict(acc_count=0, pending=False)
                continue
            st = {k: (v.to_local() if is_dtensor(v) else v) for k, v in st.items()}
            out = {k: st[k] for k in sharded}
            out.update(host_step=int(st["host_step"]), acc_count=int(st["acc_count"]), pending=bool(st["pending"]))
            if int(st.get("has_unflushed", 0)):
                out["unflushed"] = st["unflushed"]
            if int(st["has_fast"]):
                names = [n for n in fast if n in st]
                if self.params[i].dim() == 2:
                    out.update({n: st[n] for n in names}, selected=st["selected"], step=st["step"])
                    out.update({n: st[n] for n in ("auto_selected", "auto_unselected", "auto_count")})
                else:
                    out.update({n: st[n].reshape(1, -1) for n in names}, step=int(st["step"]))
            state[i] = out
        if zenflow.get("built"):
            zenflow = dict(zenflow, host_params=[i for i, st in state.items() if "host_master" in st])
        return {"state": state, "param_groups": groups, "zenflow": zenflow}
