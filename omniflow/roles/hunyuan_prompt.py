"""HunyuanImage-3 prompt pieces that carry rows: a condition image (ti2i) as its token
counts and rows, and the embedding spans that place them where a sequence template's
layout puts them, ready for add_request / keep_context."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from omniflow.engine.sequence import EmbeddingSpan
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts
from omniflow.models.hunyuan_image3.template import ConditionImage, Layout, SequenceTemplate
from omniflow.models.hunyuan_image3.tokens import ImageTokens, ratio_of_size


class Condition(NamedTuple):
    """A condition image's token counts (info) and rows: the <timestep> row at time 0 with
    the clean latent's rows, and the aligned ViT rows; key: the image's content hash."""

    info: ConditionImage
    latent: torch.Tensor
    vit: torch.Tensor
    key: str


def encode_condition(
    parts: HunyuanImage3Parts, image: torch.Tensor, base_size: int | None = None
) -> Condition:
    """A condition image RGB uint8 [H, W, 3] (sides multiples of the VAE's downsample x
    patch) -> its Condition."""
    per = parts.config.pixels_per_token
    if image.dim() != 3 or image.shape[0] % per or image.shape[1] % per:
        raise ValueError(
            f"image: height and width must be multiples of {per}, not {list(image.shape[:2])}"
        )
    latent = parts.encode_image(image)
    grid = (image.shape[0] // per, image.shape[1] // per)
    vit = parts.vit_rows(image)
    vit_grid = parts.vision_model.patch_grid(image.shape[0], image.shape[1])
    info = ConditionImage(
        base_size or parts.config.image_base_size,
        ratio_of_size(parts.config, *grid),
        grid,
        vit_grid,
        len(vit),
    )
    rows = torch.cat((parts.timestep_row(0.0), parts.image_rows(latent, 0.0)))
    key = hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()
    return Condition(info, rows, vit, key)


def condition_spans(conditions: list[Condition], layout: Layout) -> list[EmbeddingSpan]:
    """The spans of a layout's condition images (in order): the <timestep> row and the
    latent rows, then the ViT rows, each at its 2D positions and keyed by the image's bytes
    in the prefix cache."""
    positions = layout.positions()
    spans = []
    for condition, at, vit in zip(conditions, layout.cond_timesteps, layout.cond_vit, strict=True):
        end = at + len(condition.latent)
        spans.append(
            EmbeddingSpan(
                at, condition.latent, ("hunyuan-condition-latent", condition.key), positions[at:end]
            )
        )
        end = vit.start + len(condition.vit)
        spans.append(
            EmbeddingSpan(
                vit.start,
                condition.vit,
                ("hunyuan-condition-vit", condition.key),
                positions[vit.start : end],
            )
        )
    return spans


def condition_image_prompt(
    parts: HunyuanImage3Parts,
    tokens: ImageTokens,
    image: torch.Tensor,
    start: int,
    base_size: int | None = None,
) -> tuple[list[int], list[EmbeddingSpan]]:
    """A condition image placed at index ``start`` of a prompt: its ids (the release's
    joint image) and its two spans."""
    condition = encode_condition(parts, image, base_size)
    template = SequenceTemplate(tokens, lambda text: [], "pretrain")
    layout = template.context([], condition.info.base_size, 0, (1, 1), [condition.info])
    ids = layout.ids[1 : layout.joint[0].stop + 1]  # <boi> .. <eoi>
    shift = start - 1  # the layout's image starts after its <bos>
    spans = condition_spans([condition], layout)
    moved = []
    for span in spans:
        assert span.positions is not None
        moved.append(span._replace(start=span.start + shift, positions=span.positions + shift))
    return ids, moved
