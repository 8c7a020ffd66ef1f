"""Every message of the optimizer names the optimizer as the user built it: ``ZenFlowAdamW`` for the AdamW facade,
``ZenFlow(Lion)`` / ``ZenFlow(SGD)`` / ``ZenFlow(<rule name>)`` for ``ZenFlow(rule)`` (``build.display_name``), never
``ZenFlowAdamW`` for another rule. Each error below is triggered with ``rules.Lion()`` (and SGD or the facade where it
is cheap)."""

from __future__ import annotations

import copy
import pickle
import re
import warnings

import pytest
import torch
from support import make_params

from zenflow_kernels import ZenFlow, ZenFlowAdamW, rules
from zenflow_kernels.config import ZenFlowWarning
from zenflow_kernels.integrations import give_epoch_length
from zenflow_kernels.state_files import StateFileError, StateFiles
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)

ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2)
LION = "ZenFlow(Lion)"


def lion(params=None, **kwargs):
    return ZenFlow(make_params() if params is None else params, rules.Lion(), lr=1e-3,
                   zenflow=kwargs.pop("zenflow", ZEN), **kwargs)


def sgd(params=None, **kwargs):
    return ZenFlow(make_params() if params is None else params, rules.SGD(momentum=0.9), lr=1e-2,
                   zenflow=kwargs.pop("zenflow", ZEN), **kwargs)


def adamw(params=None, **kwargs):
    return ZenFlowAdamW(make_params() if params is None else params, zenflow=kwargs.pop("zenflow", ZEN), **kwargs)


def names(message: str, name: str) -> None:
    """``message`` names the optimizer ``name`` (and, for another rule than the facade's, not ``ZenFlowAdamW``)."""
    assert name in message, message
    if name != "ZenFlowAdamW":
        assert "ZenFlowAdamW" not in message, message


def raises(exc, name: str, fragment: str, fn) -> str:
    with pytest.raises(exc) as err:
        fn()
    message = str(err.value)
    names(message, name)
    assert fragment in message, message
    return message


def step_once(opt, params) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


# -- the name ------------------------------------------------------------------------------------------------------


def test_the_display_name_is_the_optimizer_as_built():
    class Mine(rules.Lion):
        name = ""  # a rule of one's own without a name: its class's

    class MyAdamW(ZenFlowAdamW):
        pass

    built = {
        "ZenFlowAdamW": adamw(), "ZenFlow(Lion)": lion(), "ZenFlow(SGD)": sgd(),
        "ZenFlow(AdamW)": ZenFlow(make_params(), rules.AdamW(), zenflow=ZEN),
        "ZenFlow(Adam)": ZenFlow(make_params(), rules.Adam(), zenflow=ZEN),
        "ZenFlow(Mine)": ZenFlow(make_params(), Mine(), zenflow=ZEN),
        "ZenFlowAdamW ": MyAdamW(make_params(), zenflow=ZEN),  # (a subclass of the facade: the facade's name)
    }
    for name, opt in built.items():
        with opt:
            assert opt.display_name == name.strip()


# -- construction ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [(lion, LION), (sgd, "ZenFlow(SGD)"), (adamw, "ZenFlowAdamW")])
@pytest.mark.parametrize("kwargs, fragment", [
    (dict(zero_stage=3), "zero_stage=3 is invalid: allowed 0, 1 or 2"),
    (dict(collective_timeout=-1.0), "collective_timeout=-1.0 is invalid"),
    (dict(release_gradients=True), "release_gradients=True with zero_stage=0 is invalid"),
    (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0 is invalid"),
    (dict(host_timeout=-1), "host_timeout=-1 is invalid"),
    (dict(zenflow=dict(ZEN, cores=[100_000])), "zenflow.cores=[100000] is invalid"),
    (dict(zenflow=dict(ZEN, offload_device="nvme", nvme_path="/no/such/folder")),
     "zenflow.nvme_path='/no/such/folder' does not exist"),
])
def test_construction_errors_name_the_optimizer(make, name, kwargs, fragment):
    message = raises((ValueError, TypeError), name, fragment, lambda: make(**kwargs))
    assert message.startswith(f"{name}: "), message


def test_parameter_errors_name_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    with warnings.catch_warnings():  # torch warns of the duplicate first
        warnings.simplefilter("ignore", UserWarning)
        for make, name in ((lion, LION), (sgd, "ZenFlow(SGD)"), (adamw, "ZenFlowAdamW")):
            message = raises(ValueError, name, "a parameter appears more than once", lambda make=make: make([p, p]))
            assert message == f"{name}: a parameter appears more than once"
    raises(TypeError, LION, "parameter dtype torch.float64 is invalid",
           lambda: lion([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))]))
    raises(ValueError, LION, "parameters on several devices ['cpu', 'meta']",
           lambda: lion([p, torch.nn.Parameter(torch.zeros(2, device="meta"))]))
    raises(ValueError, LION, f"{LION}: lr=-1.0 is invalid",
           lambda: ZenFlow([p], rules.Lion(), lr=-1.0, zenflow=ZEN))


