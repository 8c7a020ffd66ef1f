"""ZenFlowCallback under the Hugging Face Trainer and Lightning: models built from configs, synthetic
data, a few steps on CPU. What they save and evaluate holds flushed weights, a resumed run continues
exactly, the epoch length arrives, and importing the package imports neither framework."""

import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch
from tolerance import assert_within_stated_bound

from zenflow_kernels import ZenFlowAdamW
from zenflow_kernels.testing import chaos

pytestmark = pytest.mark.usefixtures("numba_backend")  # (conftest.py)


def test_importing_the_package_imports_no_framework():
    code = (
        "import sys, zenflow_kernels, zenflow_kernels.integrations, zenflow_kernels.optim\n"
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


ZEN = dict(topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=3, overlap_step=True)


# -- Hugging Face Trainer ---------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, length=16, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(seed=0):
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def hf_trainer(tmp_path, model, optimizers=(None, None), cls_kwargs=None, callbacks=(), **args):
    from zenflow_kernels.integrations.transformers import ZenFlowCallback

    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=8, save_steps=4,
                    save_strategy="steps", eval_strategy="steps", eval_steps=4, logging_steps=100, report_to=[],
                    use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    kwargs = dict(optimizers=optimizers)
    if cls_kwargs is not None:
        kwargs = dict(optimizer_cls_and_kwargs=cls_kwargs)
    return transformers.Trainer(
        model=model, args=transformers.TrainingArguments(**(defaults | args)), train_dataset=Tokens(40),
        eval_dataset=Tokens(8, seed=1), callbacks=[ZenFlowCallback(), *callbacks], **kwargs)


def flat_weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class RecordAtSave(transformers.TrainerCallback):
    """After each save: the weights the model held, and whether a flush would still change them."""

    def __init__(self):
        self.saved = {}

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        from zenflow_kernels.integrations import find_zenflow

        before = flat_weights(model)
        opt = find_zenflow(optimizer)
        opt.flush()
        self.saved[state.global_step] = (before, flat_weights(model))


@pytest.mark.parametrize("with_callback", [True, False])
def test_hf_checkpoints_hold_flushed_weights(tmp_path, with_callback):
    from safetensors.torch import load_file

    model = tiny_gpt2()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=ZEN)
    record = RecordAtSave()
    trainer = hf_trainer(tmp_path, model, optimizers=(opt, None), callbacks=[record])
    if not with_callback:  # the control: without it, saved weights are stale
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if type(c).__name__ != "ZenFlowCallback"]
    trainer.train()
    before, flushed = record.saved[4]
    on_disk = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    same = all(torch.equal(on_disk[k], flushed[k]) for k in on_disk)
    assert same == with_callback
    # a host update was pending at the save (the case tests something); with the callback, on_save gave back
    # the weights training continues from before this recorder ran
    assert not all(torch.equal(before[k], flushed[k]) for k in before)
    if with_callback:
        assert opt.closed  # flushed and closed at the end of training
        final = load_file(str(tmp_path / "checkpoint-8" / "model.safetensors"))
        assert all(torch.equal(final[k], model.state_dict()[k]) for k in final)
    else:
        opt.close()


class RecordAtEvaluation(transformers.TrainerCallback):
    """At the first batch of each evaluation: the weights the model is evaluated with, and the same after a
    flush (equal when the ZenFlowCallback flushed before the evaluation)."""

    def __init__(self):
        self.seen = {}

    def on_prediction_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        from zenflow_kernels.integrations import find_zenflow

        if state.global_step in self.seen:
            return
        before = flat_weights(model)
        find_zenflow(optimizer).flush()
        self.seen[state.global_step] = (before, flat_weights(model))


@pytest.mark.parametrize("with_callback", [True, False])
@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_hf_evaluation_without_a_save_sees_flushed_weights(tmp_path, strategy, with_callback):
    """Evaluations at steps where nothing is saved (3 and 6; or the end of the 10-batch epoch): a host update
    is pending at each, and the model is evaluated with what a flush gives. Without the callback (the
    control) it would be evaluated with stale weights."""
    model = tiny_gpt2()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=ZEN)
    record = RecordAtEvaluation()
    args = dict(eval_strategy="steps", eval_steps=3, max_steps=7) if strategy == "steps" else \
        dict(eval_strategy="epoch", max_steps=12)
    trainer = hf_trainer(tmp_path, model, optimizers=(opt, None), callbacks=[record], save_strategy="no", **args)
    if not with_callback:
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if type(c).__name__ != "ZenFlowCallback"]
    trainer.train()
    assert not list(tmp_path.glob("checkpoint-*"))  # nothing saved: no save's flush to lean on
    steps = [3, 6] if strategy == "steps" else [10]
    assert set(steps) <= set(record.seen)
    for step in steps:
        before, flushed = record.seen[step]
        assert all(torch.equal(before[k], flushed[k]) for k in before) == with_callback, step
    opt.close()


