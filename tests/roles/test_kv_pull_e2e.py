"""Two llm replicas of one deployment: a replica sent a prompt that opens with an image
another replica prefilled pulls that prefix's KV pages instead of computing them."""

from __future__ import annotations

import asyncio
import time

import pytest

import omniflow
from omniflow.content import SUMMARY_META
from omniflow.runtime.kv_peers import KV_PULL_META
from tests.helpers import vision_llm_config
from tests.roles.media import image_bytes

pytestmark = pytest.mark.slow


async def records_when(rt, check, timeout: float = 20.0):
    """``check(records)`` of the llm records once it is truthy (heartbeats carry meta)."""
    deadline = time.monotonic() + timeout
    while True:
        records = rt.client.view.replicas("llm")
        if found := check(records):
            return found
        assert time.monotonic() < deadline, [r.meta for r in records]
        await asyncio.sleep(0.05)


def test_a_replica_pulls_the_prefix_another_replica_prefilled(run_root, tmp_path):
    params = {"temperature": 0, "max_tokens": 6}
    # 64 image tokens after the bos and the chat template's opening: 5 whole pages of 16
    image = image_bytes(256, 256, seed=5)
    llm = {"replicas": 2, "policy": "round_robin"}  # the second request goes to the other one
    config = vision_llm_config("kvpull", tmp_path / "models", llm=llm)

    async def main():
        async with omniflow.Runtime(config) as rt:
            await records_when(
                rt, lambda rs: len(rs) == 2 and all(KV_PULL_META in r.meta for r in rs)
            )
            _, first = await rt.call({"text": "look", "image": image}, params=params)
            [holder] = await records_when(
                rt, lambda rs: [r for r in rs if r.meta.get(SUMMARY_META)]
            )
            await asyncio.sleep(0.5)  # the other replica's own view takes the same update
            second_outs, second = await rt.call({"text": "again", "image": image}, params=params)
            third_outs, third = await rt.call({"text": "again", "image": image}, params=params)
            records = await records_when(
                rt, lambda rs: any(r.meta["kv_pulls"]["pulled"] for r in rs) and rs
            )
            return holder, first, (second_outs, second), (third_outs, third), records

    holder, first, second, third, records = asyncio.run(main())
    assert first.usage["cached_tokens"] == 0
    # The second replica never saw the image, yet its prompt came from the cache: pulled.
    assert second[1].usage["cached_tokens"] == 80
    puller = next(r for r in records if r.replica != holder.replica)
    assert puller.meta["kv_pulls"] == {"pulled": 1, "recomputed": 0, "failed": 0}
    # The holder answers the same prompt from the pages it computed: the same greedy text.
    assert third[1].usage["cached_tokens"] == 80
    text = ["".join(o.data.get("text", "") for o in outs) for outs, _ in (second, third)]
    assert text[0] and text[0] == text[1]
