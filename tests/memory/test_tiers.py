"""Host pool <-> SSD tiering: LRU demotion above the watermark, promotion on access."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from omniflow.memory import PagePool, PoolExhausted, SsdCorruption, SsdStore, TieredCache
from tests.memory.pool_workers import start_workers, stop_workers

PAGE = 64 << 10


@pytest.fixture
def small_pool(pool_name: str):
    p = PagePool.create(pool_name, 16 * PAGE, page_size=PAGE)  # 16 pages
    yield p
    p.unlink()
    p.close()


@pytest.fixture
def cache(small_pool: PagePool, tmp_path):
    ssd = SsdStore(str(tmp_path), 64 * PAGE, PAGE)
    c = TieredCache(small_pool, ssd, high_watermark=0.75, low_watermark=0.5)
    yield c
    c.close()
    ssd.close()
    assert small_pool.stats().used_pages == 0


def _value(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(2 * PAGE // 2, generator=g).to(torch.bfloat16)  # two pages


def test_lru_entries_move_to_ssd_above_the_high_watermark(cache: TieredCache) -> None:
    pool = cache.pool
    for i in range(7):  # 14 pages: passes 12 (75%) on the seventh
        cache.put(i, _value(i))
    assert pool.stats().usage <= 0.5
    assert [cache.where(i) for i in range(7)] == ["ssd"] * 3 + ["host"] * 4
    pt = cache.acquire(0)  # promoted back, now most recently used
    assert cache.where(0) == "host" and torch.equal(
        pt.tensor.view(torch.int16), _value(0).view(torch.int16)
    )
    pt.lease.release()
    cache.put(7, _value(7))
    cache.put(8, _value(8))  # over the watermark again: 1 is the oldest now, 0 is not
    assert cache.where(1) == "ssd" and cache.where(0) == "host"


def test_restore_is_bit_exact_after_other_processes_reused_the_pages(cache: TieredCache) -> None:
    pool = cache.pool
    for i in range(7):
        cache.put(i, _value(i))
    assert cache.where(0) == "ssd"
    [worker] = start_workers(pool.name, 1)
    try:  # another process allocates and stamps every free page, then frees them
        assert worker.call("stress", (50, 1)) > 0
    finally:
        stop_workers([worker])
    for i in range(7):
        pt = cache.acquire(i)
        assert torch.equal(pt.tensor.view(torch.int16), _value(i).view(torch.int16)), i
        pt.lease.release()


def test_entries_in_use_are_never_demoted(cache: TieredCache) -> None:
    cache.put("held", _value(100))
    held = cache.acquire("held")
    for i in range(6):
        cache.put(i, _value(i))
    assert cache.where("held") == "host"
    assert torch.equal(held.tensor.view(torch.int16), _value(100).view(torch.int16))
    held.lease.release()


def test_a_pool_tensor_is_kept_by_reference(cache: TieredCache) -> None:
    t, lease = cache.pool.empty((PAGE,), torch.float32)
    t.fill_(1.5)
    cache.put("mine", t)
    assert cache.pool.refs(lease.id) == 2  # ours and the cache's: no copy was made
    lease.release()
    pt = cache.acquire("mine")
    assert pt.tensor.data_ptr() == t.data_ptr()
    pt.lease.release()


def test_full_pool_demotes_to_make_room_or_says_why(small_pool: PagePool, tmp_path) -> None:
    ssd = SsdStore(str(tmp_path), 64 * PAGE, PAGE)
    cache = TieredCache(small_pool, ssd, high_watermark=1.0, low_watermark=0.9)
    try:
        for i in range(12):  # 24 pages through a 16-page pool
            cache.put(i, _value(i))
        assert sum(cache.where(i) == "ssd" for i in range(12)) >= 4
        no_ssd = TieredCache(small_pool, None, high_watermark=1.0, low_watermark=0.9)
        with pytest.raises(PoolExhausted):
            for i in range(12):
                no_ssd.put(i, _value(i))
        no_ssd.close()
    finally:
        cache.close()
        ssd.close()


def test_corrupt_ssd_page_fails_promotion(cache: TieredCache) -> None:
    for i in range(7):
        cache.put(i, _value(i))
    first, _ = cache._entries[0].ssd.runs[0]
    fd = os.open(cache.ssd.paths[0], os.O_RDWR)
    os.pwrite(fd, b"\x00" * 8, first * PAGE + PAGE + 8)
    os.close(fd)
    used = cache.pool.stats().used_pages
    with pytest.raises(SsdCorruption):
        cache.acquire(0)
    assert cache.pool.stats().used_pages == used  # the promotion's pages were given back


def test_async_put_and_acquire(cache: TieredCache) -> None:
    async def main() -> None:
        for i in range(7):
            await cache.aput(i, _value(i))
        pt = await cache.aacquire(0)
        assert torch.equal(pt.tensor.view(torch.int16), _value(0).view(torch.int16))
        pt.lease.release()
        assert await cache.aacquire("absent") is None

    asyncio.run(main())
