"""The image refiner's base transformer (``image_refiner.base_transformer.*``), as published.

``refiner_modules.py``'s ``Transformer2DModel`` (OmniGen2/Lumina2-style), for one image at a
time: the caption (the summed codebook rows through ``cond_proj``) goes through
``time_caption_embed.caption_embedder`` (RMSNorm, Linear) and the unmodulated
``context_refiner`` blocks; the reference image latent (the ViT decoder's picture, VAE-encoded)
through ``ref_image_patch_embedder`` + ``image_index_embedding[0]`` and ``ref_image_refiner``;
the noisy latent through ``x_embedder`` and ``noise_refiner``; then caption, reference and
noise tokens jointly through ``layers`` and ``norm_out``, and the noise tokens back to a
latent. Every block: RMSNorm-zero modulation by the timestep embedding (scale, tanh gates),
attention with per-head RMSNorm on q and k (``to_q``/``to_k``/``to_v``/``to_out.0``, grouped kv
heads) and 3-axis complex RoPE, a SwiGLU ``feed_forward`` (``linear_1``, ``linear_3`` gate,
``linear_2``), and the ``norm2``/``ffn_norm1``/``ffn_norm2`` sandwich norms. Positions: caption
token i at (i, i, i); the reference at (L, row, col); the noise at
(L + max(ref rows, ref cols), row, col) (published ``RotaryPosEmbed.forward``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "image_refiner.base_transformer."


def timestep_features(t: torch.Tensor, dim: int, scale: float) -> torch.Tensor:
    """diffusers' ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = scale * t.float()[:, None] * freqs.to(t.device)[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rope_freqs(positions: torch.Tensor, axes_dim: list[int]) -> torch.Tensor:
    """Complex rotations [T, sum(axes_dim)/2] of integer positions [T, 3], theta 10000."""
    parts = []
    for axis, d in enumerate(axes_dim):
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions[:, axis].to(torch.float64)[:, None] * inv[None]
        parts.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(parts, dim=-1).to(torch.complex64)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with interleaved pairs turned by freqs [T, D/2]."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * freqs[None, :, None, :]).flatten(3).type_as(x)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, self.head_dim * kv_heads, bias=False)
        self.to_v = nn.Linear(dim, self.head_dim * kv_heads, bias=False)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.norm_q(self.to_q(x).view(b, t, self.heads, self.head_dim))
        k = self.norm_k(self.to_k(x).view(b, t, self.kv_heads, self.head_dim))
        v = self.to_v(x).view(b, t, self.kv_heads, self.head_dim)
        q, k = _rotate(q, freqs), _rotate(k, freqs)
        repeat = self.heads // self.kv_heads
        q, k, v = (
            y.transpose(1, 2).repeat_interleave(r, dim=1)
            for y, r in ((q, 1), (k, repeat), (v, repeat))
        )
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.to_out[0](out)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int, multiplier: float | None) -> None:
        super().__init__()
        inner = 4 * dim if multiplier is None else int(multiplier * 4 * dim)
        inner = multiple_of * ((inner + multiple_of - 1) // multiple_of)
        self.linear_1 = nn.Linear(dim, inner, bias=False)
        self.linear_2 = nn.Linear(inner, dim, bias=False)
        self.linear_3 = nn.Linear(dim, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)) * self.linear_3(x))


class _NormZero(nn.Module):
    """``LuminaRMSNormZero``: the timestep embedding's scales and gates, and the RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(min(dim, 1024), 4 * dim)
        self.norm = nn.RMSNorm(dim, eps=eps)


class RefinerBlock(nn.Module):
    def __init__(self, c: dict[str, Any], modulation: bool) -> None:
        super().__init__()
        dim, eps = c["hidden_size"], c.get("norm_eps", 1e-5)
        self.attn = _Attention(dim, c["num_attention_heads"], c["num_kv_heads"])
        self.feed_forward = _FeedForward(
            dim, c.get("multiple_of", 256), c.get("ffn_dim_multiplier")
        )
        self.norm1: nn.Module = _NormZero(dim, eps) if modulation else nn.RMSNorm(dim, eps=eps)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=eps)
        self.norm2 = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=eps)

    def forward(
        self, x: torch.Tensor, freqs: torch.Tensor, temb: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not isinstance(self.norm1, _NormZero) or temb is None:
            x = x + self.norm2(self.attn(self.norm1(x), freqs))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.norm1.linear(F.silu(temb)).chunk(4, -1)
        h = self.norm1.norm(x) * (1 + scale_msa[:, None])
        x = x + gate_msa[:, None].tanh() * self.norm2(self.attn(h, freqs))
        h = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp[:, None]))
        return x + gate_mlp[:, None].tanh() * self.ffn_norm2(h)


class _TimestepEmbedder(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(256, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(features.to(self.linear_1.weight.dtype))))


class _TimeCaption(nn.Module):
    def __init__(self, dim: int, text_dim: int, eps: float) -> None:
        super().__init__()
        self.timestep_embedder = _TimestepEmbedder(min(dim, 1024))
        self.caption_embedder = nn.Sequential(
            nn.RMSNorm(text_dim, eps=eps), nn.Linear(text_dim, dim)
        )


class _NormOut(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(min(dim, 1024), dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.linear_2 = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear_1(F.silu(temb))
        return self.linear_2(self.norm(x) * (1 + scale)[:, None])


def patchify(latent: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] → [B, (H/p)(W/p), p·p·C] ('c (h p1) (w p2) -> (h w) (p1 p2 c)')."""
    b, c, h, w = latent.shape
    x = latent.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def image_positions(start: int, rows: int, cols: int) -> torch.Tensor:
    r = torch.arange(rows).repeat_interleave(cols)
    return torch.stack([torch.full_like(r, start), r, torch.arange(cols).repeat(rows)], dim=-1)


