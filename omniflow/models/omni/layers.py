"""Transformer pieces shared by the omni models: attention block, 2D rotary and sincos positions.

Pure torch; nothing of omniflow's. Attention goes through ``scaled_dot_product_attention`` so
the same module runs on CPU and GPU without a custom kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotary_2d(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """cos/sin tables [N, head_dim] for 2D rotary: half the pairs rotate by row, half by column."""
    if head_dim % 4:
        raise ValueError(f"2D rotary needs head_dim divisible by 4, got {head_dim}")
    quarter = head_dim // 4
    freqs = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    angles = torch.cat([rows.float()[:, None] * freqs, cols.float()[:, None] * freqs], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]: same angle for both halves
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., N, head_dim] with the rotate-half convention."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sinusoidal embedding [N, dim] of integer positions."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def sincos_2d(height: int, width: int, dim: int) -> torch.Tensor:
    """Fixed 2D sinusoidal embedding [height*width, dim], row-major."""
    rows = torch.arange(height).repeat_interleave(width)
    cols = torch.arange(width).repeat(height)
    return torch.cat([sincos_1d(rows, dim // 2), sincos_1d(cols, dim - dim // 2)], dim=-1)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding [B, dim] of continuous timesteps t in [0, 1]."""
    return sincos_1d(t * 1000.0, dim)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rotary=None, causal: bool = False) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, N, head_dim]
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor, rotary=None, causal: bool = False) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary=rotary, causal=causal)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """A stack of ``Block``s with a final norm."""

    def __init__(self, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, rotary=None, causal: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, rotary=rotary, causal=causal)
        return self.norm(x)
