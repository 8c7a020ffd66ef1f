"""``pt_reserved_cores_perc="auto"`` (the default) through the optimizer: 1.0 for CPU parameters, a value
given kept on any device, and the setting (not its resolution) carried by a checkpoint (issue 24 item 5).
tests/test_config.py checks the resolution itself, "cuda" included; tests/test_gpu_link.py the GPU's 0.5."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from zenflow_kernels import ZenFlowAdamW, cpu_ops
from zenflow_kernels.config import ZenFlowWarning

ZEN = dict(topk_ratio=0.5, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)
HYPER = dict(lr=1e-2, weight_decay=0.01)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8, 6, generator=g)), torch.nn.Parameter(torch.randn(6, generator=g))]


def _steps(opt, params, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.fixture
def splits(monkeypatch):
    """The ``pt_reserved_cores_perc`` every build hands to ``split_cores``, in order."""
    seen, real = [], cpu_ops.split_cores

    def recording(perc, cores=None):
        seen.append(perc)
        return real(perc, cores)

    monkeypatch.setattr(cpu_ops, "split_cores", recording)
    return seen


@pytest.mark.parametrize("given, used", [(None, 1.0), (0.5, 0.5), (1.0, 1.0)])
def test_cpu_parameters_default_to_sharing_the_cores_and_a_given_value_stays(host_workers_made, splits, given,
                                                                             used):
    zen = dict(ZEN) if given is None else dict(ZEN, pt_reserved_cores_perc=given)
    threads_before = torch.get_num_threads()
    params = _params()
    with ZenFlowAdamW(params, **HYPER, zenflow=zen) as opt:
        _steps(opt, params, 1)
        assert opt.config.pt_reserved_cores_perc == ("auto" if given is None else given)
        train, host = cpu_ops.split_cores(used)
        if set(train) & set(host):  # shared (1.0, or a split that leaves one side empty): torch keeps its threads
            assert torch.get_num_threads() == threads_before
            expected = max(1, len(set(train) | set(host)) - threads_before)
        else:  # 0.5 on two or more cores: torch narrowed to the training cores
            assert torch.get_num_threads() == len(train)
            expected = len(host)
    assert splits[0] == used
    assert [m["num_threads"] for m in host_workers_made] == [expected]
    assert [m["cores"] for m in host_workers_made] == [host]
    assert torch.get_num_threads() == threads_before


@pytest.mark.parametrize("saved", ["auto", 0.5])
def test_a_resumed_run_keeps_its_setting(splits, saved):
    """The checkpoint holds what was set: "auto" resolves again where the run resumes, a number stays that
    number even when the resuming optimizer was built with another setting (warned, as every setting)."""
    params = _params()
    zen = dict(ZEN) if saved == "auto" else dict(ZEN, pt_reserved_cores_perc=saved)
    with ZenFlowAdamW(params, **HYPER, zenflow=zen) as opt:
        _steps(opt, params, 3)
        sd = opt.state_dict()
    assert sd["zenflow"]["config"]["pt_reserved_cores_perc"] == saved
    resumed_params = _params()
    for other in (dict(ZEN), dict(ZEN, pt_reserved_cores_perc=0.25)):
        with ZenFlowAdamW(resumed_params, **HYPER, zenflow=other) as resumed:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                resumed.load_state_dict(sd)
            named = [str(w.message) for w in caught if issubclass(w.category, ZenFlowWarning)
                     and "pt_reserved_cores_perc" in str(w.message)]
            assert bool(named) == (other.get("pt_reserved_cores_perc", "auto") != saved), named
            assert resumed.config.pt_reserved_cores_perc == saved
            assert splits[-1] == (1.0 if saved == "auto" else saved)  # the load rebuilt with the saved setting
            _steps(resumed, resumed_params, 1)
            assert resumed.state_dict()["zenflow"]["config"]["pt_reserved_cores_perc"] == saved


def test_cores_are_the_resuming_optimizers_and_a_list_is_used_as_given(host_workers_made):
    """``zenflow.cores``: a list is this rank's CPUs in the order given (split by ``pt_reserved_cores_perc``); it
    belongs to the machine, not the run: a checkpoint saved with one resumes with the loading optimizer's (no
    warning); CPUs outside the process's affinity are refused when the optimizer is made."""
    cpus = sorted(os.sched_getaffinity(0))
    given = cpus[::-1]
    params = _params()
    with ZenFlowAdamW(params, **HYPER, zenflow=dict(ZEN, cores=given, pt_reserved_cores_perc=0.5)) as opt:
        _steps(opt, params, 2)
        train, host = cpu_ops.split_cores(0.5, given)
        assert opt.stats()["cores"] == dict(train=train, host=host, why="zenflow.cores as given")
        assert host_workers_made[-1]["cores"] == host
        sd = opt.state_dict()
    assert sd["zenflow"]["config"]["cores"] == tuple(given)
    resumed_params = _params()
    with ZenFlowAdamW(resumed_params, **HYPER, zenflow=dict(ZEN, pt_reserved_cores_perc=0.5)) as resumed:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.load_state_dict(sd)
        assert not [w for w in caught if "cores=" in str(w.message)]
        assert resumed.config.cores == "auto"
        _steps(resumed, resumed_params, 1)
        assert resumed.stats()["cores"]["why"].startswith("this process's CPUs")
    outside = max(cpus) + 1
    with pytest.raises(ValueError, match=rf"zenflow.cores=\[{outside}\] is invalid: CPUs \[{outside}\] are outside"):
        ZenFlowAdamW(_params(), **HYPER, zenflow=dict(ZEN, cores=[outside]))
