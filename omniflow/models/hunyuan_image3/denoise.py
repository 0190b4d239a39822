"""The HunyuanImage-3 denoising loop, engine-free: `denoise_steps` is a generator that yields
each step's `BlockRequest` (the <timestep> row and the noisy latent's image rows, at their 2D
positions) and takes back that step's hidden states; it returns the final latent.
`Denoising` drives it (the next request, the hidden states fed back, the latent); an engine
runs each request as a block step over a kept context (roles/hunyuan_denoise.py on an
LLMEngine or AsyncEngine; the diffusion role with its own loop).

The context (kept with `keep_context`, computed or lent) ends at the <img_ratio> token.
With CFG it is kept with Guidance(unconditional ids, scale, combine=False): each step then
runs both halves in one forward and returns both halves' hidden states, and the
velocities are combined after final_layer, as the reference does. Same seed, same steps,
same context: the same latent, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import NamedTuple

import torch

from omniflow.models.flow_matching import (
    DEFAULT_SHIFT,
    cfg_combine,
    euler_step,
    initial_noise,
    model_time,
    shifted_sigmas,
)
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts
from omniflow.models.hunyuan_image3.tokens import image_block

Progress = Callable[[int, int], None]  # (steps done, steps in all)


class BlockRequest(NamedTuple):
    """One denoising step's block step: engine.block_step(*request[:5])."""

    request_id: str
    context_id: str
    rows: torch.Tensor  # [1 + h*w, hidden]: <timestep>, then the image tokens
    positions: torch.Tensor  # [1 + h*w, 2] (y, x)
    # The <timestep> row attends causally (the reference's full attention spans the image
    # tokens alone); the image rows see it and each other.
    causal_rows: int
    step: int


def latent_shape(parts: HunyuanImage3Parts, grid: tuple[int, int]) -> tuple[int, int, int]:
    """The latent [C, H, W] of an h x w token grid."""
    patch = parts.config.patch_size
    return parts.config.latent_channels, grid[0] * patch, grid[1] * patch


def denoise_steps(
    parts: HunyuanImage3Parts,
    context_id: str,
    context_len: int,
    grid: tuple[int, int],
    steps: int,
    cfg_scale: float,
    seed: int,
    shift: float = DEFAULT_SHIFT,
    noise: torch.Tensor | None = None,
) -> Generator[BlockRequest, torch.Tensor, torch.Tensor]:
    """Yields each step's BlockRequest, takes its hidden states: [1 + h*w, hidden] (one
    sequence, or halves already combined), or [2 (1 + h*w), hidden] ([cond; uncond], whose
    velocities combine with cfg_scale). Returns the final latent [C, H, W] float32.
    noise: the starting latent (default: Gaussian noise from seed)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale must not be negative, not {cfg_scale}")
    block = image_block(context_len, grid)
    shape = latent_shape(parts, grid)
    latent = initial_noise(shape, seed) if noise is None else noise.float().clone()
    if tuple(latent.shape) != shape:
        raise ValueError(f"noise: shape {list(latent.shape)}, expected {list(shape)}")
    sigmas = shifted_sigmas(steps, shift)
    rows_per_half = block.num_rows
    for index in range(steps):
        t = model_time(sigmas[index])
        rows = torch.cat((parts.timestep_row(t), parts.image_rows(latent, t)))
        request_id = f"{context_id}/step{index}"
        hidden = yield BlockRequest(request_id, context_id, rows, block.positions, 1, index)
        if hidden.shape[0] not in (rows_per_half, 2 * rows_per_half):
            raise ValueError(
                f"request {request_id}: hidden states of {hidden.shape[0]} rows, expected "
                f"{rows_per_half} or {2 * rows_per_half}"
            )
        halves = hidden.view(-1, rows_per_half, hidden.shape[-1])[:, 1:]  # image rows
        velocity = parts.velocity(halves, t, grid)
        if len(velocity) == 2:
            combined = cfg_combine(velocity[0], velocity[1], cfg_scale)
        else:
            combined = velocity[0]
        latent = euler_step(latent, combined, float(sigmas[index]), float(sigmas[index + 1]))
    return latent


class Denoising:
    """One driver of the `denoise_steps` loop, for every engine: ``request`` is the next
    block step to run (None once done), ``feed`` takes its hidden states back, ``latent`` is
    the result. `denoise`, `denoise_async` and the diffusion role differ only in how they
    run a block step."""

    def __init__(
        self, loop: Generator[BlockRequest, torch.Tensor, torch.Tensor], steps: int
    ) -> None:
        self._loop, self.steps = loop, steps
        self.latent: torch.Tensor | None = None
        self.request: BlockRequest | None = next(loop)

    def feed(self, hidden: torch.Tensor | None, progress: Progress | None = None) -> None:
        request = self.request
        assert request is not None, "the loop is done"
        if hidden is None:
            raise RuntimeError(f"request {request.request_id}: the block step ended bare")
        if progress is not None:
            progress(request.step + 1, self.steps)
        try:
            self.request = self._loop.send(hidden)
        except StopIteration as done:
            self.request, self.latent = None, done.value
