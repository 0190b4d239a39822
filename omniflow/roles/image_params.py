"""A text-to-image request's parameters, checked once: seed, steps, cfg_scale, size; and
the PNG an image role answers with.

Torch-free: the ``ar`` role checks them before any compute (a bad request costs nothing),
``diffusion`` again for what reaches it by another way. Each error names the field.
"""

from __future__ import annotations

import io
import re
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from omniflow.runtime.actor import BadRequest

_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX*]\s*(\d{1,6})\s*$")
MAX_SEED = (1 << 63) - 1


class ImageParams(NamedTuple):
    seed: int
    steps: int
    cfg_scale: float
    size: tuple[int, int] | None  # (width, height) in pixels; None: "auto" (AR picks a ratio)


def _integer(params: dict[str, Any], field: str, default: int, low: int, high: int | None) -> int:
    value = params.get(field, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    top = high if high is not None else value
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= top:
        wanted = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(field, f"expected an integer {wanted}, got {value!r}")
    return value


def image_params(
    params: dict[str, Any],
    *,
    steps: int,
    max_steps: int | None,
    cfg_scale: float,
    pixels_per_token: int,
    max_tokens: int,
) -> ImageParams:
    """The request's values (or the defaults given), each checked against its range
    (``max_steps`` None: no upper bound checked here; the diffusion role has one)."""
    seed = _integer(params, "seed", 0, 0, MAX_SEED)
    steps = _integer(params, "steps", steps, 1, max_steps)
    scale = params.get("cfg_scale", cfg_scale)
    if isinstance(scale, str):
        try:
            scale = float(scale)
        except ValueError:
            pass
    if (
        not isinstance(scale, (int, float))
        or isinstance(scale, bool)
        or not 0.0 <= float(scale) <= 30.0
    ):
        raise BadRequest("cfg_scale", f"expected a number in [0, 30], got {scale!r}")
    size = parse_size(params.get("size", "auto"), pixels_per_token, max_tokens)
    return ImageParams(seed, steps, float(scale), size)


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
        raise BadRequest("size", f'expected "WxH" in pixels or "auto", got {value!r}')
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (width, height)):
        raise BadRequest("size", f"expected positive integers, got {value!r}")
    if width % pixels_per_token or height % pixels_per_token:
        raise BadRequest(
            "size", f"{width}x{height}: width and height must be multiples of {pixels_per_token}"
        )
    tokens = (width // pixels_per_token) * (height // pixels_per_token)
    if tokens > max_tokens:
        largest = int(max_tokens**0.5) * pixels_per_token
        raise BadRequest(
            "size",
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
