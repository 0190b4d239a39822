"""Per-position random generators: a seeded request's noise for each token (and each code
level of a media token) comes from (seed, position, stream) alone, batch-independent."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_generator(seed: int, position: int, stream: int = 0) -> torch.Generator:
    """The generator for the token at ``position`` (its index in prompt + output) of a
    request seeded ``seed``: a state of that pair alone, mixed so that near seeds and
    positions give unrelated noise. ``stream`` > 0: another draw at that position (a media
    token's code level ``stream - 1``)."""
    state = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    if stream:
        state = _splitmix64(state ^ stream)
    return torch.Generator().manual_seed(state)
