"""Split a rank's CPU cores between training (torch) and the host-update worker (numba).

The split follows DeepSpeed ZenFlow's ``pt_reserved_cores_perc``: the first
``ceil(pt_reserved_cores_perc * n)`` cores go to training, the rest to the host worker; when either
side would be empty both share every core. Defaults to the process affinity with one logical CPU
per physical core (SMT siblings dropped): Adam is memory-bound, and two threads on one core only
contend for its load/store ports.

Using the result is the caller's business, e.g. ``torch.set_num_threads(len(train))`` in the
training thread and ``num_threads=len(host)`` for the host kernels (``os.sched_setaffinity`` pins a
whole process, not a thread, so pinning threads needs ``os.sched_setaffinity(native_thread_id, ...)``
from inside each thread).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")


def _parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def physical_cores(cpus: Iterable[int], sysfs: str | os.PathLike = SYSFS_CPU) -> list[int]:
    """One logical CPU per physical core among ``cpus`` (the lowest id of each SMT sibling group),
    sorted. When the topology cannot be read for some CPU, all of ``cpus`` are returned, sorted."""
    cpus = sorted(set(cpus))
    allowed = set(cpus)
    keep = []
    for c in cpus:
        try:
            siblings = _parse_cpu_list((Path(sysfs) / f"cpu{c}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            return cpus
        if c == min((siblings & allowed) | {c}):
            keep.append(c)
    return keep


def _reserved(perc: float, n: int) -> int:
    """ceil(perc * n), with products within 1e-9 of an integer taken as that integer (0.3 * 10 is
    3.0000000000000004 in floating point and must give 3, not 4)."""
    x = perc * n
    r = round(x)
    return r if abs(x - r) <= 1e-9 * max(1, n) else math.ceil(x)


def split_cores(pt_reserved_cores_perc: float, cores: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
    """Split cores between training and the host worker: returns ``(train_cores, host_cores)``.

    Args:
        pt_reserved_cores_perc: fraction of the cores reserved for training, a real number in [0, 1]
            (not a bool). ``ceil(fraction * n)`` cores (the first ones) go to training, the rest to the
            host worker. When that leaves one side empty (fraction 0 or 1, or n = 1) both get all cores.
        cores: the CPU ids to split, used in the order given (non-negative ints, no duplicates). Default:
            this process's affinity (``os.sched_getaffinity(0)``), SMT siblings dropped when the sysfs
            topology says which they are, sorted.

    Returns two lists of CPU ids; disjoint and covering ``cores`` when both sides are non-empty,
    otherwise both equal to ``cores``.
    """
    if isinstance(pt_reserved_cores_perc, bool) or not isinstance(pt_reserved_cores_perc, numbers.Real):
        raise TypeError(
            f"pt_reserved_cores_perc must be a real number in [0, 1], got {type(pt_reserved_cores_perc).__name__} "
            f"{pt_reserved_cores_perc!r}"
        )
    perc = float(pt_reserved_cores_perc)
    if not 0.0 <= perc <= 1.0:  # also rejects NaN
        raise ValueError(f"pt_reserved_cores_perc must be in [0, 1], got {pt_reserved_cores_perc!r}")
    if cores is None:
        core_list = physical_cores(os.sched_getaffinity(0))
    else:
        if isinstance(cores, (str, bytes)) or not isinstance(cores, Iterable):
            raise TypeError(f"cores must be an iterable of CPU ids (ints), got {type(cores).__name__} {cores!r}")
        core_list = list(cores)
        for c in core_list:
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0:
                raise ValueError(f"cores must hold non-negative integer CPU ids, got {c!r} in {core_list!r}")
        core_list = [int(c) for c in core_list]
        if len(set(core_list)) != len(core_list):
            raise ValueError(f"cores must not repeat a CPU id, got {core_list!r}")
        if not core_list:
            raise ValueError("cores must hold at least one CPU id, got an empty collection")
    n = len(core_list)
    k = _reserved(perc, n)
    if 0 < k < n:
        return core_list[:k], core_list[k:]
    return list(core_list), list(core_list)


# -- several ranks on one node --------------------------------------------------------------------------------

CGROUP_CPUSETS = (Path("/sys/fs/cgroup/cpuset.cpus.effective"),  # cgroup v2
                  Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"), Path("/sys/fs/cgroup/cpuset/cpuset.cpus"))


def node_cpus(sysfs: str | os.PathLike = SYSFS_CPU, cpusets: Iterable[os.PathLike] = CGROUP_CPUSETS) -> set[int] | None:
    """The CPUs any process of this node's job may run on: the cgroup's cpuset when readable (a container's),
    else the online CPUs; None when neither can be read."""
    for path in (*cpusets, Path(sysfs) / "online"):
        try:
            cpus = _parse_cpu_list(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return None


def local_rank_and_size(environ=None) -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as torchrun (and DeepSpeed's, accelerate's launchers) set them; ``(0, 1)``
    when unset or unreadable (one process on this node, as far as anyone said)."""
    environ = os.environ if environ is None else environ
    try:
        rank, size = int(environ.get("LOCAL_RANK", 0)), int(environ.get("LOCAL_WORLD_SIZE", 1))
    except ValueError:
        return 0, 1
    return (rank, size) if 0 <= rank < size else (0, 1)


def rank_share(cpus: Iterable[int], local_rank: int, local_size: int,
               sysfs: str | os.PathLike = SYSFS_CPU) -> list[int]:
    """Local rank ``local_rank`` of ``local_size``'s share of ``cpus``: whole physical cores (a core's SMT siblings
    go together), contiguous in CPU order, the counts as even as possible (the first ``n % local_size`` ranks one
    more). With fewer cores than ranks the ranks share them: rank ``r`` gets core ``r % n``. Sorted logical ids."""
    cpus = sorted(set(cpus))
    allowed = set(cpus)
    groups: dict[int, list[int]] = {}  # a physical core's lowest allowed sibling -> its allowed siblings
    for c in cpus:
        try:
            siblings = _parse_cpu_list((Path(sysfs) / f"cpu{c}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = {c}
        groups.setdefault(min((siblings & allowed) | {c}), []).append(c)
    cores = [groups[k] for k in sorted(groups)]
    n = len(cores)
    if n < local_size:
        return sorted(cores[local_rank % n])
    base, extra = divmod(n, local_size)
    start = local_rank * base + min(local_rank, extra)
    stop = start + base + (1 if local_rank < extra else 0)
    return sorted(c for core in cores[start:stop] for c in core)


def rank_cores(affinity: Iterable[int] | None = None, *, environ=None, sysfs: str | os.PathLike = SYSFS_CPU,
               cpusets: Iterable[os.PathLike] = CGROUP_CPUSETS) -> tuple[list[int], str]:
    """The CPUs this rank's training and host worker use, and why: its share of the node when several ranks run
    on it (``LOCAL_WORLD_SIZE`` > 1) and the process may run on every CPU of the node (torchrun binds nothing: each
    rank starts with the whole node, and their host workers would all pin the same cores); the process's affinity
    as it is when the launcher already narrowed it (DeepSpeed's ``--bind_cores_to_rank``, ``taskset``,
    ``numactl``: never widened, never split again) or when one rank runs here. Sorted logical CPU ids."""
    affinity = sorted(set(os.sched_getaffinity(0) if affinity is None else affinity))
    local_rank, local_size = local_rank_and_size(environ)
    if local_size == 1:
        return affinity, "this process's CPUs (one rank on this node)"
    node = node_cpus(sysfs, cpusets)
    if node is not None and set(affinity) != node:
        return affinity, (f"this process's CPUs as the launcher bound them (local rank {local_rank} of {local_size}; "
                          f"{len(affinity)} of the node's {len(node)})")
    share = rank_share(affinity, local_rank, local_size, sysfs)
    shared = " (fewer cores than local ranks: shared)" if len(physical_cores(affinity, sysfs)) < local_size else ""
    return share, f"local rank {local_rank}'s share of {local_size} on this node's {len(affinity)} CPUs{shared}"