def test_hf_resume_from_a_checkpoint_is_exact(tmp_path):
    straight_model = tiny_gpt2()
    hf_trainer(tmp_path / "a", straight_model, cls_kwargs=(ZenFlowAdamW, dict(lr=1e-2, zenflow=ZEN))).train()
    straight = flat_weights(straight_model)

    first = tiny_gpt2()
    hf_trainer(tmp_path / "b", first, cls_kwargs=(ZenFlowAdamW, dict(lr=1e-2, zenflow=ZEN)), max_steps=8).train()
    resumed_model = tiny_gpt2(seed=5)  # other weights: everything must come from the checkpoint
    trainer = hf_trainer(tmp_path / "b", resumed_model, cls_kwargs=(ZenFlowAdamW, dict(lr=1e-2, zenflow=ZEN)))
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    resumed = flat_weights(resumed_model)
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


@pytest.mark.parametrize("seed", [None, 2])
def test_hf_saving_and_evaluating_every_3_steps_leave_the_run_bit_identical(tmp_path, seed):
    """12 steps of a GPT-2 with dropout, saving and evaluating every 3 (host updates every 3, pending at
    each), end with the weights, bit for bit, of the same run that never saves or evaluates; on the
    synchronous link and under chaos. The control: with ``isolated_rng=False`` the evaluation's draw from
    torch's generator changes the dropout masks that follow (as it does for any optimizer)."""
    from zenflow_kernels.integrations.transformers import ZenFlowCallback

    runs = {}
    for name, args, isolated in (("plain", dict(save_strategy="no", eval_strategy="no"), True),
                                 ("saves", dict(save_steps=3, eval_steps=3), True),
                                 ("shared-rng", dict(save_steps=3, eval_steps=3), False)):
        model = tiny_gpt2()
        assert model.config.resid_pdrop > 0  # dropout: the run draws from torch's generator every step
        with chaos(seed=seed) if seed is not None else contextlib.nullcontext():
            opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=ZEN)
        trainer = hf_trainer(tmp_path / name, model, optimizers=(opt, None), max_steps=12, **args)
        for c in trainer.callback_handler.callbacks:
            if isinstance(c, ZenFlowCallback):
                c.isolated_rng = isolated
        trainer.train()
        runs[name] = flat_weights(model)
        assert opt.closed and opt.host_updates >= 4
    assert len(list((tmp_path / "saves").glob("checkpoint-*"))) == 4
    for k, v in runs["plain"].items():
        assert torch.equal(v, runs["saves"][k]), k
    assert not all(torch.equal(v, runs["shared-rng"][k]) for k, v in runs["plain"].items())


def test_hf_hands_over_the_epoch_length_in_optimizer_steps(tmp_path):
    zen = dict(topk_ratio=0.25, select_strategy="epoch", select_interval=1, update_interval=1)
    model = tiny_gpt2()
    with pytest.warns(Warning, match="never re-selected"):  # unknown at construction, said so
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=zen)
    trainer = hf_trainer(tmp_path, model, optimizers=(opt, None), gradient_accumulation_steps=3, max_steps=4,
                         save_strategy="no", eval_strategy="no")
    trainer.train()
    # 40 samples / batch 4 = 10 batches per epoch; 3 accumulation steps: 4 optimizer steps per epoch
    assert opt.schedule.steps_per_epoch == math.ceil(10 / 3) == 4
    assert opt.schedule.select_interval == 4 and opt.selections == 1


@pytest.fixture
def small_folds(monkeypatch):
    """Fold jobs many times smaller than the models here, so that the next backward's hooks wait on each."""
    from zenflow_kernels.link import AsyncLink

    monkeypatch.setattr(AsyncLink, "FOLD_CHUNK_BYTES", 1024)


