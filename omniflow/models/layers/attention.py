"""The reference attention a model runs outside the engine (no KV cache): causal SDPA over one
sequence, as the loaders' checks and the transformers comparisons call it."""

from __future__ import annotations

import torch
from torch import nn


def causal_attention(
    layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Causal attention over one sequence; q [T, H, d], k/v [T, KV, d] (GQA repeats k/v)."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)
