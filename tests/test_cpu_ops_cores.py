"""split_cores: the training / host-worker core split (DeepSpeed ZenFlow's pt_reserved_cores_perc); rank_cores: a
node's cores shared out between its local ranks."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zenflow_kernels.cpu_ops import split_cores
from zenflow_kernels.cpu_ops.cores import node_cpus, physical_cores, rank_cores, rank_share

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


# -- several ranks on one node (cpu_ops.rank_cores) ---------------------------------------------------------------

SMT16 = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}  # 8 cores, 2 threads each: siblings c and c + 8


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_rank_shares_are_whole_cores_disjoint_contiguous_and_even(tmp_path, size):
    """8 physical cores with SMT siblings (c, c + 8) among ``size`` local ranks: each rank gets whole cores (both
    threads), no core is in two shares, the shares cover the node, their sizes differ by at most one core, and a
    rank's cores are contiguous."""
    sysfs = _fake_sysfs(tmp_path, SMT16)
    shares = [rank_share(range(16), r, size, sysfs) for r in range(size)]
    cores = [sorted({c % 8 for c in share}) for share in shares]
    for share, own in zip(shares, cores, strict=True):
        assert share == sorted(own + [c + 8 for c in own])  # siblings together
        assert own == list(range(own[0], own[-1] + 1))  # contiguous
    assert sorted(c for own in cores for c in own) == list(range(8))  # a partition of the cores
    assert max(map(len, cores)) - min(map(len, cores)) <= 1
    assert [len(own) for own in cores] == sorted((len(own) for own in cores), reverse=True)  # the first get more


def test_fewer_cores_than_ranks_share_them_round_robin(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {0: "0", 1: "1"})
    assert [rank_share([0, 1], r, 4, sysfs) for r in range(4)] == [[0], [1], [0], [1]]


@pytest.mark.parametrize(
    ("env", "affinity", "node", "want", "why"),
    [
        ({}, range(16), range(16), list(range(16)), "one rank on this node"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, range(16), range(16), [4, 5, 6, 7, 12, 13, 14, 15],
         "local rank 1's share of 2"),
        # the launcher bound this rank already (DeepSpeed --bind_cores_to_rank, taskset, numactl): kept, not split
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, [4, 5, 12, 13], range(16), [4, 5, 12, 13],
         "as the launcher bound them"),
        # a container's cpuset is the node: split within it
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, [2, 3, 10, 11], [2, 3, 10, 11], [2, 10],
         "local rank 0's share of 2"),
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, range(16), range(16), list(range(16)), "one rank"),  # bad env
        ({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, range(16), range(16), list(range(16)), "one rank"),
    ],
)
def test_rank_cores_shares_the_node_unless_bound_or_alone(tmp_path, env, affinity, node, want, why):
    sysfs = _fake_sysfs(tmp_path / "sys", SMT16)
    cpuset = tmp_path / "cpuset"
    cpuset.write_text(",".join(map(str, node)) + "\n")
    cores, reason = rank_cores(affinity, environ=env, sysfs=sysfs, cpusets=[cpuset])
    assert cores == want and why in reason, (cores, reason)


def test_node_cpus_reads_the_cpuset_then_the_online_list(tmp_path):
    (tmp_path / "online").write_text("0-3,8\n")
    assert node_cpus(tmp_path, [tmp_path / "missing"]) == {0, 1, 2, 3, 8}
    (tmp_path / "cpuset").write_text("2-3\n")
    assert node_cpus(tmp_path, [tmp_path / "cpuset"]) == {2, 3}
    assert node_cpus(tmp_path / "nowhere", []) is None
