"""With migration off (``runtime.max_migrations = 0``) the client keeps nothing a resend
would need: not the inputs, not the tokens streamed so far; with it on, it keeps them."""

from __future__ import annotations

import asyncio

import pytest

import omniflow
from omniflow.runtime.config import parse

INPUTS = {"text": "x" * 4096}


def tokens_config(name: str, max_migrations: int):
    return parse(
        {
            "name": name,
            "roles": {"tokens": {"actor": "tests.graph_roles:Tokens"}},
            "graph": {"edges": [{"from": "input", "to": "tokens"}]},
            "runtime": {"heartbeat_s": 0.2, "ttl_s": 2.0, "max_migrations": max_migrations},
        },
        "<test>",
    )


@pytest.mark.parametrize("max_migrations", [0, 2])
def test_the_client_keeps_resend_state_only_with_migration_on(run_root, max_migrations):
    async def main():
        cfg = tokens_config(f"keep{max_migrations}", max_migrations)
        async with omniflow.Runtime(cfg) as rt:
            kept = []
            async for item in rt.stream(INPUTS, params={"n": 4}, request_id="r1", timeout=30):
                if isinstance(item, omniflow.Output):
                    pending = rt.client._pending["r1"]
                    kept.append((list(pending.tokens), pending.resend[0], dict(pending.delivered)))
                else:
                    result = item
            return kept, result

    kept, result = asyncio.run(main())
    assert result.request_id == "r1" and len(kept) == 4
    tokens, inputs, delivered = kept[-1]
    if max_migrations:
        assert tokens == [0, 1, 2, 3]
        assert inputs == INPUTS and delivered
    else:
        assert all(state == ([], {}, {}) for state in kept), kept
