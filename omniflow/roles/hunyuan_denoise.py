"""HunyuanImage-3's denoising loop (models/hunyuan_image3/denoise.py) run on an engine: each
step a block step over the kept context, on an `LLMEngine` that runs nothing else meanwhile
(`denoise`) or an `AsyncEngine` (`denoise_async`)."""

from __future__ import annotations

import torch

from omniflow.engine import AsyncEngine, LLMEngine
from omniflow.models.flow_matching import DEFAULT_SHIFT
from omniflow.models.hunyuan_image3.denoise import Denoising, Progress, denoise_steps
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts


def _hidden_of(deltas, request_id: str) -> torch.Tensor | None:
    for delta in deltas:
        if delta.request_id == request_id and delta.finish_reason is not None:
            if delta.hidden is None:
                raise RuntimeError(f"request {request_id} ended ({delta.finish_reason}) bare")
            return delta.hidden
    return None


def denoise(
    engine: LLMEngine,
    parts: HunyuanImage3Parts,
    context_id: str,
    context_len: int,
    grid: tuple[int, int],
    steps: int,
    cfg_scale: float,
    seed: int,
    progress: Progress | None = None,
    shift: float = DEFAULT_SHIFT,
) -> torch.Tensor:
    """The denoising loop on a sync engine that runs nothing else meanwhile (other
    requests' deltas would be dropped here): the final latent [C, H, W]."""
    run = Denoising(
        denoise_steps(parts, context_id, context_len, grid, steps, cfg_scale, seed, shift), steps
    )
    while (request := run.request) is not None:
        engine.block_step(*request[:5])
        hidden = None
        while hidden is None:
            hidden = _hidden_of(engine.step(), request.request_id)
        run.feed(hidden, progress)
    assert run.latent is not None
    return run.latent


async def denoise_async(
    engine: AsyncEngine,
    parts: HunyuanImage3Parts,
    context_id: str,
    context_len: int,
    grid: tuple[int, int],
    steps: int,
    cfg_scale: float,
    seed: int,
    progress: Progress | None = None,
    shift: float = DEFAULT_SHIFT,
) -> torch.Tensor:
    """`denoise` on an AsyncEngine (the engine thread runs the steps)."""
    run = Denoising(
        denoise_steps(parts, context_id, context_len, grid, steps, cfg_scale, seed, shift), steps
    )
    while (request := run.request) is not None:
        run.feed((await engine.block_step(*request[:5])).hidden, progress)
    assert run.latent is not None
    return run.latent
