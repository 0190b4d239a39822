"""A LongCat deployment over three network-namespace hosts on one etcd: a request through
all three, every host's actors in one status, a host killed under load, down --all.

The tests run in file order on one deployment: the host loss comes after the request
that needs all three hosts, and `down --all` ends it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

import omniflow
from omniflow.runtime.client import Output, RequestFailed, Result
from tests.roles.media import image_bytes, wav_bytes
from tests.scaleout.conftest import ROLES

# Starting three LongCat shares takes ~40 s on a quiet 2-core machine, minutes on a busy one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def longcat(cluster):
    """Host a first (it builds the tiny models every host then loads), then b and c at
    once; c joins with flags only."""
    try:
        cluster.up("a")
    except (AssertionError, subprocess.TimeoutExpired) as e:
        raise AssertionError(f"{e}\n{cluster.logs('a')}") from None
    c_flags = ("--roles", ",".join(ROLES["c"]), "--address", cluster.hosts.address["c"])
    argv = [sys.executable, "-m", "omniflow.cli", "up", str(cluster.config), "--detach"]
    started = {
        "b": cluster.hosts.popen("b", [*argv, "--host-id", "b"], cwd=cluster.work,
                                 env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
        "c": cluster.hosts.popen("c", [*argv, "--host-id", "c", *c_flags], cwd=cluster.work,
                                 env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
    }  # fmt: skip
    for host, proc in started.items():
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        assert proc.returncode == 0, (
            f"[{host}] up failed:\n{out.decode(errors='replace')}\n{cluster.logs(host)}"
        )
    return cluster


def connect(cluster):
    """A client in the root namespace: through etcd, replying on the bridge address."""
    return omniflow.connect(
        cluster.name, registry=cluster.etcd.url, address=cluster.hosts.bridge_address
    )


def status(cluster, host: str) -> dict:
    args = ("status", "--json", "--name", cluster.name, "--host-id", host)
    return json.loads(cluster.omniflow(host, *args).stdout)


def test_a_request_crosses_all_three_hosts(longcat):
    actors = status(longcat, "b")["actors"]
    where = {(a["role"], a["replica"]): a["host"] for a in actors}
    assert {a["host"] for a in actors} == {"a", "b", "c"}
    # llm replicated once per host: three replica numbers claimed, one per host
    assert sorted(r for role, r in where if role == "llm") == [0, 1, 2]
    for a in actors:  # every actor listens where the other namespaces reach it
        assert a["endpoint"].startswith(f"tcp://{longcat.hosts.address[a['host']]}:")

    async def run():
        async with await connect(longcat) as conn:
            inputs = {"text": "describe", "image": image_bytes(64, 48, seed=5)}
            inputs["audio"] = wav_bytes(0.5)
            params = {"want": "text,audio", "audio_chunks": 2, "audio_chunk_tokens": 2, "seed": 1}
            return await conn.call(inputs, params=params, timeout=120)

    outputs, result = asyncio.run(run())
    ran = {t.role for t in result.timings}
    assert {"vision_encoder", "audio_encoder", "llm", "audio_decoder"} <= ran
    hosts_used = {h for (role, _), h in where.items() if role in ran - {"llm"}}
    assert hosts_used == {"a", "b", "c"}
    text = "".join(o.data.get("text", "") for o in outputs if o.role == "llm")
    audio = [o for o in outputs if o.role == "audio_decoder"]
    assert text and audio
    assert result.usage["prompt_tokens"] > 0


def test_status_from_any_host_and_through_etcd_lists_every_host(longcat):
    local = status(longcat, "c")
    assert local["host_id"] == "c"  # this host's run dir: c's supervisor
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli", "status", "--json", "--name", longcat.name,
         "--registry", longcat.etcd.url],
        capture_output=True, text=True, timeout=60, env=longcat.env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    remote = json.loads(proc.stdout)
    key = lambda a: (a["role"], a["replica"], a["host"], a["pid"])  # noqa: E731
    assert sorted(map(key, remote["actors"])) == sorted(map(key, local["actors"]))
    assert {a["host"] for a in remote["actors"]} == {"a", "b", "c"}
    # the three shares' run dirs sit in one /tmp: a plain down must not guess which
    argv = [sys.executable, "-m", "omniflow.cli", "down", "--name", longcat.name]
    refused = longcat.hosts.run("a", argv, env=longcat.env, cwd=longcat.work)
    assert refused.returncode == 2, refused.stderr
    assert "several hosts' shares (a, b, c); pick one with --host-id" in refused.stderr


def test_send_reaches_the_deployment_through_etcd_alone(longcat, tmp_path):
    """From the root namespace, which runs no share: the config comes from etcd."""
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli", "send", "--registry", longcat.etcd.url,
         "--name", longcat.name, "--address", longcat.hosts.bridge_address,
         "-t", "hello", "--max-tokens", "4", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=longcat.env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout.splitlines()[-1])
    assert reply["text"] and reply["usage"]["completion_tokens"] == 4
    assert set(reply["timings_ms"]) == {"llm"}


def streaming_from(client, host: str) -> list:
    """The client's requests whose text a replica on ``host`` is streaming right now."""
    return [
        p
        for p in client._pending.values()
        if p.heard and not p.text_done and p.fanout is not None
        and any(b.record.host == host for b in p.fanout.branches.values())
    ]  # fmt: skip