class LogRecorder(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.logs.append(logs["grad_norm"])


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_hf_trainer_defaults_keep_the_hand_over_and_log_the_norm(tmp_path, small_folds, max_grad_norm):
    """The Trainer clips after every backward (``max_grad_norm=1.0`` by default), or rescales by 1 only to log the
    norm (0): the callback routes that into the optimizer (``clip_grad_norm_``), so no gradient is rewritten and
    gradients cross during backward (hand-over on at the end) on the asynchronous link, with the synchronous
    link's weights and the same logged gradient norms, every step. With 0 the run is also a run without any
    clipping, and the logged norms are the gradient's (torch's clip_grad_norm_ reports them in fp32: within
    1e-5 of ours); the Trainer's own clipping is back after train()."""
    runs = {}
    for name in ("sync", "chaos", "plain"):
        model = tiny_gpt2()
        with chaos(seed=0) if name == "chaos" else contextlib.nullcontext():
            opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=ZEN)
        logs = LogRecorder()
        trainer = hf_trainer(tmp_path / name, model, optimizers=(opt, None), max_grad_norm=max_grad_norm,
                             logging_steps=1, save_strategy="no", eval_strategy="no", callbacks=(logs,))
        if name == "plain":  # the Trainer alone (its own clip_grad_norm_), for the norms it logs
            trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                                  if type(c).__name__ != "ZenFlowCallback"]
        trainer.train()
        if name != "plain":
            assert "clip_grad_norm_" not in trainer.accelerator.__dict__  # unrouted at the end
        else:
            opt.close()
        runs[name] = flat_weights(model), opt.stats(), logs.logs
    for k, v in runs["sync"][0].items():
        assert torch.equal(v, runs["chaos"][0][k]), k
    (_, stats, chaos_logs), (_, _, sync_logs), (_, _, plain_logs) = runs["chaos"], runs["sync"], runs["plain"]
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0
    assert len(chaos_logs) == 8 and chaos_logs == sync_logs and all(math.isfinite(n) and n > 0 for n in chaos_logs)
    # the first step's gradient is the same whoever clips (with 1.0, the runs then differ: the host clips the
    # interval's mean gradient, not each step's; docs/huggingface.md)
    assert chaos_logs[0] == pytest.approx(plain_logs[0], rel=1e-5)
    if max_grad_norm == 0.0:
        assert chaos_logs == pytest.approx(plain_logs, rel=1e-5)
        for k, v in runs["sync"][0].items():
            assert torch.equal(v, runs["plain"][0][k]), k


def test_hf_gradient_accumulation_is_declared_and_exact(tmp_path, small_folds):
    """gradient_accumulation_steps=3 on the asynchronous link: the callback lets the optimizer read the
    Trainer's per-micro-batch sync flag, so hooks copy nothing during the first two micro-batches, the Trainer's
    clipping is the optimizer's, gradients cross during the last backward and the run gives the synchronous
    link's weights."""
    runs = {}
    for name in ("sync", "chaos"):
        model = tiny_gpt2()
        with chaos(seed=0) if name == "chaos" else contextlib.nullcontext():
            opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=ZEN)
        hf_trainer(tmp_path / name, model, optimizers=(opt, None), gradient_accumulation_steps=3, max_steps=4,
                   save_strategy="no", eval_strategy="no").train()
        runs[name] = flat_weights(model), opt.stats()
    for k, v in runs["sync"][0].items():
        assert torch.equal(v, runs["chaos"][0][k]), k
    stats = runs["chaos"][1]
    assert stats["handover"] == "on" and stats["d2h_bytes_unused"] == 0 and stats["d2h_bytes_in_backward"] > 0
    assert opt.handover.sync_source is None  # let go at the end of training


def lora_gpt2(seed=0):
    """A PEFT LoRA model (rank 4 on the attention and MLP projections) over the tiny GPT-2: the base frozen."""
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(tiny_gpt2(seed), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))


