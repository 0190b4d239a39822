"""Vision tokenizer: native-resolution ViT → 2×2 patch merge → residual VQ codes → embeddings.

An image of any size H×W (both multiples of ``patch_size * merge``) becomes
``(H / (patch*merge)) × (W / (patch*merge))`` tokens, row-major; each token has L code ids.
Positions are 2D rotary (row, column) inside attention, so no resolution is baked in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from omniflow.models.omni.embedder import CodeEmbedder
from omniflow.models.omni.layers import Transformer, rotary_2d
from omniflow.models.omni.rvq import ResidualVQ

# CLIP's normalization; an image enters as uint8 and is scaled here, not by the caller.
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VisionConfig:
    patch_size: int = 16
    merge: int = 2
    dim: int = 64
    depth: int = 2
    heads: int = 4
    code_dim: int = 32
    codebook_sizes: list[int] = field(default_factory=lambda: [1024] * 8)
    hidden_size: int = 64  # the LLM's hidden size: what the embedder produces

    @property
    def pixels_per_token(self) -> int:
        return self.patch_size * self.merge


class VisionCodes(NamedTuple):
    codes: torch.Tensor  # int64 [h*w, L], row-major over the token grid
    grid: tuple[int, int]  # (h, w) in tokens


class VisionTokenizer(nn.Module):
    mean: torch.Tensor  # registered buffer
    std: torch.Tensor  # registered buffer

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Linear(3 * c.patch_size * c.patch_size, c.dim)
        self.encoder = Transformer(c.dim, c.depth, c.heads)
        self.merger = nn.Sequential(
            nn.LayerNorm(c.merge * c.merge * c.dim),
            nn.Linear(c.merge * c.merge * c.dim, c.dim),
            nn.GELU(),
            nn.Linear(c.dim, c.code_dim),
        )
        self.quantizer = ResidualVQ(c.code_dim, c.codebook_sizes)
        self.embedder = CodeEmbedder(c.codebook_sizes, c.code_dim, c.hidden_size)
        self.register_buffer("mean", torch.tensor(_MEAN).view(3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(_STD).view(3, 1, 1), persistent=False)

    def _patches(self, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Patch vectors [gh*gw, 3*p*p] ordered so each merge window is contiguous."""
        c = self.config
        if image.dim() != 3 or image.shape[2] != 3 or image.dtype != torch.uint8:
            raise ValueError(
                f"expected a uint8 image [H, W, 3], got {image.dtype} {list(image.shape)}"
            )
        height, width = image.shape[0], image.shape[1]
        step = c.pixels_per_token
        if height % step or width % step or height == 0 or width == 0:
            raise ValueError(f"image {height}x{width} is not a positive multiple of {step}")
        x = image.permute(2, 0, 1).float().div(255.0).to(self.mean.device)
        x = (x - self.mean) / self.std
        gh, gw = height // c.patch_size, width // c.patch_size
        m, p = c.merge, c.patch_size
        # [3, gh/m, m, p, gw/m, m, p] → [gh/m, gw/m, m, m, 3, p, p]
        x = x.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        return x.reshape(gh * gw, 3 * p * p), gh, gw

    def _positions(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Patch (row, col) in the same merge-window order as ``_patches``."""
        m = self.config.merge
        rows = torch.arange(gh).view(gh // m, m, 1, 1).expand(gh // m, m, gw // m, m)
        cols = torch.arange(gw).view(1, 1, gw // m, m).expand(gh // m, m, gw // m, m)
        rows = rows.permute(0, 2, 1, 3).reshape(-1)
        cols = cols.permute(0, 2, 1, 3).reshape(-1)
        return rows, cols

    @torch.no_grad()
    def features(self, image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Merged, pre-quantization features [h*w, code_dim] of a uint8 image [H, W, 3]."""
        c = self.config
        patches, gh, gw = self._patches(image)
        rows, cols = self._positions(gh, gw)
        cos, sin = rotary_2d(rows, cols, c.dim // c.heads)
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))[None]
        x = self.encoder(x, rotary=(cos.to(x.device), sin.to(x.device)))[0]
        x = x.view(gh * gw // (c.merge * c.merge), c.merge * c.merge * c.dim)
        return self.merger(x), (gh // c.merge, gw // c.merge)

    @torch.no_grad()
    def encode(self, image: torch.Tensor) -> VisionCodes:
        """Code ids of a uint8 image [H, W, 3]."""
        features, grid = self.features(image)
        return VisionCodes(self.quantizer.encode(features), grid)

    @torch.no_grad()
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """LLM input vectors [N, hidden_size] of code ids [N, L]."""
        return self.embedder(codes.to(self.embedder.table(0).weight.device))
