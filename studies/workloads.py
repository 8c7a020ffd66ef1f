"""The tuned comparison's workloads: per seed, a model to fine-tune, its batches and a held-out loss.

* ``study_flat``, ``study_concentrated``: studies/concentration_study.py's teacher-student MLP at ``alpha`` 0 (about
  19% of the gradient's energy in the top 10% of columns) and 1.5 (about 94%); 300 steps of batch 64.
* ``gpt_finetune``: the byte GPT (bench/model.py ``tiny``) pre-trained 300 steps on the standard library's top-level
  modules, fine-tuned 160 steps on its packages, held out: package files it never saw (bench/data.py).
* ``gpt_classify``: the same GPT with a new linear head on the mean of its last layer's states (its own head
  untrained): which of the standard library's 8 largest packages a 64-byte window comes from, 20% of each package's
  files held out by a seeded shuffle; 160 steps of batch 16, held out: 32 evenly spaced windows per package
  (cross-entropy; accuracy beside it). The GPT workloads: 10% linear warm-up, weight decay 0.01.

The seed fixes every model, batch and held-out set: every variant and rate starts from the same weights and sees the
same batches. ``quick=True``: a few steps on smaller data (the tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Workload:
    """What a workload is, apart from its seed: its length, schedule and each rule family's grid centre."""

    name: str
    steps: int
    warmup_frac: float  # linear learning-rate warm-up over this share of the steps (0: constant)
    weight_decay: float
    centers: dict  # family ("adam", "lion", "sgd") -> the learning rate the grid starts around
    description: str


_MLP, _GPT = dict(adam=1e-4, lion=2e-5, sgd=3e-3), dict(adam=1e-3, lion=2e-4, sgd=0.1)
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("study_flat", 300, 0.0, 0.0, _MLP, "teacher-student MLP, alpha 0 (flat gradient)"),
    Workload("study_concentrated", 300, 0.0, 0.0, _MLP, "teacher-student MLP, alpha 1.5 (concentrated gradient)"),
    Workload("gpt_finetune", 160, 0.1, 0.01, _GPT, "byte GPT (tiny) pre-trained, fine-tuned on a new corpus"),
    Workload("gpt_classify", 160, 0.1, 0.01, _GPT, "byte GPT (tiny) pre-trained, a new head classifying 8 packages"),
)}


