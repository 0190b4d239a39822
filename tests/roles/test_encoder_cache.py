"""EncoderOutputCache over a real page pool: refs, LRU bounds, SSD spill and restore."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import torch

from omniflow.memory import CacheConfig, PagePool, unlink_pool
from omniflow.roles.encoder_cache import EncoderOutputCache
from tests.roles.media import make_ctx

PAGE = 64 << 10


@pytest.fixture
def pool():
    name = f"omniflow-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    p = PagePool.create(name, 16 * PAGE, page_size=PAGE)
    yield p
    p.close()
    unlink_pool(name)


def output(seed: int, rows: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "image_embeds": torch.randn(rows, 64, generator=g),
        "image_codes": torch.randint(0, 1024, (rows, 8), generator=g),
        "image_grid": [2, rows // 2],
        "image_hash": f"h{seed}",
    }


def end_request(ctx) -> None:
    """What the host does when a request ends: release what the handler held."""
    for lease in ctx.held:
        lease.release()
    ctx.held = []


def test_outputs_live_in_the_pool_and_hits_share_the_cached_blocks(pool):
    async def main():
        cache = EncoderOutputCache(8, 1 << 20, pool, CacheConfig(host_pool="1MiB"))
        original = output(1)
        ctx = make_ctx("vision_encoder")
        sent = await cache.put("k", original, ctx)
        assert pool.contains(sent["image_embeds"]) and pool.contains(sent["image_codes"])
        assert torch.equal(sent["image_embeds"], original["image_embeds"])
        assert sent["image_grid"] == [2, 4] and sent["image_hash"] == "h1"
        leases = [lease.id for lease in ctx.held]
        assert len(leases) == 2 and all(pool.refs(i) == 2 for i in leases)  # cache + request
        end_request(ctx)
        assert all(pool.refs(i) == 1 for i in leases)  # the cache's own

        ctx2 = make_ctx("vision_encoder", "r2")
        hit = await cache.get("k", ctx2)
        assert hit is not None and cache.stats()["hits"] == 1
        # the very same block, not a copy
        assert hit["image_embeds"].data_ptr() == sent["image_embeds"].data_ptr()
        assert torch.equal(hit["image_codes"], original["image_codes"])
        # a reader downstream takes its own ref by handle; the cache's entry stays valid
        ref = pool.share(hit["image_embeds"], os.getpid())
        end_request(ctx2)
        assert pool.refs(ref.lease) == 2
        pool.release(ref.lease)
        assert pool.refs(ref.lease) == 1
        assert await cache.get("missing", ctx2) is None and cache.stats()["misses"] == 1
        cache.close()
        assert pool.stats().used_pages == 0

    asyncio.run(main())


def test_bounded_by_entries_and_bytes_in_whole_pages(pool):
    async def main():
        cache = EncoderOutputCache(3, 1 << 20, pool, CacheConfig(host_pool="1MiB"))
        ctx = make_ctx("vision_encoder")
        for i in range(5):
            await cache.put(f"k{i}", output(i), ctx)
        end_request(ctx)
        assert len(cache) == 3 and "k0" not in cache and "k4" in cache
        assert cache.nbytes == 3 * 2 * PAGE  # two tensors an entry, a page each
        assert pool.stats().used_pages == 6
        small = EncoderOutputCache(8, 3 * PAGE, pool)
        for i in range(3):
            await small.put(f"s{i}", output(i), ctx)
        end_request(ctx)
        assert len(small) == 1  # two pages an entry, three pages allowed
        cache.close()
        small.close()
        assert pool.stats().used_pages == 0

    asyncio.run(main())


def test_without_ssd_the_cache_gives_pages_back_when_the_pool_runs_full(pool):
    async def main():
        config = CacheConfig(host_pool="1MiB", high_watermark=0.5, low_watermark=0.25)
        cache = EncoderOutputCache(100, 1 << 30, pool, config)
        ctx = make_ctx("vision_encoder")
        for i in range(8):
            await cache.put(f"k{i}", output(i), ctx)
            end_request(ctx)
        assert pool.stats().usage <= 0.5
        assert "k7" in cache and "k0" not in cache
        cache.close()

    asyncio.run(main())


def test_entries_spill_to_ssd_under_pressure_and_come_back_bit_exact(pool, tmp_path):
    async def main():
        config = CacheConfig(
            host_pool="1MiB",
            ssd_dir=str(tmp_path),
            ssd_capacity=64 * PAGE,
            high_watermark=0.5,
            low_watermark=0.25,
        )
        cache = EncoderOutputCache(100, 1 << 30, pool, config, name="enc")
        originals = {f"k{i}": output(i, rows=16) for i in range(8)}
        ctx = make_ctx("vision_encoder")
        for key, out in originals.items():
            await cache.put(key, out, ctx)
            end_request(ctx)
        places = {key: cache.where(key) for key in originals}
        assert places["k0"] == "ssd" and places["k7"] == "host", places
        assert len(cache) == 8  # spilled, not dropped
        assert list(tmp_path.iterdir())
        for key, out in originals.items():
            hit = await cache.get(key, ctx)
            assert hit is not None
            assert torch.equal(hit["image_embeds"], out["image_embeds"])
            assert torch.equal(hit["image_codes"], out["image_codes"])
            end_request(ctx)
        cache.close()
        assert pool.stats().used_pages == 0
        assert not list(tmp_path.iterdir())  # its SSD files are removed

    asyncio.run(main())


def test_without_a_pool_it_is_an_in_process_lru():
    async def main():
        cache = EncoderOutputCache(2, 1 << 20)
        ctx = make_ctx("audio_encoder")
        for i in range(3):
            sent = await cache.put(f"k{i}", output(i), ctx)
        assert ctx.held == [] and cache.where("k2") == "process" and "k0" not in cache
        hit = await cache.get("k2", ctx)
        assert hit is not None and torch.equal(hit["image_embeds"], sent["image_embeds"])

    asyncio.run(main())
