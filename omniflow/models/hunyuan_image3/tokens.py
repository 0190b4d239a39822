"""HunyuanImage-3 token sequences: special tokens, aspect-ratio grids, 2D positions.

An image to generate sits in the sequence as

    <bos> prompt <boi> <img_size_B> <img_ratio_i> <timestep> <img> x (h*w) <eoi>

The context (what the AR role computes, and lends) runs to the ratio token; each denoising
step's block is the `<timestep>` row and the h*w image rows, at the positions below. The
unconditional sequence replaces the prompt's tokens by as many `<cfg>` tokens.

A condition image (ti2i) sits in the prompt as its clean latent (time 0) and its ViT rows:

    <boi> <img_size_B> <img_ratio_i> <timestep> <img> x (h*w) <joint_img_sep> <img> x n <eoi>

its latent tokens at 2D positions like a generated image's, the rest at their indices.

Positions (the reference's build_2d_rope): text token p at (p, p); with L the index of the
first image token, image token (i, j) of an h x w grid at
(L + (w*h - h)/2 + i, L + (w*h - w)/2 + j), rounded down; tokens after it continue at L + h*w.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from omniflow.models.hunyuan_image3.config import HunyuanImage3Config

NUM_RATIOS = 33
BASE_SIZES = (256, 512, 1024)  # <img_size_*> tokens the tokenizer holds
SPECIAL_TOKENS = (
    "<boi>",
    "<eoi>",
    "<img>",
    "<timestep>",
    "<cfg>",
    *(f"<img_ratio_{i}>" for i in range(NUM_RATIOS)),
    *(f"<img_size_{size}>" for size in BASE_SIZES),
    "<joint_img_sep>",
    "<recaption>",
    "</recaption>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
)


@dataclass(frozen=True)
class ImageTokens:
    """The ids of the special tokens, read from a tokenizer."""

    bos: int
    boi: int
    eoi: int
    img: int
    timestep: int
    cfg: int
    ratios: tuple[int, ...]  # <img_ratio_0> .. <img_ratio_32>
    sizes: dict[int, int]  # base size in pixels -> <img_size_*>
    joint_sep: int  # between a condition image's VAE and ViT tokens

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, bos_token: str = "<s>") -> ImageTokens:
        """From a `tokenizers.Tokenizer` or a `TextTokenizer`."""
        inner = getattr(tokenizer, "tokenizer", tokenizer)

        def of(token: str) -> int:
            token_id = inner.token_to_id(token)
            if token_id is None:
                raise ValueError(f"tokenizer lacks the special token {token!r}")
            return int(token_id)

        return cls(
            of(bos_token),
            of("<boi>"),
            of("<eoi>"),
            of("<img>"),
            of("<timestep>"),
            of("<cfg>"),
            tuple(of(f"<img_ratio_{i}>") for i in range(NUM_RATIOS)),
            {size: of(f"<img_size_{size}>") for size in BASE_SIZES},
            of("<joint_img_sep>"),
        )

    def ratio_of(self, token_id: int) -> int | None:
        """The ratio index of an `<img_ratio_*>` id (None for other ids)."""
        return self.ratios.index(token_id) if token_id in self.ratios else None


def ratio_sizes(base: int) -> list[tuple[int, int]]:
    """The 33 (height, width) pixel sizes around base x base, by height/width ratio
    (the reference's ResolutionGroup: steps of base/16 from base/2 to 2 x base)."""
    step = base // 16
    sizes = [(base, base)]
    for sign in (1, -1):
        h = w = base
        while not (sign > 0 and h >= 2 * base and w <= base // 2) and not (
            sign < 0 and h <= base // 2 and w >= 2 * base
        ):
            h = min(h + step, 2 * base) if sign > 0 else max(h - step, base // 2)
            w = max(w - step, base // 2) if sign > 0 else min(w + step, 2 * base)
            sizes.append((h, w))
    return sorted(sizes, key=lambda size: size[0] / size[1])


def ratio_grids(config: HunyuanImage3Config) -> list[tuple[int, int]]:
    """The 33 (h, w) token grids of the ratio tokens at the config's image_base_size."""
    per = config.pixels_per_token
    return [(h // per, w // per) for h, w in ratio_sizes(config.image_base_size)]


def grid_of_ratio(config: HunyuanImage3Config, index: int) -> tuple[int, int]:
    if not 0 <= index < NUM_RATIOS:
        raise ValueError(f"ratio index {index} outside [0, {NUM_RATIOS})")
    return ratio_grids(config)[index]


def ratio_of_size(config: HunyuanImage3Config, height: int, width: int) -> int:
    """The ratio index nearest height/width (pixels or tokens alike)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"size {width}x{height}: both sides must be positive")
    grids = ratio_grids(config)
    return min(range(NUM_RATIOS), key=lambda i: abs(grids[i][0] / grids[i][1] - height / width))


def context_ids(
    tokens: ImageTokens, prompt_ids: list[int], base_size: int, ratio_index: int
) -> list[int]:
    """<bos> prompt <boi> <img_size> <img_ratio>: the prefix block steps attend to.
    prompt_ids: the prompt's text ids without <bos>."""
    if base_size not in tokens.sizes:
        raise ValueError(f"base size {base_size}: the tokenizer has {sorted(tokens.sizes)}")
    ratio = tokens.ratios[ratio_index]
    return [tokens.bos, *prompt_ids, tokens.boi, tokens.sizes[base_size], ratio]


def unconditional_ids(tokens: ImageTokens, prompt_ids: list[int]) -> list[int]:
    """The prompt's ids replaced by as many <cfg> ids."""
    return [tokens.cfg] * len(prompt_ids)


def image_sequence(
    tokens: ImageTokens,
    prompt_ids: list[int],
    base_size: int,
    ratio_index: int,
    grid: tuple[int, int],
) -> list[int]:
    """The whole sequence: context, <timestep>, h*w <img>, <eoi>."""
    h, w = grid
    context = context_ids(tokens, prompt_ids, base_size, ratio_index)
    return [*context, tokens.timestep, *[tokens.img] * (h * w), tokens.eoi]


class ImageBlock(NamedTuple):
    """A denoising step's rows over a context of context_len tokens: the <timestep> row then
    the image rows; positions [1 + h*w, 2] (y, x)."""

    grid: tuple[int, int]
    positions: torch.Tensor

    @property
    def num_rows(self) -> int:
        return 1 + self.grid[0] * self.grid[1]


def image_positions(start: int, grid: tuple[int, int]) -> torch.Tensor:
    """(y, x) [h*w, 2] of an image whose first token is at index start (row-major)."""
    h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w)[None, :].expand(h, w).reshape(-1)
    y = (2 * start + w * h - h + 2 * rows) // 2
    x = (2 * start + w * h - w + 2 * cols) // 2
    return torch.stack((y, x), dim=1)


def image_block(context_len: int, grid: tuple[int, int]) -> ImageBlock:
    """The block after a context of context_len tokens: <timestep> at context_len, the
    image from context_len + 1."""
    h, w = grid
    if h <= 0 or w <= 0:
        raise ValueError(f"image grid {h}x{w}: both sides must be positive")
    timestep = torch.tensor([[context_len, context_len]])
    return ImageBlock(grid, torch.cat((timestep, image_positions(context_len + 1, grid))))


class ConditionLayout(NamedTuple):
    """A condition image's ids, and where its rows sit (offsets from its <boi>)."""

    ids: list[int]
    timestep: int  # the <timestep> row (time 0), followed by the h*w latent rows
    vit: int  # the first of the ViT rows


def condition_image_ids(
    tokens: ImageTokens,
    base_size: int,
    ratio_index: int,
    grid: tuple[int, int],
    vit_rows: int,
) -> ConditionLayout:
    """A condition image's ids: its latent tokens (a grid) and vit_rows ViT tokens."""
    if base_size not in tokens.sizes:
        raise ValueError(f"base size {base_size}: the tokenizer has {sorted(tokens.sizes)}")
    count = grid[0] * grid[1]
    head = [tokens.boi, tokens.sizes[base_size], tokens.ratios[ratio_index], tokens.timestep]
    ids = [*head, *[tokens.img] * count, tokens.joint_sep, *[tokens.img] * vit_rows, tokens.eoi]
    return ConditionLayout(ids, 3, 3 + 1 + count + 1)
