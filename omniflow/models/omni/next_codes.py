"""The pieces of LongCat-Next's vision tokenizer that the LLM needs too: the code rows
(the vision codes' rows of ``model.embed_tokens.weight``, level by level) and the
embedding layer that maps their sum into the LLM's hidden space.

Apart from next_vision.py so that the LLM role, which embeds vision codes but never
runs the vision transformer, does not import transformers' Qwen2.5-VL at every start.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omniflow.models.omni.checkpoint import CheckpointError, read_index

EMBED = "model.embed_tokens.weight"
VISION_PREFIX = "model.visual_tokenizer."


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _PreBuffer(nn.Module):
    def __init__(self, hidden: int, inter: int, eps: float) -> None:
        super().__init__()
        self.pre_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = _MLP(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.pre_layernorm(x))


class EmbeddingLayer(nn.Module):
    def __init__(self, hidden: int, inter: int, eps: float) -> None:
        super().__init__()
        self.pre_buffer = _PreBuffer(hidden, inter, eps)


def code_offsets(offset: int, sizes: list[int]) -> torch.Tensor:
    """Level l's first row in the word embedding: offset + sizes[0] + ... + sizes[l-1]."""
    return torch.tensor([offset] + sizes[:-1], dtype=torch.int64).cumsum(0)


def load_code_rows(table: nn.Embedding, folder: str | Path, first_row: int, role: str) -> None:
    """Fill ``table`` with rows [first_row, first_row + n) of ``model.embed_tokens.weight``."""
    weight_map = read_index(folder, role)
    if EMBED not in weight_map:
        raise CheckpointError(f"role {role}: tensor {EMBED} missing from {folder}")
    n, hidden = table.weight.shape
    with safe_open(str(Path(folder) / weight_map[EMBED]), framework="pt") as f:
        part = f.get_slice(EMBED)
        rows, cols = part.get_shape()
        if cols != hidden or rows < first_row + n:
            raise CheckpointError(
                f"role {role}: tensor {EMBED} in {folder} has shape {[rows, cols]}, "
                f"expected at least [{first_row + n}, {hidden}] for the code rows"
            )
        with torch.no_grad():
            table.weight.copy_(part[first_row : first_row + n])


AUDIO_PREFIX = "model.audio_tokenizer."


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoid table [length, channels]: sin half then cos half."""
    increment = torch.log(torch.tensor(max_timescale)) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)
