"""The checkpoint format as a contract (zenflow_kernels/optim/checkpoint.py): a version written into every dict,
newer versions refused before anything changes, older ones read (tests/test_checkpoint_fixtures.py loads dicts
written before the version existed), and torch's optimizer state-dict hooks run around save and load as they do
for torch's own optimizers."""

import pytest
import torch
from support import HYPER, drive, grad_sequence, make_params, snapshot

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.ops import use_backend
from zenflow_kernels.optim import checkpoint

ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2, overlap_step=True)


@pytest.fixture(autouse=True)
def torch_backend():
    with use_backend("torch"):
        yield


def stepped(steps=5):
    params = make_params()
    opt = ZenFlowAdamW(params, **HYPER, zenflow=ZEN)
    drive(opt, params, grad_sequence(steps))
    return params, opt


def test_every_state_dict_says_its_format_and_a_newer_one_is_refused_before_anything_changes():
    params, opt = stepped()
    with opt:
        saved = opt.state_dict()
        assert saved["zenflow"]["format"] == checkpoint.FORMAT == 2
        newer = dict(saved, zenflow=dict(saved["zenflow"], format=checkpoint.FORMAT + 1))
        before, state_before = snapshot(params), {k: dict(v) for k, v in opt.state.items()}
        with pytest.raises(ValueError, match=r"has format 3, this version of zenflow_kernels reads formats 1 to 2"):
            opt.load_state_dict(newer)
        assert all(torch.equal(a, b) for a, b in zip(snapshot(params), before, strict=True))
        assert opt.t == 5 and all(opt.state[p].keys() == state_before[p].keys() for p in state_before)
        # format 1: the same layout without the key (what main wrote before it existed)
        older = dict(saved, zenflow={k: v for k, v in saved["zenflow"].items() if k != "format"})
        opt.load_state_dict(older)
        assert opt.t == 5


def test_torchs_state_dict_hooks_run_around_save_and_load():
    """``register_state_dict_pre_hook`` / ``_post_hook`` (whose return value replaces the dict) and
    ``register_load_state_dict_pre_hook`` (whose return value is what loads) / ``_post_hook``, in torch's order."""
    params, opt = stepped()
    calls = []
    with opt:
        opt.register_state_dict_pre_hook(lambda o: calls.append(("save-pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd: calls.append(("save-post", "zenflow" in sd))
                                          or dict(sd, note="added by a hook"))
        saved = opt.state_dict()
        assert saved["note"] == "added by a hook" and calls == [("save-pre", True), ("save-post", True)]

        fresh_params = make_params()
        fresh = ZenFlowAdamW(fresh_params, **HYPER, zenflow=ZEN)

        def rewrite(o, sd):
            calls.append(("load-pre", sd.pop("note")))
            return dict(sd, zenflow=dict(sd["zenflow"], t=sd["zenflow"]["t"] + 100))

        fresh.register_load_state_dict_pre_hook(rewrite)
        fresh.register_load_state_dict_post_hook(lambda o: calls.append(("load-post", o.t)))
        with fresh:
            fresh.load_state_dict(saved)
            assert calls[2:] == [("load-pre", "added by a hook"), ("load-post", 105)]
            assert fresh.t == 105  # what the pre-hook returned is what loaded
