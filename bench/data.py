"""Text for the end-to-end benchmark: the Python standard library's own source, as bytes.

Every Python ships it, nobody here wrote it, and it is real, varied code. The files are read from the running
interpreter's installation and chosen by a seeded shuffle of a sorted file list, so a seed names the same selection
on every machine with the same Python version (the file names and a digest of the bytes are recorded with the
results). Pre-training uses the top-level modules (``stdlib/*.py``); fine-tuning the files inside packages
(``asyncio/``, ``email/``, ...), split by file into a training set and a held-out set that share no file. Package
folders of tests, data tables and generated code are left out (``EXCLUDED_DIRS``).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
                           "__pycache__"})


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path, pattern: str) -> list[Path]:
    return [p for p in sorted(root.glob(pattern)) if p.is_file() and not any(
        part in EXCLUDED_DIRS or part.startswith("config-") for part in p.relative_to(root).parts[:-1])]


def _take(files: list[Path], root: Path, budget: int) -> tuple[list[str], bytes]:
    """Whole files from the front of ``files`` until ``budget`` bytes are reached (the last file is cut)."""
    names, chunks, size = [], [], 0
    for p in files:
        if size >= budget:
            break
        data = p.read_bytes()[: budget - size]
        names.append(str(p.relative_to(root)))
        chunks.append(data + b"\n")
        size += len(data) + 1
    return names, b"".join(chunks)


@dataclass
class Split:
    """One part of the corpus: its bytes as a uint8 tensor and the files they came from."""

    data: torch.Tensor
    files: list[str] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def digest(self) -> str:
        return hashlib.sha256(self.data.numpy().tobytes()).hexdigest()[:16]

    def describe(self) -> dict:
        return {"bytes": self.nbytes, "files": len(self.files), "sha256_16": self.digest(),
                "first_files": self.files[:5]}


@dataclass
class Corpus:
    pretrain: Split
    train: Split
    heldout: Split
    root: str
    seed: int

    def describe(self) -> dict:
        return {"source": "Python standard library source (sysconfig.get_paths()['stdlib'])", "root": self.root,
                "seed": self.seed, "pretrain": self.pretrain.describe(), "train": self.train.describe(),
                "heldout": self.heldout.describe()}


def load_corpus(seed: int = 0, pretrain_bytes: int = 1_000_000, train_bytes: int = 600_000,
                heldout_bytes: int = 100_000, root: str | Path | None = None) -> Corpus:
    """The seeded selection: top-level modules for pre-training; package files, split by file, for
    fine-tuning (train) and the held-out loss. Raises ``RuntimeError`` if the library is not found."""
    root = Path(root) if root is not None else stdlib_root()
    top = _files(root, "*.py")
    packaged = _files(root, "*/**/*.py")
    if not top or not packaged:
        raise RuntimeError(f"no Python standard-library sources found under {str(root)!r}")
    rng = random.Random(seed)
    rng.shuffle(top)
    rng.shuffle(packaged)
    pre_names, pre = _take(top, root, pretrain_bytes)
    held_names, held = _take(packaged, root, heldout_bytes)
    train_names, train = _take(packaged[len(held_names) :], root, train_bytes)

    def split(names: list[str], data: bytes) -> Split:
        return Split(torch.frombuffer(bytearray(data), dtype=torch.uint8).clone(), names)

    return Corpus(split(pre_names, pre), split(train_names, train), split(held_names, held), str(root), seed)


def batch_starts(n_bytes: int, context: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """``[steps, batch]`` random window starts, fixed by the seed (every run sees the same batches)."""
    return torch.randint(0, n_bytes - context - 1, (steps, batch), generator=torch.Generator().manual_seed(seed))


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, ``[len(starts), context]`` int64 each."""
    idx = starts.view(-1, 1) + torch.arange(context + 1).view(1, -1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def eval_starts(n_bytes: int, context: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced window starts covering the split (a fixed held-out set)."""
    return torch.linspace(0, n_bytes - context - 1, count).long()


def epoch_steps(n_bytes: int, context: int, batch: int) -> int:
    """Optimizer steps in one pass over ``n_bytes`` (windows of ``context`` bytes, ``batch`` per step)."""
    return max(1, n_bytes // (context * batch))
