"""HunyuanImage-3 prompt pieces that carry rows: a condition image (ti2i) as ids and
embedding spans, ready for add_request / keep_context."""

from __future__ import annotations

import hashlib

import torch

from omniflow.engine.sequence import EmbeddingSpan
from omniflow.models.hunyuan_image3_parts import HunyuanImage3Parts
from omniflow.models.hunyuan_image3_tokens import (
    ImageTokens,
    condition_image_ids,
    image_positions,
    ratio_of_size,
)


def condition_image_prompt(
    parts: HunyuanImage3Parts,
    tokens: ImageTokens,
    image: torch.Tensor,
    start: int,
    base_size: int | None = None,
) -> tuple[list[int], list[EmbeddingSpan]]:
    """A condition image (RGB uint8 [H, W, 3], sides multiples of the VAE's downsample x
    patch) placed at index ``start`` of a prompt: its ids and two embedding spans, the
    <timestep> row at time 0 with the clean latent's rows (2D positions) and the ViT rows.
    Both spans are keyed by the image's bytes in the prefix cache."""
    per = parts.config.pixels_per_token
    if image.dim() != 3 or image.shape[0] % per or image.shape[1] % per:
        raise ValueError(
            f"image: height and width must be multiples of {per}, not {list(image.shape[:2])}"
        )
    latent = parts.encode_image(image)
    grid = (image.shape[0] // per, image.shape[1] // per)
    vit = parts.vit_rows(image)
    ratio = ratio_of_size(parts.config, *grid)
    layout = condition_image_ids(
        tokens, base_size or parts.config.image_base_size, ratio, grid, len(vit)
    )
    key = hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()
    at = start + layout.timestep
    rows = torch.cat((parts.timestep_row(0.0), parts.image_rows(latent, 0.0)))
    positions = torch.cat((torch.tensor([[at, at]]), image_positions(at + 1, grid)))
    spans = [
        EmbeddingSpan(at, rows, ("hunyuan-condition-latent", key), positions),
        EmbeddingSpan(start + layout.vit, vit, ("hunyuan-condition-vit", key)),
    ]
    return layout.ids, spans