def test_bf16_state_on_nvme_names_the_optimizer(tmp_path):
    raises(ValueError, LION, "keeps its state in torch.bfloat16 with zenflow.offload_device='nvme'",
           lambda: ZenFlow(make_params(), rules.Lion(state_dtype=torch.bfloat16), zenflow=dict(
               ZEN, offload_device="nvme", nvme_path=str(tmp_path))))


# -- param groups ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [(lion, LION), (adamw, "ZenFlowAdamW")])
def test_param_group_errors_name_the_optimizer(make, name):
    params = make_params()
    with make(params) as opt:
        extra = torch.nn.Parameter(torch.zeros(3))
        raises(ValueError, name, f"{name} group 1: lr=-1.0 is invalid",
               lambda: opt.add_param_group({"params": [extra], "lr": -1.0}))
        raises(ValueError, name, f"{name} param group 1: 'update_interval' cannot be set per param group",
               lambda: opt.add_param_group({"params": [extra], "update_interval": 3}))
        raises(ValueError, name, f"{name} param group 1: zenflow.topk_ratio=2.0 is invalid",
               lambda: opt.add_param_group({"params": [extra], "topk_ratio": 2.0}))
        raises(ValueError, name, f"{name}: parameters on several devices",
               lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device="meta"))]}))
        assert len(opt.param_groups) == 1
        step_once(opt, params)
        raises(RuntimeError, name, f"{name}.add_param_group after the first step() is not supported",
               lambda: opt.add_param_group({"params": [extra]}))
        opt.param_groups[0]["lr"] = -1.0  # (a scheduler gone wrong: the step checks the groups)
        raises(ValueError, name, f"{name} group 0: lr=-1.0 is invalid", lambda: step_once(opt, params))


# -- the step --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [(lion, LION), (sgd, "ZenFlow(SGD)"), (adamw, "ZenFlowAdamW")])
def test_step_errors_name_the_optimizer(make, name):
    params = make_params()
    opt = make(params)
    step_once(opt, params)
    with opt.flushed():
        raises(RuntimeError, name, f"{name}.step() inside opt.flushed()", lambda: step_once(opt, params))
        raises(RuntimeError, name, f"{name}.load_state_dict() inside opt.flushed()",
               lambda: opt.load_state_dict(opt.state_dict()))
    raises(ValueError, name, f"{name}.clip_grad_norm_: max_norm=-1 is invalid", lambda: opt.clip_grad_norm_(-1))
    raises(ValueError, name, f"{name}.clip_grad_norm_: norm_type=1 is invalid", lambda: opt.clip_grad_norm_(1.0, 1))
    raises(TypeError, name, f"{name}.set_requires_gradient_sync: requires_gradient_sync='yes' is invalid",
           lambda: opt.set_requires_gradient_sync("yes"))
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad = torch.zeros_like(params[0]).to_sparse()
    raises(ValueError, name, f"{name}: gradient of parameter 0", opt.step)
    opt.grad_scale = torch.tensor(0.0)  # (what a GradScaler sets, gone wrong)
    raises(ValueError, name, f"{name}.step(): grad_scale=0.0 (set by a GradScaler) is invalid", opt.step)
    del opt.grad_scale
    opt.close()
    raises(RuntimeError, name, f"{name}.step() after close()", lambda: step_once(opt, params))


def test_flushed_weights_still_held_warn_naming_the_optimizer():
    params = make_params()
    with lion(params) as opt:
        step_once(opt, params)
        step_once(opt, params)
        opt.hold_flushed(True)
        with pytest.warns(ZenFlowWarning) as caught:
            step_once(opt, params)
        names(str(caught[0].message), LION)
        assert str(caught[0].message).startswith(f"{LION}.step(): the weights flushed")


@pytest.mark.parametrize("how", [copy.deepcopy, pickle.dumps])
def test_copies_name_the_optimizer(how):
    with lion() as opt:
        message = raises(TypeError, LION, f"{LION} cannot be copied or pickled", lambda: how(opt))
        assert f"load it into a new {LION} with load_state_dict()" in message


