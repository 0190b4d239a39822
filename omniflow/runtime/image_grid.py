"""An image size ("WIDTHxHEIGHT") as LongCat-Next's token grid, for the clients that take a
size and a deployment whose roles read ``image_grid``: the gateway and ``omniflow send``
map it the same way and refuse the same sides.

A side of n tokens is max(16, ceil(28 n / 16) * 16) pixels (the ViT decoder's 28 px a
token, rounded up to the refiner's 16), n = 1..32.
"""

from __future__ import annotations

import re

LONGCAT_SIDES = {max(16, -(-28 * n // 16) * 16): n for n in range(1, 33)}
DEFAULT_GRID = (4, 4)  # 112x112 px: what an image request without a size gets

_SIZE = re.compile(r"(\d+)x(\d+)")


class SizeError(ValueError):
    """A size that is not ``WIDTHxHEIGHT`` of two LongCat sides; the message says why."""


def longcat_grid(size: str) -> list[int]:
    """``[rows, columns]`` in tokens for ``size``; a side that is no LongCat side is a
    ``SizeError`` naming it and the two nearest valid sides."""
    match = _SIZE.fullmatch(size)
    if not match:
        raise SizeError(f"expected WIDTHxHEIGHT, got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if side not in LONGCAT_SIDES:
            near = sorted(LONGCAT_SIDES, key=lambda s: abs(s - side))[:2]
            raise SizeError(
                f"{side} px is not a longcat image side (a side of n tokens is "
                f"max(16, ceil(28n/16)*16) px, n = 1..32; nearest: {sorted(near)})"
            )
    return [LONGCAT_SIDES[height], LONGCAT_SIDES[width]]
