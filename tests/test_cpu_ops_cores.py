"""split_cores: the training / host-worker core split (DeepSpeed ZenFlow's pt_reserved_cores_perc)."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zenflow_kernels.cpu_ops import split_cores
from zenflow_kernels.cpu_ops.cores import physical_cores

PERCS = ["0", "0.1", "0.2", "0.25", "0.3", "1/3", "0.5", "0.6", "2/3", "0.7", "0.75", "0.9", "0.99", "1"]
COUNTS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 64, 96, 128]


def expected_train_count(perc: str, n: int) -> int:
    """ceil(perc * n) in exact rational arithmetic on the *decimal* the user wrote."""
    return math.ceil(Fraction(perc) * n)


def test_split_table():
    """Every (fraction, core count) pair: training gets ceil(perc * n) cores, the host the rest,
    or both share all cores when one side would be empty."""
    rows = []
    for perc in PERCS:
        for n in COUNTS:
            cores = list(range(100, 100 + n))  # ids that are not positions, to catch index/id mixups
            train, host = split_cores(float(Fraction(perc)), cores)
            k = expected_train_count(perc, n)
            want = (cores[:k], cores[k:]) if 0 < k < n else (cores, cores)
            rows.append((perc, n, len(train), len(host), (train, host) == want))
    bad = [r for r in rows if not r[-1]]
    assert not bad, f"(perc, n, train, host) mismatches: {bad}"
    # the float trap: 0.3 * 10 == 3.0000000000000004 and 0.7 * 10 == 7.000000000000001 in binary
    assert [len(split_cores(0.3, range(10))[0]), len(split_cores(0.7, range(10))[0])] == [3, 7]
    # and an integer fraction is a fraction
    assert split_cores(1, range(4)) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert split_cores(0, range(4)) == ([0, 1, 2, 3], [0, 1, 2, 3])


@given(
    perc=st.floats(0.0, 1.0, allow_nan=False),
    cores=st.lists(st.integers(0, 4096), min_size=1, max_size=300, unique=True),
)
def test_split_is_a_partition_or_full_sharing(perc, cores):
    train, host = split_cores(perc, cores)
    n, want = len(cores), perc * len(cores)
    if train == host:  # shared: only when the reserve is empty or everything
        assert train == cores
        assert n == 1 or want <= 1e-6 or want > n - 1 - 1e-6, (perc, n)
    else:  # a partition: order kept, disjoint, complete, ceil(perc * n) for training
        assert train + host == cores and train and host
        assert want - 1e-6 <= len(train) < want + 1 + 1e-6, (perc, n, len(train))


@pytest.mark.parametrize(
    ("perc", "exc", "words"),
    [
        (True, TypeError, ["pt_reserved_cores_perc", "bool", "True"]),
        (False, TypeError, ["pt_reserved_cores_perc", "bool"]),
        ("0.5", TypeError, ["pt_reserved_cores_perc", "str"]),
        (None, TypeError, ["pt_reserved_cores_perc", "NoneType"]),
        (-0.1, ValueError, ["pt_reserved_cores_perc", "[0, 1]", "-0.1"]),
        (1.01, ValueError, ["pt_reserved_cores_perc", "[0, 1]", "1.01"]),
        (2, ValueError, ["pt_reserved_cores_perc", "[0, 1]", "2"]),
        (float("nan"), ValueError, ["pt_reserved_cores_perc", "nan"]),
        (float("inf"), ValueError, ["pt_reserved_cores_perc", "inf"]),
    ],
)
def test_fraction_is_validated(perc, exc, words):
    with pytest.raises(exc) as info:
        split_cores(perc, [0, 1])
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize(
    ("cores", "exc", "words"),
    [
        ([], ValueError, ["cores", "at least one"]),
        ([0, 1, 1], ValueError, ["cores", "repeat"]),
        ([0, -1], ValueError, ["cores", "-1"]),
        ([0, 1.0], ValueError, ["cores", "1.0"]),
        ([True, 2], ValueError, ["cores", "True"]),
        ("0-3", TypeError, ["cores", "str"]),
        (4, TypeError, ["cores", "int"]),
    ],
)
def test_cores_are_validated(cores, exc, words):
    with pytest.raises(exc) as info:
        split_cores(0.5, cores)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_default_uses_this_process_affinity_physical_cores():
    affinity = os.sched_getaffinity(0)
    train, host = split_cores(0.5)
    phys = physical_cores(affinity)
    assert set(train) | set(host) == set(phys) and set(phys) <= affinity
    if len(phys) > 1:
        assert not set(train) & set(host) and len(train) == math.ceil(len(phys) / 2)
    else:
        assert train == host == phys


def _fake_sysfs(root, siblings: dict[int, str]):
    for cpu, text in siblings.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    ("siblings", "cpus", "want"),
    [
        ({0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}, range(8), [0, 1, 2, 3]),
        ({0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, range(4), [0, 2]),
        # only the second thread of a core is ours: it stands for that core
        ({1: "0-1", 2: "2-3", 3: "2-3"}, [1, 2, 3], [1, 2]),
        ({0: "0", 1: "1"}, [0, 1], [0, 1]),  # no SMT
        ({0: "0,2"}, [0, 2], [0, 2]),  # cpu2's topology unreadable: keep every logical CPU
        ({0: "garbage", 1: "1"}, [0, 1], [0, 1]),
    ],
)
def test_physical_cores_drop_smt_siblings(tmp_path, siblings, cpus, want):
    assert physical_cores(cpus, _fake_sysfs(tmp_path, siblings)) == want
