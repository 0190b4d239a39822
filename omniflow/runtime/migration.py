"""What a client does when a replica dies holding its requests: each moves on to another
replica under a new attempt id (resuming what was streamed) or fails once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

from omniflow.control.discovery.view import RegistryView
from omniflow.control.graph import INPUT
from omniflow.control.routing import FULL_CREDIT, Fanout, RouteError, Router
from omniflow.messages import LEAVING, ActorRecord, Call, Cancel, Code, Fail
from omniflow.runtime.actor import RESUMABLE_META
from omniflow.runtime.config import Config
from omniflow.runtime.requests import Pending, RequestFailed
from omniflow.transport.codec import encode
from omniflow.transport.endpoint import Inbox, Outbox, PeerUnavailable

log = logging.getLogger("omniflow.runtime.client")
# How long after a replica left the view the requests it may have dropped unread move on:
# time for the supervisor's death notices (which cover what it had read) to arrive first.
_GONE_GRACE_S = 0.5


class Migration:
    """The client's failover, as a base of ``Client``: it reads the client's config, view,
    router, sockets and requests in flight."""

    config: Config
    view: RegistryView
    router: Router
    inbox: Inbox
    outbox: Outbox
    _pending: dict[str, Pending]
    _migrating: set[asyncio.Task]

    def _lost(self, pending: Pending, fail: Fail) -> None:
        """A replica died holding the request: it moves on elsewhere, or fails once."""
        # branches orphaned by the death
        self._cancel_after(pending, fail.replica.rpartition("/")[0] or fail.role)
        why = self._cannot_migrate(pending, fail)
        if why is None:
            return self._migrate(pending, fail)
        message = f"{fail.message}; {why}" if why else fail.message
        pending.push(RequestFailed(fail.code, message, fail.role, pending.request_id))

    def _cannot_migrate(self, pending: Pending, fail: Fail) -> str | None:
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

    def _moved_on(self, pending: Pending, error: BaseException) -> bool:
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

    def _held_by(self, record: ActorRecord) -> dict[str, Pending]:
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

    def _lost_with_replica(self, record: ActorRecord, held: list[tuple[Pending, str]]) -> None:
        for pending, attempt in held:
            if self._pending.get(attempt) is not pending:
                continue  # ended, or moved on by a death notice meanwhile
            where = f" on host {record.host}" if record.host != self.config.host_id else ""
            message = f"{record.actor_id}{where} left the registry while handling it"
            self._lost(
                pending,
                Fail(Code.UNAVAILABLE.value, message, record.role, attempt, record.actor_id),
            )

    def _lost_in_queue(self, record: ActorRecord, suspects: list[tuple[Pending, str]]) -> None:
        for pending, attempt in suspects:
            if pending.heard or self._pending.get(attempt) is not pending:
                continue  # answered meanwhile, migrated by a notice, or ended
            message = f"{record.actor_id} died before it answered"
            fail = Fail(Code.UNAVAILABLE.value, message, record.role, attempt, record.actor_id)
            if self._cannot_migrate(pending, fail) is None:
                self._cancel_after(pending, record.role)
                self._migrate(pending, fail, record.pid)
            # Else it is left to its deadline: it may be on its way past that replica.

    def _cancel_after(self, pending: Pending, dead: str) -> None:
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

    def _migrate(self, pending: Pending, fail: Fail, pid: int = 0) -> None:
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

    async def _migration_sent(self, pending: Pending, rest: Awaitable[None]) -> None:
        try:
            await rest
        except RouteError as e:
            if not self._moved_on(pending, e):
                pending.push(RequestFailed(e.code, str(e), "client", pending.request_id))
        except PeerUnavailable as e:
            pending.push(
                RequestFailed(Code.UNAVAILABLE.value, str(e), "client", pending.request_id)
            )


def _sent_to(fanout: Fanout, record: ActorRecord) -> bool:
    """Whether ``fanout`` sent a branch to that process of a replica."""
    return any(
        b.record.pid == record.pid and b.record.actor_id == record.actor_id
        for b in fanout.branches.values()
    )
