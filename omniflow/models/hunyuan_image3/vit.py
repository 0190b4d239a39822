"""HunyuanImage-3's understanding tower: a SigLIP2 vision transformer and its aligner.

Checkpoint names are the release's: ``vision_model.*`` is transformers'
`Siglip2VisionTransformer` (embeddings.patch_embedding, a Linear over flattened
(row, column, channel) patches; embeddings.position_embedding, a square grid resized
bilinearly with antialiasing to each image's patch grid; encoder.layers.N.{layer_norm1,
self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}; post_layernorm; head.* when
``vision_use_head``, loaded but unused: the release feeds the last hidden state to the
aligner). ``vision_aligner.layers.*`` is its LightProjector ``mlp_gelu``: Linear, GELU,
Linear (depth 2). The config keys are Siglip2VisionConfig's (``vit``) and the projector's
(``vit_aligner``: projector_type, input_dim, n_embed, depth).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise NotImplementedError(f"vit hidden_act {name!r}")


class SiglipAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """keys: [B, 1, 1, T] bool, the rows every row may attend to (None: all)."""
        batch, tokens, width = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(batch, tokens, self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), attn_mask=keys
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, width))


class SiglipMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, eps: float, act: str):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = SiglipAttention(width, heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = SiglipMLP(width, hidden, act)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), keys)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, layers: list[SiglipLayer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class SiglipEmbeddings(nn.Module):
    def __init__(self, channels: int, patch: int, width: int, num_patches: int):
        super().__init__()
        self.patch_embedding = nn.Linear(channels * patch * patch, width)
        self.position_embedding = nn.Embedding(num_patches, width)
        self.grid = math.isqrt(num_patches)
        if self.grid**2 != num_patches:
            raise ValueError(f"vit num_patches {num_patches} is not a square")

    def forward(self, patches: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """patches [B, n, C*p*p] of an h x w patch grid (n >= h*w: padding after the grid,
        which takes the first position's embedding, as the release's) -> [B, n, width]."""
        weight = self.position_embedding.weight
        grid = weight.reshape(self.grid, self.grid, -1).permute(2, 0, 1)[None].float()
        resized = F.interpolate(
            grid, size=shape, mode="bilinear", align_corners=False, antialias=True
        )
        positions = resized[0].reshape(weight.shape[1], -1).T.to(weight.dtype)
        pad = patches.shape[1] - positions.shape[0]
        positions = torch.cat((positions, positions[:1].expand(pad, -1)))
        return self.patch_embedding(patches.to(weight.dtype)) + positions


class PoolingHead(nn.Module):
    """transformers' Siglip2MultiheadAttentionPoolingHead's tensors (loaded, not run)."""

    def __init__(self, width: int, heads: int, hidden: int, eps: float, act: str):
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, width))
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.layernorm = nn.LayerNorm(width, eps=eps)
        self.mlp = SiglipMLP(width, hidden, act)


class Siglip2Vision(nn.Module):
    """An image -> one row per patch, [B, h*w, width] (the last hidden state)."""

    def __init__(self, vit: dict[str, Any], processor: dict[str, Any] | None = None):
        super().__init__()
        width, heads = int(vit["hidden_size"]), int(vit["num_attention_heads"])
        hidden, eps = int(vit["intermediate_size"]), float(vit.get("layer_norm_eps", 1e-6))
        act = str(vit.get("hidden_act", "gelu_pytorch_tanh"))
        self.patch = int(vit["patch_size"])
        self.channels = int(vit.get("num_channels", 3))
        # The processor's (vit_processor) patch budget: each image's rows are padded to it.
        self.max_patches = int((processor or {}).get("max_num_patches", vit["num_patches"]))
        self.embeddings = SiglipEmbeddings(
            self.channels, self.patch, width, int(vit["num_patches"])
        )
        self.encoder = SiglipEncoder(
            [
                SiglipLayer(width, heads, hidden, eps, act)
                for _ in range(int(vit["num_hidden_layers"]))
            ]
        )
        self.post_layernorm = nn.LayerNorm(width, eps=eps)
        if vit.get("vision_use_head", True):
            self.head = PoolingHead(width, heads, hidden, eps, act)

    def patchify(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """[B, C, H, W] (H, W multiples of the patch) -> [B, h*w, p*p*C] in (row, column,
        channel) order, as Siglip2ImageProcessor flattens them, and (h, w)."""
        batch, channels, height, width = pixels.shape
        p = self.patch
        h, w = height // p, width // p
        x = pixels.reshape(batch, channels, h, p, w, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(batch, h * w, p * p * channels), (h, w)

    def forward_patches(
        self, patches: torch.Tensor, shape: tuple[int, int], pad_to: int | None = None
    ) -> torch.Tensor:
        """patches [B, h*w, C*p*p] -> [B, pad_to or h*w, width]: the rows past the grid are
        zero patches that no row attends to (the release's pixel_attention_mask)."""
        keys = None
        count = patches.shape[1]
        if pad_to is not None and pad_to > count:
            patches = F.pad(patches, (0, 0, 0, pad_to - count))
            keys = (torch.arange(pad_to, device=patches.device) < count).view(1, 1, 1, -1)
        x = self.embeddings(patches, shape)
        for layer in self.encoder.layers:
            x = layer(x, keys)
        return self.post_layernorm(x)

    def patch_grid(self, height: int, width: int) -> tuple[int, int]:
        """The (rows, columns) of patches forward makes of a height x width image."""
        h, w = grid_size(height, width, self.patch, self.max_patches)
        return h // self.patch, w // self.patch

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] (SigLIP2's mean = std = 0.5 normalisation), resized to
        the patch grid of at most max_patches keeping the aspect ratio -> [B, max_patches,
        width], the rows past the grid padding (the release puts them all in the sequence)."""
        height, width = grid_size(pixels.shape[2], pixels.shape[3], self.patch, self.max_patches)
        pixels = F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False)
        patches, shape = self.patchify(pixels)
        return self.forward_patches(patches, shape, self.max_patches)


def grid_size(height: int, width: int, patch: int, max_patches: int) -> tuple[int, int]:
    """The largest size (multiples of patch, at least one patch a side) of at most
    max_patches patches at about the image's aspect ratio (Siglip2ImageProcessor's search)."""

    def scaled(scale: float, size: int) -> int:
        return max(patch, math.ceil(size * scale / patch) * patch)

    low, high = 1e-6, 100.0
    while high - low >= 1e-5:
        scale = (low + high) / 2
        if scaled(scale, height) * scaled(scale, width) <= max_patches * patch * patch:
            low = scale
        else:
            high = scale
    return scaled(low, height), scaled(low, width)


class LightProjector(nn.Module):
    """vit_aligner: ``mlp_gelu`` (Linear, then depth - 1 x (GELU, Linear)) or ``linear``."""

    def __init__(self, aligner: dict[str, Any], hidden: int):
        super().__init__()
        kind = aligner.get("projector_type", "mlp_gelu")
        width, out = int(aligner["input_dim"]), int(aligner.get("n_embed", hidden))
        if out != hidden:
            raise ValueError(
                f"vit_aligner n_embed {out} is not the backbone's hidden_size {hidden}"
            )
        self.layers: nn.Module
        if kind == "linear":
            self.layers = nn.Linear(width, out)
        elif kind == "mlp_gelu":
            modules: list[nn.Module] = [nn.Linear(width, out)]
            for _ in range(1, int(aligner.get("depth", 2))):
                modules += [nn.GELU(), nn.Linear(out, out)]
            self.layers = nn.Sequential(*modules)
        else:
            raise NotImplementedError(f"vit_aligner projector_type {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
