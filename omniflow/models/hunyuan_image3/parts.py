"""HunyuanImage-3's small parts between pixels, latents and the backbone.

- `TimestepEmbedder`: a diffusion time t -> a row (sinusoidal features through an MLP).
- `patch_embed` (UNetDown): latent [C, H, W] + time -> image token rows [h*w, hidden].
- `final_layer` (UNetUp): image tokens' hidden states + time -> velocity [C, H, W].
- the VAE (AutoencoderKLConv3D, vae.py): a condition image's clean latent,
  and the decoder to RGB uint8
- the ViT (SigLIP2, vit.py) and its aligner: a condition image -> rows.

The timestep embedders, patch_embed and final_layer follow the reference's modules and
checkpoint names (timestep-conditioned ResBlocks with adaptive group norm), the VAE, the
ViT and its aligner too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omniflow.models.hunyuan_image3.config import HunyuanImage3Config
from omniflow.models.hunyuan_image3.model import IMAGE_PART_PREFIXES
from omniflow.models.hunyuan_image3.vae import AutoencoderKLConv3D
from omniflow.models.hunyuan_image3.vit import LightProjector, Siglip2Vision
from omniflow.models.loader import iter_checkpoint_tensors


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features [N, dim] of times t [N] (cos first, then sin)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs.to(t.device)[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, frequency_size: int = 256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        weight = next(self.parameters())
        return self.mlp(timestep_embedding(t, self.frequency_size).to(weight.dtype))


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, channels), channels)


class ResBlock(nn.Module):
    """Two 3x3 convs, the second's group norm scaled and shifted by the time embedding;
    optionally halving (down) or doubling (up) the resolution."""

    def __init__(self, channels: int, emb: int, out: int, up: bool = False, down: bool = False):
        super().__init__()
        self.in_layers = nn.Sequential(
            _norm(channels), nn.SiLU(), nn.Conv2d(channels, out, 3, 1, 1)
        )
        self.up, self.down = up, down
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb, 2 * out))
        self.out_layers = nn.Sequential(
            _norm(out), nn.SiLU(), nn.Dropout(0.0), nn.Conv2d(out, out, 3, 1, 1)
        )
        self.skip_connection: nn.Module = (
            nn.Identity() if out == channels else nn.Conv2d(channels, out, 1)
        )

    def _resample(self, x: torch.Tensor) -> torch.Tensor:
        if self.up:
            return F.interpolate(x, scale_factor=2, mode="nearest")
        if self.down:
            return F.avg_pool2d(x, 2)
        return x

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers[:-1](x)
        h = self.in_layers[-1](self._resample(h))
        x = self._resample(x)
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1.0 + scale) + shift
        return self.skip_connection(x) + self.out_layers[1:](h)


class UNetDown(nn.Module):
    """Latent [B, C, H, W] + time embedding -> token rows [B, h*w, hidden] and (h, w)."""

    def __init__(self, patch: int, latent: int, emb: int, hidden_channels: int, out: int):
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(latent, hidden_channels, 3, 1, 1)])
        if patch == 1:
            self.model.append(ResBlock(hidden_channels, emb, out))
        for i in range(patch // 2):
            last = (i + 1) * 2 == patch
            self.model.append(
                ResBlock(hidden_channels, emb, out if last else hidden_channels, down=True)
            )

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        for module in self.model:
            x = module(x, emb) if isinstance(module, ResBlock) else module(x)
        batch, channels, h, w = x.shape
        return x.reshape(batch, channels, h * w).transpose(1, 2), h, w


class UNetUp(nn.Module):
    """Token rows [B, h*w, hidden] + time embedding -> [B, C, H, W]."""

    def __init__(self, patch: int, hidden: int, emb: int, hidden_channels: int, out: int):
        super().__init__()
        self.model = nn.ModuleList()
        if patch == 1:
            self.model.append(ResBlock(hidden, emb, hidden_channels))
        for i in range(patch // 2):
            self.model.append(
                ResBlock(hidden if i == 0 else hidden_channels, emb, hidden_channels, up=True)
            )
        self.model.append(
            nn.Sequential(
                _norm(hidden_channels), nn.SiLU(), nn.Conv2d(hidden_channels, out, 3, 1, 1)
            )
        )

    def forward(self, x: torch.Tensor, emb: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)
        for module in self.model:
            x = module(x, emb) if isinstance(module, ResBlock) else module(x)
        return x


def pixels_in(image: torch.Tensor) -> torch.Tensor:
    """RGB uint8 [H, W, 3] -> [1, 3, H, W] float in [-1, 1]."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
        raise ValueError(f"image: RGB uint8 [H, W, 3], not {image.dtype} {list(image.shape)}")
    return image.permute(2, 0, 1)[None].float() / 127.5 - 1.0


