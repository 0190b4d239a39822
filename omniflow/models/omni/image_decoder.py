"""Stand-in image decoder: codes → codebook embeddings → transformer → latent → flow refiner.

Our own parts, in the ``{"kind": ...}`` format, until the published ViT decoder and refiner
transformer replace them. The transformer turns the token grid into a coarse latent
(``latent_patch`` latent pixels per token side). A tiny conv velocity model refines it by flow
matching: x_t = (1 - t)·x0 + t·noise, velocity = noise - x0, Euler steps from t = 1 to t = 0,
with classifier-free guidance whose conditional and unconditional branches run as ONE batched
forward. The latent goes to pixels through the published VAE (``next_image.py``), whose
``latent_channels`` and scale (``vae_scale`` pixels per latent pixel) this config must match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from omniflow.models.omni.layers import Transformer, sincos_2d, timestep_embedding
from omniflow.models.omni.rvq import check_ids


@dataclass
class ImageDecoderConfig:
    code_dim: int = 32
    codebook_sizes: list[int] = field(default_factory=lambda: [1024] * 8)
    dim: int = 64
    depth: int = 2
    heads: int = 4
    latent_channels: int = 4
    latent_patch: int = 8
    vae_scale: int = 4
    refiner_width: int = 32

    @property
    def pixels_per_token(self) -> int:
        return self.latent_patch * self.vae_scale


class FlowRefiner(nn.Module):
    """Velocity model v(x_t, cond, t): convs with the timestep applied as a scale and shift."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.conv_in = nn.Conv2d(2 * channels, width, kernel_size=3, padding=1)
        self.time_mlp = nn.Sequential(
            nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 2 * width)
        )
        self.conv_mid = nn.Conv2d(width, width, kernel_size=3, padding=1)
        self.conv_out = nn.Conv2d(width, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.conv_in(torch.cat([x, cond], dim=1)))
        scale, shift = self.time_mlp(timestep_embedding(t, self.width).to(h)).chunk(2, dim=-1)
        h = h * (1.0 + scale[:, :, None, None]) + shift[:, :, None, None]
        h = h + F.silu(self.conv_mid(h))
        return self.conv_out(h)


class ImageDecoder(nn.Module):
    def __init__(self, config: ImageDecoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tables = nn.ModuleList(nn.Embedding(n, c.code_dim) for n in c.codebook_sizes)
        self.in_proj = nn.Linear(c.code_dim, c.dim)
        self.transformer = Transformer(c.dim, c.depth, c.heads)
        self.to_latent = nn.Linear(c.dim, c.latent_channels * c.latent_patch**2)
        self.refiner = FlowRefiner(c.latent_channels, c.refiner_width)

    def image_size(self, grid: tuple[int, int]) -> tuple[int, int]:
        """(height, width) in pixels of a token grid (h, w)."""
        return grid[0] * self.config.pixels_per_token, grid[1] * self.config.pixels_per_token

    @torch.no_grad()
    def coarse_latent(self, codes: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Condition latent [1, C, h*lp, w*lp] of codes [h*w, L]."""
        c = self.config
        height, width = grid
        check_ids(codes, c.codebook_sizes)
        if codes.shape[0] != height * width or height <= 0 or width <= 0:
            raise ValueError(f"{codes.shape[0]} codes do not fill a {height}x{width} grid")
        device = self.in_proj.weight.device
        codes = codes.to(device)
        summed = sum(self.tables[level](codes[:, level]) for level in range(len(self.tables)))
        x = self.in_proj(summed) + sincos_2d(height, width, c.dim).to(device)
        x = self.to_latent(self.transformer(x[None])[0])  # [h*w, C*lp*lp]
        lp, ch = c.latent_patch, c.latent_channels
        x = x.view(height, width, ch, lp, lp).permute(2, 0, 3, 1, 4)
        return x.reshape(1, ch, height * lp, width * lp)

    def guided_velocity(
        self, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor, cfg_scale: float
    ) -> torch.Tensor:
        """CFG velocity: both branches in ONE forward; the unconditional one gets a zero cond."""
        both = self.refiner(
            torch.cat([x, x]), torch.cat([cond, torch.zeros_like(cond)]), torch.cat([t, t])
        )
        conditional, unconditional = both.chunk(2)
        return unconditional + cfg_scale * (conditional - unconditional)

    @torch.no_grad()
    def refine(
        self, cond: torch.Tensor, steps: int, cfg_scale: float, generator: torch.Generator | None
    ) -> torch.Tensor:
        """Euler integration of the guided flow from noise (t = 1) to a latent (t = 0)."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        x = torch.randn(cond.shape, generator=generator, dtype=torch.float32).to(cond)
        times = torch.linspace(1.0, 0.0, steps + 1)
        for i in range(steps):
            t = torch.full((cond.shape[0],), float(times[i]), device=cond.device, dtype=cond.dtype)
            velocity = self.guided_velocity(x, cond, t, cfg_scale)
            x = x + float(times[i + 1] - times[i]) * velocity
        return x

    @torch.no_grad()
    def latent(
        self,
        codes: torch.Tensor,
        grid: tuple[int, int],
        steps: int = 4,
        cfg_scale: float = 2.0,
        seed: int = 0,
    ) -> torch.Tensor:
        """The refined latent [1, C, h*lp, w*lp] of codes [h*w, L] (the VAE's input)."""
        generator = torch.Generator().manual_seed(seed)
        return self.refine(self.coarse_latent(codes, grid), steps, cfg_scale, generator)
