"""Column selection (docs/design.md section 2, reference.py): scoring the columns, choosing each matrix's top k (or
a seeded random draw), moving the fast path's rule state with the columns that stay and handing the departing ones'
values back to the host master, and Zen-auto's vote on whether the host needs an update."""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import ops
from .._memory import gather_columns
from ..concentration import gradient_concentration
from .fast_path import FastPath
from .run import BuiltOptimizer

__all__ = ["Selection"]


class Selection:
    """Which columns of each matrix are on the fast path. ``seed_from_host``: after loading a torch AdamW state
    dict, a matrix's first selection takes its columns' rule state from the host (the imported moments and step)
    instead of starting them from zero."""

    def __init__(self, run: BuiltOptimizer, fast: FastPath, *, seed_from_host: bool = False):
        self.run, self.fast, self.seed_from_host = run, fast, seed_from_host
        self._selected: set[int] = set()  # matrices known to have a selection (unselected())

    def scores(self, indices: list[int], scale: float, inv_scale: float) -> tuple[list, list[torch.Tensor]]:
        """Each matrix's importance rule and its per-column scores (a scorer of one's own sees the gradient
        unscaled, as it would without a GradScaler: ``scale`` and its float32 reciprocal ``inv_scale``)."""
        importances = [self.run.setting(i, "importance") for i in indices]
        if scale != 1.0:
            importances = [_unscaled(f, inv_scale) if callable(f) else f for f in importances]
        return importances, self.run.shard.scores(indices, importances)

    def choose(self, t: int, indices: list[int], importances: list, scores: list[torch.Tensor], ks: list[int]) -> list:
        """The selected columns of each matrix (sorted int64 on the device): top-k of its scores (one multi-tensor
        launch for all), or for ``importance="random"`` k columns drawn uniformly from a generator seeded with
        (selection_seed, step, parameter index): the same on every rank and after a resume."""
        top = [n for n, importance in enumerate(importances) if importance != "random"]
        chosen: list = [None] * len(indices)
        picked = ops.multi_topk_columns([scores[n] for n in top], [ks[n] for n in top], check_data=False)
        for n, columns in zip(top, picked, strict=True):
            chosen[n] = columns
        for n, importance in enumerate(importances):
            if importance == "random":
                rng = np.random.default_rng([self.run.config.selection_seed, t, indices[n]])
                draw = np.sort(rng.choice(self.run.params[indices[n]].shape[1], size=ks[n], replace=False))
                chosen[n] = torch.from_numpy(draw.astype(np.int64)).to(self.run.device)
        return chosen

    def unselected(self, matrices: list[int]) -> list[int]:
        """The matrices among ``matrices`` with no selection yet (their first step after warm-up, or a matrix whose
        gradient first appears now): they are selected at this step, between selection boundaries. Those seen with
        a selection are remembered (one is never taken away), so a step looks at no state when none is new."""
        seen = self._selected
        if seen.issuperset(matrices):
            return []
        out = []
        for i in matrices:
            if i in seen:
                continue
            if "selected" in self.run.fast_state(i):
                seen.add(i)
            else:
                out.append(i)
        return out

    def compact_gradients(self, matrices: list[int]) -> dict | None:
        """The selected columns' gradients of these matrices as every replica's fast step reads them (ZeRO-2's
        released gradients: ``Sharding.selected_gradients``), or None where the fast step indexes ``.grad``."""
        shard, run = self.run.shard, self.run
        if not shard.exchanges_selected:
            return None
        return shard.selected_gradients([(i, run.fast_state(i)["selected"]) for i in matrices])

    @torch.no_grad()
    def reselect(self, t: int, indices: list[int], scale: float = 1.0, inv_scale: float = 1.0) -> None:
        """New columns for these matrices at step ``t``; state moves with the columns that stay."""
        run = self.run
        importances, scores = self.scores(indices, scale, inv_scale)
        ks = [run.topk(i) for i in indices]
        chosen = self.choose(t, indices, importances, scores, ks)
        jaccards, masses = [], []
        returning: list = []  # columns leaving the fast path for the host master (on disk: in one pass, after)
        for i, new, s in zip(indices, chosen, scores, strict=True):
            jaccard = self._move(i, new, returning)
            if jaccard is not None:
                jaccards.append(jaccard)
            masses.append(torch.stack([s[new].sum().float() if new.numel() else s.new_zeros((), dtype=torch.float32),
                                       s.sum().float()]))
        # each matrix's selected and whole score mass, as the scores' dtype sums them: one device sync for all
        sums = torch.stack(masses).tolist() if masses else []
        captured, total = sum(m[0] for m in sums), sum(m[1] for m in sums)
        run.host.set_columns(returning)
        run.telemetry.record_selection(t, jaccards, captured / total if total > 0 else float("nan"),
                                       self.concentration(indices, importances, scores, chosen))
        self.fast.invalidate()

    def concentration(self, indices: list[int], importances: list, scores: list, chosen: list) -> dict:
        """The gradient's concentration at this selection (zenflow_kernels.concentration): from the l2 scores
        (squared column norms: "l2", and "random", which is scored so), the other matrices scored again in l2."""
        again = [n for n, imp in enumerate(importances) if callable(imp) or imp == "l1"]
        energies = list(scores)
        if again:
            for n, e in zip(again, self.run.shard.scores([indices[n] for n in again], ["l2"] * len(again)),
                            strict=True):
                energies[n] = e
        return {"indices": list(indices), **gradient_concentration(energies, chosen)}

    def _move(self, i: int, new: torch.Tensor, returning: list) -> float | None:
        """Matrix ``i`` takes the columns ``new``: its fast-path state follows the columns that stay, entering
        columns start from zero state and step 0 (a low-precision matrix: from the host master's value), departing
        columns' values go back to the host master (``returning``). Returns the Jaccard overlap with the old columns."""
        run, fast = self.run, self.fast
        host, device, names = run.host, run.device, run.rule.state_names
        p, st = run.local[i], run.fast_state(i)
        R, k = p.shape[0], new.numel()
        owned = i in host.slots  # ZeRO: this rank holds the matrix's host state
        old = st.get("selected")
        carry = old is not None and old.numel() > 0
        # reselect_state="reset": no column keeps its rule state; all take the matrix's one step count
        reset = run.config.reselect_state == "reset"
        count = int(st["step"].max()) if reset and carry else 0
        jaccard = None
        # the same k, the state where the fast step reads it: the new state is written over the old through
        # transient [R, k] temporaries (a second fast-path state freed, or heap temporaries of this size, would
        # stay in the process's RSS: see _memory)
        in_place = carry and not fast.offload and old.numel() == k and all(
            tuple(st[name].shape) == (R, k) for name in names)
        # a low-precision matrix keeps an fp32 master of its selected columns; entering columns take the host
        # master's value (the live weight is that value, rounded)
        master = run.from_host(i, "master", new, transient=in_place) if p.dtype != torch.float32 else None
        if carry:
            # sorted index sets: position of each new column in the old set, if it was there
            pos = torch.searchsorted(old, new).clamp_(max=old.numel() - 1)
            stay = old[pos] == new
            old_master = st["master"].to(device) if master is not None else None
            gone = ~torch.isin(old, new)
            if owned and gone.any():  # ownership returns to the host, value included
                src = (gather_columns(old_master, gone.nonzero().view(-1)) if master is not None
                       else gather_columns(p, old[gone]))
                returning.append(("master", i, old[gone].cpu(), src.to("cpu", torch.float32)))
                if host.disk is None:  # in memory: at once (nothing to batch, no copy kept)
                    host.set_columns(returning)
                    returning.clear()
            jaccard = float(stay.sum()) / max(1, int(torch.unique(torch.cat([old, new])).numel()))
        if in_place:  # staying columns move to their new positions; entering ones start as below
            kept = torch.zeros_like(stay) if reset else stay
            for name in names:
                st[name].copy_(gather_columns(st[name], pos).masked_fill_(~kept, 0))
            if master is not None:
                torch.where(stay, gather_columns(old_master, pos), master, out=st["master"])
            run.set_state(i, selected=new, step=st["step"][pos].masked_fill_(~kept, 0) + count)
            return jaccard
        state = {name: torch.zeros(R, k, dtype=torch.float32, device=device) for name in names}
        steps = torch.zeros(k, dtype=torch.int64, device=device)
        if old is None and self.seed_from_host:  # continuing an imported torch run
            for name, t in state.items():
                t.copy_(run.from_host(i, name, new))
            steps.fill_(run.host_step(i))
        if carry and not reset:
            for name, t in state.items():
                t[:, stay] = st[name].to(device)[:, pos[stay]]
            steps[stay] = st["step"][pos[stay]]
        if carry and reset:
            steps.fill_(count)
        if carry and master is not None:
            master[:, stay] = old_master[:, pos[stay]]
        moved = {name: fast.to_state(t) for name, t in state.items()}
        if master is not None:
            moved["master"] = fast.to_state(master)
        run.set_state(i, selected=new, step=steps, **moved)
        return jaccard

    def auto_vote(self, matrices: list[int], scale: float) -> bool:
        """Zen-auto (see reference.py): do at least ``auto_ratio`` of the matrices need a host update? ``scale``:
        GradScaler's, which the gradients carry."""
        run = self.run
        voters = needing = 0
        eligible = []
        for i in matrices:
            p = run.params[i]
            k = run.fast_state(i)["selected"].numel()
            if k == p.shape[1]:
                continue
            voters += 1
            if k == 0:
                needing += 1
            else:
                eligible.append(i)
        if eligible:
            params = [run.params[i] for i in eligible]
            # the magnitudes of the gradient's columns: l1 sums for "l1", l2 norms otherwise (a "random" or
            # callable selection still votes on the gradient)
            norms = ["l1" if run.setting(i, "importance") == "l1" else "l2" for i in eligible]
            scores = run.shard.scores(eligible, norms)
            pairs = []
            for i, p, s, norm in zip(eligible, params, scores, norms, strict=True):
                mags = s.sqrt() if norm == "l2" else s
                sel = run.fast_state(i)["selected"]
                sel_sum = mags[sel].sum()
                pairs.append(torch.stack([sel_sum / sel.numel(), (mags.sum() - sel_sum) / (p.shape[1] - sel.numel())]))
            # (under a GradScaler the gradients are scaled: its power-of-two scale divides the magnitudes exactly)
            means = (torch.stack(pairs).double() / scale).tolist()  # one device sync for all matrices
            for i, (sel_mean, unsel_mean) in zip(eligible, means, strict=True):
                st = run.fast_state(i)
                run.set_state(i, auto_selected=st.get("auto_selected", 0.0) + sel_mean,
                              auto_unselected=st.get("auto_unselected", 0.0) + unsel_mean,
                              auto_count=st.get("auto_count", 0) + 1)
                if st["auto_unselected"] >= st["auto_selected"] / st["auto_count"]:
                    needing += 1
        return voters > 0 and needing >= run.config.auto_ratio * voters

    def reset_votes(self) -> None:
        """A host update ran: Zen-auto's running means start again."""
        run = self.run
        for i, p in enumerate(run.params):
            if "auto_count" in run.state.get(p, ()):
                run.set_state(i, auto_selected=0.0, auto_unselected=0.0, auto_count=0)


def _unscaled(scorer, inv_scale: float):
    """A selection scorer called with the gradient times ``inv_scale`` (GradScaler's reciprocal)."""

    @functools.wraps(scorer)
    def scores(grad, param):
        return scorer(grad * inv_scale, param)

    return scores
