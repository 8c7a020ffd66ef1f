"""A stand-in for ``torch.cuda`` faithful enough to catch the CUDA engine's ordering and memory bugs on CPU.

CPU tensors play device memory; ``FakeCuda().install(monkeypatch)`` puts the stand-in in place of the parts of
``torch.cuda`` the CUDA engine (``zenflow_kernels.link.CudaEngine``) calls. What it models, and so what a test on
it can catch:

* **Streams and the current stream, per thread and per device.** ``torch.cuda.stream(s)`` makes ``s`` current for
  the calling thread (on ``s``'s device), ``torch.cuda.device(d)`` the thread's current device; every device has a
  default stream.
* **Deferred work.** Copies (``torch._foreach_copy_``, ``Tensor.copy_``) and zeroing (``torch._foreach_zero_``)
  issued while a side stream is current are queued on it and run in order, reading their sources when they run,
  only when something needs them: an event recorded after them is synchronized (or queried: the query runs them
  but answers False that once, as the work was not done when asked), the stream or the device is synchronized, or
  a stream waiting for them runs. So a destination read before the wait that orders it holds what was there
  before: an **early read** gives a wrong number.
* **The default stream** runs the host's torch calls eagerly, and its waits (``wait_stream``, ``wait_event``) are
  queued as barriers, honoured lazily: when an intercepted default-stream op (``copy_``, ``zero_``, ``add_``,
  ``mul_``, their ``_foreach`` forms, and kernels a test wraps with :meth:`FakeCuda.kernel`) touches memory that
  queued side-stream work reads or writes, the barriers run first; if that work is still queued after them,
  nothing ordered the two: a **missing wait**, recorded in ``violations`` (and the op goes on, racing).
* **The caching allocator, for what deferred work reads.** Queued work keeps an alias of its source (device
  memory still holds the data). When it runs, if nothing but the stand-in holds the source's storage any more
  (the program dropped it: ``zero_grad(set_to_none=True)``) and ``record_stream`` was not called on it for that
  stream, the allocator could have given the memory to new work meanwhile: a **cross-stream reuse**, recorded in
  ``violations``. :meth:`FakeCuda.held_by_program` tells which storages something other than the stand-in still
  holds (memory the synchronous link would have freed).
* **Page-locking.** ``cudart().cudaHostRegister`` accepts whole pages at a page-aligned address no earlier
  registration covers (else ``cudaErrorInvalidValue``, 1, or ``...AlreadyRegistered``, 712, kept as the runtime's
  last error); ``cudaHostUnregister`` what was registered (else 713).

A stream marked ``eager`` runs its work at once (the H2D stream in the optimizer's tests: its write-back mixes
copies with column gathers the stand-in does not defer). Everything the stand-in was asked is in ``log``.
What it does not model: the default stream's own kernels running late (the host runs them at once), so a side
stream that forgets to wait for the default stream before reading what it produced is not caught.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import threading
from dataclasses import dataclass, field

import torch

PAGE = mmap.PAGESIZE
_real_foreach_copy = torch._foreach_copy_
_real_foreach_zero = torch._foreach_zero_
_real_foreach_add = torch._foreach_add_
_real_foreach_mul = torch._foreach_mul_
_real_copy = torch.Tensor.copy_
_real_zero = torch.Tensor.zero_
_real_add = torch.Tensor.add_
_real_mul = torch.Tensor.mul_


def _tensors_on(cdata) -> int:
    """How many tensors reference the storage ``cdata`` (torch counts one reference of its own beside them)."""
    return torch._C._storage_Use_Count(cdata) - 1


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


@dataclass
class _Op:
    """Queued work: ``run()``; ``sources`` the aliases of device memory it reads (kept, as the allocator keeps it),
    ``touches`` the storages of device memory it reads or writes."""

    run: object
    sources: list = field(default_factory=list)
    touches: set = field(default_factory=set)
    label: str = ""


class FakeStream:
    def __init__(self, cuda: FakeCuda, device=None, *, default: bool = False):
        self.cuda = cuda
        self.device = cuda.device_of(device)
        self.default = default
        self.eager = False
        self.queue: list[_Op] = []
        self.done = 0  # ops run; an op's position is the count of ops enqueued before it
        self.enqueued = 0
        self.waited_for: list = []  # streams and events this stream was made to wait for
        self.synchronized = False

    def __repr__(self):
        return f"FakeStream({'default' if self.default else 'side'}, {self.device})"

    def enqueue(self, run, sources=(), touches=(), label="") -> None:
        if self.eager:
            run()
            return
        with self.cuda.lock:
            self.queue.append(_Op(run, list(sources), set(touches), label))
            self.enqueued += 1

    def run_until(self, position: int) -> None:
        """Run the queued work enqueued before ``position``, in order."""
        with self.cuda.lock:
            while self.done < position and self.queue:
                op = self.queue.pop(0)
                try:
                    self.cuda.check_sources(self, op)
                    op.run()
                    self.done += 1
                finally:
                    op = None  # its aliases go with it, before the lock is let go (held_by_program counts them)

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self, other))
        self.waited_for.append(other)
        self._depend(other, other.enqueued)

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self, event))
        self.waited_for.append(event)
        if event.stream is not None:
            self._depend(event.stream, event.position)

    def _depend(self, other: FakeStream, position: int) -> None:
        self.enqueue(lambda: other.run_until(position), label="wait")

    def synchronize(self) -> None:
        self.cuda.log.append(("stream_synchronize", self))
        self.synchronized = True
        self.run_until(self.enqueued)

    def query(self) -> bool:
        return self.done == self.enqueued


class FakeEvent:
    made: list[FakeEvent] = []

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.blocking = blocking
        self.stream: FakeStream | None = None
        self.position = 0
        self.recorded_on = None
        FakeEvent.made.append(self)

    def record(self, stream=None):
        stream = stream if stream is not None else _CUDA.current_stream()
        self.stream, self.recorded_on, self.position = stream, stream, stream.enqueued
        _CUDA.log.append(("record", self, stream))

    def synchronize(self):
        self.synchronized_on = threading.current_thread().name
        _CUDA.log.append(("event_synchronize", self, self.synchronized_on))
        if self.stream is not None:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        """Done before this call: True; otherwise its work runs now, and this answer is False."""
        if self.stream is None or self.stream.done >= self.position:
            return True
        self.stream.run_until(self.position)
        return False

    def wait(self, stream=None):
        (stream if stream is not None else _CUDA.current_stream()).wait_event(self)


class FakeCudart:
    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.last_error = 0
        self.fail_register = self.fail_unregister = False  # a test makes the next calls fail

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        self.cuda.log.append(("register", ptr, nbytes))
        overlaps = any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items())
        err = 1 if (ptr % PAGE or nbytes % PAGE or not nbytes) else 712 if overlaps else 2 if self.fail_register else 0
        if err:
            self.last_error = err  # as the runtime does: the next cudaGetLastError returns it
            return err
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        self.cuda.log.append(("unregister", ptr))
        if ptr not in self.registered or self.fail_unregister:
            self.last_error = 713
            return 713
        del self.registered[ptr]
        return 0

    def cudaGetLastError(self):
        err, self.last_error = self.last_error, 0
        return err

    class cudaError(int):  # noqa: N801 - the binding's name
        pass

    @staticmethod
    def cudaGetErrorString(err):
        return {1: "invalid argument", 2: "out of memory", 712: "part or all of the requested memory range is "
                "already mapped", 713: "pointer does not correspond to a registered memory region"}.get(
                    int(err), "unknown error")


class FakeCuda:
    """The stand-in (see the module docstring). One per test, installed with :meth:`install`."""

    def __init__(self):
        self.lock = threading.RLock()
        self.log: list[tuple] = []
        self.cudart = FakeCudart(self)
        self.defaults: dict[torch.device, FakeStream] = {}
        self.made: list[FakeStream] = []
        self.local = threading.local()
        self.set_devices: list[tuple[str, torch.device]] = []
        self.guards: list[torch.device] = []
        self.recorded: dict[int, set] = {}  # storage address -> streams record_stream was called for
        self.violations: list[str] = []
        self.capturing = False

    # -- devices and the current stream --------------------------------------------------------------------

    def device_of(self, device) -> torch.device:
        if device is None:
            return getattr(self.local, "device", None) or torch.device("cuda", 0)
        device = torch.device(device) if not isinstance(device, torch.device) else device
        return torch.device("cuda", device.index if device.index is not None else 0)

    def default_stream(self, device=None) -> FakeStream:
        device = self.device_of(device)
        with self.lock:
            if device not in self.defaults:
                self.defaults[device] = FakeStream(self, device, default=True)
                self.made.append(self.defaults[device])
        return self.defaults[device]

    def current_stream(self, device=None) -> FakeStream:
        device = self.device_of(device)
        current = getattr(self.local, "streams", {}).get(device)
        return current if current is not None else self.default_stream(device)

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        streams = self.local.__dict__.setdefault("streams", {})
        before = streams.get(s.device)
        streams[s.device] = s
        try:
            yield s
        finally:
            streams[s.device] = before

    @contextlib.contextmanager
    def device(self, d):
        d = self.device_of(d)
        self.guards.append(d)
        before = getattr(self.local, "device", None)
        self.local.device = d
        try:
            yield
        finally:
            self.local.device = before

    def synchronize(self, device=None):
        with self.lock:
            while any(s.queue for s in self.made):
                for s in list(self.made):
                    s.run_until(s.enqueued)

    # -- deferred work and the default stream's hazards ------------------------------------------------------

    def _side(self) -> FakeStream | None:
        """The current stream when it is a side stream that defers its work."""
        s = self.current_stream()
        return None if s.default or s.eager else s

    def default_op(self, tensors, what: str) -> None:
        """A default-stream op on ``tensors`` is about to run: the queued work touching them runs first if the
        default stream waited for it (its barriers honoured now); if it is still queued, nothing ordered it."""
        touched = _storages(tensors)
        with self.lock:
            racing = [op for s in self.made if not s.default for op in s.queue if op.touches & touched]
            if not racing:
                return
            default = self.current_stream()
            default.run_until(default.enqueued)
            still = [op for s in self.made if not s.default for op in s.queue if op.touches & touched]
        for op in still:
            self.violations.append(f"missing wait: {what} on the default stream touches memory that {op.label} queued "
                                   "on a side stream reads or writes, and nothing orders the two")

    def kernel(self, fn, what: str):
        """``fn`` as a default-stream kernel on the tensors in its (list) arguments (see :meth:`default_op`)."""
        def run(*args, **kwargs):
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            self.default_op(tensors, what)
            return fn(*args, **kwargs)

        return run

    def foreach_copy_(self, dsts, srcs, non_blocking=False):
        s = self._side()
        if s is None:
            self.default_op([*dsts, *srcs], "a copy")
            return _real_foreach_copy(dsts, srcs, non_blocking=non_blocking)
        dsts, aliases = list(dsts), self._aliases_of(srcs)  # the work holds aliases only, never the caller's tensors
        self.log.append(("copy", s, len(dsts)))
        s.enqueue(lambda: _real_foreach_copy(dsts, aliases), aliases, _storages(aliases), "a copy")
        return None

    def copy_(self, dst, src, non_blocking=False):
        s = self._side() if isinstance(src, torch.Tensor) else None
        if s is None:
            self.default_op([dst, src], "a copy")
            return _real_copy(dst, src, non_blocking)
        [alias] = self._aliases_of([src])
        self.log.append(("copy", s, 1))
        s.enqueue(lambda: _real_copy(dst, alias), [alias], _storages([alias]), "a copy")
        return dst

    def foreach_zero_(self, tensors):
        tensors = list(tensors)
        s = self._side()
        if s is None:
            self.default_op(tensors, "zeroing")
            return _real_foreach_zero(tensors)
        self.log.append(("zero", s, len(tensors)))
        s.enqueue(lambda: _real_foreach_zero(tensors), [], _storages(tensors), "zeroing")
        return None

    def _aliases_of(self, sources) -> list[torch.Tensor]:
        return [src.detach() for src in sources]

    def record_stream(self, t: torch.Tensor, stream) -> None:
        self.log.append(("record_stream", t.untyped_storage().data_ptr(), stream))
        self.recorded.setdefault(t.untyped_storage().data_ptr(), set()).add(stream)

    def _aliases(self, address: int) -> int:
        """The stand-in's own tensors on the storage at ``address`` (queued work's aliases)."""
        return sum(1 for s in self.made for op in s.queue for a in op.sources
                   if a.untyped_storage().data_ptr() == address)

    def check_sources(self, stream: FakeStream, op: _Op) -> None:
        """Queued work is about to run: a source nobody but the stand-in holds, not recorded for this stream, went
        back to the allocator while the work could still read it."""
        for alias in op.sources:
            address = alias.untyped_storage().data_ptr()
            if stream in self.recorded.get(address, ()):
                continue
            # (this op left the queue: its alias counts beside the queued ones)
            held = _tensors_on(alias.untyped_storage()._cdata) > self._aliases(address) + 1
            if held:  # garbage not yet collected (a reference cycle) holds no memory the allocator cannot reuse
                gc.collect()
                held = _tensors_on(alias.untyped_storage()._cdata) > self._aliases(address) + 1
            if not held:
                self.violations.append(f"cross-stream reuse: {op.label} on {stream} read memory its owner had freed "
                                       "and that was not recorded for the stream (record_stream)")

    @staticmethod
    def handles(tensors) -> list:
        """Weak handles on the storages of ``tensors``, for :meth:`held_by_program`."""
        from torch.multiprocessing.reductions import StorageWeakRef

        return [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().data_ptr()) for t in tensors]

    def held_by_program(self, handles) -> list[int]:
        """Of ``handles`` (:meth:`handles`), the addresses of the storages that something other than the stand-in's
        queued work still holds."""
        gc.collect()
        with self.lock:
            return [address for weak, address in handles
                    if not weak.expired() and _tensors_on(weak.cdata) > self._aliases(address)]

    # -- installing it ----------------------------------------------------------------------------------------

    def install(self, monkeypatch) -> FakeCuda:
        global _CUDA
        _CUDA = self
        FakeEvent.made.clear()
        cuda = self

        class Stream(FakeStream):
            def __init__(self, device=None, priority=0):
                super().__init__(cuda, device)
                with cuda.lock:
                    cuda.made.append(self)

        self.Stream = Stream
        self.default_stream(None)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "device", self.device)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "set_device",
                            lambda d: self.set_devices.append((threading.current_thread().name, torch.device(d))))
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self.cudart)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch, "_foreach_copy_", self.foreach_copy_)
        monkeypatch.setattr(torch, "_foreach_zero_", self.foreach_zero_)
        monkeypatch.setattr(torch, "_foreach_add_", self.kernel(_real_foreach_add, "an add"))
        monkeypatch.setattr(torch, "_foreach_mul_", self.kernel(_real_foreach_mul, "a multiply"))

        def copy_(dst, src, non_blocking=False):  # plain functions: the tensor is their first argument
            return cuda.copy_(dst, src, non_blocking)

        def zero_(t):
            cuda.default_op([t], "zeroing")
            return _real_zero(t)

        def add_(t, *args, **kwargs):
            cuda.default_op([t, *args], "an add")
            return _real_add(t, *args, **kwargs)

        def mul_(t, *args, **kwargs):
            cuda.default_op([t, *args], "a multiply")
            return _real_mul(t, *args, **kwargs)

        def record_stream(t, stream):
            cuda.record_stream(t, stream)

        for name, fn in (("copy_", copy_), ("zero_", zero_), ("add_", add_), ("mul_", mul_),
                         ("record_stream", record_stream)):
            monkeypatch.setattr(torch.Tensor, name, fn)
        return self


_CUDA: FakeCuda | None = None
