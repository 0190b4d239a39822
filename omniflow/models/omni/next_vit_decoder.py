"""The published image decoder's ViT decoder (``image_decoder.*`` of the image decoder file).

Summed codebook rows [n, codebook_dim] of an ``h × w`` token grid → ``post_quant_conv`` →
``post_quant_norm`` (RMSNorm) → ``patch_unmerger`` (RMSNorm, Linear, GELU, Linear: each
token → its 2 × 2 merge window of patches) → ``norm_in`` → ``encoder.layers.N`` (pre-norm
RMSNorm blocks; attention with 2D RoPE, the first half of each head rotated by the patch's
row, the second by its column, over the raster position of the row in the unmerged grid, as
the published ``_build_2d_positions`` numbers them; SwiGLU ``w1``/``w2``/``w3`` or
``fc1``/``fc2``; optional ``subln`` norms) → ``norm_out`` → ``decoder_head`` → patches →
a CLIP-normalised image [3, 2·14·h, 2·14·w]. Config: ``visual_decoder_config.
image_decoder_config``. Not yet on the image decoder role's path (docs/models.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "image_decoder."


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rope_1d(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Interleaved-pair rotary embedding of x [..., T, d] at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = pos.to(torch.float32)[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2)


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([_rope_1d(x[..., :half], rows), _rope_1d(x[..., half:], cols)], dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        dim = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.k_proj = nn.Linear(dim, dim, bias=c.get("k_bias", True))
        self.v_proj = nn.Linear(dim, dim, bias=c.get("v_bias", True))
        self.q_proj = nn.Linear(dim, dim, bias=c.get("q_bias", True))
        self.inner_attn_ln = RMSNorm(dim, c["layer_norm_eps"]) if c["subln"] else nn.Identity()
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        t, dim = x.shape
        q, k, v = (
            p(x).view(t, self.heads, -1).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rope_2d(q, rows, cols), rope_2d(k, rows, cols)
        out = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(t, dim)
        return self.out_proj(self.inner_attn_ln(out))


class _SwiGLU(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        dim, inner = c["hidden_size"], c["intermediate_size"]
        self.w1 = nn.Linear(dim, inner)
        self.w2 = nn.Linear(dim, inner)
        self.w3 = nn.Linear(inner, dim)
        self.ffn_ln = RMSNorm(inner, c["layer_norm_eps"]) if c["subln"] else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(self.ffn_ln(F.silu(self.w1(x)) * self.w2(x)))


class _MLP(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        dim, inner = c["hidden_size"], c["intermediate_size"]
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim)
        self.ffn_ln = RMSNorm(inner, c["layer_norm_eps"]) if c["subln"] else nn.Identity()
        if c.get("hidden_act", "gelu") not in ("gelu", "quick_gelu"):
            raise ValueError(f"image_decoder_config.hidden_act {c['hidden_act']!r} unsupported")
        self.quick = c.get("hidden_act") == "quick_gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * torch.sigmoid(1.702 * h) if self.quick else F.gelu(h)
        return self.fc2(self.ffn_ln(h))


class _Layer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.layer_norm1 = RMSNorm(c["hidden_size"], c["layer_norm_eps"])
        self.mlp: nn.Module = _SwiGLU(c) if c["swiglu"] else _MLP(c)
        self.layer_norm2 = RMSNorm(c["hidden_size"], c["layer_norm_eps"])

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), rows, cols)
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))


class _Unmerger(nn.Module):
    def __init__(self, dim: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.ln_q = RMSNorm(dim, 1e-6)
        wide = dim * merge * merge
        self.mlp = nn.Sequential(nn.Linear(dim, wide), nn.GELU(), nn.Linear(wide, wide))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x)).reshape(x.shape[0] * self.merge * self.merge, -1)


class VisionTransformerDecoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        c = self.config = config
        dim, eps = c["hidden_size"], c["layer_norm_eps"]
        self.patch, self.merge = c["patch_size"], c["spatial_merge_size"]
        self.temporal = c["temporal_patch_size"]
        self.post_quant_conv = nn.Linear(c["codebook_dim"], dim)
        self.post_quant_norm = RMSNorm(dim, eps)
        self.patch_unmerger = _Unmerger(dim, self.merge)
        self.norm_in = RMSNorm(dim, eps)
        self.encoder = _Encoder(c)
        self.norm_out = RMSNorm(dim, eps)
        out = 3 * self.patch * self.patch * self.temporal
        self.decoder_head = nn.Sequential(
            nn.Linear(dim, c["intermediate_size"]),
            nn.GELU(),
            nn.Linear(c["intermediate_size"], out),
        )

    @torch.no_grad()
    def forward(self, embeddings: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """CLIP-normalised image [3, H, W] of summed code rows [h*w, codebook_dim]."""
        h, w = grid
        m, p = self.merge, self.patch
        x = self.post_quant_norm(self.post_quant_conv(embeddings))
        x = self.norm_in(self.patch_unmerger(x))  # [h*w*m*m, dim]
        raster = torch.arange(x.shape[0], device=x.device)
        rows, cols = raster // (w * m), raster % (w * m)
        for layer in self.encoder.layers:
            x = layer(x, rows, cols)
        patches = self.decoder_head(self.norm_out(x))
        r = patches.reshape(h, w, m, m, 3, self.temporal, p, p)
        return r.permute(5, 4, 0, 2, 6, 1, 3, 7).reshape(self.temporal, 3, h * m * p, w * m * p)[0]