def test_a_host_killed_under_load_ends_every_request_once(longcat):
    """Host b frozen (SIGSTOP) while its llm streams requests, then kill -9 of all its
    processes and its namespace deleted: each request ends with exactly one terminal
    outcome (a result, or a clear failure), those b was streaming move on or fail, none
    waits for b, and the survivors keep serving."""
    n = 12

    async def one(conn, i: int, events: list) -> None:
        try:
            async for event in conn.stream(
                {"text": f"tell me a story {i}"}, params={"max_tokens": 256}, timeout=45
            ):
                events.append(event)
        except RequestFailed as e:
            events.append(e)

    async def run():
        async with await connect(longcat) as conn:
            events: list[list] = [[] for _ in range(n)]
            tasks = [asyncio.create_task(one(conn, i, events[i])) for i in range(n)]
            # b dies while its llm streams some of them (load spreads them over a, b, c);
            # frozen first, so none of those can still finish on b.
            deadline = time.monotonic() + 60
            while not streaming_from(conn.client, "b"):
                assert time.monotonic() < deadline, "b's llm never streamed a request"
                await asyncio.sleep(0.01)
            longcat.hosts.freeze("b")
            frozen_at = time.time()
            on_b = {p.request_id for p in streaming_from(conn.client, "b")}
            longcat.hosts.kill("b")
            longcat.forget("b")
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
            after = await conn.call({"text": "still there?"}, params={"max_tokens": 4}, timeout=60)
            left = dict(conn.client._pending)
            return events, on_b, after, left, frozen_at

    events, on_b, after, left, frozen_at = asyncio.run(run())
    outcomes = {}
    for evs in events:
        terminal = [e for e in evs if isinstance(e, Result | RequestFailed)]
        assert len(terminal) == 1, evs
        assert evs[-1] is terminal[0]  # nothing after the end
        assert all(isinstance(e, Output) for e in evs[:-1])
        outcomes[terminal[0].request_id] = terminal[0]
    assert len(outcomes) == n
    for outcome in outcomes.values():
        if isinstance(outcome, RequestFailed):
            assert outcome.code in ("unavailable", "deadline"), outcome
    assert any(isinstance(o, Result) for o in outcomes.values())
    # what b was streaming moved on (the llm resumes it elsewhere) or failed clearly, or
    # had ended on b before the freeze (its last frames still on their way to the client)
    assert on_b
    for request_id in on_b:
        moved = outcomes[request_id]
        if isinstance(moved, RequestFailed) or moved.migrations >= 1:
            continue
        llm = [t for t in moved.timings if t.role == "llm"]
        assert llm and max(t.left for t in llm) <= frozen_at, moved
    assert not left  # the client holds nothing of the ended requests
    assert after[1].usage["completion_tokens"] > 0  # served by a or c
    # b's leases expire within ttl_s of its death: then it left everyone's view
    deadline = time.monotonic() + 10
    while {a["host"] for a in status(longcat, "a")["actors"]} != {"a", "c"}:
        assert time.monotonic() < deadline, "host b is still listed"
        time.sleep(0.5)


def test_down_stops_one_hosts_share_and_down_all_the_rest(longcat):
    longcat.omniflow("c", "down", "--name", longcat.name, "--host-id", "c", "--timeout", "10")
    assert not longcat.hosts.pids("c") and longcat.hosts.pids("a")
    assert {a["host"] for a in status(longcat, "a")["actors"]} == {"a"}
    out = longcat.omniflow("a", "down", "--all", "--name", longcat.name, "--timeout", "10")
    assert out.stdout.split() == ["stopped", longcat.name, "on", "hosts", "a"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and longcat.hosts.pids("a"):
        time.sleep(0.2)
    assert not longcat.hosts.pids("a")
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow.cli", "status", "--json", "--name", longcat.name,
         "--registry", longcat.etcd.url],
        capture_output=True, text=True, timeout=60, env=longcat.env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["actors"] == []