class Task:
    """One workload at one seed: ``model()`` a fresh copy of the starting weights, ``trainable(model)`` the
    parameters the optimizer gets, ``loss(model, step)`` the training loss on batch ``step``, ``heldout(model)`` the
    held-out loss and ``metrics(model)`` what else the workload reports."""

    steps: int

    def trainable(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return list(model.parameters())

    def metrics(self, model: torch.nn.Module) -> dict:
        return {}


class StudyTask(Task):
    def __init__(self, alpha: float, seed: int, steps: int):
        from studies import concentration_study as cs

        self.cs, self.seed, self.steps = cs, seed, steps
        self.inner = cs.Task(alpha, seed, steps)

    def model(self):
        return self.cs.mlp(self.seed)

    def loss(self, model, step):
        x, y = self.inner.batches[step]
        return F.mse_loss(model(x), y)

    def heldout(self, model):
        return self.inner.loss(model)


class GPTFinetuneTask(Task):
    def __init__(self, seed: int, steps: int, quick: bool):
        from bench import data, e2e_core

        self.e2e, self.data, self.seed, self.steps = e2e_core, data, seed, steps
        cfg = e2e_core.E2EConfig(model="tiny", seed=seed, steps=steps, device="cpu", threads=torch.get_num_threads(),
                                 overlap=False, pretrain_steps=40 if quick else 300,
                                 pretrain_bytes=200_000 if quick else 1_000_000,
                                 train_bytes=100_000 if quick else 400_000, heldout_bytes=30_000 if quick else 100_000)
        self.prep = e2e_core.prepare(cfg, e2e_core.cache_dir())
        self.context = self.prep.cfg.size().context

    def model(self):
        return self.e2e.make_model(self.prep)

    def loss(self, model, step):
        x, y = self.data.windows(self.prep.corpus.train.data, self.prep.starts[step], self.context)
        return model.loss(x, y)

    def heldout(self, model):
        return self.e2e.model_heldout_loss(self.prep, model)


class PackageClassifier(torch.nn.Module):
    """The pre-trained byte GPT's body and a new linear head on the mean of its last layer's states."""

    def __init__(self, body, classes: int):
        super().__init__()
        self.body = body
        self.classify = torch.nn.Linear(body.size.d_model, classes)
        torch.nn.init.normal_(self.classify.weight, std=0.02)
        torch.nn.init.zeros_(self.classify.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b = self.body
        x = b.tok(idx) + b.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in b.blocks:
            x = block(x)
        return self.classify(b.ln_f(x).mean(dim=1))


CLASSES = 8
HELDOUT_PER_CLASS = 32


class GPTClassifyTask(GPTFinetuneTask):
    def __init__(self, seed: int, steps: int, quick: bool):
        super().__init__(seed, steps, quick)
        batch = self.prep.cfg.size().batch
        root = self.data.stdlib_root()
        by_package: dict[str, list[Path]] = {}
        for p in self.data._files(root, "*/**/*.py"):
            if p.stat().st_size > 4 * self.context:
                by_package.setdefault(p.relative_to(root).parts[0], []).append(p)
        size = {k: sum(p.stat().st_size for p in v) for k, v in by_package.items() if len(v) >= 5}
        self.packages = sorted(sorted(size, key=lambda k: -size[k])[:CLASSES])
        rng = random.Random(seed)
        train, held = [], []
        for label, name in enumerate(self.packages):
            group = sorted(by_package[name])
            rng.shuffle(group)
            cut = max(1, round(0.2 * len(group)))
            held += [(label, p) for p in group[:cut]]
            train += [(label, p) for p in group[cut:]]
        texts = self._texts(train)
        gen = torch.Generator().manual_seed(3000 + seed)
        # batches drawn with equal classes in expectation (a class's windows uniform over its files' bytes)
        self.batches = []
        for labels in torch.randint(0, CLASSES, (steps, batch), generator=gen):
            rows = []
            for y in labels.tolist():
                start = int(torch.randint(0, texts[y].numel() - self.context, (1,), generator=gen))
                rows.append(texts[y][start:start + self.context].long())
            self.batches.append((torch.stack(rows), labels))
        xs, ys, per = [], [], 8 if quick else HELDOUT_PER_CLASS
        for label, text in self._texts(held).items():
            for start in torch.linspace(0, text.numel() - self.context - 1, per).long().tolist():
                xs.append(text[start:start + self.context].long())
                ys.append(label)
        self.heldout_set = torch.stack(xs), torch.tensor(ys)

    @staticmethod
    def _texts(items):
        """Per class: its files' bytes, concatenated (a window never spans two classes)."""
        chunks = {label: [] for label in range(CLASSES)}
        for label, p in items:
            chunks[label].append(p.read_bytes() + b"\n")
        return {label: torch.frombuffer(bytearray(b"".join(c)), dtype=torch.uint8).clone()
                for label, c in chunks.items()}

    def model(self):
        torch.manual_seed(5000 + self.seed)  # the new head's initialisation
        return PackageClassifier(self.e2e.make_model(self.prep), CLASSES)

    def trainable(self, model):
        return [p for n, p in model.named_parameters() if not n.startswith("body.head.")]

    def loss(self, model, step):
        x, y = self.batches[step]
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def _logits(self, model):
        was = model.training
        model.eval()
        x = self.heldout_set[0]
        out = torch.cat([model(x[i:i + 64]) for i in range(0, x.shape[0], 64)])
        model.train(was)
        return out

    def heldout(self, model):
        return float(F.cross_entropy(self._logits(model), self.heldout_set[1]))

    def metrics(self, model):
        return dict(accuracy=float((self._logits(model).argmax(1) == self.heldout_set[1]).float().mean()))


def task(workload: str, seed: int, quick: bool = False) -> Task:
    """The task of ``workload`` at ``seed`` (quick: a few steps on less data)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is invalid: allowed {sorted(WORKLOADS)}")
    steps = (24 if workload.startswith("study_") else 12) if quick else WORKLOADS[workload].steps
    if workload.startswith("study_"):
        return StudyTask(0.0 if workload == "study_flat" else 1.5, seed, steps)
    return (GPTFinetuneTask if workload == "gpt_finetune" else GPTClassifyTask)(seed, steps, quick)
