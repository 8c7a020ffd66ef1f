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
