"""prefix_aware routing of LLM sessions across two real replicas (embedded registry and etcd).

Each LLM replica publishes the sessions (and leading media) it holds in its registry
record; producers route a session's next turn there, new sessions by load. A replica
killed with -9 comes back with an empty summary, and the next turn of a session it held
is served fresh: correct output, nothing reused.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import zlib

import pytest

import omniflow
from omniflow.content import SUMMARY_META, content_hash, summary_key
from tests.helpers import cli, vision_llm_config
from tests.roles.media import image_bytes

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_tokens": 8}
WORDS = "amber basil cedar delta ember fjord gravel harbor island juniper kelp lumen".split()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix-models")


def config(name, models, registry="embedded"):
    return vision_llm_config(
        name,
        models,
        llm={"replicas": 2, "policy": "prefix_aware"},
        cache={"host_pool": "8MiB"},
        runtime={"restart_backoff_s": 0.2},
        registry=registry,
    )


def turn_text(session: str, turn: int) -> str:
    """Distinct from its first character on, so no two prompts share a full KV page by chance."""
    words = [WORDS[zlib.crc32(f"{session}/{turn}/{i}".encode()) % len(WORDS)] for i in range(8)]
    return f"{session} turn {turn}: " + " ".join(words)


async def turn(client, session, n, **inputs):
    outs, result = await client.call(
        {"text": turn_text(session, n), **inputs}, params=GREEDY, session=session
    )
    (replica,) = {t.replica for t in result.timings if t.role == "llm"}
    return "".join(o.data.get("text", "") for o in outs), replica, result.usage


async def summaries_settle(rt, placement, timeout=10.0):
    """Wait until each replica's published summary lists the sessions placed on it."""
    deadline = time.monotonic() + timeout
    while True:
        held = {
            r.replica: set(r.meta.get(SUMMARY_META, ())) for r in rt.client.view.replicas("llm")
        }
        if all(summary_key("session", s) in held.get(r, ()) for s, r in placement.items()):
            return held
        assert time.monotonic() < deadline, (held, placement)
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("registry", ["embedded", pytest.param("etcd", marks=pytest.mark.etcd)])
def test_sessions_follow_their_replica_and_new_ones_spread(run_root, models, request, registry):
    url = request.getfixturevalue("etcd_url") if registry == "etcd" else "embedded"
    sessions = [f"s{i}" for i in range(4)]

    async def main():
        async with omniflow.Runtime(config(f"pfx{registry[:2]}", models, url)) as rt:
            placement, usage = {}, {}
            for n in (1, 2, 3):  # interleaved turns of four sessions through one client
                for s in sessions:
                    media = {"image": image_bytes(64, 64, seed=7)} if (s, n) == ("s0", 1) else {}
                    _, replica, used = await turn(rt, s, n, **media)
                    assert placement.setdefault(s, replica) == replica, (s, n, placement)
                    usage[s, n] = used
            held = await summaries_settle(rt, placement)
            # A new client knows nothing of where these sessions went: it has only the
            # summaries the replicas publish through the registry.
            conn = await omniflow.connect(run_dir=rt.run_dir)
            try:
                fresh = {s: await turn(conn, s, 4) for s in sessions}
            finally:
                await conn.close()
            return placement, usage, held, fresh

    placement, usage, held, fresh = asyncio.run(main())
    assert set(placement.values()) == {0, 1}  # new sessions spread over both replicas
    for s in sessions:
        assert usage[s, 1]["cached_tokens"] == 0
        assert usage[s, 2]["cached_tokens"] > 0 and usage[s, 3]["cached_tokens"] > 0
        assert usage[s, 3]["cached_tokens"] > usage[s, 2]["cached_tokens"]  # all of turn 2 too
        _, replica, used = fresh[s]
        assert replica == placement[s] and used["cached_tokens"] > usage[s, 3]["cached_tokens"]
    # The summaries are exact about sessions: each lists its own, never the other's.
    for s, r in placement.items():
        assert summary_key("session", s) not in held[1 - r]
    image_key = summary_key("image", content_hash(image_bytes(64, 64, seed=7)))
    assert image_key in held[placement["s0"]]  # it began s0's prompt there


def test_a_session_continues_through_the_cli_with_cached_tokens(run_root, models):
    """`omniflow send --json` is its own process: it routes by the published summary alone."""

    async def start_session(rt):
        _, replica, first = await turn(rt, "cli-1", 1)
        await summaries_settle(rt, {"cli-1": replica})
        return first

    async def main():
        async with omniflow.Runtime(config("pfxcli", models)) as rt:
            first = await start_session(rt)
            proc = await asyncio.to_thread(
                cli, "send", "--name", "pfxcli", "--text", turn_text("cli-1", 2),
                "--session", "cli-1", "--json",
            )  # fmt: skip
            image_only = (await rt.call({"text": "draw"}, params={"want": "image"}))[1].usage
            return first, json.loads(proc.stdout.strip().splitlines()[-1]), image_only

    first, report, image_only = asyncio.run(main())
    assert first["cached_tokens"] == 0
    assert report["usage"]["cached_tokens"] > 0 and report["text"]
    assert image_only["cached_tokens"] == 0  # reported for every LLM request, text or not


def test_a_replica_killed_with_9_comes_back_with_no_summary_and_no_stale_kv(run_root, models):
    async def main():
        async with omniflow.Runtime(config("pfxkill", models)) as rt:
            _, home, _ = await turn(rt, "k", 1)
            _, again, second = await turn(rt, "k", 2)
            assert again == home and second["cached_tokens"] > 0
            await summaries_settle(rt, {"k": home})
            victim = next(r for r in rt.client.view.replicas("llm") if r.replica == home)
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while True:  # back, with a new record whose summary holds nothing
                record = rt.client.view.find(f"llm/{home}")
                if record is not None and record.pid != victim.pid:
                    break
                assert time.monotonic() < deadline, "the replica did not come back"
                await asyncio.sleep(0.05)
            summary = record.meta.get(SUMMARY_META)
            text, where, third = await turn(rt, "k", 3)
            # The same words as the first turn of a brand-new session: what a correct
            # replica without the lost history must answer.
            outs, _ = await rt.call({"text": turn_text("k", 3)}, params=GREEDY, session="new")
            return summary, text, where, third, "".join(o.data["text"] for o in outs)

    summary, text, where, third, expected = asyncio.run(main())
    assert summary == []
    assert third["cached_tokens"] == 0
    assert text == expected and text
    assert where in (0, 1)