class RefinerTransformer(nn.Module):
    """``Transformer2DModel`` from ``visual_decoder_config.transformer_config``."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.config = c
        dim, p = c["hidden_size"], c.get("patch_size", 2)
        self.patch = p
        self.in_channels = c.get("in_channels", 16)
        self.out_channels = c.get("out_channels") or self.in_channels
        self.axes_dim = list(c.get("axes_dim_rope", (32, 32, 32)))
        if dim // c["num_attention_heads"] != sum(self.axes_dim):
            raise ValueError(
                "transformer_config: hidden_size / heads must equal sum(axes_dim_rope)"
            )
        self.timestep_scale = float(c.get("timestep_scale", 1.0))
        eps, layers = c.get("norm_eps", 1e-5), c.get("num_refiner_layers", 2)
        self.x_embedder = nn.Linear(p * p * self.in_channels, dim)
        self.ref_image_patch_embedder = nn.Linear(p * p * self.in_channels, dim)
        self.time_caption_embed = _TimeCaption(dim, c.get("text_feat_dim", 1024), eps)
        self.noise_refiner = nn.ModuleList(RefinerBlock(c, True) for _ in range(layers))
        self.ref_image_refiner = nn.ModuleList(RefinerBlock(c, True) for _ in range(layers))
        self.context_refiner = nn.ModuleList(RefinerBlock(c, False) for _ in range(layers))
        self.layers = nn.ModuleList(RefinerBlock(c, True) for _ in range(c.get("num_layers", 26)))
        self.norm_out = _NormOut(dim, p * p * self.out_channels)
        self.image_index_embedding = nn.Parameter(torch.randn(5, dim) * 0.02)

    def _temb(self, t: torch.Tensor) -> torch.Tensor:
        features = timestep_features(t, 256, self.timestep_scale)
        return self.time_caption_embed.timestep_embedder(features)

    def forward(
        self,
        latent: torch.Tensor,
        t: torch.Tensor,
        caption: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> torch.Tensor:
        """Velocity [B, C, H, W] of noisy latents [B, C, H, W] at times t [B], captions
        [B, L, text_feat_dim] and reference latents [B, C, H', W'] (None: no reference)."""
        p, (_, _, h, w) = self.patch, latent.shape
        temb = self._temb(t)
        cap_len = caption.shape[1]
        text = self.time_caption_embed.caption_embedder(caption)
        cap_freqs = rope_freqs(torch.arange(cap_len)[:, None].repeat(1, 3), self.axes_dim)
        for block in self.context_refiner:
            text = block(text, cap_freqs.to(text.device))
        noise_start, parts, freqs = cap_len, [text], [cap_freqs]
        if ref is not None:
            rh, rw = ref.shape[2] // p, ref.shape[3] // p
            ref_freqs = rope_freqs(image_positions(cap_len, rh, rw), self.axes_dim)
            r = self.ref_image_patch_embedder(patchify(ref, p)) + self.image_index_embedding[0]
            for block in self.ref_image_refiner:
                r = block(r, ref_freqs.to(r.device), temb)
            noise_start += max(rh, rw)
            parts.append(r)
            freqs.append(ref_freqs)
        noise_freqs = rope_freqs(image_positions(noise_start, h // p, w // p), self.axes_dim)
        x = self.x_embedder(patchify(latent, p))
        for block in self.noise_refiner:
            x = block(x, noise_freqs.to(x.device), temb)
        joint, joint_freqs = torch.cat(parts + [x], 1), torch.cat(freqs + [noise_freqs])
        for block in self.layers:
            joint = block(joint, joint_freqs.to(joint.device), temb)
        out = self.norm_out(joint, temb)[:, -x.shape[1] :]
        out = out.reshape(-1, h // p, w // p, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(-1, self.out_channels, h, w)


def schedule(steps: int, num_tokens: int, dynamic_shift: bool) -> torch.Tensor:
    """The published ``FlowMatchEulerDiscreteScheduler`` times: steps + 1 float32 values from
    0 (noise) to 1 (image); with ``dynamic_time_shift``, t / (m - m·t + t), m = sqrt(latent
    pixels) / 40."""
    times = np.linspace(0, 1, steps + 1, dtype=np.float32)[:-1]
    if dynamic_shift:
        m = np.sqrt(num_tokens) / 40
        times = times / (m - m * times + times)
    return torch.cat([torch.from_numpy(np.asarray(times)).float(), torch.ones(1)])
