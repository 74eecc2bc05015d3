"""A small GPT-style language model (pre-norm transformer), for the demo, the tests and the benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Args: vocab, context length, layers, width, heads."""

    vocab: int = 96
    context: int = 64
    layers: int = 2
    width: int = 128
    heads: int = 4

    @staticmethod
    def for_params(target: float, vocab: int = 96, context: int = 64) -> GPTConfig:
        """A config of about `target` parameters (12 * layers * width^2 dominates)."""
        layers = 2 if target < 3e6 else 4 if target < 3e7 else 8
        width = max(32, int(math.sqrt(target / (12 * layers)) // 32 * 32))
        return GPTConfig(vocab=vocab, context=context, layers=layers, width=width, heads=max(1, width // 32))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.out = nn.Linear(4 * c.width, c.width)
        self.heads = c.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, `layers` pre-norm blocks, a final norm and an LM head."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when targets are given."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
