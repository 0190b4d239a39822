"""How many KV pages an engine keeps."""

from __future__ import annotations


def pages_for_bytes(kv_cache_bytes: int, bytes_per_page: int, pages_for_all: int) -> int:
    """The pages kv_cache_bytes holds, never more than every sequence at its longest needs
    (pages_for_all), and at least one."""
    return max(1, min(kv_cache_bytes // bytes_per_page, pages_for_all))