def test_the_links_and_state_files_carry_the_name(tmp_path, monkeypatch):
    """The CUDA engine's refusal of a captured backward and the NVMe state file's errors name the optimizer: the
    build hands both its name (the asynchronous CPU link's engine stands in for the CUDA one here)."""
    from zenflow_kernels.link.cuda_engine import CudaEngine

    params = make_params()
    with chaos(seed=0, max_delay=0.0):
        opt = lion(params)
    with opt:
        step_once(opt, params)
        assert opt.run.link.engine.owner == LION and opt.run.name == LION
    engine = object.__new__(CudaEngine)  # (no CUDA here: only its refusal)
    engine.owner = LION
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    raises(RuntimeError, LION, f"{LION}: a backward captured in a CUDA graph is not supported", engine.refuse_capture)

    opt = lion(params, zenflow=dict(ZEN, offload_device="nvme", nvme_path=str(tmp_path)))
    opt.NVME_DIRECT = False  # (tmpfs has no O_DIRECT)
    with opt:
        step_once(opt, params)
        assert opt.run.host.disk.owner == LION
    files = StateFiles(tmp_path, 4096, fields=("master", *rules.Lion.state_names), block_numel=1024, owner=LION)
    files.release()
    raises(StateFileError, LION, f"{LION} NVMe state: read after release", lambda: files.read("master", 0, 4))


def test_the_epoch_length_warning_names_the_optimizer():
    with pytest.warns(ZenFlowWarning):  # (the schedule's: no epoch length yet)
        opt = lion(zenflow=dict(select_strategy="epoch", select_interval=1, update_interval=2))
    with opt, pytest.warns(UserWarning, match=re.escape(f"so {LION} keeps its columns")) as caught:
        give_epoch_length([opt], None, 1, "ZenFlowCallback")
    names(str(caught[0].message), LION)


# -- checkpoints -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [(lion, LION), (adamw, "ZenFlowAdamW")])
def test_load_state_dict_errors_name_the_optimizer(make, name):
    params = make_params()
    with make(params) as opt:
        step_once(opt, params)
        saved = copy.deepcopy(opt.state_dict())
    with make(make_params()) as opt:
        raises(ValueError, name, f"{name}.load_state_dict: expected a state dict with 'state' and 'param_groups' "
                                 f"(from {name}.state_dict()", lambda: opt.load_state_dict([]))
        two = dict(saved, param_groups=saved["param_groups"] * 2)
        raises(ValueError, name, f"{name}.load_state_dict: the state dict has 2 param groups",
               lambda: opt.load_state_dict(two))
        short = copy.deepcopy(saved)
        short["param_groups"][0]["params"] = short["param_groups"][0]["params"][:-1]
        raises(ValueError, name, f"{name}.load_state_dict: param group 0 holds", lambda: opt.load_state_dict(short))
        newer = copy.deepcopy(saved)
        newer["zenflow"]["format"] = 10**6
        raises(ValueError, name, f"{name}.load_state_dict: the state dict has format 1000000",
               lambda: opt.load_state_dict(newer))
        changed = copy.deepcopy(saved)
        changed["zenflow"]["config"]["topk_ratio"] = 0.5
        with pytest.warns(ZenFlowWarning) as caught:
            opt.load_state_dict(changed)
        names(str(caught[0].message), name)
        assert str(caught[0].message).startswith(f"{name}.load_state_dict: the checkpoint's settings replace")
    shapes = [(s[1], s[0]) if len(s) == 2 and s[0] != s[1] else s for s in (tuple(p.shape) for p in params)]
    with make([torch.nn.Parameter(torch.zeros(s)) for s in shapes]) as other:
        raises(ValueError, name, f"{name}.load_state_dict: parameter 0 was saved with shape",
               lambda: other.load_state_dict(saved))


def test_another_rules_checkpoint_names_the_loading_optimizer():
    params = make_params()
    with lion(params) as opt:
        step_once(opt, params)
        saved = copy.deepcopy(opt.state_dict())
    with adamw(make_params()) as opt:
        raises(ValueError, "ZenFlowAdamW", "ZenFlowAdamW.load_state_dict: the state dict was saved by an optimizer "
                                           "with the update rule 'Lion'", lambda: opt.load_state_dict(saved))
    torch_adamw = torch.optim.AdamW(params)
    step_once(torch_adamw, params)
    with sgd(make_params()) as opt:
        raises(ValueError, "ZenFlow(SGD)", "ZenFlow(SGD).load_state_dict: the state dict has no 'zenflow' entry",
               lambda: opt.load_state_dict(torch_adamw.state_dict()))


@pytest.mark.parametrize("make, name", [
    (lambda ps: ZenFlow(ps, rules.AdamW(), zenflow=ZEN), "ZenFlow(AdamW)"), (adamw, "ZenFlowAdamW")])
def test_torch_adamw_imports_name_the_optimizer(make, name):
    params = make_params()
    torch_adamw = torch.optim.AdamW(params, amsgrad=True)
    step_once(torch_adamw, params)
    with make(make_params()) as opt:
        message = raises(ValueError, name, f"{name}.load_state_dict: param group 0 was saved with amsgrad=True, "
                                           f"which {name} does not do", lambda: opt.load_state_dict(
                                               torch_adamw.state_dict()))
        assert message.count(name) == 2
