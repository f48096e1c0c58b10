"""The demo's model: a small decoder-only transformer in plain torch.

Deterministic (fixed seed, no dropout) so that a spawned worker process builds the same
architecture with :func:`build_model`, and forward passes can be compared bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SEED = 1234


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes of the demo transformer."""

    vocab: int = 512
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    context: int = 128
    mlp_ratio: int = 4
    tied: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, written out with matmuls."""

    mask: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.d_model % config.heads:
            raise ValueError("d_model must be a multiple of heads")
        self.heads = config.heads
        self.head_dim = config.d_model // config.heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        mask = torch.ones(config.context, config.context, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, time, d_model) -> same shape."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden), nn.GELU(), nn.Linear(hidden, config.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, time, d_model) -> same shape."""
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyTransformer(nn.Module):
    """A decoder-only language model: token and position embeddings, blocks, LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.apply(_init_weights)
        if config.tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: (batch, time) int64 -> logits (batch, time, vocab)."""
        _, t = tokens.shape
        if t > self.config.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context {self.config.context}")
        positions = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style initialisation: small normal weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model() -> nn.Module:
    """The demo transformer (~3.3M parameters), identically initialised at every call.

    Module-level, so spawned worker processes can build it from a pickled reference.
    """
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        return TinyTransformer(ModelConfig())
    finally:
        torch.random.set_rng_state(state)


def copy_task_batch(
    generator: torch.Generator, batch: int, length: int, *, period: int = 16, symbols: int = 64
) -> torch.Tensor:
    """Sequences that repeat a random prefix of ``period`` tokens: learn to copy.

    Returns int64 tokens of shape (batch, length). The first ``period`` tokens of each
    row are drawn from the first ``symbols`` token ids, the rest repeat them: a model
    first learns which ids occur (the loss falls within a few steps), then to copy.
    """
    prefix = torch.randint(0, symbols, (batch, period), generator=generator)
    reps = -(-length // period)
    return prefix.repeat(1, reps)[:, :length].contiguous()
