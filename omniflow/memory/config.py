"""The ``[cache]`` table of a deployment config, and byte sizes written as ``"4GiB"``.

``omniflow/runtime/config.py`` embeds ``CacheConfig``; decoding goes through msgspec, so a bad
value surfaces as a ``msgspec.ValidationError`` whose message names the field.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MAX_PAGES = 1 << 24  # lease ids keep the slot in 24 bits (see pagetable.py)


def parse_size(value: str | int, field: str = "size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"4GiB"``, ``"64KiB"``, ``"1.5G"``.

    Binary units: K/KiB, M/MiB, G/GiB, T/TiB; decimal: KB, MB, GB, TB.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a size like '4GiB' or an int, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected a size like '4GiB' or an int, got {value!r}")
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{field}: cannot parse size {value!r}; write a number and a unit, e.g. "
            "'4GiB', '512MiB', '64KiB' (binary) or '4GB' (decimal)"
        )
    number = float(m.group(1)) * _UNITS[unit]
    if number != int(number):
        raise ValueError(f"{field}: size {value!r} is not a whole number of bytes")
    return int(number)


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


class CacheConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """``[cache]``: the host page pool, the SSD tier below it, and when tensors ride as frames."""

    host_pool: Annotated[
        str | int, Meta(description="page data in the shared host pool (a page_size multiple)")
    ] = "1GiB"
    page_size: Annotated[str | int, Meta(description="a power of two, 4KiB..1GiB")] = "64KiB"
    ssd_dir: Annotated[str, Meta(description="folder of the SSD tier (empty: none)")] = ""
    ssd_capacity: Annotated[
        str | int, Meta(description="bytes of the SSD tier (a page_size multiple)")
    ] = 0
    high_watermark: Annotated[
        float, Meta(description="demote LRU pages to SSD above this share of the pool...")
    ] = 0.90
    low_watermark: Annotated[
        float, Meta(description="...until usage is back under this one (0 < low < high <= 1)")
    ] = 0.75
    frame_threshold: Annotated[
        str | int, Meta(description="smaller tensors travel as frames even on one host")
    ] = "64KiB"
    populate: Annotated[
        bool, Meta(description="fault the whole pool in at start, not on the first message")
    ] = True
    pin_memory: Annotated[
        bool, Meta(description="register the pool with CUDA in the processes that use a GPU")
    ] = True
    device_pool: Annotated[
        str | int,
        Meta(description="per GPU process: device memory for CUDA IPC hand-offs (2MiB multiple)"),
    ] = "256MiB"

    def __post_init__(self) -> None:
        pool = parse_size(self.host_pool, "cache.host_pool")
        page = parse_size(self.page_size, "cache.page_size")
        ssd = parse_size(self.ssd_capacity, "cache.ssd_capacity")
        parse_size(self.frame_threshold, "cache.frame_threshold")
        if parse_size(self.device_pool, "cache.device_pool") % (2 << 20):
            raise ValueError(
                f"cache.device_pool: must be a multiple of 2MiB (0: no CUDA IPC), "
                f"got {self.device_pool!r}"
            )
        if page < 4096 or page > (1 << 30) or page & (page - 1):
            raise ValueError(
                f"cache.page_size: must be a power of two between 4KiB and 1GiB, "
                f"got {format_size(page)}"
            )
        if pool < page or pool % page:
            raise ValueError(
                f"cache.host_pool: must be a positive multiple of page_size "
                f"({format_size(page)}), got {format_size(pool)}"
            )
        if pool // page > MAX_PAGES:
            raise ValueError(
                f"cache.host_pool: {pool // page} pages of {format_size(page)} exceed the "
                f"{MAX_PAGES} a pool can index; raise cache.page_size"
            )
        if self.ssd_dir and (ssd < page or ssd % page):
            raise ValueError(
                f"cache.ssd_capacity: with ssd_dir set it must be a positive multiple of "
                f"page_size ({format_size(page)}), got {format_size(ssd)}"
            )
        if ssd and not self.ssd_dir:
            raise ValueError("cache.ssd_dir: ssd_capacity is set but ssd_dir is empty")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ValueError(
                f"cache.low_watermark/high_watermark: need 0 < low < high <= 1, got "
                f"low={self.low_watermark} high={self.high_watermark}"
            )

    @property
    def host_pool_bytes(self) -> int:
        return parse_size(self.host_pool)

    @property
    def device_pool_bytes(self) -> int:
        return parse_size(self.device_pool)

    @property
    def page_size_bytes(self) -> int:
        return parse_size(self.page_size)

    @property
    def ssd_capacity_bytes(self) -> int:
        return parse_size(self.ssd_capacity)

    @property
    def frame_threshold_bytes(self) -> int:
        return parse_size(self.frame_threshold)
