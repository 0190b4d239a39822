"""A stop lets the requests in flight finish through the whole graph, refusing new ones."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import omniflow
from omniflow.runtime.drain import stop_order
from omniflow.runtime.holding import read_holding
from tests.helpers import echo_config, expected_echo


def test_stop_finishes_a_request_upstream_through_every_role_after_it(run_root):
    cfg = echo_config(name="drainorder", runtime={"drain_timeout_s": 20.0})

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            assert rt.client is not None
            view, gone = rt.client.view, []
            on_gone = view.on_gone

            def seen_gone(record):
                gone.append((record.actor_id, record.state))
                on_gone(record)

            view.on_gone = seen_gone
            # Each role sleeps 2.5 s on it: the stop begins while it is in `upper`, and
            # `reverse` must still be there when `upper` hands it on, its record kept alive
            # past the registry's TTL (1 s) while it drains.
            inflight = asyncio.create_task(
                rt.call({"text": "in flight"}, params={"delay_ms": 2500}, timeout=30)
            )
            upper = next(r for r in rt.supervisor.replicas if r.role == "upper")
            holding = Path(rt.run_dir) / "upper-0.holding"
            until = time.monotonic() + 10
            while not read_holding(holding, upper.proc.pid):
                assert time.monotonic() < until
                await asyncio.sleep(0.01)
            started = time.monotonic()
            stopping = asyncio.create_task(rt.supervisor.stop())
            while True:  # a request sent before `upper` took the signal still runs
                sent = time.monotonic()
                try:
                    await rt.call({"text": "late"}, timeout=10)
                except omniflow.RequestFailed as e:
                    refused, refused_after = e, time.monotonic() - sent
                    break
                assert time.monotonic() - started < 10
            outs, _ = await inflight
            await stopping
            took = time.monotonic() - started
            return [o.data["text"] for o in outs], refused, refused_after, took, gone

    texts, refused, refused_after, took, gone = asyncio.run(main())
    # Each left the registry in order, none by its record expiring while it drained.
    assert sorted(gone) == [("reverse/0", "leaving"), ("upper/0", "leaving")]
    assert texts == expected_echo("in flight")
    assert refused.code == "shutting_down" and refused_after < 3.0  # at once, not by a timeout
    assert took < 20.0


def test_stop_order_follows_the_graph():
    from omniflow.runtime.config import load

    plan = load("configs/longcat.toml").plan()
    assert stop_order(plan) == [
        {"vision_encoder", "audio_encoder"},
        {"llm"},
        {"audio_decoder", "image_decoder"},
    ]
