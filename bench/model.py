"""A small GPT-style byte language model for the end-to-end benchmarks and the notebooks.

Pre-norm transformer blocks (causal self-attention + 4x MLP, GELU), learned position embeddings and an untied
output head: almost every parameter is a ``[out, in]`` matrix (ZenFlow's column split applies to nearly all of the
model). Sizes are named presets (``SIZES``); bytes are the tokens (vocabulary 256): no tokenizer, no vocabulary file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


@dataclass(frozen=True)
class ModelSize:
    """One preset: width, depth, heads, context length, and the batch the benchmark trains with."""

    d_model: int
    n_layer: int
    n_head: int
    context: int
    batch: int

    def as_dict(self) -> dict:
        return asdict(self)


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(d_model=64, n_layer=2, n_head=4, context=64, batch=16),
    "small": ModelSize(d_model=128, n_layer=3, n_head=4, context=96, batch=16),
    "base": ModelSize(d_model=256, n_layer=4, n_head=8, context=96, batch=8),
    # the GPU benchmark's model (bench.gpu_e2e): 152 M parameters
    "gpt152m": ModelSize(d_model=1024, n_layer=12, n_head=16, context=256, batch=16),
}


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        shape = (B, T, self.n_head, D // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """Byte-level GPT: ``forward(idx [B, T] int64) -> logits [B, T, 256]``."""

    def __init__(self, size: ModelSize):
        super().__init__()
        self.size = size
        d = size.d_model
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(size.context, d)
        self.blocks = nn.ModuleList(Block(d, size.n_head) for _ in range(size.n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * size.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats per byte)."""
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def build_model(size: str | ModelSize, seed: int = 0, device: str | torch.device = "cpu") -> CharGPT:
    """A freshly initialised model (deterministic for a seed)."""
    preset = SIZES[size] if isinstance(size, str) else size
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = CharGPT(preset)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(device)


def num_params(model: nn.Module) -> dict:
    """Parameter counts: total, in 2-D matrices (ZenFlow's column split applies) and in vectors."""
    mats = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "matrix": mats, "vector": total - mats}