def test_peft_lora_under_the_trainer_matches_the_reference_on_both_links(tmp_path):
    """``peft.get_peft_model`` under the Trainer with the callback and ``optimizers=(ZenFlowAdamW(
    model.parameters()), None)``: most parameters frozen. Both links give the same bits (gradients crossing during
    backward on the asynchronous one), the reference run through the same Trainer the same weights within the
    stated bound, the frozen base never moves, and only the adapters have host state (``host_bytes()``)."""
    from zenflow_kernels.integrations.transformers import ZenFlowCallback
    from zenflow_kernels.reference import ReferenceZenFlow

    zen = dict(ZEN, update_interval=2)
    runs, base = {}, None
    for name in ("reference", "sync", "chaos"):
        model = lora_gpt2()
        base = base or {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
        params = list(model.parameters())
        with chaos(seed=0) if name == "chaos" else contextlib.nullcontext():
            opt = (ReferenceZenFlow if name == "reference" else ZenFlowAdamW)(params, lr=1e-2, zenflow=zen)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=8, save_strategy="no",
            eval_strategy="no", logging_steps=100, report_to=[], use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=0.0)
        callbacks = [] if name == "reference" else [ZenFlowCallback()]
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(40), optimizers=(opt, None),
                             callbacks=callbacks).train()
        if name == "reference":
            opt.flush()  # (the callback flushes ZenFlowAdamW at the last step)
        else:
            trainable = [p for p in params if p.requires_grad]
            padded = sum(-(-p.numel() // 16) * 16 for p in trainable)
            assert opt.host_bytes()["master"] == 4 * padded and padded < sum(p.numel() for p in params) / 10
            runs[name + "_stats"] = opt.stats()
        runs[name] = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert base and all(torch.equal(runs["chaos"][k], v) for k, v in base.items())
    assert all(torch.equal(runs["sync"][k], v) for k, v in runs["chaos"].items())
    for k, v in runs["sync"].items():
        assert_within_stated_bound(v, runs["reference"][k], lr=1e-2, steps=8, what=k)
    lora = [k for k in runs["sync"] if "lora_" in k]
    assert lora and all(not torch.equal(runs["sync"][k], lora_gpt2().state_dict()[k]) for k in lora if "lora_B" in k)
    stats = runs["chaos_stats"]
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0


# -- Lightning ----------------------------------------------------------------------------------------------

L = pytest.importorskip("lightning.pytorch")


class TinyModule(L.LightningModule):
    def __init__(self, zenflow, seed=0, dropout=0.0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(24, 6))
        self.zenflow = zenflow
        self.flushed_at_save = {}

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return ZenFlowAdamW(self.parameters(), lr=1e-2, zenflow=self.zenflow)


def pairs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 12, generator=g), torch.randn(n, 6, generator=g))


def lightning_trainer(tmp_path, max_steps=8, **kw):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zenflow_kernels.integrations.lightning import ZenFlowCallback

    # a checkpoint at the end of each epoch (4 steps): a plain DataLoader cannot resume mid-epoch
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_epochs=1, save_top_k=-1, filename="{step}")
    defaults = dict(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[ZenFlowCallback(), ckpt], num_sanity_val_steps=0,
                    limit_val_batches=2, deterministic=True)
    return L.Trainer(**(defaults | kw))


def ZenFlowCallbackFor():  # noqa: N802 (a factory: the import stays inside the tests that use Lightning)
    from zenflow_kernels.integrations.lightning import ZenFlowCallback

    return ZenFlowCallback()


def loader(n=16, batch=4, seed=0):
    return torch.utils.data.DataLoader(pairs(n, seed), batch_size=batch)


class FlushAt(TinyModule):
    """Flushes after training step ``at`` and records the weights: what a checkpoint there should hold."""

    def __init__(self, zenflow, at, seed=0, dropout=0.0):
        super().__init__(zenflow, seed, dropout)
        self.at, self.flushed = at, None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == self.at:
            self.trainer.optimizers[0].flush()
            self.flushed = {k: v.clone() for k, v in self.state_dict().items()}