def pixels_out(pixels: torch.Tensor) -> torch.Tensor:
    """[1, 3, H, W] in [-1, 1] -> RGB uint8 [H, W, 3]."""
    scaled = ((pixels[0].float().clamp(-1, 1) + 1.0) * 127.5).round()
    return scaled.to(torch.uint8).permute(1, 2, 0).contiguous()


class HunyuanImage3Parts(nn.Module):
    """Everything of a HunyuanImage-3 checkpoint but the backbone, under its names."""

    def __init__(self, config: HunyuanImage3Config, decoder_only: bool = False):
        super().__init__()
        self.config = config
        if decoder_only:  # the VAE's decoder alone (vae.decoder.*): decode_image only
            self.vae = AutoencoderKLConv3D(config.vae, encoder=False)
            return
        hidden, latent = config.hidden_size, config.latent_channels
        patch, width = config.patch_size, config.patch_embed_hidden_dim
        vae, vit, aligner = config.vae, config.vit, config.vit_aligner
        self.timestep_emb = TimestepEmbedder(hidden)
        self.patch_embed = UNetDown(patch, latent, hidden, width, hidden)
        self.time_embed = TimestepEmbedder(hidden)
        self.final_layer = UNetUp(patch, hidden, hidden, width, latent)
        self.time_embed_2 = TimestepEmbedder(hidden)
        self.vae = AutoencoderKLConv3D(vae)
        self.vision_model = Siglip2Vision(vit, config.vit_processor)
        self.vision_aligner = LightProjector(aligner, hidden)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _times(self, t: float | torch.Tensor, batch: int = 1) -> torch.Tensor:
        device = next(self.parameters()).device
        return torch.as_tensor(t, dtype=torch.float32, device=device).reshape(-1).expand(batch)

    @torch.inference_mode()
    def timestep_row(self, t: float | torch.Tensor) -> torch.Tensor:
        """The `<timestep>` token's row [1, hidden] for time t (0..1000)."""
        return self.timestep_emb(self._times(t))

    @torch.inference_mode()
    def image_rows(self, latent: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """patch_embed: latent [C, H, W] at time t -> rows [h*w, hidden] (row-major grid)."""
        x = latent[None].to(self.dtype)
        rows, _, _ = self.patch_embed(x, self.time_embed(self._times(t)))
        return rows[0]

    @torch.inference_mode()
    def velocity(
        self, hidden: torch.Tensor, t: float | torch.Tensor, grid: tuple[int, int]
    ) -> torch.Tensor:
        """final_layer: image tokens' hidden states [B, h*w, hidden] (or [h*w, hidden]) at
        time t -> predictions [B, C, H, W] (or [C, H, W])."""
        single = hidden.dim() == 2
        x = hidden[None] if single else hidden
        emb = self.time_embed_2(self._times(t, x.shape[0]))
        out = self.final_layer(x.to(self.dtype), emb, *grid).float()
        return out[0] if single else out

    @torch.inference_mode()
    def decode_image(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent [C, h, w] -> RGB uint8 [h*d, w*d, 3]."""
        return pixels_out(self.vae.decode(latent[None].to(self.dtype)))

    @torch.inference_mode()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """RGB uint8 [H, W, 3] (H, W multiples of the downsample) -> clean latent [C, h, w]."""
        d = self.vae.downsample
        if image.dim() == 3 and (image.shape[0] % d or image.shape[1] % d):
            raise ValueError(
                f"image: height and width must be multiples of {d}, not {list(image.shape[:2])}"
            )
        return self.vae.encode(pixels_in(image).to(self.dtype))[0].float()

    @torch.inference_mode()
    def vit_rows(self, image: torch.Tensor) -> torch.Tensor:
        """A condition image RGB uint8 [H, W, 3] -> understanding rows [n, hidden]."""
        rows = self.vision_aligner(self.vision_model(pixels_in(image).to(self.dtype)))
        return rows[0]


def load_image_parts(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    decoder_only: bool = False,
) -> HunyuanImage3Parts:
    """The image parts of a HunyuanImage-3 folder (the tensors the backbone skips); with
    decoder_only, the VAE's decoder alone (only the vae.decoder.* tensors are read)."""
    raw: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    parts = HunyuanImage3Parts(HunyuanImage3Config.from_dict(raw), decoder_only)
    params = parts.state_dict()
    loaded = set()
    prefixes = ("vae.decoder.",) if decoder_only else IMAGE_PART_PREFIXES
    for name, tensor in iter_checkpoint_tensors(path, lambda n: n.startswith(prefixes)):
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the image parts")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, the image parts "
                f"expect {list(params[name].shape)}"
            )
        with torch.no_grad():
            params[name].copy_(tensor)
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint in {path} lacks image-part tensors: {sorted(missing)[:8]}")
    return parts.to(device=device, dtype=dtype).eval()
