"""A text-to-image request's parameters, checked once: seed, steps, cfg_scale, size; and
the PNG an image role answers with.

Torch-free: the ``ar`` role checks them before any compute (a bad request costs nothing),
``diffusion`` again for what reaches it by another way. Each error names the field.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from omniflow.roles.options import TextToImageParams, read_params
from omniflow.runtime.actor import BadRequest

_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX*]\s*(\d{1,6})\s*$")


class ImageParams(NamedTuple):
    seed: int
    steps: int
    cfg_scale: float
    size: tuple[int, int] | None  # (width, height) in pixels; None: "auto" (AR picks a ratio)


def image_params(
    params: Mapping[str, Any],
    *,
    steps: int,
    max_steps: int | None,
    cfg_scale: float,
    pixels_per_token: int,
    max_tokens: int,
) -> ImageParams:
    """The request's values (the role's ``steps`` and ``cfg_scale`` where it gives none):
    types and ranges as ``TextToImageParams`` declares them (``read_params``), then this
    role's own bounds: ``max_steps`` (None: none checked here; the diffusion role has one)
    and the size's ``max_tokens``."""
    given = read_params(TextToImageParams, params)
    steps = given.steps if "steps" in params else steps
    if max_steps is not None and steps > max_steps:
        raise BadRequest("params.steps", f"{steps} is more than max_steps ({max_steps}) here")
    scale = given.cfg_scale if "cfg_scale" in params else cfg_scale
    size = parse_size(given.size, pixels_per_token, max_tokens)
    return ImageParams(given.seed, steps, float(scale), size)


def parse_size(value: Any, pixels_per_token: int, max_tokens: int) -> tuple[int, int] | None:
    """ "auto" (None), "WxH" or [W, H] in pixels: multiples of ``pixels_per_token``, at most
    ``max_tokens`` latent tokens in all."""
    if value is None or value == "auto":
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        width, height = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        width, height = int(match[1]), int(match[2])
    else:
        raise BadRequest("params.size", f'expected "WxH" in pixels or "auto", got {value!r}')
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (width, height)):
        raise BadRequest("params.size", f"expected positive integers, got {value!r}")
    if width % pixels_per_token or height % pixels_per_token:
        raise BadRequest(
            "params.size",
            f"{width}x{height}: width and height must be multiples of {pixels_per_token}",
        )
    tokens = (width // pixels_per_token) * (height // pixels_per_token)
    if tokens > max_tokens:
        largest = int(max_tokens**0.5) * pixels_per_token
        raise BadRequest(
            "params.size",
            f"{width}x{height} is {tokens} image tokens, more than the {max_tokens} allowed "
            f"(about {largest}x{largest} at most)",
        )
    return width, height


def png_bytes(rgb: np.ndarray) -> bytes:
    """uint8 [H, W, 3] pixels as PNG bytes. compress_level 1: a tiny model's image is
    noise-like, and higher levels only cost time."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
