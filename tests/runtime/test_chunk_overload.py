"""A producer that streams chunks faster than the consumer handles them: past the role's
queue bound the request fails as overloaded, and the consumer goes on serving others."""

from __future__ import annotations

import asyncio

import omniflow
from tests.helpers import echo_config, expected_echo


def test_chunks_past_the_bound_fail_the_request_as_overloaded(run_root):
    # upper streams one chunk per word at once; reverse takes 200 ms a chunk.
    cfg = echo_config(
        name="chunkflood", reverse={"max_stream_chunks": 4, "options": {"delay_ms": 200}}
    )
    flood = " ".join(f"w{i}" for i in range(60))

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            try:
                await rt.call({"text": flood}, timeout=30)
                flooded = None
            except omniflow.RequestFailed as e:
                flooded = e
            outs, _ = await rt.call({"text": "a b"}, timeout=30)  # within the bound
            return flooded, [o.data["text"] for o in outs]

    flooded, small = asyncio.run(main())
    assert flooded is not None, "60 chunks queued behind a bound of 4"
    assert (flooded.code, flooded.role) == ("overloaded", "reverse")
    assert "chunks waiting" in flooded.detail
    assert small == expected_echo("a b")
