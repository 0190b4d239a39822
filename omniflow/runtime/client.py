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
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import zmq

from omniflow.control.balance import make_policy
from omniflow.control.discovery import open_registry
from omniflow.control.discovery.view import RegistryView
from omniflow.control.graph import INPUT
from omniflow.control.routing import FULL_CREDIT, Fanout, RouteError, Router
from omniflow.messages import (
    LEAVING,
    TOKEN_BYTES,
    ActorRecord,
    Call,
    Cancel,
    Code,
    DataMessage,
    Done,
    Emit,
    Fail,
    Timing,
    add_usage,
)
from omniflow.runtime import tracing
from omniflow.runtime.actor import RESUMABLE_META
from omniflow.runtime.config import Config
from omniflow.transport.codec import (
    BadMessage,
    check_parts,
    decode,
    decoder_for,
    encode,
    materialize_tensors,
    release_tensors,
)
from omniflow.transport.endpoint import Inbox, Outbox, PeerUnavailable
from omniflow.transport.links import attach_pool, attached_pool, detach_pool, pool_client_address
from omniflow.transport.throttle import Throttled

log = logging.getLogger(__name__)
_decoder = decoder_for(DataMessage)
_client_ids = itertools.count()
_PATIENCE_TICK = 0.1  # seconds: how often waits past their deadline are ended
# How long after a replica left the view the requests it may have dropped unread move on:
# time for the supervisor's death notices (which cover what it had read) to arrive first.
_GONE_GRACE_S = 0.5


class RequestFailed(RuntimeError):
    """A request ended with ``Fail``: ``code``, ``role`` and ``request_id`` say where and why."""

    def __init__(self, code: str, message: str, role: str, request_id: str) -> None:
        super().__init__(f"[{code}] {role}: {message} (request {request_id})")
        self.code = code
        self.role = role
        self.request_id = request_id
        self.detail = message


@dataclass
class Output:
    """One streamed chunk of output from ``role``."""

    role: str
    seq: int
    data: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    """The end of a request: usage counters and each role's compute time."""

    request_id: str
    usage: dict[str, int]
    timings: list[Timing]
    latency_ms: float
    migrations: int = 0  # times it moved to another replica after one died holding it


class _Pending:
    """A request in flight: where its events go, the credit that came back, and what it
    takes to send it again (migrate it) if a replica dies holding it."""

    __slots__ = (
        "push",
        "credit",
        "usage",
        "timings",
        "started",
        "patience",
        "request_id",
        "attempt",
        "fanout",
        "resend",
        "migrations",
        "exclude",
        "delivered",
        "skip",
        "offset",
        "tokens",
        "token_role",
        "text_done",
        "heard",
        "migratable",
        "token",
    )

    def __init__(
        self, push: Any, patience: float, request_id: str, migratable: bool = True
    ) -> None:
        self.push = push  # called with each Output, then a Result or a RequestFailed
        self.credit = 0
        self.usage: dict[str, int] = {}
        self.timings: list[Timing] = []
        self.started = time.perf_counter()
        self.patience = patience  # time.time() after which the client stops waiting
        self.request_id = request_id  # the caller's id; an attempt after a migration differs
        self.attempt = request_id
        self.fanout: Fanout | None = None
        self.resend: tuple[dict, dict, str, float] = ({}, {}, "", 0.0)
        self.migrations = 0
        self.exclude: frozenset[int] = frozenset()  # pids of replicas that died holding it
        self.delivered: dict[str, int] = {}  # role -> output chunks handed to the caller
        self.skip: dict[str, int] = {}  # role -> chunks of a new attempt it already has
        self.offset: dict[str, int] = {}  # role -> seq shift of the role that resumes
        self.tokens: list[int] = []  # ids of the text streamed so far (outputs' "tokens")
        self.token_role = ""
        self.text_done = False
        self.heard = False  # anything came back for the current attempt
        # False with migration off: nothing above is kept for a resend (inputs, tokens).
        self.migratable = migratable
        # Drawn for this request and sent in its Call: what comes back must show it.
        self.token = secrets.token_bytes(TOKEN_BYTES)

    def deliver(self, output: Output) -> None:
        """Hand one output to the caller, once: after a migration, what the new attempt
        sends again is dropped and the resuming role's chunks go on numbering."""
        if not self.migratable:
            self.push(output)
            return
        role = output.role
        if role in self.offset:
            output.seq += self.offset[role]
        elif output.seq < self.skip.get(role, 0):
            return
        self.delivered[role] = max(self.delivered.get(role, 0), output.seq + 1)
        tokens = output.data.get("tokens")
        if isinstance(tokens, list):
            self.tokens += tokens
            self.token_role = role
            self.text_done = self.text_done or bool(output.data.get("finished"))
        self.push(output)