def test_lightning_checkpoints_hold_flushed_weights_and_resume_exactly(tmp_path):
    """Validating and checkpointing every epoch (4 steps) leaves a run with dropout bit-identical to one that
    does neither; the checkpoint holds the weights flush() gives there, and resuming from it is exact. The
    control: with ``isolated_rng=False`` validation's draw from torch's generator changes later dropout."""
    module = TinyModule(ZEN, dropout=0.2)
    trainer = lightning_trainer(tmp_path / "a")
    trainer.fit(module, loader(), loader(8, seed=1))
    opt = trainer.optimizers[0]
    assert opt.closed
    final = {k: v.clone() for k, v in module.state_dict().items()}
    plain = TinyModule(ZEN, dropout=0.2)
    lightning_trainer(tmp_path / "p", enable_checkpointing=False, limit_val_batches=0,
                      callbacks=[ZenFlowCallbackFor()]).fit(plain, loader())
    for k, v in plain.state_dict().items():
        assert torch.equal(v, final[k]), k
    shared = TinyModule(ZEN, dropout=0.2)
    callback = ZenFlowCallbackFor()
    callback.isolated_rng = False
    lightning_trainer(tmp_path / "s", enable_checkpointing=False, callbacks=[callback]).fit(
        shared, loader(), loader(8, seed=1))
    assert not all(torch.equal(v, final[k]) for k, v in shared.state_dict().items())
    ckpt = torch.load(tmp_path / "a" / "step=4.ckpt", weights_only=False)
    # a host update was pending at the save: the optimizer state carries the weights training continued from
    states = ckpt["optimizer_states"][0]["state"].values()
    assert any(st.get("pending") for st in states) and all("unflushed" in st for st in states if st.get("pending"))
    flush_at = FlushAt(ZEN, at=4, dropout=0.2)
    lightning_trainer(tmp_path / "f", max_steps=4, enable_checkpointing=False, limit_val_batches=0,
                      callbacks=[ZenFlowCallbackFor()]).fit(flush_at, loader())
    for k, v in ckpt["state_dict"].items():
        assert torch.equal(v, flush_at.flushed[k]), k

    end = torch.load(tmp_path / "a" / "step=8.ckpt", weights_only=False)
    for k, v in end["state_dict"].items():
        assert torch.equal(v, final[k]), k

    # resume (without dropout: a Lightning checkpoint does not hold torch's generator, whatever the optimizer)
    assert_resumes_like_the_straight_run(tmp_path)


def assert_resumes_like_the_straight_run(tmp_path, checkpoint=None) -> None:
    """A run resumed at step 4 from ``checkpoint`` (default: the straight run's own) ends where the straight
    8-step run (in memory) ends, bit for bit."""
    straight = TinyModule(ZEN)
    lightning_trainer(tmp_path / "c").fit(straight, loader(), loader(8, seed=1))
    resumed = TinyModule(ZEN, seed=3)
    lightning_trainer(tmp_path / "b").fit(resumed, loader(), loader(8, seed=1),
                                          ckpt_path=str(checkpoint or tmp_path / "c" / "step=4.ckpt"))
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, straight.state_dict()[k]), k


class RecordAtValidation(TinyModule):
    """At the first batch of each validation: the weights validated, and the same after a flush."""

    def __init__(self, zenflow, seed=0):
        super().__init__(zenflow, seed)
        self.seen = {}

    def validation_step(self, batch, batch_idx):
        from zenflow_kernels.integrations import find_zenflow

        if batch_idx == 0 and self.global_step not in self.seen:
            before = {k: v.clone() for k, v in self.state_dict().items()}
            find_zenflow(self.trainer.optimizers[0]).flush()
            self.seen[self.global_step] = (before, {k: v.clone() for k, v in self.state_dict().items()})
        return super().validation_step(batch, batch_idx)


@pytest.mark.parametrize("with_callback", [True, False])
def test_lightning_validation_without_a_checkpoint_sees_flushed_weights(tmp_path, with_callback):
    """Validation every 3 batches (global steps 3 and 7 of 4-batch epochs), no checkpointing: a host update is
    pending at each, and the module is validated with what a flush gives; without the callback (the
    control), with stale weights."""
    from zenflow_kernels.integrations.lightning import ZenFlowCallback

    module = RecordAtValidation(ZEN)
    callbacks = [ZenFlowCallback()] if with_callback else []
    trainer = lightning_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=False, val_check_interval=3)
    trainer.fit(module, loader(), loader(8, seed=1))
    assert not list(tmp_path.glob("*.ckpt"))
    assert {3, 7} <= set(module.seen)
    for step in (3, 7):
        before, flushed = module.seen[step]
        assert all(torch.equal(before[k], flushed[k]) for k in before) == with_callback, step
    trainer.optimizers[0].close()


def test_lightning_without_the_callback_saves_stale_weights(tmp_path):
    """The control of the test above: the same run without ZenFlowCallback checkpoints weights that still
    await a host update (pending), and closes nothing."""
    module = TinyModule(ZEN)
    trainer = lightning_trainer(tmp_path)
    trainer.callbacks[:] = [c for c in trainer.callbacks if type(c).__name__ != "ZenFlowCallback"]
    trainer.fit(module, loader(), loader(8, seed=1))
    ckpt = torch.load(tmp_path / "step=4.ckpt", weights_only=False)
    assert any(st.get("pending") for st in ckpt["optimizer_states"][0]["state"].values())
    assert not trainer.optimizers[0]._closed
    trainer.optimizers[0].close()


