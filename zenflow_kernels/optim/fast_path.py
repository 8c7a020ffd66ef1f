"""The device fast path (docs/design.md section 2): the update rule's multi-tensor step (AdamW: one fused launch) over
the selected columns of every matrix and every vector, laid out once per selection; with ``offload`` its state lives
in host memory and visits the device bucket by bucket."""

from __future__ import annotations

import torch

from ..launch_plan import LaunchItems
from .run import BuiltOptimizer

__all__ = ["FastPath"]


class FastPath:
    """The fast step's plan and state placement. ``offload``: the state's home is host memory (the link's);
    ``bucket_numel``: with it, the largest bucket of state elements on the device at once."""

    def __init__(self, run: BuiltOptimizer, *, offload: bool, bucket_numel: int):
        self.run, self.offload, self.bucket_numel = run, offload, bucket_numel
        self._plan = None  # the per-selection lists (plan())
        self._split: tuple[list[int], list[int], list[int]] | None = None  # (active, its matrices, its vectors)
        self._joined: set[int] = set()  # vectors known to have fast-path state (it is never taken away)

    def invalidate(self) -> None:
        """The fast path's state changed shape (a selection, a vector joining): lay the plan out again."""
        self._plan = None

    def split(self, active: list[int]) -> tuple[list[int], list[int]]:
        """The active parameters' matrices and vectors (kept while the same parameters step)."""
        if self._split is None or self._split[0] != active:
            params = self.run.params
            matrices = [i for i in active if params[i].dim() == 2]
            self._split = (active, matrices, [i for i in active if params[i].dim() != 2])
        return self._split[1], self._split[2]

    def to_state(self, t: torch.Tensor) -> torch.Tensor:
        """Where the fast path's rule state is kept: the device, or host memory (the link's) with ``offload``."""
        return self.run.link.new_host_state(t) if self.offload else t.to(self.run.device)

    def join(self, vectors: list[int]) -> None:
        """Of ``vectors``, the ones without fast-path state yet join the fast path (:meth:`init_vector`); those seen
        with state are remembered, so a step looks at no state when none is new (a restored checkpoint's is seen)."""
        for i in vectors:
            if i in self._joined:
                continue
            if "step" not in self.run.fast_state(i):
                self.init_vector(i)
            self._joined.add(i)

    def init_vector(self, i: int) -> None:
        """A vector joins the fast path with the rule state the host gave it during warm-up (``vector_state="reset"``:
        from zero state and step 0)."""
        run = self.run
        p = run.local[i]
        n = p.numel()
        if run.config.vector_state == "reset":
            entries = {name: self.to_state(torch.zeros(1, n, dtype=torch.float32)) for name in run.rule.state_names}
            step = 0
        else:
            entries = {name: self.to_state(run.from_host(i, name).reshape(1, n)) for name in run.rule.state_names}
            step = run.host_step(i)
        if p.dtype != torch.float32:
            entries["master"] = self.to_state(run.from_host(i, "master").reshape(1, n))
        run.set_state(i, step=step, **entries)
        self._plan = None

    def reset_vectors(self) -> None:
        """``vector_state="reset"``, at a selection: the rule state of every vector on the fast path starts again from
        zero (its step count goes on)."""
        run = self.run
        for key, p in zip(run.params, run.local, strict=True):
            st = run.state.get(key)
            if p.dim() != 2 and st and "step" in st:
                for name in run.rule.state_names:
                    st[name].zero_()

    def plan(self) -> tuple[list, torch.Tensor | None, dict, list]:
        """What the fast step needs of each parameter on the fast path, built once per selection (not per step):
        ``(index, param [R, C] or [1, n], is_matrix, state, group)`` for every parameter with fast-path state, one
        int64 tensor holding the per-column step counts of all those matrices (each matrix's ``state["step"]``
        becomes a view of it, so one ``add_`` advances them all), and the launch caches of the fast step's
        multi-tensor calls (``LaunchItems``: laid out once per selection), and each entry's state tensors."""
        if self._plan is not None:
            return self._plan
        run = self.run
        entries, steps = [], []
        for i, (key, p) in enumerate(zip(run.params, run.local, strict=True)):
            st = run.state.get(key)
            if not st or "step" not in st:
                continue
            if p.dim() != 2:
                entries.append((i, p.view(1, -1), False, st, run.group_of[i]))
            elif st["selected"].numel():
                entries.append((i, p, True, st, run.group_of[i]))
                steps.append((i, st["step"]))
        flat = None
        if steps:
            flat = torch.cat([s for _, s in steps])
            offset = 0
            for i, s in steps:
                run.set_state(i, step=flat[offset : offset + s.numel()])
                offset += s.numel()
        # what the fused launch takes of each entry that stays put for the plan's life: (selected columns or None,
        # the rule's state tensors, master or None); the step counts are read at each step (a vector's is an int)
        names = run.rule.state_names
        fixed = [(st["selected"] if is_matrix else None, *(st[n] for n in names), st.get("master"))
                 for _, _, is_matrix, st, _ in entries]
        self._plan = (entries, flat, {}, fixed)
        return self._plan

    def step(self, active: list[int], grads: dict[int, torch.Tensor], hyperparams: list[dict], *, grad_scale: float,
             compact: dict[int, torch.Tensor] | None = None) -> None:
        """The rule's multi-tensor step over the selected columns of every active matrix and every active vector
        (one launch set per distinct ``rule.launch_hyperparams`` of the param groups, AdamW's (beta1, beta2, eps):
        usually one). With every parameter active, each launch is laid out once per selection (``LaunchItems``).
        ``grads``: the step's own gradients by index (``StepInputs.grads``); ``grad_scale`` divides them
        (GradScaler's scale, clipping); ``compact``: released gradients, only the selected columns' ``[R, k]``."""
        run = self.run
        entries, flat_steps, launches, fixed = self.plan()
        if len(active) < len(run.params):
            stepping = set(active)
            kept = [n for n, e in enumerate(entries) if e[0] in stepping]
            entries, fixed = [entries[n] for n in kept], [fixed[n] for n in kept]
            for _, _, is_matrix, st, _ in entries:
                if is_matrix:
                    st["step"].add_(1)
            launches = None  # not the plan's list of tensors: laid out at this step
        elif flat_steps is not None:
            flat_steps.add_(1)
        run.count_vector_steps([st for _, _, is_matrix, st, _ in entries if not is_matrix])
        if compact is not None or self.offload:
            launches = None  # tensors made at this step (gathered columns, state visiting the device)
        rule = run.rule
        tensor_values = [tuple(h[k] for k in rule.tensor_hyperparams) for h in hyperparams]
        group_keys = [tuple(h[k] for k in rule.launch_hyperparams) for h in hyperparams]
        items, gathered = [], []
        # (the entry's fixed part spliced in whole: unpacking it into names would build a list per entry)
        for (i, pv, is_matrix, st, gi), head in zip(entries, fixed, strict=True):
            if not is_matrix:
                items.append((pv, grads[i][None], *head, st["step"], *tensor_values[gi]))  # [1, n], as pv
            elif compact is None:
                items.append((pv, grads[i], *head, st["step"], *tensor_values[gi]))
            else:
                # released gradients: only the selected columns' [R, k] exist; a dense update of the gathered
                # columns, scattered back after (the same arithmetic as the indexed update)
                idx = head[0]
                cols = pv.detach().index_select(1, idx)
                gathered.append((pv, idx, cols))
                items.append((cols, compact[i], None, *head[1:], st["step"], *tensor_values[gi]))
        distinct = dict.fromkeys(group_keys)
        keys = [group_keys[e[4]] for e in entries] if len(distinct) > 1 else None
        for key in distinct:
            chosen = items if keys is None else [item for item, kk in zip(items, keys, strict=True) if kk == key]
            if not chosen:
                continue
            if launches is not None:
                chosen = LaunchItems(chosen, launches.setdefault(key, {}), same_tensors=True)
            for bucket in self.buckets(chosen):
                self._update(bucket, key, grad_scale)
        with torch.no_grad():
            for p, idx, cols in gathered:
                p.index_copy_(1, idx, cols)

    def _update(self, bucket, key: tuple, grad_scale: float) -> None:
        link, rule = self.run.link, self.run.rule
        held = slice(3, 4 + len(rule.state_names))  # an item's state tensors and master
        if self.offload:  # stream this bucket's state in; it goes back out after the update
            moved = [(*item[:3], *(None if t is None else link.to_device(t) for t in item[held]), *item[held.stop:])
                     for item in bucket]
        else:
            moved = bucket
        rule.fast_step_(moved, grad_scale=grad_scale, **dict(zip(rule.launch_hyperparams, key, strict=True)))
        if self.offload:
            for home, there in zip(bucket, moved, strict=True):
                for dst, src in zip(home[held], there[held], strict=True):
                    if dst is not None:
                        link.to_host_(dst, src)

    def buckets(self, items: list[tuple]) -> list[list[tuple]]:
        """All at once, or (offload) buckets of at most ``bucket_numel`` state elements."""
        if not self.offload:
            return [items]
        buckets, size = [[]], 0
        stateless = not self.run.rule.state_names
        for item in items:
            # a state tensor's elements (the columns', R x k); a rule without state: the columns' too
            numel = item[0].shape[0] * item[2].numel() if stateless and item[2] is not None else (
                item[0].numel() if stateless else item[3].numel())
            if buckets[-1] and size + numel > self.bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += numel
        return buckets
