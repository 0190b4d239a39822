"""Flow matching as HunyuanImage-3 samples it: shifted sigmas, Euler steps, CFG.

x_sigma = (1 - sigma) x_0 + sigma noise; the model predicts the velocity noise - x_0 at
time 1000 sigma; an Euler step moves x by (sigma_next - sigma) velocity, from sigma 1
(noise) to 0 (the image latent).
"""

from __future__ import annotations

import torch

DEFAULT_SHIFT = 3.0
TRAIN_TIMESTEPS = 1000


def shifted_sigmas(steps: int, shift: float = DEFAULT_SHIFT) -> torch.Tensor:
    """[steps + 1] float32 sigmas from 1 to 0: shift t / (1 + (shift - 1) t) over evenly
    spaced t."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1.0 + (shift - 1.0) * t)).float()


def model_time(sigma: float | torch.Tensor) -> float:
    """The time the model's embedders take for a sigma."""
    return float(sigma) * TRAIN_TIMESTEPS


def euler_step(
    latent: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float
) -> torch.Tensor:
    return latent + (float(sigma_next) - float(sigma)) * velocity.to(latent.dtype)


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale (cond - uncond)."""
    return uncond + scale * (cond - uncond)


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian noise [shape] float32 from a CPU generator: the same bytes for a seed on any
    device."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randn(shape, generator=generator, dtype=torch.float32)