def test_lightning_hands_over_the_epoch_length(tmp_path):
    zen = dict(topk_ratio=0.25, select_strategy="epoch", select_interval=1, update_interval=1)
    module = TinyModule(zen)
    trainer = lightning_trainer(tmp_path, max_steps=4, accumulate_grad_batches=3, limit_val_batches=0)
    with pytest.warns(Warning, match="never re-selected"):
        trainer.fit(module, loader(40))
    # 40 samples / batch 4 = 10 batches; 3 accumulation steps: ceil(10 / 3) = 4 optimizer steps per epoch
    assert trainer.optimizers[0].schedule.steps_per_epoch == 4


def test_lightning_gradient_accumulation_hands_over_in_the_last_micro_batch(tmp_path, small_folds):
    """accumulate_grad_batches=3 on the asynchronous link: the callback declares each backward (its last
    micro-batch runs inside optimizer.step's closure), gradients cross during that backward, and the run
    gives the synchronous link's weights."""
    weights, stats = {}, None
    for name in ("sync", "chaos"):
        module = TinyModule(ZEN)
        trainer = lightning_trainer(tmp_path / name, max_steps=6, accumulate_grad_batches=3, limit_val_batches=0)
        with chaos(seed=1) if name == "chaos" else contextlib.nullcontext():
            trainer.fit(module, loader(72))
        weights[name] = flat_weights(module)
        stats = trainer.optimizers[0].stats()
    for k, v in weights["sync"].items():
        assert torch.equal(v, weights["chaos"][k]), k
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0


def test_random_state_puts_back_every_generator_cuda_included(monkeypatch):
    """RandomState (the callbacks' isolated_rng) restores torch's, Python's and numpy's generators, and the CUDA
    generators when CUDA is initialised (entered here with a recording stand-in for torch.cuda's calls)."""
    import random

    import numpy as np

    from zenflow_kernels.integrations import RandomState

    saved_cuda, restored = [torch.tensor([1, 2, 3], dtype=torch.uint8)], []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(saved_cuda))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    state = RandomState()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand(4)  # an evaluation draws
    state.restore()
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]
    assert len(restored) == 1 and torch.equal(restored[0][0], saved_cuda[0])


