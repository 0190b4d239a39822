"""HunyuanImage-3's VAE: the release's AutoencoderKLConv3D, under its ``vae.*`` names.

Non-causal Conv3d (3x3x3, padding 1) over [B, C, T, H, W]; GroupNorm(32, eps 1e-6) and
SiLU; ResnetBlock (norm1, conv1, norm2, conv2, nin_shortcut when the width changes);
AttnBlock (norm, 1x1x1 q, k, v, proj_out; one head over all positions) in the middle;
down/up-sampling by pixel shuffle (DCAE): ``downsample.conv`` to out / factor channels then
space-to-channels (r1 r2 r3 c order), plus the input space-to-channels averaged over groups;
``upsample.conv`` to out x factor then channels-to-space, plus the input repeated. Level i
resamples spatially while i < log2(ffactor_spatial), temporally too from level
log2(ffactor_spatial / ffactor_temporal) (encoder) / while i < log2(ffactor_temporal)
(decoder). The encoder's conv_out adds its input averaged to 2 x latent channels; the
decoder's conv_in adds the latent repeated. An image is one frame: the encoder repeats it to
ffactor_temporal frames, the decoder's frames are cut to the last.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class Conv3d(nn.Conv3d):
    """nn.Conv3d that runs oneDNN's convolution on the CPU: PyTorch's own choice for narrow
    layers is its slow reference loop (about 8x slower here at 32 channels), same numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and x.dtype == torch.float32
        ):
            return torch.ops.aten.mkldnn_convolution(
                x.contiguous(),
                self.weight,
                self.bias,
                self.padding,
                self.stride,
                self.dilation,
                self.groups,
            )
        return super().forward(x)


