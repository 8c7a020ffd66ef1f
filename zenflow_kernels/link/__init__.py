"""Device <-> host movement for ZenFlow (docs/design.md sections 4-5): one protocol, three links.

The optimizer decides *what* moves and *when* (the algorithm); a link moves it and hands back
completions. Every asynchronous operation returns or records a handle, and nothing is read before
its handle was waited on. The training thread keeps all bookkeeping (what was accumulated in which
interval, counts, what is pending); a link never changes anything the optimizer decides with.

One interval on a GPU (``overlap_step=True``), time running right::

    training thread   backward -(hooks)-> stage(g_i) ... end of backward ... step: check | fast step | accumulate() |
                                                                                boundary: wait U(n-1), write_back(),
                                                                                update U(n)
    compute stream      fp_i = fingerprint(g_i) ...  waits for D2H  ...  fingerprints again; compare (one sync)
    D2H stream          g_i -> landing[i] (own dtype) ...                 changed or unstaged g_j -> landing[j]
    accumulate worker                                                     wait copies; acc[b] += landing * scale
                                                                          (fold jobs, in the hooks' order)
    update worker                                        wait last fold of b; rule(acc[b]); wait guard;
                                                         write out; acc[b] = 0
    H2D stream                                       out -> non-selected columns -> event (= the guard);
                                                     the device's later work waits for it

Buffers and their owners (who writes, who reads, which wait hands them over):

* ``landing[i]`` (one buffer per parameter dtype, laid out like the copy-out buffers; HostShard): written by the
  D2H copies of one step (from parameter i's backward hook, or at ``step()``), read by the fold job ``step()``
  submits once it checked the gradient; written again (the next step's hook or ``step()``) only after that job
  completed. Nothing of a step reaches ``acc[b]`` before ``step()`` confirmed it, so a step can always be taken
  back: a skipped step, a gradient changed after its hook, a second backward (docs/design.md section 5.1).
* ``acc[b]``: written by the fold jobs of the intervals that use ``b`` (in order, one worker), read and zeroed
  by that interval's host update, which first waits for the last of those jobs; the training thread reads it
  only after draining (checkpoints).
* copy-out buffers ``out``: written by a host update only after the previous write-back's handle
  (the copy-out guard) completed, read by the write-back copies.
* master and moments: owned by the host update in flight; the training thread touches them only
  after waiting for it (drain).

Links:

* :class:`CpuLink` (CPU parameters): plain synchronous copies; the training thread accumulates
  itself (and may fold the interval's last gradient into a synchronous update).
* :class:`AsyncLink` over a :class:`CudaEngine`: pinned host buffers (whole pages of their own, page-locked in
  place), D2H/H2D streams, events.
* :class:`AsyncLink` over a :class:`ThreadEngine`: the same protocol on CPU, each stream a thread
  running its copies in order, each event a future, with optional seeded random delays before and
  after every asynchronous piece of work (:func:`zenflow_kernels.testing.chaos`). An ordering bug
  that a GPU would expose (a read before a copy finished, a count read before a worker ran, a buffer
  reused while a copy still reads it) then gives a wrong number on CPU, where the oracle sees it.

The package, a module each:

* :mod:`.completions`: :class:`Future` (a worker's job), :class:`Event` (a CUDA event), where worker threads start.
* :mod:`.cuda_engine`: :class:`CudaEngine` and its page-locking helpers; :mod:`.thread_engine`: :class:`ThreadEngine`.
* :mod:`.base`: what every link shares; :mod:`.cpu`: :class:`CpuLink`; :mod:`.asynchronous`: :class:`AsyncLink`.
* :mod:`.factory`: :func:`make_engine`, :func:`host_alloc`, :func:`make_link` (the optimizer's way in).
"""

from __future__ import annotations

from ..device_model import Chaos
from .asynchronous import AsyncLink
from .completions import Event, Future, new_worker
from .completions import _submit as _submit  # (tests queue jobs of their own on an engine's workers)
from .cpu import CpuLink, add_scaled
from .cuda_engine import CudaEngine, clear_cuda_error, cuda_error_text, page_aligned_zeros, pinned_sizes
from .factory import host_alloc, make_engine, make_link
from .thread_engine import ThreadEngine

__all__ = [
    "AsyncLink", "Chaos", "CpuLink", "CudaEngine", "Event", "Future", "ThreadEngine", "add_scaled", "clear_cuda_error",
    "cuda_error_text", "host_alloc", "make_engine", "make_link", "new_worker",
    "page_aligned_zeros", "pinned_sizes",
]