def test_lightning_with_the_state_on_disk_checkpoints_and_saves_after_fit(tmp_path):
    """offload_device="nvme" under Lightning (issue 25): the run, its epoch checkpoints (file-backed host state
    written by Lightning's torch.save) and ``trainer.save_checkpoint()`` after ``fit()`` (the optimizer is closed
    by then) are bit-identical to the in-memory run's; nothing is left under nvme_path; the disk run's checkpoint
    resumes an in-memory run exactly."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    runs = {}
    for name, zen in (("memory", ZEN), ("disk", dict(ZEN, offload_device="nvme", nvme_path=str(nvme)))):
        module = TinyModule(zen)
        trainer = lightning_trainer(tmp_path / name)
        trainer.fit(module, loader(), loader(8, seed=1))
        assert trainer.optimizers[0]._closed
        trainer.save_checkpoint(tmp_path / name / "after-fit.ckpt")
        runs[name] = {f: torch.load(tmp_path / name / f, weights_only=False)
                      for f in ("step=4.ckpt", "step=8.ckpt", "after-fit.ckpt")}
    assert os.listdir(nvme) == []
    for f, ckpt in runs["disk"].items():
        mem = runs["memory"][f]
        for k, v in ckpt["state_dict"].items():
            assert torch.equal(v, mem["state_dict"][k]), (f, k)
        for i, st in ckpt["optimizer_states"][0]["state"].items():
            for key in ("host_master", "host_exp_avg", "host_exp_avg_sq", "acc"):
                assert torch.equal(st[key], mem["optimizer_states"][0]["state"][i][key]), (f, i, key)
    assert_resumes_like_the_straight_run(tmp_path, tmp_path / "disk" / "step=4.ckpt")


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_lightning_clipping_is_routed_and_keeps_the_hand_over(tmp_path, small_folds, precision):
    """``gradient_clip_val=0.05`` (by norm): the callback routes it into the optimizers (``clip_grad_norm_`` before
    each optimizer step; ``trainer.gradient_clip_val`` unset during ``fit`` and put back after), so gradients are
    not rewritten and cross during backward; the synchronous link's weights. With ``precision="16-mixed"`` (its
    GradScaler on CPU through an explicit plugin: Lightning maps "16-mixed" on CPU to bf16) GradScaler unscales
    inside the optimizer, which Lightning refuses to combine with its own clipping: routed, it runs."""
    from lightning.pytorch.plugins import MixedPrecision

    weights, stats, clips = {}, None, []
    for name in ("sync", "chaos"):
        module = TinyModule(ZEN)
        kw = dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]) if (
            precision == "16-mixed") else {}
        trainer = lightning_trainer(tmp_path / name, max_steps=8, gradient_clip_val=0.05, limit_val_batches=0, **kw)
        with chaos(seed=1) if name == "chaos" else contextlib.nullcontext():
            trainer.fit(module, loader(40))
        weights[name] = flat_weights(module)
        stats = trainer.optimizers[0].stats()
        clips.append(trainer.gradient_clip_val)
    for k, v in weights["sync"].items():
        assert torch.equal(v, weights["chaos"][k]), k
    assert stats["handover"] == "on" and stats["d2h_bytes_in_backward"] > 0
    assert clips == [0.05, 0.05]


class FrozenBackbone(L.LightningModule):
    """A backbone frozen in ``__init__`` (a pretrained feature extractor) and a head; the optimizer built from
    ``self.parameters()``, frozen ones included (the setup that failed the first step on a GPU)."""

    def __init__(self, factory):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.LayerNorm(24))
        self.head = torch.nn.Linear(24, 6)
        self.backbone.requires_grad_(False)
        self.factory = factory

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return self.factory(self.parameters())


def test_lightning_with_a_frozen_backbone_unfrozen_at_epoch_1_matches_the_reference(tmp_path):
    """Lightning's fine-tuning callback API (``BaseFinetuning``: frozen before training, ``make_trainable`` at
    epoch 1): both links give the same bits, a plain loop into the reference with the same schedule the same
    weights within the stated bound; the backbone did not move in epoch 0 and got host state when it trained."""
    from lightning.pytorch.callbacks import BaseFinetuning

    from zenflow_kernels.integrations.lightning import ZenFlowCallback
    from zenflow_kernels.reference import ReferenceZenFlow

    class UnfreezeAtEpoch1(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone, train_bn=False)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.make_trainable(pl_module.backbone)

    zen = dict(ZEN, update_interval=2)
    weights, after_epoch0, stats, memory = {}, {}, {}, {}

    class Watch(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            if trainer.current_epoch == 0:
                after_epoch0[name] = [p.detach().clone() for p in module.backbone.parameters()]
                memory[name] = trainer.optimizers[0].host_bytes()["master"]

    for name in ("sync", "chaos"):
        module = FrozenBackbone(lambda ps: ZenFlowAdamW(ps, lr=1e-2, zenflow=zen))
        initial = [p.detach().clone() for p in module.backbone.parameters()]
        trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                            callbacks=[ZenFlowCallback(), UnfreezeAtEpoch1(), Watch()])
        with chaos(seed=2) if name == "chaos" else contextlib.nullcontext():
            trainer.fit(module, loader(16))
        weights[name] = flat_weights(module)
        stats[name] = trainer.optimizers[0].stats(), trainer.optimizers[0].host_bytes()["master"]
        assert all(torch.equal(a, b) for a, b in zip(after_epoch0[name], initial, strict=True))
    assert all(torch.equal(v, weights["chaos"][k]) for k, v in weights["sync"].items())
    assert stats["chaos"][0]["handover"] == "on" and stats["chaos"][0]["d2h_bytes_in_backward"] > 0
    head = 4 * sum(-(-p.numel() // 16) * 16 for p in FrozenBackbone(None).head.parameters())
    assert memory["sync"] == head < stats["sync"][1]  # the backbone's host state came with its training
    module = FrozenBackbone(None)
    ref = ReferenceZenFlow(module.parameters(), lr=1e-2, zenflow=zen)
    for epoch in range(3):
        module.backbone.requires_grad_(epoch >= 1)
        for x, y in loader(16):
            module.training_step((x, y), 0).backward()
            ref.step()
            ref.zero_grad()
    ref.flush()
    for k, v in flat_weights(module).items():
        assert_within_stated_bound(weights["sync"][k], v, lr=1e-2, steps=12, what=k)
