"""Two embedded Runtimes of one deployment at once: one runs, the other is refused."""

from __future__ import annotations

import asyncio

import omniflow
from omniflow.runtime.replica import StartError
from tests.helpers import echo_config, expected_echo


def test_second_runtime_of_a_deployment_is_refused_while_the_first_starts(run_root):
    cfg = echo_config(name="locked")

    async def main():
        first, second = omniflow.Runtime(cfg), omniflow.Runtime(cfg)
        starts = await asyncio.gather(first.start(), second.start(), return_exceptions=True)
        winner = next(rt for rt, s in zip((first, second), starts, strict=True) if s is rt)
        refused = [s for s in starts if isinstance(s, BaseException)]
        try:
            outs, _ = await winner.call({"text": "still mine"})
        finally:
            await first.close()
            await second.close()  # the refused one owns nothing: this touches nothing
        return refused, [o.data["text"] for o in outs]

    refused, texts = asyncio.run(main())
    assert len(refused) == 1 and isinstance(refused[0], StartError), refused
    assert "already running" in str(refused[0])
    assert texts == expected_echo("still mine")
    assert not list(run_root.rglob("*.sock"))