def _conv(cin: int, cout: int, kernel: int = 3) -> nn.Conv3d:
    return Conv3d(cin, cout, kernel, padding=kernel // 2)


def space_to_channels(x: torch.Tensor, r1: int) -> torch.Tensor:
    """b c (f r1) (h 2) (w 2) -> b (r1 2 2 c) f h w."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // r1, r1, h // 2, 2, w // 2, 2)
    return x.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(b, r1 * 4 * c, t // r1, h // 2, w // 2)


def channels_to_space(x: torch.Tensor, r1: int) -> torch.Tensor:
    """b (r1 2 2 c) f h w -> b c (f r1) (h 2) (w 2)."""
    b, channels, t, h, w = x.shape
    c = channels // (r1 * 4)
    x = x.reshape(b, r1, 2, 2, c, t, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, c, t * r1, h * 2, w * 2)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), _conv(cin, cout)
        self.norm2, self.conv2 = _norm(cout), _conv(cout, cout)
        self.nin_shortcut = _conv(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v = (
            _conv(channels, channels, 1),
            _conv(channels, channels, 1),
            _conv(channels, channels, 1),
        )
        self.proj_out = _conv(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, t, hh, w = x.shape

        def rows(conv: nn.Conv3d) -> torch.Tensor:
            return conv(h).reshape(b, 1, c, t * hh * w).transpose(2, 3)

        out = F.scaled_dot_product_attention(rows(self.q), rows(self.k), rows(self.v))
        return x + self.proj_out(out.transpose(2, 3).reshape(b, c, t, hh, w))


class DownsampleDCAE(nn.Module):
    def __init__(self, cin: int, cout: int, temporal: bool):
        super().__init__()
        self.r1 = 2 if temporal else 1
        factor = 4 * self.r1
        if cout % factor:
            raise ValueError(f"vae: {cout} channels do not split into {factor} sub-pixels")
        self.conv = _conv(cin, cout // factor)
        self.group = factor * cin // cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = space_to_channels(self.conv(x), self.r1)
        shortcut = space_to_channels(x, self.r1)
        b, _, t, hh, w = shortcut.shape
        return h + shortcut.view(b, h.shape[1], self.group, t, hh, w).mean(dim=2)


class UpsampleDCAE(nn.Module):
    def __init__(self, cin: int, cout: int, temporal: bool):
        super().__init__()
        self.r1 = 2 if temporal else 1
        factor = 4 * self.r1
        self.conv = _conv(cin, cout * factor)
        self.repeats = factor * cout // cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = channels_to_space(self.conv(x), self.r1)
        return h + channels_to_space(x.repeat_interleave(self.repeats, dim=1), self.r1)


class Level(nn.Module):
    """One resolution: its ResnetBlocks, then its ``downsample`` / ``upsample`` if any."""

    block: nn.ModuleList

    def __init__(self, blocks: list[ResnetBlock]):
        super().__init__()
        self.block = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        resample = self._modules.get("downsample") or self._modules.get("upsample")
        return x if resample is None else resample(x)


class Middle(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    def __init__(
        self, cin: int, z: int, widths: list[int], blocks: int, spatial: int, temporal: int
    ):
        super().__init__()
        if widths[-1] % (2 * z):
            raise ValueError(
                f"vae block_out_channels[-1] {widths[-1]} is not a multiple of 2 x {z}"
            )
        self.z = z
        self.conv_in = _conv(cin, widths[0])
        self.down = nn.ModuleList()
        width = widths[0]
        for i, out in enumerate(widths):
            level = Level([ResnetBlock(width if j == 0 else out, out) for j in range(blocks)])
            width = out
            spatial_down = i < math.log2(spatial)
            if spatial_down:
                nxt = widths[i + 1]
                level.downsample = DownsampleDCAE(width, nxt, i >= math.log2(spatial // temporal))
                width = nxt
            self.down.append(level)
        self.mid = Middle(width)
        self.norm_out = _norm(width)
        self.conv_out = _conv(width, 2 * z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        b, c, t, hh, w = h.shape
        shortcut = h.reshape(b, 2 * self.z, c // (2 * self.z), t, hh, w).mean(dim=2)
        return self.conv_out(F.silu(self.norm_out(h))) + shortcut


class Decoder(nn.Module):
    def __init__(
        self, z: int, cout: int, widths: list[int], blocks: int, spatial: int, temporal: int
    ):
        super().__init__()
        if widths[0] % z:
            raise ValueError(f"vae block_out_channels[-1] {widths[0]} is not a multiple of {z}")
        self.repeats = widths[0] // z
        width = widths[0]
        self.conv_in = _conv(z, width)
        self.mid = Middle(width)
        self.up = nn.ModuleList()
        for i, out in enumerate(widths):
            level = Level([ResnetBlock(width if j == 0 else out, out) for j in range(blocks + 1)])
            width = out
            spatial_up, temporal_up = i < math.log2(spatial), i < math.log2(temporal)
            if spatial_up or temporal_up:
                nxt = widths[i + 1]
                level.upsample = UpsampleDCAE(width, nxt, temporal_up)
                width = nxt
            self.up.append(level)
        self.norm_out = _norm(width)
        self.conv_out = _conv(width, cout)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z) + z.repeat_interleave(self.repeats, dim=1))
        for level in self.up:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class AutoencoderKLConv3D(nn.Module):
    """RGB images <-> latents [C, H / ffactor_spatial, W / ffactor_spatial]."""

    def __init__(self, vae: dict[str, Any], encoder: bool = True):
        super().__init__()
        widths = [int(c) for c in vae["block_out_channels"]]
        z, blocks = int(vae["latent_channels"]), int(vae["layers_per_block"])
        spatial, temporal = int(vae["ffactor_spatial"]), int(vae["ffactor_temporal"])
        if len(widths) <= math.log2(spatial):
            raise ValueError(f"vae: {len(widths)} levels cannot downsample {spatial}x")
        if not (
            vae.get("downsample_match_channel", True) and vae.get("upsample_match_channel", True)
        ):
            raise NotImplementedError("vae downsample/upsample_match_channel = false")
        self.downsample, self.temporal = spatial, temporal
        self.scaling = float(vae.get("scaling_factor") or 1.0)
        self.shift = float(vae.get("shift_factor") or 0.0)
        if encoder:  # a decoder-only VAE (the vae_decoder role's) has none
            in_channels = int(vae.get("in_channels", 3))
            self.encoder = Encoder(in_channels, z, widths, blocks, spatial, temporal)
        self.decoder = Decoder(
            z, int(vae.get("out_channels", 3)), widths[::-1], blocks, spatial, temporal
        )

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> the posterior's mean, shifted and scaled [B, C, h, w]."""
        frames = pixels[:, :, None].expand(-1, -1, self.temporal, -1, -1)
        mean, _ = self.encoder(frames).chunk(2, dim=1)
        return (mean[:, :, -1] - self.shift) * self.scaling

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, 3, h * d, w * d] in [-1, 1] (the last decoded frame)."""
        frames = self.decoder((latent / self.scaling + self.shift)[:, :, None])
        return frames[:, :, -1].clamp(-1, 1)
