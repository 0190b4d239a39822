"""The Python API refuses the parameters and inputs `omniflow send` and the gateway refuse,
naming the key, before anything is sent; the deployment serves on."""

from __future__ import annotations

import asyncio

import pytest

import omniflow
from tests.helpers import echo_config, expected_echo


def test_runtime_and_connect_refuse_unknown_params_and_inputs(run_root):
    async def main():
        async with omniflow.Runtime(echo_config("apichecks")) as rt:
            with pytest.raises(omniflow.InvalidRequest, match=r"params\.max_token: no role"):
                await rt.call({"text": "a b"}, params={"max_token": 4})
            with pytest.raises(omniflow.InvalidRequest, match=r"did you mean delay_ms"):
                rt.stream({"text": "a b"}, params={"delay_m": 4})
            with pytest.raises(omniflow.InvalidRequest, match=r"inputs\.txt.*did you mean text"):
                await rt.call({"txt": "a b"})
            with pytest.raises(omniflow.InvalidRequest, match=r"params\.delay_ms=\"soon\""):
                await rt.call({"text": "a b"}, params={"delay_ms": "soon"})
            async with await omniflow.connect(run_dir=rt.run_dir) as conn:
                with pytest.raises(omniflow.InvalidRequest, match=r"params\.max_token"):
                    await conn.call({"text": "a b"}, params={"max_token": 4})
                with pytest.raises(omniflow.InvalidRequest, match=r"inputs\.txt"):
                    conn.stream({"txt": "a b"})
                outs, _ = await conn.call({"text": "a b"}, params={"delay_ms": 1})
            return outs

    outs = asyncio.run(main())
    assert [o.data["text"] for o in outs] == expected_echo("a b")
