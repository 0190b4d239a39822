"""A replica that dies holding a request: the client cancels it at the roles after the dead
one and at the replicas it sent the request to, not at every replica of every role."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import zmq

import omniflow
from omniflow.control.discovery import actor_key, encode_record, open_registry
from omniflow.messages import ActorRecord, Cancel
from omniflow.runtime.config import parse
from omniflow.runtime.holding import read_holding
from omniflow.transport.codec import decode
from omniflow.transport.endpoint import Inbox

ECHO = "omniflow.roles.echo"


def chain_config():
    return parse(
        {
            "name": "cancelscope",
            "roles": {
                "head": {"actor": f"{ECHO}:Upper"},
                "mid": {"actor": f"{ECHO}:Reverse", "options": {"delay_ms": 30_000}},
                "tail": {"actor": f"{ECHO}:Upper"},
            },
            "graph": {
                "edges": [
                    {"from": "input", "to": "head"},
                    {"from": "head", "to": "mid"},
                    {"from": "mid", "to": "tail"},
                ]
            },
            "runtime": {
                "heartbeat_s": 30.0,
                "ttl_s": 60.0,
                "restart_backoff_s": 0.1,
                "max_migrations": 0,
            },
        },
        "<test>",
    )


def test_a_death_cancels_only_where_the_request_may_be(run_root):
    async def main():
        async with omniflow.Runtime(chain_config()) as rt:
            call = asyncio.create_task(rt.call({"text": "hi"}, request_id="c1", timeout=40))
            victim = next(r for r in rt.supervisor.replicas if r.role == "mid")
            until = time.monotonic() + 20
            path = Path(rt.run_dir) / "mid-0.holding"
            while not any(rid == "c1" for rid, _ in read_holding(path, victim.proc.pid)):
                assert time.monotonic() < until
                await asyncio.sleep(0.05)
            # Now that it is at mid: a listed replica of a role before the dead one, never
            # sent the request, and one of a role after it, both this test's sockets.
            ctx = zmq.Context()
            cancels: dict[str, Counter[str]] = {"head": Counter(), "tail": Counter()}
            inboxes, registry = [], open_registry(rt.supervisor.registry_address)
            for role in cancels:

                def on_message(identity, parts, seen=cancels[role]):
                    msg = decode(parts[0])
                    if isinstance(msg, Cancel):
                        seen[msg.request_id] += 1

                inbox = Inbox(ctx, f"ipc://{rt.run_dir}/fake-{role}.sock", on_message)
                inbox.start()
                inboxes.append(inbox)
                record = ActorRecord(role, 7, os.getpid(), inbox.endpoint, socket.gethostname())
                key = actor_key("cancelscope", role, 7)
                await registry.put(key, encode_record(record), ttl=60.0)
            while rt.client.view.find("head/7") is None or rt.client.view.find("tail/7") is None:
                assert time.monotonic() < until
                await asyncio.sleep(0.05)
            os.kill(victim.proc.pid, signal.SIGKILL)
            try:
                await call
            except omniflow.RequestFailed as e:
                failure = e
            while not cancels["tail"]:
                assert time.monotonic() < until + 10
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a Cancel to head/7 would have left with tail/7's
            await registry.close()
            for inbox in inboxes:
                inbox.close()
            ctx.term()
            return failure, cancels

    failure, cancels = asyncio.run(main())
    assert (failure.code, failure.role) == ("unavailable", "mid")
    assert cancels["tail"] == Counter({"c1": 1})
    assert not cancels["head"]
