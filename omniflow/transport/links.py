"""What a sender knows of a receiver, and the error for a ref that cannot be honoured.

Torch-free, so that routing and the hot path can name them without importing torch.
"""

from __future__ import annotations

from typing import NamedTuple

FRAME_THRESHOLD = 64 << 10


class Link(NamedTuple):
    """What the sender knows of the receiver, from the registry's records."""

    same_host: bool = False
    gpus: tuple[int, ...] = ()
    pid: int = 0  # the receiver's pid: its refs are reclaimed if it dies (0: anonymous)


class TensorError(ValueError):
    """A tensor ref that cannot be honoured (forged, stale, or inconsistent)."""
