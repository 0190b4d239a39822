"""The client: the first producer of every request, and where its outputs arrive.

It binds its own ROUTER for replies, holds a registry view, picks the entry
replicas itself, and finishes a request when every share of its completion
credit came back in a ``Done`` (or at the first ``Fail``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Collection, Mapping
from pathlib import Path
from typing import Any, NoReturn

import zmq

from omniflow.control.balance import make_policy
from omniflow.control.discovery import open_registry
from omniflow.control.discovery.view import RegistryView
from omniflow.control.graph import INPUT
from omniflow.control.routing import FULL_CREDIT, Fanout, RouteError, Router
from omniflow.messages import Call, Cancel, Code, DataMessage, Done, Emit, Fail, add_usage
from omniflow.runtime import tracing
from omniflow.runtime.config import Config
from omniflow.runtime.migration import Migration
from omniflow.runtime.requests import (
    TIMEOUT,
    Collect,
    Output,
    Pending,
    RequestFailed,
    Result,
    cancel_is_moot,
    no_answer,
    patience,
)
from omniflow.transport.codec import (
    BadMessage,
    check_parts,
    decode,
    decoder_for,
    encode,
    materialize_tensors,
    release_tensors,
)
from omniflow.transport.endpoint import Inbox, Outbox
from omniflow.transport.links import attach_pool, attached_pool, detach_pool, pool_client_address
from omniflow.transport.throttle import Throttled

__all__ = ["Client", "Output", "RequestFailed", "Result"]

log = logging.getLogger(__name__)
_decoder = decoder_for(DataMessage)
_client_ids = itertools.count()
_PATIENCE_TICK = 0.1  # seconds: how often waits past their deadline are ended


class Client(Migration):
    def __init__(
        self, config: Config, registry_address: str, run_dir: Path, pool: Any = None
    ) -> None:
        """``pool``: the deployment's ``PagePool``, mapped in this process (the supervisor's
        own): outputs then come back from this host's roles as pool handles, not bytes."""
        self.config = config
        self._pool = pool
        self._own_pool = False  # outputs come as pool handles, inputs go as them
        self._attached = False  # this client attached the pool: it detaches it
        self.registry_address = registry_address
        self.run_dir = Path(run_dir)
        self._pending: dict[str, Pending] = {}
        self.ctx: zmq.Context | None = None
        self._id_prefix = uuid.uuid4().hex[:16]  # unique per client; a counter after it
        self._ids = itertools.count()
        self._sweeper: asyncio.TimerHandle | None = None
        self._migrating: set[asyncio.Task] = set()
        # Messages for a request in flight that lack its token: dropped, warned about.
        self._forged = Throttled(
            log, "client: dropped a %s for request %s: not a reply with its token"
        )

    async def start(self) -> None:
        self.ctx = zmq.Context()
        if self.config.runtime.transport == "tcp":
            address = f"tcp://{self.config.addresses()[0]}:*"
        else:
            n = next(_client_ids)
            address = f"ipc://{self.run_dir}/client-{os.getpid()}-{n}.sock"
            if self._pool is not None and attached_pool() in (None, self._pool):
                if attached_pool() is None:  # else mapped for the process (a worker's)
                    attach_pool(self._pool, self.config.cache.frame_threshold_bytes)
                    self._attached = True
                self._own_pool = True
                address = pool_client_address(str(self.run_dir), os.getpid(), n)
        keys = self.config.security.load_keys()
        advertise = self.config.addresses()[1]
        self.inbox = Inbox(
            self.ctx,
            address,
            self._on_message,
            keys=keys,
            advertise=advertise,
            max_message=self.config.runtime.max_message_bytes,
        )
        self.inbox.start()
        self.registry = open_registry(self.registry_address)
        self.view = RegistryView(self.registry, self.config.name)
        self.view.on_gone = self._replica_gone
        await self.view.start()
        self.outbox = Outbox(self.ctx, self.config.runtime.send_timeout_s, keys=keys)
        policies = {
            name: make_policy(rc.policy, role=name) for name, rc in self.config.roles.items()
        }
        idempotent = frozenset(n for n, rc in self.config.roles.items() if rc.idempotent)
        # Inputs go by pool handle only through this deployment's pool: where the process
        # maps another one (a second Runtime's), no replica counts as on this host for them.
        host = self.config.host_id
        if attached_pool() is not None and not self._own_pool:
            host = f"{host} (another deployment's pool is attached here)"
        self.router = Router(self.config.plan(), self.view, self.outbox, policies, idempotent, host)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for task in self._migrating:
            task.cancel()
        for pending in list(self._pending.values()):
            pending.push(RequestFailed(Code.CANCELLED.value, "client closed", "client", ""))
        self.inbox.close()
        if self._attached and attached_pool() is self._pool:
            detach_pool()  # the supervisor closes the pool itself
        self._attached = False
        await self.view.close()
        await self.registry.close()
        self.outbox.close()
        assert self.ctx is not None
        self.ctx.term()

    async def wait_ready(self, timeout: float = 10.0, roles: Collection[str] | None = None) -> None:
        """Wait until every role (of ``roles``, if given) has a live replica."""
        for role in self.config.roles if roles is None else roles:
            if not await self.view.wait_for(role, timeout):
                raise RequestFailed(Code.UNAVAILABLE.value, "no live replica", role, "")

    def _on_message(self, identity: bytes, parts: list[Any]) -> None:
        try:
            msg = decode(parts[0], _decoder)
        except BadMessage:
            return
        pending = self._pending.get(getattr(msg, "request_id", ""))
        late = pending is None
        if pending is not None and not _shows_token(msg, pending.token):
            # Not from the roles the request went to: it never answers nor ends it (nor
            # releases refs: they may name blocks the request's own messages bring).
            self._forged.note(type(msg).__name__, msg.request_id)
            pending = None
        try:
            check_parts(msg, parts)
        except BadMessage as e:
            release_tensors(getattr(msg, "tensors", {}).values(), opened=False)
            if pending is not None:
                role = getattr(msg, "role", "")
                pending.push(RequestFailed(Code.BAD_REQUEST.value, str(e), role, msg.request_id))
            return
        if pending is None:
            if late:  # of a request that already ended (cancelled, timed out): its
                # blocks go back, or they stay the pool's until this process ends
                release_tensors(getattr(msg, "tensors", {}).values(), opened=False)
            return
        pending.heard = True
        if isinstance(msg, Emit):
            tensors = materialize_tensors(msg.tensors, parts, True) if msg.tensors else {}
            pending.deliver(Output(msg.role, msg.seq, msg.data, tensors))
        elif isinstance(msg, Done):
            if msg.seq >= 0:
                tensors = materialize_tensors(msg.tensors, parts, True) if msg.tensors else {}
                pending.deliver(Output(msg.role, msg.seq, msg.data, tensors))
            pending.credit += msg.credit
            pending.timings += msg.timings
            add_usage(pending.usage, msg.usage)
            if pending.credit >= FULL_CREDIT:
                latency = (time.perf_counter() - pending.started) * 1e3
                result = Result(
                    pending.request_id, pending.usage, pending.timings, latency, pending.migrations
                )
                pending.push(result)
        elif isinstance(msg, Fail):
            if msg.code == Code.UNAVAILABLE.value:
                return self._lost(pending, msg)
            pending.push(RequestFailed(msg.code, msg.message, msg.role, pending.request_id))

    async def stream(
        self,
        inputs: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        session: str = "",
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Output | Result]:
        """Send one request; yield its ``Output`` chunks, then one ``Result``.

        Raises ``RequestFailed`` if any role fails it. Leaving the loop early
        cancels the request everywhere it went.
        """
        queue: asyncio.Queue = asyncio.Queue()
        pending, deadline, rest = self._open(
            inputs, params, session, timeout, request_id, queue.put_nowait
        )
        if rest is not None:
            await self._sent(pending, rest)
        finished = False
        # No wait_for around get(): Python 3.11's swallows a cancel that lands as the
        # get completes, and the disconnect is lost. A timer queues the timeout instead.
        timer = (
            asyncio.get_running_loop().call_later(patience(deadline), queue.put_nowait, TIMEOUT)
            if deadline
            else None
        )
        try:
            while True:
                item = await queue.get()
                if item is TIMEOUT:
                    raise no_answer(pending.request_id)
                if isinstance(item, RequestFailed):
                    finished = cancel_is_moot(pending, item)
                    raise item
                if isinstance(item, Result):
                    finished = True  # before the yield: the caller may stop iterating here
                    yield item
                    return
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            self._end(pending, finished)

    def _open(
        self,
        inputs: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        session: str,
        timeout: float | None,
        request_id: str | None,
        push: Any,
    ) -> tuple[Pending, float, Awaitable[None] | None]:
        """Start a new request: route its first hop; its events go to ``push``.

        The first hop leaves from here when the entry replica's queue takes it; else
        the last item is what is left to await (``_sent`` it).
        """
        request_id = request_id or f"{self._id_prefix}{next(self._ids):x}"
        # Every request gets a deadline: a branch lost with a dead replica ends in
        # `deadline` instead of a wait without end.
        cap = self.config.runtime.request_timeout_s
        timeout = min(timeout, cap) if timeout and cap else (timeout or cap)
        deadline = time.time() + timeout if timeout else 0.0
        migratable = self.config.runtime.max_migrations > 0
        pending = Pending(push, deadline + 1.0 if deadline else 0.0, request_id, migratable)
        call = Call(
            request_id,
            "",
            self.inbox.endpoint,
            params=dict(params or {}),
            deadline=deadline,
            session=session,
            origin="client",
            trace=tracing.CURRENT.get(),  # the caller's traceparent (the HTTP request's)
            token=pending.token,
        )
        if migratable:  # what a resend takes; inputs may be large tensors
            pending.resend = (dict(inputs or {}), dict(params or {}), session, deadline)
        pending.fanout = fanout = Fanout(self.router, INPUT, call)
        self._pending[request_id] = pending
        try:
            rest = fanout.finish_now(FULL_CREDIT, [], {}, dict(inputs or {}))
        except BaseException as e:
            if not self._moved_on(pending, e):
                self._failed_to_send(pending, e)
            rest = None
        return pending, deadline, rest

    async def _sent(self, pending: Pending, rest: Awaitable[None]) -> None:
        try:
            await rest
        except BaseException as e:
            if not self._moved_on(pending, e):
                self._failed_to_send(pending, e)

    def _failed_to_send(self, pending: Pending, error: BaseException) -> NoReturn:
        self._end(pending, False)
        if isinstance(error, RouteError):
            raise RequestFailed(error.code, str(error), "client", pending.request_id) from None
        raise error

    def _end(self, pending: Pending, finished: bool) -> None:
        """Forget a request; one left unfinished is cancelled everywhere it went."""
        self._pending.pop(pending.attempt, None)
        if not finished and pending.fanout is not None:
            cancel = [encode(Cancel(pending.attempt, token=pending.token))]
            for address in pending.fanout.addresses:
                with contextlib.suppress(Exception):
                    self.outbox.post(address, cancel)

    async def call(
        self,
        inputs: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        session: str = "",
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> tuple[list[Output], Result]:
        """Run one request to its end; every output chunk and the result.

        The same as collecting ``stream``, without a generator and a queue in the
        way: outputs are appended as they arrive and one future ends the wait. The
        wait is bounded by one sweep timer per client, not a timer per call.
        """
        collect = Collect(asyncio.get_running_loop().create_future())
        pending, deadline, rest = self._open(inputs, params, session, timeout, request_id, collect)
        if rest is not None:
            await self._sent(pending, rest)
        finished = False
        if deadline and self._sweeper is None:
            self._watch_patience()
        try:
            result = await collect.done
            finished = True
            return collect.outputs, result
        except RequestFailed as e:
            finished = cancel_is_moot(pending, e)
            raise
        finally:
            self._end(pending, finished)

    def _watch_patience(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(_PATIENCE_TICK, self._sweep_patience)

    def _sweep_patience(self) -> None:
        """End the waits of ``call``s whose deadline passed a second ago with no answer."""
        self._sweeper = None
        now = time.time()
        waiting = False
        for pending in list(self._pending.values()):
            if not pending.patience or not isinstance(pending.push, Collect):
                continue
            if pending.patience <= now:
                pending.push(no_answer(pending.request_id))
            else:
                waiting = True
        if waiting:
            self._watch_patience()


def _shows_token(msg: Any, token: bytes) -> bool:
    """Whether ``msg`` is a reply kind that carries ``token``, the request's."""
    if not isinstance(msg, Emit | Done | Fail):
        return False
    return hmac.compare_digest(msg.token, token)
