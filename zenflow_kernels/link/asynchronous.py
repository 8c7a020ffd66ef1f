"""The asynchronous link (:class:`AsyncLink`) over an engine: gradients land in a host landing area from
backward's hooks, fold into the sums once ``step()`` checked them; write-backs and fetches on the engine's
streams (docs/design.md section 5.1)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch

from .. import ops
from ..cpu_ops.fingerprint import fingerprint_unchecked
from ..device_model import Delays, recorded
from ..host import HostShard
from .base import _Link
from .completions import Future, _submit, new_worker


class AsyncLink(_Link):
    """Asynchronous movement: gradients land in a host landing area, fold into the sums once ``step()`` checked
    them; write-backs and fetches on an engine's streams (docs/design.md section 5.1)."""

    asynchronous = True
    FOLD_CHUNK_BYTES = 1 << 26
    """Landing bytes one fold job adds into the sums: the next backward's hooks each wait only for the job that
    reads their gradient's place, in the order they fired (a class attribute; tests shrink it)."""

    def __init__(self, host: HostShard, engine, *, kind: str, delays: Delays | None = None, **kwargs):
        super().__init__(host, thread_setup=engine.thread_setup, **kwargs)
        self.kind = kind
        self.moves_state = engine.moves_state
        self.engine = engine  # the CudaEngine or ThreadEngine this link's copies run on
        self._delays = delays
        self.alloc, self._fetcher = engine.alloc, engine.fetcher
        self._accumulator = new_worker(
            num_threads=kwargs["host_threads"], cores=kwargs["cores"], timeout=kwargs["timeout"],
            name="zenflow-accumulate", setup=engine.thread_setup,
        )
        self.workers += [self._accumulator, *engine.workers]
        self.key = int.from_bytes(os.urandom(8), "little")  # the fingerprints' weights (ops.multi_fingerprint)
        self._fingerprints: torch.Tensor | None = None  # int64 [params] on the device: each taken at its hook
        # this step's gradients that backward's hooks copied into the landing area (index -> bytes), in the order
        # the hooks fired; step() checks each against its fingerprint before folding it into the sums
        self._staged: dict[int, int] = {}
        self._overwritten = 0  # bytes of this step's hook copies a later hook copied over (a second backward)
        # the gradients this backward's hooks staged, with their version counters then: one written in place later in
        # the same backward (another hook's doing) may have been copied mid-change, and changed back before step()
        # its fingerprint would agree. Such a suspect's landed bytes are fingerprinted on the host at step() and
        # copied again if they differ (a version counter is shared by views: FSDP2's gradients, views of one flat
        # buffer, all move when one is added into, so a moved counter is a reason to look, not a change)
        self._watch: dict[int, tuple[torch.Tensor, int]] = {}
        self._suspect: set[int] = set()
        self._readers: dict[int, Future] = {}  # index -> the fold job that last read its place in the landing area
        self._ordered = False  # this backward's end orders the device's later work after its copies (queued)
        self._last_accumulate = None  # completion of every fold (and upload) issued so far (jobs run in order)
        self._guard = None  # completion of the last write-back: the copy-out buffers are free after it
        self._sums_zeroed = None  # device_accumulation in memory: the last upload's zeroing of the device sums
        self.timeline = getattr(engine, "timeline", None)

    def submit_update(self, fn: Callable) -> Future:
        return _submit(self._updater, recorded(fn, self.timeline, "update"), self._delays)

    @property
    def landing_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.host.landing.values())

    def _free(self, i: int) -> None:
        """Parameter ``i``'s place in the landing area may be written: the fold that read it is done (the wait,
        from a hook or step(), counts as stall)."""
        reader = self._readers.get(i)
        if reader is not None:
            if not reader.done():
                t0 = time.perf_counter()
                try:
                    reader.wait()
                finally:
                    self._waited(t0, "fold")
            del self._readers[i]

    def stage(self, i: int, grad: torch.Tensor) -> None:
        """From parameter ``i``'s backward hook, as backward produced its gradient: take its fingerprint (on the
        device, in stream order) and start its copy into the landing area. Nothing reaches the sums before
        ``step()`` checked the gradient is still what was copied (:meth:`accumulate`); a second backward copies
        over the first (the copy stream runs in order)."""
        dst = self.host.landing_view(i)
        if grad.shape != dst.shape or grad.dtype != dst.dtype:
            return  # not this parameter's gradient as the host lays it out: step() copies (or refuses) it
        self.engine.refuse_capture()
        self._free(i)
        if self._fingerprints is None:
            self._fingerprints = torch.zeros(len(self.host.host_step), dtype=torch.int64, device=grad.device)
        src = grad.detach()
        ops.multi_fingerprint([src], self.key, out=self._fingerprints[i : i + 1])
        self._watch[i] = (src, src._version)  # (a detached tensor shares the gradient's version counter)
        self._suspect.discard(i)
        self.engine.d2h([(dst, src)])
        nbytes = src.numel() * src.element_size()
        self.d2h_bytes += nbytes
        self._overwritten += self._staged.pop(i, 0)  # (re-inserted: the order is the last firing's)
        self._staged[i] = nbytes
        if not self._ordered:
            self._ordered = at_backward_end(self._after_backward)

    def _after_backward(self) -> None:
        """End of a backward whose hooks copied gradients: the device's later work (a user's in-place write to a
        gradient, GradScaler's unscale, the optimizer step) comes after those copies, so a copy reads the
        gradient its fingerprint was taken of. A stream wait on a GPU; the stand-in's training thread waits."""
        self._ordered = False
        self._check_versions()
        t0 = time.perf_counter()
        self.engine.device_waits_for_d2h()
        self._waited(t0, "backward")

    def _check_versions(self) -> None:
        """The gradients staged since the last check that were written in place since their hook are suspect."""
        self._suspect.update(i for i, (src, version) in self._watch.items() if src._version != version)
        self._watch.clear()

    def accumulate(self, items, buf: int, *, scale: float = 1.0, fuse_min_numel: int | None = None) -> dict:
        """acc[buf] += grad * ``scale`` for each ``(index, grad)``, in the background: a gradient a hook copied
        whose fingerprint is unchanged is not copied again; every other one (changed since its hook, or never
        staged) is copied now, into its place in the landing area; then fold jobs add the landing area into
        acc[buf] (on the accumulate worker, behind the copies). Hooks' copies of gradients not in ``items``
        are dropped. Returns ``{}`` (nothing is left to fuse)."""
        staged, wanted = self._staged, dict(items)
        self._check_versions()  # (a backward that failed never ran its end)
        checked = [(i, wanted[i]) for i in staged if i in wanted]
        changed: set[int] = set()
        if checked:
            # (the gradients were checked by step(): dense, of an allowed dtype, on the device)
            now = ops.multi_fingerprint_unchecked([g.detach() if g.requires_grad else g for _, g in checked], self.key)
            where = torch.tensor([i for i, _ in checked], device=now.device)
            differ = (now != self._fingerprints.index_select(0, where)).tolist()  # (one device sync)
            changed = {i for (i, _), d in zip(checked, differ, strict=True) if d}
            if self._suspect:  # (written in place during their backward: what landed is looked at)
                looks = [(i, f) for (i, _), f, d in zip(checked, now.tolist(), differ, strict=True)
                         if not d and i in self._suspect]
                changed |= self._landed_differ(looks)
        self._suspect.clear()
        kept = [i for i, _ in checked if i not in changed]
        hooks_copied = self.engine.d2h_marker() if kept else None
        copies = []
        for i, grad in items:
            if i in staged and i not in changed:
                continue
            self._free(i)
            copies.append((self.host.landing_view(i), grad.detach() if grad.requires_grad else grad))
        if copies:
            self.engine.d2h(copies)
            self.d2h_bytes += sum(src.numel() * src.element_size() for _, src in copies)
        hook_bytes = sum(staged.values()) + self._overwritten
        used = sum(staged[i] for i in kept)
        self.early_bytes += used
        self.unused_bytes += hook_bytes - used
        self._step_bytes = (sum(staged.values()), sum(staged[i] for i in changed))
        self._overwritten, self._ordered = 0, False  # (a backward that failed never ran its end: start again)
        # fold in the order the next backward's hooks will want their places back (this one's), then the rest
        later = [i for i, _ in items if i not in kept]
        all_copied = self.engine.d2h_marker() if later else hooks_copied
        for order, copied in ((kept, hooks_copied), (later, all_copied)):
            for chunk in self._chunks(order):
                self._fold(chunk, buf, scale, copied)
        self._staged = {}
        # the copies read the gradients as they are now; whatever the user does to them after step()
        # (zero_grad(set_to_none=False), p.grad.zero_(), the next backward adding in place) comes after
        self.engine.device_orders_after_d2h()
        return {}

    def _landed_differ(self, suspects: list[tuple[int, int]]) -> set[int]:
        """Of these ``(index, fingerprint at step())``, gradients written in place during the backward that staged
        them: those whose landed bytes differ (their copy read them mid-change). Waits for the hooks' copies."""
        if not suspects:
            return set()
        self.wait(self.engine.d2h_marker())
        self.landed_checked_bytes += sum(self._staged[i] for i, _ in suspects)
        landed = fingerprint_unchecked([self.host.landing_view(i) for i, _ in suspects], self.key).tolist()
        return {i for (i, want), got in zip(suspects, landed, strict=True) if got != want}

    def _chunks(self, order: list[int]) -> list[list[int]]:
        """``order`` cut into runs of at most ``FOLD_CHUNK_BYTES`` of landing area (a larger gradient alone)."""
        chunks, size = [], 0
        for i in order:
            s = self.host.slots[i]
            nbytes = s.numel * s.dtype.itemsize
            if not chunks or size + nbytes > self.FOLD_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += nbytes
        return chunks

    def _fold(self, indices: list[int], buf: int, scale: float, copied) -> None:
        """One job on the accumulate worker: wait for the copies, then acc[buf] += landing * scale for these
        parameters; their places in the landing area are the job's until it is done."""
        host, timeline = self.host, self.timeline

        def fold():
            copied.wait()
            t0 = time.perf_counter()
            host.fold(buf, indices, scale)
            t1 = time.perf_counter()
            self.fold_s += t1 - t0  # (one worker thread adds; the training thread reads it for telemetry)
            if timeline is not None:
                timeline.add("accumulate", "fold", t0, t1,
                             sum(host.slots[i].numel * host.slots[i].dtype.itemsize for i in indices))

        self._last_accumulate = job = _submit(self._accumulator, fold, self._delays)
        for i in indices:
            self._readers[i] = job

    def upload(self, items: Sequence[tuple[int, torch.Tensor]], buf: int) -> None:
        """acc[buf] <- a device-side sum for each ``(index, sum)``, copied straight into the (pinned)
        accumulation buffer, which holds nothing of this interval; the copies' completion is the
        accumulation's. The device zeroes the sums once the copies have read them."""
        self.engine.d2h([(self.host.acc_view(buf, i), total) for i, total in items])
        self._last_accumulate = self.engine.d2h_marker()
        sums = [total for _, total in items]
        # the next interval starts from zero, zeroed behind the copies: the device's next work (the next
        # forward and backward) overlaps the crossing; only the next write into the sums waits (sums_ready)
        self._sums_zeroed = self.engine.behind_d2h(lambda: torch._foreach_zero_(sums))
        self.d2h_bytes += sum(total.numel() * total.element_size() for total in sums)

    def sums_ready(self) -> None:
        """The device sums are about to be read or written: the last upload's copies and zeroing come first, for
        the stream current now; every access waits until the zeroing is known to have run (a first access under a
        side stream, ``state_dict()`` inside ``torch.cuda.stream(s)``, must not leave the default stream's next
        add racing it)."""
        if self._sums_zeroed is not None:
            done = self._sums_zeroed
            t0 = time.perf_counter()
            self.engine.device_waits_for(done)
            self._waited(t0, "sums")
            if self.engine.completed(done):
                self._sums_zeroed = None

    def discard(self) -> None:
        """Forget what backward's hooks copied this step (a skipped step or batch): none of it reached the sums;
        the next copies into the same places land after these (the copy stream runs in order)."""
        self.unused_bytes += sum(self._staged.values()) + self._overwritten
        self._staged, self._overwritten, self._ordered = {}, 0, False
        self._watch.clear()
        self._suspect.clear()

    def accumulation(self) -> Future | None:
        """The completion of every accumulation issued so far (jobs run in order)."""
        return self._last_accumulate

    def copy_out_guard(self):
        return self._guard

    def write_back(self, items) -> None:
        nbytes = self._count_write_back(items)
        self._guard = self.engine.h2d(self._write_back_work(items), nbytes)

    def before_grad_write(self) -> None:
        """Gradients are about to be written in place: the copies reading them must finish first."""
        self.engine.device_waits_for_d2h()

    def join(self) -> None:
        t0 = time.perf_counter()
        self.engine.join()
        self._waited(t0, "join")

    def synchronize(self) -> None:
        if self._last_accumulate is not None:
            self.wait(self._last_accumulate)
        self.engine.synchronize()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return self.engine.to_device(t)

    def to_host_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.engine.to_host_(dst, src)

    def new_host_state(self, t: torch.Tensor) -> torch.Tensor:
        return self.engine.new_host_state(t)

    def pinned_bytes(self) -> dict[str, int]:
        pinned = getattr(self.engine, "pinned_bytes", None)
        return pinned() if pinned is not None else {}

    def close(self) -> None:
        super().close()
        self.engine.close()


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass running now ends (autograd's final callbacks, as FSDP2 uses);
    False outside a backward pass (nothing queued)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True
