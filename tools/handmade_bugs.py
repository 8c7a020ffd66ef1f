"""Hand-made bugs: meaning-level mistakes a person makes, run against the tests (a safety net for refactors).

mutmut's operators (``+`` for ``-``, ``<`` for ``<=``, a constant off by one) are killed at about 98%;
bugs made by hand aim at what the code means (a cache not invalidated, a hook not removed, a span that
assumes it starts at 0, a flush that is skipped when no save comes with it) and were caught at about 75%.
Each entry of :data:`BUGS` is one such bug as a patch: a file, a snippet of today's code that must occur
exactly once, its replacement, and what it breaks. The runner copies the working tree (``git ls-files``:
tracked files and untracked ones git does not ignore) to a temporary folder, never touching the working
tree, applies one bug at a time there, runs the bug's test files with ``-x`` and reports::

    python tools/handmade_bugs.py                      # every bug, each against its own test files
    python tools/handmade_bugs.py --only plan-stale-after-load hooks-kept-after-reset
    python tools/handmade_bugs.py --fast               # only the bugs the fast files can catch
    python tools/handmade_bugs.py --tests tests/test_optim_api.py --k "reloading"   # override the tests
    python tools/handmade_bugs.py --list

caught: the tests failed (or timed out) with the bug in; missed: they passed; stale: the snippet is no
longer in the file, or its ``-k`` selects no test (the code or the tests moved: update the entry, do not drop
it). The exit status is 0 when every
bug that applied was caught. The tests that run in-process use the repository's interpreter; the ZeRO
tests' rank processes import the package from the copy (tests/zero_worker.py puts the copy first).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the fast optimizer files and selection mutmut uses (pyproject.toml [tool.mutmut])
FAST = ("tests/test_optim_api.py", "tests/test_optim.py")
FAST_K = "not chaos1 and not chaos2 and not interpreter_exits and not every_backend"
INTEGRATIONS = ("tests/test_integrations.py",)
ZERO = ("tests/test_zero.py",)
HANDOVER = ("tests/test_handover.py",)
ORACLE = ("tests/test_oracle_sweep.py",)
FINETUNING = ("tests/test_finetuning.py",)
RULES = ("tests/test_rules.py", "tests/test_cpu_rules.py")
SWEEP = ("tests/test_sharded_sweep.py",)  # every loop on every sharding, against the reference fed the average
ORACLES = ("tests/test_rule_oracles.py",)  # every rule against torch's optimizer (Lion: the paper's loop)
UNCOVERED = ("tests/test_uncovered.py",)  # DeepSpeed's switches offloaded, thawing, old checkpoints, planner
# the spawned two-rank cases against one rank and the reference, ZeRO-2's hooks and reloads
ZERO_K = "two_ranks_match or stage2_keeps or spans_start_past"


@dataclass(frozen=True)
class Bug:
    name: str
    file: str
    original: str
    replacement: str
    breaks: str
    tests: tuple[str, ...] = FAST
    k: str | None = FAST_K
    judged: str | None = None  # why no test can catch it (equivalent, or only on a GPU): a miss is not counted
    env: tuple[tuple[str, str], ...] = ()  # more environment for its test run (a narrower sweep)


BUGS = [
    # -- the four gaps the safety net closes (issue item 0) ------------------------------------------------
    Bug(
        "plan-stale-after-load",
        "zenflow_kernels/optim/fast_path.py",
        "        run.set_state(i, step=step, **entries)\n        self._plan = None\n",
        "        run.set_state(i, step=step, **entries)\n",
        "(a) a vector joining the fast path (after warm-up, or after a load) keeps the fast step's per-selection "
        "plan: the plan laid out before it joined leaves it out, so its fast-path state never moves",
    ),
    Bug(
        "hooks-kept-after-reset",
        "zenflow_kernels/optim/optimizer.py",
        "            self._stats.retire(self.run.link)\n            self._finalizer()\n",
        "            self._stats.retire(self.run.link)\n            self.run.link.close()\n",
        "(b) a reload stops the old link but not the rest of the finalizer's work: the old backward hooks stay, "
        "so each load adds one more hook per parameter (every gradient staged again and again)",
    ),
    Bug(
        "hooks-kept-after-close",
        "zenflow_kernels/handover.py",
        "        for handle in self.handles.values():\n            handle.remove()\n",
        "        pass  # the hooks check _closed and return\n",
        "(b) close() and the finalizer leave the backward hooks on the parameters (a closed or collected "
        "optimizer is still called from every backward)",
    ),
    Bug(
        "exchange-span-from-zero",
        "zenflow_kernels/sharding/zero_context.py",
        "span = host.out[dtype][lo:hi] if r == self.rank",
        "span = host.out[dtype][: hi - lo] if r == self.rank",
        "(c) the owner sends its copy-out from the start of its shard, as if the written-back parameters "
        "always began there: wrong weights reach the other replicas when the rank's first parameter is not "
        "written back (a vector after warm-up, a parameter without a gradient)",
        tests=ZERO, k=ZERO_K,
    ),
    Bug(
        "exchange-span-read-from-zero",
        "zenflow_kernels/sharding/zero_context.py",
        "exchange.received[s.index] = span[s.out_offset - lo : s.out_offset - lo + s.numel].view(",
        "exchange.received[s.index] = span[s.out_offset : s.out_offset + s.numel].view(",
        "(c) a replica reads the received span at the owner's shard offsets, as if it began at offset 0",
        tests=ZERO, k=ZERO_K,
    ),
    Bug(
        "stage2-hooks-not-registered",
        "zenflow_kernels/optim/build.py",
        'if handover.mode == "on" or run.shard.consumes_hooks:',
        'if handover.mode == "on":',
        "(b) ZeRO-2 registers no backward hooks: every reduction starts in step(), none overlaps backward",
        tests=ZERO, k=ZERO_K,
    ),
    Bug(
        "hf-no-flush-before-evaluation",
        "zenflow_kernels/integrations/transformers.py",
        "if control.should_save or control.should_evaluate:",
        "if control.should_save:",
        "(d) the Hugging Face callback flushes before saves only: an evaluation at a step without a save "
        "sees weights up to an interval stale",
        tests=INTEGRATIONS, k=None,
    ),
    Bug(
        "hf-no-flush-at-epoch-end",
        "zenflow_kernels/integrations/transformers.py",
        "    def on_epoch_end(self, args, state, control, **kwargs):\n"
        "        self._before_save_or_evaluate(args, control, kwargs)\n",
        "    def on_epoch_end(self, args, state, control, **kwargs):\n        pass\n",
        "(d) with eval_strategy=\"epoch\" (the Trainer decides to evaluate at the epoch's end, after the last "
        "step's on_step_end) the evaluation sees stale weights",
        tests=INTEGRATIONS, k=None,
    ),
    Bug(
        "lightning-no-flush-before-validation",
        "zenflow_kernels/integrations/lightning.py",
        "    def on_validation_start(self, trainer, pl_module) -> None:\n        self._hold(trainer, True)\n",
        "    def on_validation_start(self, trainer, pl_module) -> None:\n        pass\n",
        "(d) Lightning's validation runs on stale weights when no checkpoint comes with it",
        tests=INTEGRATIONS, k=None,
    ),
    # -- more of the same kind --------------------------------------------------------------------------
    Bug(
        "entering-columns-keep-old-moments",
        "zenflow_kernels/optim/selection.py",
        "            for name, t in state.items():\n                t[:, stay] = st[name].to(device)[:, pos[stay]]\n",
        "            for name, t in state.items():\n                t.copy_(st[name].to(device)[:, pos])\n",
        "a re-selection's entering columns take the moments of the old column at their sorted position "
        "instead of starting from zero (spec 2.3)",
    ),
    Bug(
        "write-back-overwrites-selected-columns",
        "zenflow_kernels/optim/interval.py",
        "            items.append((run.local[i], others[i] if i in others else run.host.out_view(i), sel))\n",
        "            items.append((run.local[i], others[i] if i in others else run.host.out_view(i), None))\n",
        "the host result overwrites the whole matrix, the fast path's selected columns included (spec 2.5)",
    ),
    Bug(
        "mean-over-steps-not-gradients",
        "zenflow_kernels/optim/interval.py",
        "        counts = self.counts[self.buf]\n        for i in indices:\n            counts[i] += 1\n",
        "        counts = self.counts[self.buf]\n        for i in range(len(self.run.params)):\n"
        "            counts[i] += self.run.params[i].dim() == 2\n",
        "the interval's mean gradient divides by the steps of the interval, also counting the steps in which "
        "a matrix had no gradient",
    ),
    Bug(
        "clip-coefficient-twice",
        "zenflow_kernels/optim/optimizer.py",
        "grad_scale = self._amp if coef is None else self._amp / coef",
        "grad_scale = self._amp if coef is None else self._amp / (coef * coef)",
        "the fast path divides the gradient by the clipping coefficient twice (spec 2.6)",
    ),
    Bug(
        "checkpoint-drops-pending",
        "zenflow_kernels/optim/checkpoint.py",
        "st.update(acc_count=interval.counted(i), pending=i in interval.pending)",
        "st.update(acc_count=interval.counted(i), pending=False)",
        "a checkpoint taken with an overlapped host result awaiting its write-back forgets it: the resumed "
        "run never writes that interval's result back (spec 2.7)",
    ),
    Bug(
        "load-drops-interval-counts",
        "zenflow_kernels/optim/checkpoint.py",
        "        interval.counts[interval.buf][i] = int(st[\"acc_count\"])\n",
        "",
        "a loaded checkpoint restores the interval's gradient sums but not how many gradients they hold",
    ),
    Bug(
        "zero-grad-does-not-wait",
        "zenflow_kernels/optim/optimizer.py",
        "                self.run.link.before_grad_write()  # copies still reading the gradients finish first\n",
        "                pass\n",
        "zero_grad(set_to_none=False) zeroes gradients that queued copies to the host still read",
        judged="equivalent on CPU: step() already orders its gradient copies before later writes and joins "
               "them on the test link (6df95e1); only a CUDA stream wait could still differ",
    ),
    Bug(
        "overlap-reuses-the-busy-buffer",
        "zenflow_kernels/optim/interval.py",
        "        self.buf = (self.buf + 1) % len(self.counts)\n",
        "",
        "with overlap the next interval accumulates into the buffer the background host update is reading",
    ),
    Bug(
        "vectors-join-fast-path-at-step-zero",
        "zenflow_kernels/optim/fast_path.py",
        "            step = run.host_step(i)\n",
        "            step = 0\n",
        "a vector joins the fast path with the host's moments but restarts bias correction at step 0",
    ),
    Bug(
        "leaving-columns-not-handed-back",
        "zenflow_kernels/optim/selection.py",
        "            if owned and gone.any():  # ownership returns to the host, value included\n",
        "            if False:  # ownership returns to the host, value included\n",
        "columns that leave the selection do not refresh the host master: the fast path's updates of them "
        "are lost at the next write-back (spec 2.3)",
    ),
    Bug(
        "every-group-gets-group-0-hyper",
        "zenflow_kernels/optim/fast_path.py",
        "        tensor_values = [tuple(h[k] for k in rule.tensor_hyperparams) for h in hyperparams]\n",
        "        tensor_values = [tuple(hyperparams[0][k] for k in rule.tensor_hyperparams) for h in hyperparams]\n",
        "the fast path uses the first param group's lr and weight decay for every parameter",
    ),
    # -- the hand-over's bookkeeping (handover.py: one owner since the optimizer became a facade) ----------------
    Bug(
        "handover-copies-every-firing",
        "zenflow_kernels/handover.py",
        "        return self.mode == \"on\" and n >= self.backwards\n",
        "        return self.mode == \"on\"\n",
        "undeclared micro-batches: every backward's hooks copy their gradients, not only the last one's (the "
        "learned backward count is ignored): each earlier copy crosses PCIe for nothing",
        tests=HANDOVER, k=None,
    ),
    Bug(
        "handover-skip-keeps-firings",
        "zenflow_kernels/handover.py",
        "        \"\"\"The batch was dropped before ``step()`` (``zero_grad()``): nothing to learn from it.\"\"\"\n"
        "        self._fires.clear()\n",
        "        \"\"\"The batch was dropped before ``step()`` (``zero_grad()``): nothing to learn from it.\"\"\"\n",
        "a batch skipped with zero_grad() before step() counts its backward passes into the next step's, so the "
        "next step learns one backward too many and its last backward's hooks copy nothing",
        tests=HANDOVER, k=None,
    ),
    Bug(
        "handover-rewrites-never-reset",
        "zenflow_kernels/handover.py",
        "            self._rewrites.clear()  # a step whose copies were used (or that had none) ends the row\n",
        "            pass  # a step whose copies were used (or that had none) ends the row\n",
        "occasional rewrites (a repaired NaN, clipping on a spike) add up over the run instead of needing "
        "REWRITES_BEFORE_OFF steps in a row: the hand-over switches off for good after three isolated ones",
        tests=HANDOVER, k=None,
    ),
    # -- the parts the facade hands to (optim/flushed.py, step_inputs.read_step, fast_path.join) -------------
    Bug(
        "inner-flushed-restores",
        "zenflow_kernels/optim/flushed.py",
        "        if not self.depth and not self.held and interval is not None:\n",
        "        if not self.held and interval is not None:\n",
        "nested flushed() contexts: the inner one's exit restores the live weights while the outer one (a save "
        "around an evaluation) still expects the flushed ones",
        tests=("tests/test_flushed.py",), k=None,
    ),
    Bug(
        "missed-restore-not-restored",
        "zenflow_kernels/optim/flushed.py",
        "            self.hold(False, interval, closed=False)\n",
        "            self.held = False\n",
        "an integration that never restores the held weights: step() warns but trains on from the flushed "
        "weights, so the run differs from one without the save for good",
        tests=("tests/test_flushed.py",), k=None,
    ),
    Bug(
        "norm-of-scaled-gradients",
        "zenflow_kernels/optim/step_inputs.py",
        "if len(own) == len(active) else None) / amp\n",
        "if len(own) == len(active) else None)\n",
        "under a GradScaler the clipping norm (and the norm clip_grad_norm_() returns) is the scaled gradients': "
        "clipping cuts by the scale too",
        tests=HANDOVER, k=None,
    ),
    Bug(
        "vector-state-reset-every-step",
        "zenflow_kernels/optim/fast_path.py",
        "            if i in self._joined:\n                continue\n"
        "            if \"step\" not in self.run.fast_state(i):\n",
        "            if True:\n",
        "every step, each vector takes its Adam state from the host again: the fast path's updates of the "
        "vectors are thrown away",
    ),
    # -- issue 40: the combinations both links share (checked against the reference), fine-tuning setups ----------
    Bug(
        "strided-gradients-not-unscaled",
        "zenflow_kernels/link/cpu.py",
        "                           [g for g, f in zip(grads, flat, strict=True) if not f], scale)\n",
        "                           [g for g, f in zip(grads, flat, strict=True) if not f], 1.0)\n",
        "a strided (transposed) gradient is added into the host sums without GradScaler's unscale (the CPU link's "
        "torch path for non-contiguous gradients)",
        tests=ORACLE, k="strided",
    ),
    Bug(
        "norm-skips-strided-gradients",
        "zenflow_kernels/sharding/base.py",
        "        total = sum_squares_unchecked([g if g.is_contiguous() else g.contiguous() for g in grads])\n",
        "        total = sum_squares_unchecked([g for g in grads if g.is_contiguous()])\n",
        "the global gradient norm (clipping, the skip check) leaves strided gradients out: both links clip by too "
        "small a norm",
        tests=ORACLE, k="strided",
    ),
    Bug(
        "device-sums-not-unscaled",
        "zenflow_kernels/optim/sums.py",
        "            accumulate_unchecked(sums, grads, scale=scale)\n        elif scale == 1.0:",
        "            accumulate_unchecked(sums, grads, scale=1.0)\n        elif scale == 1.0:",
        "device_accumulation adds the scaled gradients into the device sums (GradScaler's scale left in the host's "
        "interval mean)",
        tests=ORACLE, k="devacc",
    ),
    Bug(
        "fused-host-update-under-a-scale",
        "zenflow_kernels/optim/optimizer.py",
        "fuse = self.FUSE_MIN_NUMEL if inputs.max_norm is None and inputs.inv_amp == 1.0 else None",
        "fuse = self.FUSE_MIN_NUMEL if inputs.max_norm is None else None",
        "a synchronous update folds a large matrix's last gradient into its AdamW pass under a GradScaler too: that "
        "gradient enters the mean still scaled",
        tests=ORACLE, k="fuse",
    ),
    Bug(
        "scorer-sees-scaled-gradients",
        "zenflow_kernels/optim/selection.py",
        "            importances = [_unscaled(f, inv_scale) if callable(f) else f for f in importances]\n",
        "            importances = list(importances)\n",
        "a callable importance is handed the gradient still scaled by the GradScaler (a scorer not homogeneous in the "
        "gradient ranks other columns)",
        tests=ORACLE, k="scorer or groups",
    ),
    Bug(
        "group-topk-ignored",
        "zenflow_kernels/optim/run.py",
        "        return self.param_groups[self.group_of[i]].get(name, getattr(self.config, name))\n",
        "        return getattr(self.config, name)\n",
        "a param group's own topk_ratio and importance are ignored: every matrix takes the optimizer's",
        tests=ORACLE, k="groups",
    ),
    Bug(
        "clip-request-last-wins",
        "zenflow_kernels/optim/step_inputs.py",
        "            self.request = min(float(max_norm), self.request or math.inf)\n",
        "            self.request = float(max_norm)\n",
        "two clip_grad_norm_() requests in one step: the last applies, not the smallest",
        tests=ORACLE, k="requests",
    ),
    Bug(
        "clip-request-kept-after-zero-grad",
        "zenflow_kernels/optim/optimizer.py",
        "        self._clips.drop()\n        super().zero_grad(set_to_none=set_to_none)\n",
        "        super().zero_grad(set_to_none=set_to_none)\n",
        "the request of a batch dropped with opt.zero_grad() clips the next step",
        tests=ORACLE, k="requests",
    ),
    Bug(
        "clip-request-never-used-up",
        "zenflow_kernels/optim/step_inputs.py",
        "        request, norms = self.request, self.norms\n        self.drop()\n",
        "        request, norms = self.request, self.norms\n        self.norms = []\n",
        "a request stays in force after its step (until a zero_grad()): a loop that zeroes with model.zero_grad() "
        "clips every later step by it",
        tests=ORACLE, k="requests",
    ),
    Bug(
        "lightning-routes-value-clipping",
        "zenflow_kernels/integrations/lightning.py",
        'algorithm in (None, "norm") and _zenflow_optimizers(trainer)',
        'algorithm in (None, "norm", "value") and _zenflow_optimizers(trainer)',
        "Lightning's gradient_clip_algorithm='value' is routed into the optimizer's clipping by norm",
        tests=ORACLE, k="lightning",
    ),
    Bug(
        "fingerprint-odd-tail-weight",
        "zenflow_kernels/cpu_ops/kernels/fingerprint.py",
        "                s += np.uint64(x[x.size - 1]) * fingerprint_weight(lo + full, key)\n",
        "                s += np.uint64(x[x.size - 1]) * fingerprint_weight(full, key)\n",
        "a 2-byte tensor's odd last element is weighted as if its work item were the first: past the first item the "
        "numba fingerprint differs from the other backends'",
        tests=("tests/test_fingerprint.py",), k=None,
    ),
    Bug(
        "hook-on-a-frozen-parameter",
        "zenflow_kernels/handover.py",
        "            if not p.requires_grad:\n                continue",
        "            if False:\n                continue",
        "backward hooks are registered on frozen parameters too: torch refuses, the first step of any frozen model "
        "fails on the asynchronous link",
        tests=FINETUNING, k=None,
    ),
    Bug(
        "unfrozen-parameter-not-laid-out",
        "zenflow_kernels/optim/optimizer.py",
        "        if not self.run.host_params.issuperset(active):\n",
        "        if False:\n",
        "a parameter frozen when the host shard was laid out and trained later never gets host state",
        tests=FINETUNING, k=None,
    ),
    Bug(
        "frozen-parameters-get-host-state",
        "zenflow_kernels/optim/build.py",
        "    return {i for i, p in enumerate(params) if p.requires_grad or p.grad is not None} | set(kept)\n",
        "    return set(range(len(params)))\n",
        "frozen parameters get host state (16 B/param and more of host memory for a frozen backbone)",
        tests=FINETUNING, k="host_memory",
    ),
    Bug(
        "restore-assumes-host-state",
        "zenflow_kernels/optim/checkpoint.py",
        '        if i in host.slots and "host_master" in st:',
        "        if i in host.slots:",
        "a checkpoint entry without host state (a frozen parameter's) is read as if it had some",
        tests=FINETUNING, k="checkpoint",
    ),
    Bug(
        "checkpoint-host-set-forgotten",
        "zenflow_kernels/optim/optimizer.py",
        "        self._held = loaded.host_params\n",
        "        self._held = set()\n",
        "a loaded checkpoint's parameters with host state that are frozen now lose it (the loaded state is dropped)",
        tests=FINETUNING, k="checkpoint",
    ),
    Bug(
        "zero-write-back-layout-of-all",
        "zenflow_kernels/sharding/zero_context.py",
        "if self.owner[i] == r and i in host_params])[1]",
        "if self.owner[i] == r])[1]",
        "ZeRO's write-back broadcasts assume every owned parameter has host state: with frozen ones the spans are "
        "shifted and replicas receive other parameters' weights",
        tests=ZERO, k="frozen",
    ),
    Bug(
        "zero2-unbucketed-matrix-not-reduced",
        "zenflow_kernels/sharding/zero_context.py",
        "            outside = sorted(i for i in active if self.params[i].dim() == 2 and i not in self.bucketed)\n",
        "            outside = []\n",
        "ZeRO-2: a matrix frozen when the buckets were made and trained now is never reduced to its owner",
        tests=ZERO, k="frozen",
    ),
    Bug(
        "fsdp2-placeholder-by-local-size",
        "zenflow_kernels/sharding/fsdp2.py",
        '"host_master" in st and tuple(st["host_master"].shape) == (0,) and self.params[i].numel()):',
        '"host_master" in st and st["host_master"].to_local().numel() == 0 and self.params[i].numel()):',
        "FSDP2: a rank holding none of a parameter's rows takes its empty shard for a frozen parameter's placeholder "
        "and the ranks diverge after a load at another world size",
        tests=("tests/test_fsdp2.py",), k="resumes or continue",
    ),
    Bug(
        "version-not-checked-at-backward-end",
        "zenflow_kernels/link/asynchronous.py",
        "        self._ordered = False\n        self._check_versions()\n",
        "        self._ordered = False\n",
        "a gradient written in place during its backward is checked only at step(), where a loop's legitimate "
        "post-backward write (clipping that leaves the bits) also moved its version",
        tests=FINETUNING, k="changed or data_edit or keeps_the_bits",
    ),
    Bug(
        "landed-bytes-trusted",
        "zenflow_kernels/link/asynchronous.py",
        "        return {i for (i, want), got in zip(suspects, landed, strict=True) if got != want}\n",
        "        return set()\n",
        "a gradient changed during backward and changed back: its copy, which read it mid-change, is folded in",
        tests=FINETUNING, k="changed_in_place",
    ),
    Bug(
        "overwritten-copies-are-rewrites",
        "zenflow_kernels/link/asynchronous.py",
        "        self._step_bytes = (sum(staged.values()), sum(staged[i] for i in changed))\n",
        "        self._step_bytes = (hook_bytes, hook_bytes - used)\n",
        "copies a later backward copied over count as rewrites: undeclared micro-batches of varying number turn the "
        "hand-over off",
        tests=FINETUNING, k="micro_batches",
    ),
    Bug(
        "replaced-optimizer-keeps-its-hooks",
        "zenflow_kernels/optim/build.py",
        "    check_params(params, name)\n    release_hooks(params)\n",
        "    check_params(params, name)\n",
        "a new optimizer over the same parameters leaves the old one's hooks copying until its own first step",
        tests=FINETUNING, k="replaced",
    ),
    Bug(
        "failed-build-leaves-threads",
        "zenflow_kernels/optim/build.py",
        "    except BaseException:\n        shutdown(link, run.torch_threads, hooks)\n        raise\n",
        "    except BaseException:\n        raise\n",
        "a first step whose parts fail to build leaves the link's threads running",
        tests=FINETUNING, k="first_step_that_fails",
    ),
    Bug(
        "worker-joins-itself",
        "zenflow_kernels/link/worker.py",
        "            if threading.current_thread() is not self._thread:\n                self._thread.join(timeout)",
        "            self._thread.join(timeout)",
        "an optimizer collected on its own worker thread fails in its finalizer (cannot join current thread)",
        tests=FINETUNING, k="own_worker",
    ),
    # -- issue 44: a step's work does not grow with the tensor count ---------------------------------------------
    Bug(
        "landing-views-made-every-step",
        "zenflow_kernels/host.py",
        "        view = self._landing_views.get(index)\n",
        "        view = None\n",
        "each gradient's view into the landing area is made again at every step (two torch operators a matrix)",
        tests=("tests/test_step_work.py",), k=None,
    ),
    Bug(
        "every-copy-detached",
        "zenflow_kernels/link/asynchronous.py",
        "grad.detach() if grad.requires_grad else grad))",
        "grad.detach()))",
        "every gradient step() copies is detached first (a torch operator a matrix), needed only for one that "
        "requires a gradient",
        tests=("tests/test_step_work.py",), k=None,
    ),
    Bug(
        "unselected-shortcut-too-eager",
        "zenflow_kernels/optim/selection.py",
        "        if seen.issuperset(matrices):\n",
        "        if seen:\n",
        "once any matrix has a selection, a matrix whose gradient first appears between selection boundaries is not "
        "selected: the host alone updates it until the next boundary",
        tests=FAST, k=FAST_K,
    ),
    # -- issue 41: the update rule as a seam ------------------------------------------------------------------------
    Bug(
        "lion-host-ignores-weight-decay",
        "zenflow_kernels/cpu_ops/kernels/lion.py",
        "        p = p if decay == np.float32(1.0) else p * decay\n",
        "        p = p\n",
        "the host's Lion kernel skips the decoupled weight decay (the device's torch step keeps it)",
        tests=RULES, k=None,
    ),
    Bug(
        "sgd-first-step-dampened",
        "zenflow_kernels/cpu_ops/kernels/sgd.py",
        "        b = d if first else fma(d, one_minus_dampening, load_f32(buf, i) * momentum)\n",
        "        b = fma(d, one_minus_dampening, load_f32(buf, i) * momentum)\n",
        "SGD's momentum buffer takes dampening at its first step (torch's starts as the gradient itself)",
        tests=RULES, k=None,
    ),
    Bug(
        "bf16-state-option-ignored",
        "zenflow_kernels/host_fields.py",
        "alloc(numel, torch.float32 if name == \"master\" else state_dtype)",
        "alloc(numel, torch.float32)",
        "a rule's state_dtype=torch.bfloat16 is silently ignored: the host keeps fp32 state",
        tests=RULES, k="bf16",
    ),
    Bug(
        "another-rules-checkpoint-accepted",
        "zenflow_kernels/optim/checkpoint.py",
        "    if saved_rule.get(\"name\") != rule.name or tuple(saved_rule.get(\"state_names\", ())) != "
        "rule.state_names:\n",
        "    if False:\n",
        "a checkpoint of another update rule is loaded (its state names read as this rule's) instead of refused",
        tests=RULES, k="refused",
    ),
    Bug(
        "subclass-schedule-replaced-on-load",
        "zenflow_kernels/optim/optimizer.py",
        "            self.schedule = self.make_schedule(saved=loaded.schedule)\n",
        "            self.schedule = Schedule.from_dict(loaded.schedule)\n",
        "load_state_dict makes a stock Schedule: a subclass's schedule_class is lost at the first load",
        tests=("tests/test_hacking.py",), k="schedule",
    ),
    Bug(
        "columns-stepped-at-one-count",
        "zenflow_kernels/rules/base.py",
        "        if len(values) == 1:\n",
        "        if True:\n",
        "a rule without a fused kernel steps all of a matrix's selected columns at the first column's step count "
        "(entering columns and staying ones share one bias correction)",
        tests=RULES, k=None,
    ),
    # -- issue 54: the sharded paths through the loops people write ----------------------------------------
    Bug(
        "zero2-change-told-by-identity",
        "zenflow_kernels/sharding/zero_context.py",
        "                           or not torch.equal(ops.multi_fingerprint(now, self._key), fingerprints))\n",
        "                           or False)\n",
        "ZeRO-2 keeping .grad tells a changed bucket only by which gradients it holds, not by their bits: a .data "
        "write after the hook started the bucket reaches the selected columns but not the owner's average",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_keep-data_all"),),
    ),
    Bug(
        "zero2-change-decided-alone",
        "zenflow_kernels/sharding/zero.py",
        "        self._averaged = self.reducer.finish(chosen, summed[1:])\n",
        "        self._averaged = self.reducer.finish(chosen, votes[1:])\n",
        "each rank re-sends the buckets it alone saw change: an edit on one rank leaves the ranks' reductions "
        "mismatched (a hang until collective_timeout)",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_keep-edit_one_rank-Lion"),),
    ),
    Bug(
        "zero2-refusal-decided-alone",
        "zenflow_kernels/sharding/zero.py",
        "        if int(summed[0]):\n",
        "        if refuse:\n",
        "a loop that changed released gradients is refused only on the rank that saw it: the others go on into "
        "collectives the refusing rank never joins",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-nan_repair-SGD"),),
    ),
    Bug(
        "zero2-unscale-not-told",
        "zenflow_kernels/optim/step_inputs.py",
        "    shard.user_unscaled = getattr(opt, \"found_inf\", None) is not None and getattr(opt, \"grad_scale\", "
        "None) is None\n",
        "    shard.user_unscaled = False\n",
        "the user's scaler.unscale_ under ZeRO-2's released gradients goes unseen on a model of matrices only: the "
        "released matrices are stepped at the loss scale",
        tests=SWEEP, k="matches_one_process",
        env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-amp_unscale_clip-AdamW-bare"),),
    ),
    Bug(
        "zero2-vectors-not-watched",
        "zenflow_kernels/sharding/zero.py",
        "        return bool(now) and not torch.equal(",
        "        return False and not torch.equal(",
        "a NaN repair or edit after backward under ZeRO-2's released gradients is not refused: it reaches the "
        "vectors and not the matrices",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-nan_repair-AdamW"),),
    ),
    Bug(
        "scaler-not-told-on-other-ranks",
        "zenflow_kernels/optim/step_inputs.py",
        "        tell_scaler_found_inf(opt)\n",
        "        pass\n",
        "an overflow on one rank skips the step everywhere but only that rank's GradScaler backs off: the ranks' "
        "scales part, and the next averages mix gradients at two scales",
        tests=SWEEP, k="backs_off", env=(("ZENFLOW_SWEEP_ONLY", "zero1-amp_inf_one_rank-AdamW"),),
    ),
    Bug(
        "dropped-batch-reductions-kept",
        "zenflow_kernels/sharding/zero.py",
        "        if self.reducer is not None and self.reducer.pending():\n",
        "        if False:\n",
        "a batch dropped with zero_grad() under ZeRO-2's released gradients stays in the owners' sums: the next "
        "step adds it",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-dropped_batch-Lion"),),
    ),
    Bug(
        "zero_grad-forgets-the-sharding",
        "zenflow_kernels/optim/optimizer.py",
        "            self._shard.drop_step()  # (ZeRO-2: reductions a dropped batch's backward started)\n",
        "",
        "zero_grad() before step() does not tell the sharding: a dropped batch's reductions are kept",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-dropped_batch-AdamW"),),
    ),
    Bug(
        "zero2-vectors-left-local",
        "zenflow_kernels/sharding/zero.py",
        "        self.ctx.average_([self.params[i].grad for i in active if self.params[i].dim() != 2], \"vector "
        "gradients\")\n",
        "",
        "ZeRO-2 never averages the vectors' gradients: each replica steps its biases and norms with its own "
        "half batch",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_keep-plain-SGD"),),
    ),
    Bug(
        "zero2-kept-columns-summed",
        "zenflow_kernels/sharding/zero.py",
        "        self.ctx.average_(compact, \"selected columns\")\n",
        "        self.ctx.sum_(compact, \"selected columns\")\n",
        "ZeRO-2 keeping .grad sums the selected columns over the ranks instead of averaging them: the fast step "
        "takes twice the gradient",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_keep-routed_clip-SGD"),),
    ),
    Bug(
        "zero2-micro-batch-rounds-not-divided",
        "zenflow_kernels/sharding/zero_context.py",
        "            total.div_(self.ctx.world)\n",
        "",
        "ZeRO-2 with released gradients adds the ranks' sums and never divides by the world: the owner's "
        "matrices see the sum, not the average",
        tests=SWEEP, k="matches_one_process", env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-plain-SGD"),),
    ),
    Bug(
        "scaler-not-told-under-release",
        "zenflow_kernels/optim/step_inputs.py",
        "    if not overflow and not math.isfinite(norm) and getattr(opt, \"found_inf\", None) is not None:\n",
        "    if False:\n",
        "one rank overflows under ZeRO-2's released gradients: every rank skips the step, but only that rank's "
        "GradScaler backs off (the others checked the finite vectors they still hold)",
        tests=SWEEP, k="backs_off", env=(("ZENFLOW_SWEEP_ONLY", "zero2_release-amp_inf_one_rank-SGD"),),
    ),
    # -- issue 54: the ground the last run left uncovered (rules against torch, bf16 state, schedules, DeepSpeed's switches, freeze/thaw, old checkpoints, planner, concentration)  # noqa: E501
    Bug(
        "bf16-state-not-written-back",
        "zenflow_kernels/rules/base.py",
        "                t.copy_(w if rounding is None else round_to_bf16(w, rounding, k))\n",
        "                pass\n",
        "a rule without a host kernel (UpdateRule's torch host_step_) and bf16 state steps fp32 copies of its state "
        "and never writes them back: its host state stays zero",
        tests=ORACLES, k="bf16 and torch-host",
    ),
    Bug(
        "sgd-group-nesterov-ignored",
        "zenflow_kernels/rules/sgd.py",
        'nesterov=group["nesterov"]',
        "nesterov=self.nesterov",
        "a param group's own nesterov is ignored: every group steps with the rule's",
        tests=ORACLES, k="sgd-groups",
    ),
    Bug(
        "adam-default-weight-decay",
        "zenflow_kernels/rules/adamw.py",
        "weight_decay: float = 0.0,",
        "weight_decay: float = 0.01,",
        "rules.Adam() decays by default (AdamW's 0.01 as L2), where torch.optim.Adam's default is 0",
        tests=ORACLES, k="adam-defaults or defaults_are_torchs",
    ),
    Bug(
        "sgd-steps-along-the-rounded-buffer",
        "zenflow_kernels/cpu_ops/kernels/sgd.py",
        "        return fma(b, momentum, d) if nesterov else b\n",
        "        return fma(b, momentum, d) if nesterov else load_f32(buf, i)\n",
        "SGD's numba kernels without Nesterov step along the stored momentum buffer: with bf16 state, the buffer "
        "rounded to bf16 instead of the fp32 momentum just computed",
        tests=ORACLES, k="bf16 and sgd and numba-host",
    ),
    Bug(
        "rule-plan-keeps-the-first-lr",
        "zenflow_kernels/cpu_ops/_rule_plan.py",
        "        if tensor_hyperparams != self.tensor_hyperparams:  # a scheduler changes lr at every step\n",
        "        if self.tensor_hyperparams is None:  # a scheduler changes lr at every step\n",
        "Lion's and SGD's numba fast path keeps the lr (and weight decay) of the selection's first step while the "
        "layout is kept: an LR scheduler is followed only at re-selections",
        tests=ORACLES, k="scheduler and numba and (lion or sgd)",
    ),
    Bug(
        "reset-offloaded-columns-restart-at-zero",
        "zenflow_kernels/optim/selection.py",
        "            steps.fill_(count)\n",
        "            steps.fill_(0)\n",
        "reselect_state=\"reset\" with the fast path's state offloaded: the selected columns restart their step "
        "count at 0 instead of the matrix's count (bias correction restarts)",
        tests=UNCOVERED, k="reselect_state-offload or semantics-offload",
    ),
    Bug(
        "thaw-holds-only-this-steps-params",
        "zenflow_kernels/optim/optimizer.py",
        "            self._held = set(self.run.host_params).union(active)\n",
        "            self._held = set(active)\n",
        "the re-layout when a frozen parameter is thawed gives host state only to that step's parameters: a "
        "parameter frozen again meanwhile loses its host master and moments",
        tests=UNCOVERED, k="thaw",
    ),
    Bug(
        "old-checkpoint-holds-no-host-state",
        "zenflow_kernels/optim/checkpoint.py",
        'zenflow.get("host_params", range(len(local)))',
        'zenflow.get("host_params", ())',
        "a format-1 checkpoint (written before host_params existed, holding every parameter's host state) is read "
        "as holding none: a parameter frozen at the load loses its host state",
        tests=UNCOVERED, k="old_checkpoint",
    ),
    Bug(
        "planner-writes-back-vectors",
        "zenflow_kernels/planner.py",
        "    written_back = round((1.0 - topk_ratio) * matrix_params)\n",
        "    written_back = round((1.0 - topk_ratio) * everything)\n",
        "the planner's write-back counts the vector parameters too (they stay on the device): the predicted "
        "write-back and stall are too high",
        tests=UNCOVERED, k="planner",
    ),
    Bug(
        "concentration-of-scorer-output",
        "zenflow_kernels/optim/selection.py",
        'if callable(imp) or imp == "l1"]',
        'if imp == "l1"]',
        "a callable importance's scores are taken as the concentration's energies (not the gradient's squared "
        "column norms)",
        tests=UNCOVERED, k="concentration",
    ),
    Bug(
        "lion-decay-after-update",
        "zenflow_kernels/rules/lion.py",
        "        if weight_decay != 0:\n            param.mul_(1 - lr * weight_decay)\n"
        "        param.add_(update, alpha=-lr)\n",
        "        param.add_(update, alpha=-lr)\n        if weight_decay != 0:\n"
        "            param.mul_(1 - lr * weight_decay)\n",
        "Lion's torch step decays the weight after the sign update instead of before (the decay also shrinks "
        "the update): the torch fast path and a host without the kernel drift from the paper's step",
        tests=ORACLES, k="lion-groups and (torchfast or torchhost) or lion-torch-",
    ),
    Bug(
        "lion-group-betas-ignored",
        "zenflow_kernels/rules/lion.py",
        'beta1=group["betas"][0], beta2=group["betas"][1],',
        "beta1=self.betas[0], beta2=self.betas[1],",
        "a param group's own Lion betas are ignored: every group interpolates with the rule's",
        tests=ORACLES, k="lion-groups",
    ),
    Bug(
        "adam-host-kernel-decoupled",
        "zenflow_kernels/rules/adamw.py",
        "zero_grad=zero_grad, adamw=self.decoupled, rounding=rounding, **hyperparams)",
        "zero_grad=zero_grad, adamw=True, rounding=rounding, **hyperparams)",
        "Adam's host pass runs the numba kernel as AdamW: the host decays the weight decoupled while the fast path "
        "adds the L2 term to the gradient",
        tests=ORACLES, k="adam-groups-host-every-step-numbafast-numbahost or adam-numba-host",
    ),
    Bug(
        "sgd-nesterov-lookahead-swapped",
        "zenflow_kernels/rules/sgd.py",
        "            d = d.add(buf, alpha=momentum) if nesterov else buf\n",
        "            d = buf.add(d, alpha=momentum) if nesterov else buf\n",
        "SGD's torch step takes Nesterov's look-ahead as buf + momentum * d instead of d + momentum * buf",
        tests=ORACLES, k="sgd-groups and (torchfast or torchhost) or sgd-nesterov-torch-",
    ),
    Bug(
        "lion-host-decay-without-lr",
        "zenflow_kernels/cpu_ops/lion.py",
        "    return 1.0 / grad_scale, 1.0 - lr * weight_decay, -lr,",
        "    return 1.0 / grad_scale, 1.0 - weight_decay, -lr,",
        "the host Lion launcher decays by 1 - weight_decay instead of 1 - lr * weight_decay",
        tests=ORACLES, k="lion-groups-host-every-step-numbafast-numbahost or lion-numba-host",
    ),
    Bug(
        "reference-columns-at-the-largest-count",
        "zenflow_kernels/reference.py",
        "        rule.step_(p, grad[:, cols], held, step=int(s), **hyperparams)\n",
        "        rule.step_(p, grad[:, cols], held, step=int(steps.max()), **hyperparams)\n",
        "the reference steps a matrix's selected columns at the largest count among them: entering columns take "
        "the staying ones' bias correction",
        tests=ORACLES, k="scheduler and adamw and not triton",
    ),
    # -- issue 54: the messages and settings (the optimizer as built, semantics presets, DeepSpeed JSON, host_timeout,
    # tensor lr, concentration, the planner CLI) and FSDP2 resumed with a parameter frozen again
    # -- messages and config: semantics="deepspeed" keeps what was set, DeepSpeed JSON refusals, check_lr -------------
    Bug(
        "deepspeed-preset-overrides-our-default",
        "zenflow_kernels/config.py",
        "            if name not in self._given:\n",
        "            if isinstance(value, str) and value == _ours:\n",
        "semantics=\"deepspeed\" tells a field left unset by its value (equal to our default) instead of by whether "
        "the caller set it, so a field set explicitly to our default silently becomes DeepSpeed's, with no warning",
        tests=("tests/test_deepspeed_semantics.py",), k="keeps_a_field",
    ),
    Bug(
        "replace-pins-the-resolved-fields",
        "zenflow_kernels/config.py",
        "        given = getattr(self, \"_given\", self.field_names())\n",
        "        given = self.field_names()\n",
        "ZenFlowConfig.replace passes every field on as if set explicitly, so the values the deepspeed preset filled "
        "in (or our defaults) are pinned: replace(semantics=\"deepspeed\") keeps ours with a warning, and switching "
        "back keeps DeepSpeed's",
        tests=("tests/test_deepspeed_semantics.py",), k="replace_keeps",
    ),
    Bug(
        "offload-optimizer-none-read-as-host",
        "zenflow_kernels/config.py",
        "\"offload_optimizer\", where, (\"cpu\", \"nvme\")",
        "\"offload_optimizer\", where, (\"cpu\", \"nvme\", \"none\")",
        "a DeepSpeed config with zero_optimization.offload_optimizer.device=\"none\" (the optimizer state kept on the "
        "device) is accepted and run with the state offloaded to host memory instead of refused",
        tests=("tests/test_config.py",), k="cannot_be_honoured",
    ),
    Bug(
        "offload-section-string-ignored",
        "zenflow_kernels/config.py",
        "    if value is None:\n        return {}\n",
        "    if value is None or isinstance(value, str):\n        return {}\n",
        "a bare string offload section (zero_optimization.offload_optimizer=\"nvme\") is read as no section, so the "
        "state silently stays in host memory instead of the config being refused",
        tests=("tests/test_config.py",), k="cannot_be_honoured",
    ),
    Bug(
        "zero-stage-true-read-as-one",
        "zenflow_kernels/config.py",
        "(isinstance(stage, bool) or stage not in (0, 1, 2))",
        "stage not in (0, 1, 2)",
        "zero_optimization.stage=true in a DeepSpeed JSON passes as stage 1 (True == 1) instead of being refused",
        tests=("tests/test_config.py",), k="cannot_be_honoured",
    ),
    Bug(
        "suggestions-at-difflibs-cutoff",
        "zenflow_kernels/config.py",
        "_SUGGEST_CUTOFF = 0.8",
        "_SUGGEST_CUTOFF = 0.6",
        "\"did you mean\" uses difflib's default similarity, so unrelated DeepSpeed keys get zenflow suggestions "
        "(gradient_accumulation_steps -> device_accumulation)",
        tests=("tests/test_config.py",), k="no_suggestion",
    ),
    Bug(
        "integer-tensor-lr-accepted",
        "zenflow_kernels/config.py",
        "lr.numel() != 1 or not lr.dtype.is_floating_point or lr.is_complex()",
        "lr.numel() != 1 or lr.is_complex()",
        "an integer tensor lr (torch.tensor(1)) is accepted as a learning rate of 1.0; torch.optim refuses it",
        tests=("tests/test_optim_api.py",), k="bad_lr",
    ),
    Bug(
        "display-name-of-an-unnamed-rule",
        "zenflow_kernels/optim/build.py",
        "getattr(rule, 'name', '') or type(rule).__name__",
        "getattr(rule, 'name', type(rule).__name__)",
        "a rule whose name is empty is called ZenFlow() in every message, not by its class's name",
        tests=("tests/test_messages.py",), k="display_name",
    ),
    Bug(
        "host-timeout-true-is-one-second",
        "zenflow_kernels/optim/build.py",
        "isinstance(host_timeout, bool) or not isinstance(host_timeout, numbers.Real)",
        "not isinstance(host_timeout, numbers.Real)",
        "host_timeout=True is taken as a limit of 1 second instead of refused",
        tests=("tests/test_optim_api.py",), k="host_timeout",
    ),
    Bug(
        "plan-count-truncates-a-fraction",
        "zenflow_kernels/__main__.py",
        "    if not value.is_integer():\n"
        "        raise argparse.ArgumentTypeError(f\"{text!r} is not an integer (allowed e.g. 4096 or 1e6)\")\n",
        "",
        "the planner's integer arguments written as floats are truncated (--probe-params 4096.5 runs as 4096, "
        "--update-interval 2.5 as 2) instead of refused",
        tests=("tests/test_cli.py",), k="plan_refuses",
    ),
    Bug(
        "tokens-per-step-checked-against-step-ms",
        "zenflow_kernels/__main__.py",
        "    if args.tokens_per_step is not None and args.device_tflops is None:\n",
        "    if args.tokens_per_step is not None and args.device_step_ms is None:\n",
        "plan's --tokens-per-step check looks at the wrong member of the exclusive pair: --tokens-per-step with "
        "--device-step-ms (where it means nothing) is accepted, and with --device-tflops (which needs it) refused",
        tests=("tests/test_cli.py",), k="plan_refuses",
    ),
    Bug(
        "explain-leaves-out-the-kept-fields",
        "zenflow_kernels/explain.py",
        "    found = [*config.notes, *s.warnings]",
        "    found = list(s.warnings)",
        "`explain` lists only the schedule's warnings, not the fields kept against semantics=\"deepspeed\" (their "
        "warning is silenced there), so the report says \"none\"",
        tests=("tests/test_cli.py",), k="kept_against_semantics",
    ),
    Bug(
        "explain-warns-outside-the-report",
        "zenflow_kernels/__main__.py",
        "        with warnings.catch_warnings():\n"
        "            warnings.simplefilter(\"ignore\")  # the report prints them itself, once\n"
        "            config = ZenFlowConfig.from_dict(args.config)\n",
        "        config = ZenFlowConfig.from_dict(args.config)\n"
        "        with warnings.catch_warnings():\n"
        "            warnings.simplefilter(\"ignore\")  # the report prints them itself, once\n",
        "`explain` reads the config outside the silenced block, so a field kept against semantics=\"deepspeed\" is "
        "warned on stderr as well as listed in the report",
        tests=("tests/test_cli.py",), k="kept_against_semantics",
    ),
    Bug(
        "concentration-zero-selections-ran",
        "zenflow_kernels/concentration.py",
        "        if stats.get(\"selections\"):\n",
        "        if stats.get(\"selections\") is not None:\n",
        "concentration_report says \"0 selection(s) ran, but no matrix was selected\" before any selection has run "
        "(a count of 0 taken as selections having run)",
        tests=("tests/test_concentration.py",), k="vectors_only",
    ),
    Bug(
        "concentration-tensor-iterated",
        "zenflow_kernels/concentration.py",
        "        return [value]\n",
        "        return list(value)\n",
        "gradient_concentration iterates a single tensor as if it were a list, so one matrix's energies [C] is read "
        "as C scalars and refused (and one index tensor as one entry per index)",
        tests=("tests/test_concentration.py",), k="single_tensor",
    ),
    # -- FSDP2: a parameter frozen again, saved with DCP and resumed ------------------------------------------------
    Bug(
        "fsdp2-frozen-again-state-left-out",
        "zenflow_kernels/sharding/fsdp2.py",
        "                if \"host_master\" in st:\n"
        "                    again[i] = self._entry(i, st, local, topk, sharded, fast)\n",
        "",
        "FSDP2: a parameter frozen again after training (it keeps its host state) is saved as an empty entry only, "
        "its host state never put whole into the zenflow[\"frozen\"] header record, so the resumed optimizer has "
        "no host state for it and its pending host result is never written back",
        tests=("tests/test_fsdp2.py",), k="frozen_again",
    ),
    Bug(
        "fsdp2-frozen-rows-from-zero",
        "zenflow_kernels/sharding/fsdp2.py",
        "v[first:first + count]",
        "v[:count]",
        "FSDP2: a rank resuming a frozen-again parameter takes the first rows of its whole host state from the header, "
        "not its own rows, so every rank but the first resumes with rank 0's state",
        tests=("tests/test_fsdp2.py",), k="frozen_again",
    ),
    Bug(
        "fsdp2-newly-frozen-not-refused",
        "zenflow_kernels/sharding/fsdp2.py",
        "if i not in state and i in frozen[\"trainable\"] and not self.params[i].requires_grad]",
        "if i not in state and i not in frozen[\"trainable\"] and not self.params[i].requires_grad]",
        "FSDP2: the refusal of a parameter frozen now but trainable (with host state) when saved looks at the "
        "parameters frozen when saved instead, so the resume goes on silently without that parameter's host state",
        tests=("tests/test_fsdp2.py",), k="other_parameters_frozen",
    ),
    # -- issue 55: a rule in plain torch, compiled --------------------------------------------------------------------
    Bug(
        "compiled-step-count-a-float",
        "zenflow_kernels/rules/compiled.py",
        "    return int(step)\n",
        "    return float(step)\n",
        "the compiled step's count passed as a float: torch code that makes a tensor of it (a rule from torch) is "
        "specialized on it, a recompile per host update and eager after eight",
        tests=("tests/test_compiled_rules.py",), k="does_not_recompile_as",
    ),
    Bug(
        "compile-counted-against-host-timeout",
        "zenflow_kernels/link/worker.py",
        "            waited += 0.0 if compiling() else now - last\n",
        "            waited += now - last\n",
        "a first compile on the worker counts against host_timeout: a slow compile fails the run as a stuck worker",
        tests=("tests/test_compiled_rules.py",), k="host_timeout",
    ),
    Bug(
        "layout-runs-kept-for-any-interval",
        "zenflow_kernels/host.py",
        " and len(set(counts.values())) == 1 and len(",
        " and len(",
        "the host update's kept runs are used when the parameters' gradient counts differ: a run divides every "
        "parameter's sum by its first parameter's count",
        tests=("tests/test_host.py",), k="usual_intervals",
    ),
    Bug(
        "reference-takes-hyper-its-rule-lacks",
        "zenflow_kernels/reference.py",
        "            _check_explicit(rule, dict(betas=betas, eps=eps, weight_decay=weight_decay))\n",
        "",
        "ReferenceZenFlow(weight_decay=0.5, rule=RMSprop()) silently ignores the 0.5",
        tests=("tests/test_compiled_rules.py",), k="refuses_hyperparameters",
    ),
    # -- issue 56: bf16 host state rounded stochastically --------------------------------------------------------------
    Bug(
        "stochastic-rounding-keys-of-the-shard",
        "zenflow_kernels/sharding/fsdp2.py",
        "            keys[i] += self._rows(p)[0] * math.prod(p.shape[1:])\n",
        "            keys[i] += 0\n",
        "FSDP2: a rank keys its rows from the parameter's first element, not from their place in it: every rank "
        "draws the same bits as rank 0's rows, so the rounding noise is not one process's",
        tests=("tests/test_fsdp2.py",), k="matches_one_process and stochastic",
    ),
    Bug(
        "stochastic-rounding-moments-share-bits",
        "zenflow_kernels/cpu_ops/kernels/adam.py",
        "        store_state_high(exp_avg_sq, i, v, h, salt)\n",
        "        store_state_low(exp_avg_sq, i, v, h, salt)\n",
        "the host Adam kernel rounds both moments with the same 16 bits (they round up together)",
        tests=("tests/test_stochastic_rounding.py",), k="host_kernels_round",
    ),
    Bug(
        "stochastic-rounding-key-without-shift",
        "zenflow_kernels/host.py",
        "            rounding = rule.rounding(step, lo + self._key_shift[first])",
        "            rounding = rule.rounding(step, lo)",
        "ZeRO: a rank keys its shard's elements by their offset in its own buffers, not in the whole model's host "
        "layout: the ranks' bits differ from one process's",
        tests=ZERO, k="two_ranks_match and stochastic",
    ),
]


def copy_tree(dest: Path) -> None:
    """The working tree's files (tracked, and untracked but not ignored) copied under ``dest``."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_bug(bug: Bug, tree: Path, tests: tuple[str, ...], k: str | None, timeout: float) -> tuple[str, float, str]:
    """Apply ``bug`` in ``tree``, run ``tests``, restore the file. Returns (outcome, seconds, last lines)."""
    path = tree / bug.file
    text = path.read_text()
    if text.count(bug.original) != 1:
        return f"stale ({text.count(bug.original)} matches)", 0.0, ""
    path.write_text(text.replace(bug.original, bug.replacement))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    if k:
        cmd += ["-k", k]
    env = {**os.environ, "PYTHONPATH": str(tree), **dict(bug.env)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        # exit 5: the -k selected no test (a renamed test, a stale expression): nothing ran, nothing was caught
        outcome = ("missed" if proc.returncode == 0 else "stale (no test selected)" if proc.returncode == 5 else
                   "caught" if proc.returncode == 1 else f"caught (pytest exit {proc.returncode})")
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    except subprocess.TimeoutExpired:
        outcome, tail = "caught (timeout)", ""
    finally:
        path.write_text(text)
    return outcome, time.monotonic() - t0, tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="bug names (default: all)")
    ap.add_argument("--fast", action="store_true", help="only the bugs whose tests are the fast optimizer files")
    ap.add_argument("--tests", nargs="*", help="test files to run for every bug (default: each bug's own)")
    ap.add_argument("--k", default=None, help="with --tests: a -k expression")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per bug (a hang is a catch)")
    ap.add_argument("--list", action="store_true", help="print the bugs and what they break, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the last lines of each run")
    args = ap.parse_args(argv)
    bugs = [b for b in BUGS if (not args.only or b.name in args.only) and (not args.fast or b.tests == FAST)]
    if args.only and len(bugs) != len(set(args.only)):
        unknown = sorted(set(args.only) - {b.name for b in BUGS})
        raise SystemExit(f"unknown bugs: {unknown}")
    if args.list:
        for b in bugs:
            print(f"{b.name:40} {b.file}\n    {b.breaks}\n    tests: {' '.join(b.tests)}" + (f" -k {b.k!r}" if b.k
                                                                                             else ""))
        return 0
    with tempfile.TemporaryDirectory(prefix="handmade-bugs-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        probe = subprocess.run([sys.executable, "-c", "import zenflow_kernels; print(zenflow_kernels.__file__)"],
                               cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                               text=True, check=True).stdout.strip()
        if not probe.startswith(str(tree)):
            raise SystemExit(f"the copy imports zenflow_kernels from {probe}, not from {tree}")
        rows = []
        for bug in bugs:
            tests = tuple(args.tests) if args.tests else bug.tests
            k = args.k if args.tests else bug.k
            outcome, seconds, tail = run_bug(bug, tree, tests, k, args.timeout)
            rows.append((bug, outcome))
            print(f"  {outcome:<26} {seconds:6.0f} s  {bug.name}", flush=True)
            if args.verbose and tail:
                print("      " + tail.replace("\n", "\n      "), flush=True)
    applied = [(b, o) for b, o in rows if not o.startswith("stale")]
    counted = [(b, o) for b, o in applied if b.judged is None]
    caught = sum(o.startswith("caught") for _, o in counted)
    notes = [f"{len(rows) - len(applied)} stale"] if len(applied) != len(rows) else []
    notes += [f"{len(applied) - len(counted)} judged, not counted"] if len(counted) != len(applied) else []
    print(f"hand-made bugs: {caught} of {len(counted)} caught" + (f" ({'; '.join(notes)})" if notes else ""))
    for b, o in applied:
        if b.judged is not None:
            print(f"  judged {b.name} ({o}): {b.judged}")
    return 0 if caught == len(counted) else 1


if __name__ == "__main__":
    sys.exit(main())
