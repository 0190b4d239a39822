"""The encoder-output cache in the deployment's page pool, with real processes.

A repeated image skips the vision encoder (its replica says it encoded once), the LLM
gets identical embeddings by handle, the pool holds only the cache's own blocks once
requests end, and nothing is left in /dev/shm or the SSD folder after stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import omniflow
from omniflow.cache import PagePool
from tests.helpers import vision_llm_config
from tests.roles.media import image_bytes

pytestmark = pytest.mark.slow
PAGE = 16 << 10


def config(models: Path, ssd: Path):
    # Small frame threshold: the embeddings travel as Shm handles, not frames.
    cache = {
        "host_pool": "4MiB",
        "page_size": "16KiB",
        "frame_threshold": "1KiB",
        "ssd_dir": str(ssd),
        "ssd_capacity": "1MiB",
    }
    return vision_llm_config("enccache", models, cache=cache)


async def meta_of(rt, role: str, want: dict, timeout: float = 10.0) -> dict:
    """The replica's published meta once it shows ``want`` (heartbeats lag a little)."""
    deadline = time.monotonic() + timeout
    while True:
        (record,) = rt.client.view.replicas(role)
        if all(record.meta.get(k) == v for k, v in want.items()):
            return record.meta
        assert time.monotonic() < deadline, record.meta
        await asyncio.sleep(0.05)


def test_a_repeated_image_skips_the_encoder_and_comes_by_handle(run_root, tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    params = {"temperature": 0, "max_tokens": 6}
    image = image_bytes(224, 224, seed=5)  # 8x8 tokens at 28 px: 16 KiB of embeddings

    async def main():
        async with omniflow.Runtime(config(tmp_path / "models", ssd)) as rt:
            pool_name = rt.supervisor.pool_name
            first_outs, first = await rt.call({"text": "look", "image": image}, params=params)
            second_outs, second = await rt.call({"text": "look", "image": image}, params=params)
            other_outs, other = await rt.call(
                {"text": "look", "image": image_bytes(224, 224, seed=6)}, params=params
            )
            meta = await meta_of(rt, "vision_encoder", {"encoded": 2})
            pool = PagePool.attach(pool_name)
            try:
                stats = pool.stats()
            finally:
                pool.close()
            return (first_outs, first), (second_outs, second), (other_outs, other), meta, stats

    first, second, other, meta, stats = asyncio.run(main())
    text = ["".join(o.data.get("text", "") for o in outs) for outs, _ in (first, second, other)]
    assert "encoder_cache_hits" not in first[1].usage
    assert second[1].usage["encoder_cache_hits"] == 1
    assert "encoder_cache_hits" not in other[1].usage
    assert text[0] and text[1] == text[0]  # identical embeddings, identical greedy output
    assert second[1].usage["prompt_tokens"] == first[1].usage["prompt_tokens"]
    # The encoder ran for the two distinct images only.
    assert meta["encoded"] == 2
    assert meta["encoder_cache"] == {"entries": 2, "bytes": 4 * PAGE, "hits": 1, "misses": 2}
    # Requests are over: the pool holds the cache's blocks (2 images x 2 tensors, a page
    # each) and nothing else: every reader released its ref.
    assert (stats.used_pages, stats.live_leases) == (4, 4)
    assert not [p for p in Path("/dev/shm").iterdir() if "enccache" in p.name]
    assert not list(ssd.iterdir())  # the SSD tier's files went with the encoder


def test_a_killed_encoder_frees_its_pool_blocks_and_its_successor_removes_its_ssd_files(
    run_root, tmp_path
):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    params = {"temperature": 0, "max_tokens": 4}
    image = image_bytes(224, 224, seed=8)

    async def main():
        async with omniflow.Runtime(config(tmp_path / "models", ssd)) as rt:
            await rt.call({"text": "look", "image": image}, params=params)
            (victim,) = rt.client.view.replicas("vision_encoder")
            before = sorted(p.name for p in ssd.iterdir())
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while True:
                records = rt.client.view.replicas("vision_encoder")
                if records and records[0].pid != victim.pid:
                    break
                assert time.monotonic() < deadline, "the encoder did not come back"
                await asyncio.sleep(0.05)
            after = sorted(p.name for p in ssd.iterdir())
            _, result = await rt.call({"text": "look", "image": image}, params=params)
            pool = PagePool.attach(rt.supervisor.pool_name)
            try:
                stats = pool.stats()
            finally:
                pool.close()
            return victim.pid, records[0].pid, before, after, result.usage, stats

    old, new, before, after, usage, stats = asyncio.run(main())
    assert before and all(str(old) in name for name in before)
    assert after and all(str(new) in name for name in after)  # the dead one's are gone
    assert "encoder_cache_hits" not in usage  # a new process: its cache starts empty
    assert (stats.used_pages, stats.live_leases) == (2, 2)  # the dead cache's blocks came back
    assert not list(ssd.iterdir())