class _Collect:
    """``push`` for ``call``: outputs into a list, the end into one future."""

    __slots__ = ("outputs", "done")

    def __init__(self, done: asyncio.Future) -> None:
        self.outputs: list[Output] = []
        self.done = done

    def __call__(self, item: Any) -> None:
        if isinstance(item, Output):
            self.outputs.append(item)
        elif not self.done.done():
            if isinstance(item, RequestFailed):
                self.done.set_exception(item)
            else:
                self.done.set_result(item)


class Client:
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
        self._pending: dict[str, _Pending] = {}
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
        if pending is not None and not _shows_token(msg, pending.token):
            # Not from the roles the request went to: it never answers nor ends it.
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
            return  # a late message of a request that already ended
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

    def _lost(self, pending: _Pending, fail: Fail) -> None:
        """A replica died holding the request: it moves on elsewhere, or fails once."""
        # branches orphaned by the death
        self._cancel_after(pending, fail.replica.rpartition("/")[0] or fail.role)
        why = self._cannot_migrate(pending, fail)
        if why is None:
            return self._migrate(pending, fail)
        message = f"{fail.message}; {why}" if why else fail.message
        pending.push(RequestFailed(fail.code, message, fail.role, pending.request_id))

    # ------------------------------------------------------------------ migration

    def _cannot_migrate(self, pending: _Pending, fail: Fail) -> str | None:
        """Why a request that lost a replica cannot go on elsewhere ("" when no reason is
        worth naming); None when it can."""
        limit = self.config.runtime.max_migrations
        if not pending.migratable or pending.migrations >= limit:
            return f"moved {limit} times already" if limit else ""
        deadline = pending.resend[3]
        if deadline and deadline <= time.time():
            return ""
        if not fail.replica:
            return ""  # no replica named as dead or not taking it: fails as before migration
        # The dead replica's role must be one that may run a request again: idempotent
        # (then on another replica, or its restart: the new attempt waits a little for a
        # ready one), or resuming what was streamed (the LLM: on another replica, up now).
        role = fail.replica.rpartition("/")[0]
        idempotent = role in self.router.idempotent
        if not idempotent and not self.view.flagged(role, RESUMABLE_META):
            return ""
        others = [
            r
            for r in self.view.replicas(role)
            if r.actor_id != fail.replica and r.pid not in pending.exclude
        ]
        if not others and not idempotent:
            return f"no other replica of {role!r} to move it to"
        return None

    def _moved_on(self, pending: _Pending, error: BaseException) -> bool:
        """A first hop that a replica did not take (dead, most likely): the request moves
        on as after a death notice, where it may (True)."""
        if not isinstance(error, RouteError) or not error.replica:
            return False
        if (
            error.code != Code.UNAVAILABLE.value
            or self._pending.get(pending.attempt) is not pending
        ):
            return False  # another failure, or the request ended meanwhile
        role = error.replica.rpartition("/")[0]
        fail = Fail(Code.UNAVAILABLE.value, str(error), role, pending.attempt, error.replica)
        if self._cannot_migrate(pending, fail) is not None:
            return False
        self._cancel_after(pending, role)
        self._migrate(pending, fail)
        return True

    def _replica_gone(self, record: ActorRecord) -> None:
        """A replica left the view (it died, most likely). What this client sent it and has
        heard nothing of since may have sat unread in its queue, which no death notice
        covers (the supervisor knows only what it read): shortly after, once any notice had
        time to arrive, each such request moves on as a migration would, where it may."""
        suspects = [
            (p, p.attempt)
            for p in self._pending.values()
            if p.migratable and not p.heard and p.fanout is not None and _sent_to(p.fanout, record)
        ]
        # What it was working on for this client: its supervisor answers for those when the
        # replica dies, but not when the whole host went (its leases expired), so they end
        # here too, as that notice would (the first wins). Known from its record's holding
        # (as of its last heartbeat, which lags under load) and, for the role streaming a
        # request's text to this client, from the replica this client sent it to.
        if record.state == LEAVING:  # it drains what it holds before it goes
            held = {}
        else:
            held = self._held_by(record)
        loop = asyncio.get_running_loop()
        if suspects:
            loop.call_later(_GONE_GRACE_S, self._lost_in_queue, record, suspects)
        if held:
            lost = [(p, attempt) for attempt, p in held.items()]
            loop.call_later(_GONE_GRACE_S, self._lost_with_replica, record, lost)

    def _held_by(self, record: ActorRecord) -> dict[str, _Pending]:
        held = {
            attempt: p
            for attempt, reply_to in record.holding
            if reply_to == self.inbox.endpoint and (p := self._pending.get(attempt)) is not None
        }
        for p in self._pending.values():
            streaming = p.token_role == record.role and not p.text_done
            if streaming and p.fanout is not None and _sent_to(p.fanout, record):
                held[p.attempt] = p
        return held

    def _lost_with_replica(self, record: ActorRecord, held: list[tuple[_Pending, str]]) -> None:
        for pending, attempt in held:
            if self._pending.get(attempt) is not pending:
                continue  # ended, or moved on by a death notice meanwhile
            where = f" on host {record.host}" if record.host != self.config.host_id else ""
            message = f"{record.actor_id}{where} left the registry while handling it"
            self._lost(
                pending,
                Fail(Code.UNAVAILABLE.value, message, record.role, attempt, record.actor_id),
            )

    def _lost_in_queue(self, record: ActorRecord, suspects: list[tuple[_Pending, str]]) -> None:
        for pending, attempt in suspects:
            if pending.heard or self._pending.get(attempt) is not pending:
                continue  # answered meanwhile, migrated by a notice, or ended
            message = f"{record.actor_id} died before it answered"
            fail = Fail(Code.UNAVAILABLE.value, message, record.role, attempt, record.actor_id)
            if self._cannot_migrate(pending, fail) is None:
                self._cancel_after(pending, record.role)
                self._migrate(pending, fail, record.pid)
            # Else it is left to its deadline: it may be on its way past that replica.

    def _cancel_after(self, pending: _Pending, dead: str) -> None:
        """Cancel the current attempt where it may still be after a replica of role ``dead``
        died with it: every replica of the roles after ``dead`` (its branches there, parts
        waiting at a join, hold pool blocks and compute, and no one else would cancel them),
        and the replicas this client sent it to (each passes the Cancel on along the path it
        sent the request). Roles off its path are left alone."""
        addresses = set(pending.fanout.addresses) if pending.fanout is not None else set()
        for role in self.router.plan.downstream(dead):
            addresses.update(record.endpoint for record in self.view.replicas(role))
        cancel = [encode(Cancel(pending.attempt, Code.UNAVAILABLE.value, pending.token))]
        for address in addresses:
            with contextlib.suppress(Exception):
                self.outbox.post(address, cancel)

    def _migrate(self, pending: _Pending, fail: Fail, pid: int = 0) -> None:
        """Send the request again under a new attempt id, away from the dead replica, with
        the text already streamed as ``params["resume"]``: the LLM re-prefills it and goes
        on; outputs the caller has already are not handed over twice."""
        del self._pending[pending.attempt]
        pending.migrations += 1
        dead = self.view.find(fail.replica) if fail.replica else None
        pid = pid or (dead.pid if dead is not None else 0)
        if pid:  # still listed (the view may not have seen it go): never pick that process
            pending.exclude |= {pid}
        pending.offset = (
            {pending.token_role: pending.delivered.get(pending.token_role, 0)}
            if pending.token_role
            else {}
        )
        pending.skip = dict(pending.delivered)
        pending.credit = 0
        pending.heard = False
        pending.usage, pending.timings = {}, []
        inputs, params, session, deadline = pending.resend
        if pending.tokens or pending.text_done:
            params = {**params, "resume": {"tokens": pending.tokens, "finished": pending.text_done}}
        attempt = f"{pending.request_id}~{pending.migrations}"
        call = Call(
            attempt,
            "",
            self.inbox.endpoint,
            params=params,
            deadline=deadline,
            session=session,
            origin="client",
            trace=pending.fanout.call.trace if pending.fanout is not None else "",
            token=pending.token,
        )
        fanout = Fanout(self.router, INPUT, call)
        fanout.exclude_pids = pending.exclude
        pending.attempt, pending.fanout = attempt, fanout
        self._pending[attempt] = pending
        log.info("request %s moves on as %s: %s", pending.request_id, attempt, fail.message)
        try:
            rest = fanout.finish_now(FULL_CREDIT, [], {}, inputs)
        except RouteError as e:
            if not self._moved_on(pending, e):
                pending.push(RequestFailed(e.code, str(e), "client", pending.request_id))
            return
        if rest is not None:
            task = asyncio.get_running_loop().create_task(self._migration_sent(pending, rest))
            self._migrating.add(task)
            task.add_done_callback(self._migrating.discard)

    async def _migration_sent(self, pending: _Pending, rest: Awaitable[None]) -> None:
        try:
            await rest
        except RouteError as e:
            if not self._moved_on(pending, e):
                pending.push(RequestFailed(e.code, str(e), "client", pending.request_id))
        except PeerUnavailable as e:
            pending.push(
                RequestFailed(Code.UNAVAILABLE.value, str(e), "client", pending.request_id)
            )

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
            asyncio.get_running_loop().call_later(_patience(deadline), queue.put_nowait, _TIMEOUT)
            if deadline
            else None
        )
        try:
            while True:
                item = await queue.get()
                if item is _TIMEOUT:
                    raise _no_answer(pending.request_id)
                if isinstance(item, RequestFailed):
                    finished = _cancel_is_moot(pending, item)
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
    ) -> tuple[_Pending, float, Awaitable[None] | None]:
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
        pending = _Pending(push, deadline + 1.0 if deadline else 0.0, request_id, migratable)
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

    async def _sent(self, pending: _Pending, rest: Awaitable[None]) -> None:
        try:
            await rest
        except BaseException as e:
            if not self._moved_on(pending, e):
                self._failed_to_send(pending, e)

    def _failed_to_send(self, pending: _Pending, error: BaseException) -> NoReturn:
        self._end(pending, False)
        if isinstance(error, RouteError):
            raise RequestFailed(error.code, str(error), "client", pending.request_id) from None
        raise error

    def _end(self, pending: _Pending, finished: bool) -> None:
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
        collect = _Collect(asyncio.get_running_loop().create_future())
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
            finished = _cancel_is_moot(pending, e)
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
            if not pending.patience or not isinstance(pending.push, _Collect):
                continue
            if pending.patience <= now:
                pending.push(_no_answer(pending.request_id))
            else:
                waiting = True
        if waiting:
            self._watch_patience()


