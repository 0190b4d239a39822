"""LongCat-Next's LLM-side extras in the published names: the n-gram input embedding
(``model.ngram_embeddings.{embedders,post_projs}.i``) and the depth heads ``visual_head`` /
``audio_head`` (the heads as the checkpoint's ``CasualDepthTransformerHead`` runs them:
autoregressive over the code levels; the n-gram equations as vLLM's ``longcat_next.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from omniflow.models.omni.checkpoint import load_part, read_config
from omniflow.models.omni.ngram import NGRAM_PREFIX, NgramEmbedding

HEAD_DIM = 128  # the depth heads' attention head size (fixed in the published code)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class _HeadAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.heads = max(1, dim // HEAD_DIM)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, depth, dim = x.shape
        q, k, v = (
            p(x).view(b, depth, self.heads, dim // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, depth, dim))


class _HeadLayer(nn.Module):
    def __init__(self, dim: int, scale: int, depth: int) -> None:
        super().__init__()
        self.dim, self.scale, self.depth = dim, scale, depth
        self.self_attention = _HeadAttention(dim)
        self.layernorm1 = _RMSNorm(dim)
        self.layernorm2 = _RMSNorm(dim)
        self.linear1 = nn.Linear(dim, scale * dim)
        self.linear2 = nn.Linear(scale * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attention(self.layernorm1(x))
        inner = self.scale * self.dim // self.depth
        # Depth-wise FFN: position l uses its own slice of linear1/linear2 (biases unused);
        # x may hold the first positions only (causal: the rest do not change them).
        n = x.shape[1]
        w1 = self.linear1.weight.view(inner, self.depth, self.dim)[:, :n]
        w2 = self.linear2.weight.view(self.dim, self.depth, inner)[:, :n]
        f = nn.functional.gelu(torch.einsum("bld,tld->blt", self.layernorm2(h), w1))
        return h + torch.einsum("blt,dlt->bld", f, w2)


class NextDepthHead(nn.Module):
    """``visual_head`` / ``audio_head``: hidden → a small causal depth transformer → per-level
    logits over codebook size + 1."""

    def __init__(self, hidden: int, sizes: list[int], dim: int, layers: int, scale: int) -> None:
        super().__init__()
        self.depth = len(sizes)
        self.hidden_norm = _RMSNorm(hidden)
        self.hidden_proj = nn.Linear(hidden, dim, bias=False)
        self.transformer_layers = nn.ModuleList(
            _HeadLayer(dim, scale, self.depth) for _ in range(layers)
        )
        self.headnorm = _RMSNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, n + 1) for n in sizes)

    def forward(
        self, hidden: torch.Tensor, previous: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Per-level logits [B, size_l + 1] of LLM hidden states [B, hidden], given
        ``previous`` [B, depth - 1, hidden]: at l, the sum of the word-embedding rows of
        levels 0..l of the code (the checkpoint's ``CasualDepthTransformerHead``: position 0
        is the hidden state, position l + 1 that running sum; causal, so level l's logits
        read only the levels before it). None: zeros (only level 0's logits are then the
        model's)."""
        if previous is None:
            previous = hidden.new_zeros(hidden.shape[0], self.depth - 1, hidden.shape[-1])
        x = self._positions(hidden, previous)
        return [head(x[:, level]) for level, head in enumerate(self.heads)]

    def level_logits(
        self, hidden: torch.Tensor, previous: torch.Tensor, level: int
    ) -> torch.Tensor:
        """forward's logits of one level only: positions 0..level run, the rest never read."""
        x = self._positions(hidden, previous[:, :level])
        return self.heads[level](x[:, level])

    def _positions(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden[:, None], previous.to(hidden.dtype)], 1)
        x = self.hidden_proj(self.hidden_norm(x))
        for layer in self.transformer_layers:
            x = layer(x)
        return self.headnorm(x)


def head_for(config: dict[str, Any], which: str) -> NextDepthHead:
    """The ``visual`` or ``audio`` depth head a config describes."""
    sub = config[f"{which}_config"]
    key = "image" if which == "visual" else "audio"
    return NextDepthHead(
        int(config["hidden_size"]),
        [int(n) for n in sub["vq_config"]["codebook_sizes"]],
        int(sub.get(f"{key}_head_transformer_dims", 2048)),
        int(sub.get(f"{key}_head_transformer_layers", 4)),
        int(sub.get(f"{key}_head_transformer_ffn_scale", 16)),
    )


def load_next_heads(
    folder: str | Path, role: str = "llm"
) -> tuple[NgramEmbedding, NextDepthHead, NextDepthHead]:
    """The n-gram embedding and both depth heads of a published-layout folder, strictly."""
    config = read_config(folder, role)
    ngram = NgramEmbedding(config)
    load_part(ngram, folder, NGRAM_PREFIX, role)
    visual, audio = head_for(config, "visual"), head_for(config, "audio")
    load_part(visual, folder, "visual_head.", role)
    load_part(audio, folder, "audio_head.", role)
    return ngram.eval(), visual.eval(), audio.eval()
