"""A real deployment in a background thread, and a raw ZeroMQ probe to talk to its actor.

The tests (and benchmarks/fuzz.py) send hand-made multipart messages straight to an
actor's ROUTER, bypassing the client, and read what comes back on a ROUTER of their own
(the ``reply_to`` of every Call they forge) or on the probe's DEALER (the answer to a
header too malformed to name a reply address).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import uuid
from typing import Any

import zmq

import omniflow
from omniflow.memory import PagePool
from omniflow.messages import Call, Frame
from omniflow.runtime.config import Config, parse
from omniflow.transport.codec import decode, encode

ROLE = "check"
TOKEN = b"probe-token-0123"  # the request token of every Call a probe forges (16 bytes)


def tensor_config(name: str = "sec", **runtime: Any) -> Config:
    """One role that sums the tensor ``x`` it gets, with a page pool for ``Shm`` refs
    (``runtime``: more ``[runtime]`` keys)."""
    return parse(
        {
            "name": name,
            "roles": {ROLE: {"actor": "tests.graph_roles:CheckTensor", "max_concurrency": 8}},
            "graph": {"edges": [{"from": "input", "to": ROLE}]},
            "cache": {"host_pool": "16MiB", "page_size": "64KiB"},
            "runtime": {"heartbeat_s": 0.5, "ttl_s": 10.0, "drain_timeout_s": 2.0, **runtime},
        }
    )


class LiveDeployment:
    """``omniflow.Runtime(config)`` running on its own event loop thread until ``close``."""

    def __init__(self, config: Config, role: str = ROLE) -> None:
        self.role = role
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self.rt: Any = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(config),))
        self._thread.start()
        if not self._started.wait(120) or self._error is not None:
            raise RuntimeError(f"deployment did not start: {self._error!r}")

    async def _main(self, config: Config) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with omniflow.Runtime(config) as rt:
                self.rt = rt
                self._started.set()
                await self._stop.wait()
        except BaseException as e:
            self._error = e
            self._started.set()

    @property
    def replica(self) -> Any:
        return next(r for r in self.rt.supervisor.replicas if r.role == self.role)

    @property
    def pool(self) -> PagePool:
        return self.rt.supervisor.pool

    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Run ``coro`` on the deployment's loop (``self.rt`` lives there)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def alive(self) -> bool:
        proc = self.replica.proc
        return proc is not None and proc.poll() is None

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


class Probe:
    """A DEALER to the actor and a ROUTER for the replies of the Calls it forges."""

    def __init__(self, endpoint: str, run_dir: str, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context()
        self.replies = self.ctx.socket(zmq.ROUTER)
        self.replies.setsockopt(zmq.LINGER, 0)
        self.replies.bind(f"ipc://{run_dir}/probe-{os.getpid()}-{id(self)}.sock")
        self.reply_to = self.replies.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(endpoint)
        self._n = 0
        # Unique across probes: a new probe can reuse a freed one's id(), and the actor
        # remembers the request ids that ended (a reused one is refused as replayed).
        self._tag = uuid.uuid4().hex[:12]

    def request_id(self) -> str:
        self._n += 1
        return self.last_request_id()

    def last_request_id(self) -> str:
        return f"probe-{self._tag}-{self._n}"

    def send(self, parts: list[Any]) -> None:
        self.dealer.send_multipart(parts)

    def reply(self, timeout: float = 10.0) -> Any:
        """The next message on either socket (decoded header), or None after ``timeout``."""
        poller = zmq.Poller()
        poller.register(self.replies, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout * 1000)))
        if self.replies in ready:
            return decode(self.replies.recv_multipart()[1])
        if self.dealer in ready:
            return decode(self.dealer.recv_multipart()[0])
        return None

    def call(self, rid: str, tensors: dict[str, Any], frames: list[Any], **fields: Any) -> Any:
        """Send a Call for ``rid`` with ``tensors`` refs and ``frames``; the reply for it."""
        fields.setdefault("token", TOKEN)
        call = Call(rid, ROLE, self.reply_to, tensors=tensors, credit=1, **fields)
        self.send([encode(call), *frames])
        return self.reply_for(rid)

    def reply_for(self, rid: str, timeout: float = 10.0) -> Any:
        while (msg := self.reply(timeout)) is not None:
            if getattr(msg, "request_id", rid) in (rid, ""):
                return msg
        return None

    def served(self) -> bool:
        """Whether the actor still answers a good request correctly."""
        rid = self.request_id()
        four = b"\x00\x00\x80@"  # float32 4.0, little-endian
        msg = self.call(rid, {"x": Frame(1, "float32", (2,))}, [four * 2])
        return getattr(msg, "data", {}).get("sum") == 8.0

    def close(self) -> None:
        self.replies.close(0)
        self.dealer.close(0)