def _shows_token(msg: Any, token: bytes) -> bool:
    """Whether ``msg`` is a reply kind that carries ``token``, the request's."""
    if not isinstance(msg, Emit | Done | Fail):
        return False
    return hmac.compare_digest(msg.token, token)


def _sent_to(fanout: Fanout, record: ActorRecord) -> bool:
    """Whether ``fanout`` sent a branch to that process of a replica."""
    return any(
        b.record.pid == record.pid and b.record.actor_id == record.actor_id
        for b in fanout.branches.values()
    )


def _cancel_is_moot(pending: _Pending, failure: RequestFailed) -> bool:
    """Whether a failed request needs no Cancel: the failing role cancels only what it
    sent itself, so the other branches (parts waiting at a join, a producer still
    streaming) must be cancelled from here, unless the client opened one branch only and
    that is the role that failed (as a request refused at its first hop)."""
    fanout = pending.fanout
    return fanout is not None and len(fanout.branches) == 1 and failure.role in fanout.branches


_TIMEOUT = object()  # queued by stream()'s timer at the deadline's patience


def _patience(deadline: float) -> float:
    """How long the client waits: roles enforce the deadline, this bounds a dead path."""
    return max(0.0, deadline - time.time()) + 1.0


def _no_answer(request_id: str) -> RequestFailed:
    return RequestFailed(Code.DEADLINE.value, "no answer before the deadline", "client", request_id)
