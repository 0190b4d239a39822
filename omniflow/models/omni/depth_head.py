"""Depth head: predicts the L code ids of one image/audio token from an LLM hidden state.

A small causal transformer runs along the *depth* axis (levels), not along time: position 0 is
the projected hidden state, position l is the embedding of the id chosen at level l-1, and
the output at position l gives level l's logits. Decoding is one level at a time, batched over
tokens. With L = 8 and a tiny transformer a KV cache is not worth its complexity: each step
re-runs the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from omniflow.models.omni.layers import Transformer


@dataclass
class DepthHeadConfig:
    hidden_size: int = 64  # the LLM's hidden size
    dim: int = 64
    depth: int = 2
    heads: int = 4
    codebook_sizes: list[int] = field(default_factory=lambda: [1024] * 8)


class DepthHead(nn.Module):
    def __init__(self, config: DepthHeadConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.levels = len(c.codebook_sizes)
        self.in_proj = nn.Linear(c.hidden_size, c.dim)
        # The last level's id is never fed back, so it needs no input table.
        self.level_embeds = nn.ModuleList(nn.Embedding(n, c.dim) for n in c.codebook_sizes[:-1])
        self.positions = nn.Parameter(torch.randn(self.levels, c.dim) * 0.02)
        self.transformer = Transformer(c.dim, c.depth, c.heads)
        self.heads = nn.ModuleList(nn.Linear(c.dim, n) for n in c.codebook_sizes)

    def _inputs(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Depth sequence [B, 1 + ids.shape[1], dim] of hidden [B, H] and known ids [B, k]."""
        steps = [self.in_proj(hidden)]
        for level in range(ids.shape[1]):
            steps.append(self.level_embeds[level](ids[:, level]))
        x = torch.stack(steps, dim=1)
        return x + self.positions[: x.shape[1]]

    def logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits, one [B, size_l] per level, given all ids [B, L]."""
        out = self.transformer(self._inputs(hidden, ids[:, :-1]), causal=True)
        return [self.heads[level](out[:, level]) for level in range(self.levels)]

    @torch.no_grad()
    def generate(
        self,
        hidden: torch.Tensor,
        temperature: float = 0.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Code ids [B, L] int64 for hidden states [B, hidden_size]; greedy at temperature 0."""
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"expected hidden states [B, {self.config.hidden_size}], got {list(hidden.shape)}"
            )
        hidden = hidden.to(self.in_proj.weight.dtype)
        ids = torch.empty(hidden.shape[0], 0, dtype=torch.int64, device=hidden.device)
        for level in range(self.levels):
            out = self.transformer(self._inputs(hidden, ids), causal=True)
            logits = self.heads[level](out[:, -1]).float()
            chosen = _pick(logits, temperature, top_k, generator)
            ids = torch.cat([ids, chosen[:, None]], dim=1)
        return ids


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator) -> torch.Tensor:
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
