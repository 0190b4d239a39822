"""``[cache]`` parsing: sizes, validation errors that name the field, building from config."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omniflow.memory import CacheConfig, PagePool, TieredCache, format_size, parse_size


@pytest.mark.parametrize(
    "text, expect",
    [
        ("4GiB", 4 << 30),
        ("64KiB", 64 << 10),
        ("1.5G", 3 << 29),
        ("512 MiB", 512 << 20),
        ("4GB", 4 * 10**9),
        ("100", 100),
        (4096, 4096),
        ("2t", 2 << 40),
    ],
)
def test_parse_size(text, expect) -> None:
    assert parse_size(text) == expect


@pytest.mark.parametrize("bad", ["4 gigs", "GiB", "-1", "1.3B", True, 2.5, -5])
def test_parse_size_rejects_with_the_field_name(bad) -> None:
    with pytest.raises(ValueError, match="cache.host_pool"):
        parse_size(bad, "cache.host_pool")


def test_format_size_round_trips() -> None:
    for n in (4 << 30, 64 << 10, 4097):
        assert parse_size(format_size(n)) == n


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"host_pool": "lots"}, "cache.host_pool: cannot parse"),
        ({"page_size": "3KiB"}, "cache.page_size: must be a power of two"),
        ({"page_size": "2GiB"}, "cache.page_size"),
        ({"host_pool": "100KiB"}, "cache.host_pool: must be a positive multiple"),
        ({"host_pool": "2TiB", "page_size": "4KiB"}, "raise cache.page_size"),
        ({"ssd_capacity": "1GiB"}, "cache.ssd_dir: ssd_capacity is set"),
        ({"ssd_dir": "/tmp"}, "cache.ssd_capacity: with ssd_dir set"),
        ({"low_watermark": 0.95}, "cache.low_watermark/high_watermark"),
        ({"high_watermark": 1.5}, "cache.low_watermark/high_watermark"),
        ({"frame_threshold": "x"}, "cache.frame_threshold"),
        ({"hostpool": "1GiB"}, "unknown field `hostpool`"),
    ],
)
def test_bad_config_names_the_field(fields, message) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(fields, CacheConfig)


def test_toml_table_and_derived_sizes() -> None:
    class Top(msgspec.Struct):
        cache: CacheConfig = CacheConfig()

    top = msgspec.toml.decode(
        b'[cache]\nhost_pool = "2GiB"\nssd_dir = "/tmp"\nssd_capacity = "8GiB"\n', type=Top
    )
    assert top.cache.host_pool_bytes == 2 << 30
    assert top.cache.page_size_bytes == 64 << 10
    assert top.cache.ssd_capacity_bytes == 8 << 30
    assert top.cache.frame_threshold_bytes == 64 << 10
    assert msgspec.toml.decode(b"", type=Top).cache == CacheConfig()


def test_pool_and_tiers_from_config(pool_name: str, tmp_path) -> None:
    config = CacheConfig(
        host_pool="1MiB", page_size="64KiB", ssd_dir=str(tmp_path), ssd_capacity="2MiB"
    )
    pool = PagePool.from_config(pool_name, config, create=True)
    worker_view = PagePool.from_config(pool_name, config)
    cache = TieredCache.from_config(pool, config, "ssd-test")
    try:
        assert pool.pages == 16 and worker_view.pages == 16
        cache.put("k", torch.arange(10))
        assert cache.ssd is not None and cache.ssd.slots == 32
    finally:
        cache.close()
        worker_view.close()
        pool.unlink()
        pool.close()
    assert list(tmp_path.iterdir()) == []
