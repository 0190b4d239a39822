"""The producer's side of a hop: pick the next replica, send, split completion credit.

Every producer (the client for a request's first hop, each actor after that)
routes its own outputs: there is no central router. A ``Fanout`` holds the
branches one request opened from one producer; outputs on streaming edges go
out at once as numbered chunks, outputs on plain edges are merged and sent
when the producer finishes. Completion is tracked by credit: the producer's
share is split over the branches it opened, or returned to the client in a
``Done`` when it opened none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any

from omniflow.control.balance import NoReplicaError, PickKey, prefix_chain
from omniflow.control.branch import Branch, merge
from omniflow.control.graph import INPUT
from omniflow.control.router import FULL_CREDIT, NO_LINK, RouteError, Router, revoke_if_unsent
from omniflow.messages import ActorRecord, Call, Code, Done, Emit, Join, Timing
from omniflow.transport.codec import encode, export_tensors, revoke_tensors, split_output
from omniflow.transport.endpoint import PeerUnavailable
from omniflow.transport.links import client_link

__all__ = ["FULL_CREDIT", "NO_REPLICA_GRACE_S", "Fanout", "RouteError", "Router"]

log = logging.getLogger(__name__)

_NO_KEY = PickKey()  # what a policy that keys on nothing is handed
# How long a request waits, once, for a role that has no ready replica in this process's
# registry view before it fails as unavailable (never past its deadline). Right after a
# deployment starts, one actor's view may not have seen a neighbour turn ready yet, though
# the client's has; a replica being restarted is the other case.
NO_REPLICA_GRACE_S = 5.0
_REPICK_PAUSE_S = 0.1  # between tries of an idempotent role's only replica


class Fanout:
    """The branches one request opened from one producer."""

    def __init__(self, router: Router, src: str, call: Call) -> None:
        self.router = router
        self.src = src
        self.call = call  # the request's identity: id, reply_to, params, deadline, join
        self.branches: dict[str, Branch] = {}
        self.emitted = 0
        self.addresses: set[str] = set()
        self.waited_for_replicas = False
        # Processes this request must not be sent to: replicas that died holding it before.
        self.exclude_pids: frozenset[int] = frozenset()
        # The traceparent its hops hang under: the request's, or this role's span's.
        self.trace = call.trace

    async def output(self, output: Mapping[str, Any]) -> None:
        data, tensors = split_output(output)
        routes = self.router.plan.route(self.src, self.call.params, output, self.call.loops)
        if not routes and self.src == INPUT:
            return  # the client checks that some role took the request
        if missing := self._roles_without_replicas(routes):
            await self._wait_for_replicas(missing)
        if not routes:
            emit = Emit(self.call.request_id, self.src, self.emitted, data, token=self.call.token)
            self.emitted += 1
            link = client_link(self.call.reply_to) if tensors else NO_LINK
            rest = self.router.send_now(self.call.reply_to, emit, tensors, link)
            if rest is not None:
                await revoke_if_unsent(rest, emit, link)
            return
        for branch in self._branches_for(routes, data):
            if branch.stream:
                await self._send_chunk(branch, data, tensors, last=False, credit=0)
            else:
                merge(branch.data, data)
                branch.tensors.update(tensors)

    def peer(self, role: str) -> ActorRecord:
        """The replica this request's outputs to ``role`` will reach, picked now (the branch
        opens early): a role lending it something by pid (a KV lease) asks before sending."""
        branch = self.branches.get(role)
        if branch is None:
            edges = [e for e in self.router.plan.out_edges.get(self.src, []) if e.dst == role]
            if not edges:
                raise RouteError(Code.ERROR, f"no edge from {self.src!r} to {role!r}")
            branch = self._open(edges[0], None, {})
        return branch.record

    def _branches_for(self, routes: list, data: Mapping[str, Any]) -> list[Branch]:
        """The branch each route goes down, opened (replica picked) on first use."""
        joins = self._joins_for(routes, data)
        return [
            self.branches.get(route.edge.dst) or self._open(route.edge, joins.get(route), data)
            for route in routes
        ]

    def _roles_without_replicas(self, routes: list) -> list[str]:
        """Roles a branch must still be opened to, with no ready replica in the view (empty
        once this request has waited for them)."""
        if self.waited_for_replicas:
            return []
        view = self.router.view
        dead = self.exclude_pids  # a retry's: its dead replica may still be listed
        return [
            route.edge.dst
            for route in routes
            if route.edge.dst not in self.branches
            and not [r for r in view.replicas(route.edge.dst) if r.pid not in dead]
        ]

    async def _wait_for_replicas(self, roles: list[str]) -> None:
        """Up to NO_REPLICA_GRACE_S (and the deadline) for each role to get a ready replica;
        whatever is still missing then fails when its branch is opened."""
        self.waited_for_replicas = True
        until = time.time() + NO_REPLICA_GRACE_S
        if self.exclude_pids and self.call.deadline:
            until = self.call.deadline  # a retry after a death: its restart may take longer
        if self.call.deadline:
            until = min(until, self.call.deadline)
        for role in roles:
            await self.router.view.wait_for(role, until - time.time(), self.exclude_pids)

    def _joins_for(self, routes: list, data: Mapping[str, Any]) -> dict:
        """Join tags for routes whose branches meet again downstream."""
        passthrough = self.call.join
        if passthrough is None and all(route.join is None for route in routes):
            return {}
        by_join: dict[str, list] = {}
        for route in routes:
            if route.join is not None:
                by_join.setdefault(route.join, []).append(route)
        tags: dict = {}
        for join_role, members in by_join.items():
            if passthrough is not None and passthrough.role == join_role:
                for route in members:
                    tags[route] = passthrough
                continue
            if len(members) < 2:
                continue
            try:
                key = self._key(join_role, data)
                target = self.router.pick(join_role, key, exclude_pids=self.exclude_pids)
            except NoReplicaError:
                raise RouteError(
                    Code.UNAVAILABLE, f"no live replica of role {join_role!r}"
                ) from None
            for i, route in enumerate(members):
                tags[route] = Join(join_role, target.actor_id, len(members), i)
        return tags

    def _open(self, edge: Any, join: Join | None, data: Mapping[str, Any]) -> Branch:
        role = edge.dst
        loops = self.call.loops
        if edge.max_iters:
            loops = {**loops, edge.key: loops.get(edge.key, 0) + 1}
        if join is None and self.call.join is not None and self.call.join.role == role:
            join = self.call.join
        if join is not None and join.role == role:  # the join's replica was chosen at the split
            record = self.router.view.find(join.replica)
            if record is None:
                message = f"the {role} replica {join.replica} is gone"
                raise RouteError(Code.UNAVAILABLE, message, join.replica)
        else:
            record = self._pick(role, key=self._key(role, data))
        branch = Branch(role, record, edge.stream, join, loops)
        self.branches[role] = branch
        return branch

    def _key(self, role: str, data: Mapping[str, Any] | None = None) -> PickKey:
        """What ``role``'s policy picks by: the prefix chain only where it is used."""
        policy = self.router.policies[role]
        if not getattr(policy, "uses_key", True):
            return _NO_KEY
        c = self.call
        uses_prefix = getattr(policy, "uses_prefix", False)
        return PickKey(
            c.request_id, c.session, prefix_chain(c.session, data) if uses_prefix else ()
        )

    def _pick(
        self, role: str, exclude: frozenset[str] = frozenset(), key: PickKey | None = None
    ) -> ActorRecord:
        try:
            record = self.router.pick(role, key or self._key(role), exclude, self.exclude_pids)
        except NoReplicaError:
            raise RouteError(Code.UNAVAILABLE, f"no live replica of role {role!r}") from None
        self.router.policies[role].on_send(record.actor_id)
        return record

    async def _send_chunk(
        self,
        branch: Branch,
        data: dict,
        tensors: dict,
        last: bool,
        credit: int,
        timings: list[Timing] | None = None,
        usage: dict[str, int] | None = None,
    ) -> None:
        msg = self._chunk(branch, data, last, credit, timings, usage)
        await self._deliver(branch, msg, tensors)

    def _chunk(
        self,
        branch: Branch,
        data: dict,
        last: bool,
        credit: int,
        timings: list[Timing] | None,
        usage: dict[str, int] | None,
    ) -> Call:
        c = self.call
        return Call(
            c.request_id,
            branch.role,
            c.reply_to,
            data,
            {},
            c.params,
            branch.seq,
            last,
            credit,
            c.deadline,
            c.session,
            self.src,
            branch.join,
            timings or [],
            usage or {},
            c.hops + 1,
            branch.loops,
            self.trace,
            c.token,  # the request's, for every hop: its replies and cancels carry it
        )

    async def _deliver(self, branch: Branch, msg: Call, tensors: dict) -> None:
        while True:
            try:
                link = self.router.link(branch.record) if tensors else NO_LINK
                await self.router.send(branch.record.endpoint, msg, tensors, link)
                break
            except BaseException as e:
                # Not sent: the pool refs exported for this replica's pid would outlive it
                # (a dead one was reclaimed already); a retry exports afresh.
                if msg.tensors:
                    revoke_tensors(msg.tensors.values(), link.pid)
                    msg.tensors = {}
                if not isinstance(e, PeerUnavailable):
                    raise
                # A dead replica: retry elsewhere only where nothing of this branch went
                # out yet and the stage may run twice.
                retry = branch.seq == 0 and branch.join is None
                if not retry or branch.role not in self.router.idempotent:
                    raise RouteError(
                        Code.UNAVAILABLE,
                        f"replica {branch.record.actor_id} did not take the request",
                        branch.record.actor_id,
                    ) from None
                branch.record = await self._repick(branch)
        self._sent(branch)

    async def _repick(self, branch: Branch) -> ActorRecord:
        """Another replica for a branch of an idempotent role whose replica did not take
        it; with none, the same one again after a pause (restarting, or just restarted and
        not yet reconnected to), until the request's deadline."""
        try:
            return self._pick(branch.role, frozenset({branch.record.actor_id}))
        except RouteError:
            until = self.call.deadline or time.time() + NO_REPLICA_GRACE_S
            if time.time() + _REPICK_PAUSE_S >= until:
                raise
        await asyncio.sleep(_REPICK_PAUSE_S)
        await self.router.view.wait_for(branch.role, until - time.time(), self.exclude_pids)
        return self._pick(branch.role)

    def _sent(self, branch: Branch) -> None:
        self.addresses.add(branch.record.endpoint)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s -> %s (pid %d) %s seq %d",
                self.src,
                branch.record.actor_id,
                branch.record.pid,
                self.call.request_id,
                branch.seq,
            )
        branch.seq += 1

    def finish_now(
        self,
        credit: int,
        timings: list[Timing],
        usage: dict[str, int],
        last_output: Mapping[str, Any] | None = None,
    ) -> Awaitable[None] | None:
        """Close every branch, splitting ``credit``; with none open, return it to the client.

        ``last_output`` is a final output not yet routed: when it goes to the client and
        no branch is open, it rides inside the Done. Runs in synchronous code: what the
        peers' queues take goes out here, in order; what is left to await is returned
        (None when nothing is).
        """
        if last_output is not None:
            data, tensors = split_output(last_output)
            routes = self.router.plan.route(
                self.src, self.call.params, last_output, self.call.loops
            )
            if not routes and not self.branches:
                if self.src == INPUT:
                    raise RouteError(Code.BAD_REQUEST.value, "no role accepts this input")
                done = Done(
                    self.call.request_id, self.src, credit, timings, usage, self.emitted, data
                )
                done.token = self.call.token
                self.emitted += 1
                link = client_link(self.call.reply_to) if tensors else NO_LINK
                rest = self.router.send_now(self.call.reply_to, done, tensors, link)
                return (
                    rest if rest is None or not done.tensors else revoke_if_unsent(rest, done, link)
                )
            if not routes or any(route.edge.stream for route in routes):
                # It goes out on its own first: an Emit, or chunks on streaming edges.
                return self._output_then_finish(last_output, credit, timings, usage)
            if missing := self._roles_without_replicas(routes):
                return self._finish_when_ready(missing, credit, timings, usage, last_output)
            for branch in self._branches_for(routes, data):
                merge(branch.data, data)
                branch.tensors.update(tensors)
        if not self.branches:
            done = Done(self.call.request_id, self.src, credit, timings, usage)
            done.token = self.call.token
            return self.router.send_now(self.call.reply_to, done, {})
        return self._close_branches(credit, timings, usage)

    async def finish(
        self,
        credit: int,
        timings: list[Timing],
        usage: dict[str, int],
        last_output: Mapping[str, Any] | None = None,
    ) -> None:
        """``finish_now``, awaiting what it leaves."""
        rest = self.finish_now(credit, timings, usage, last_output)
        if rest is not None:
            await rest

    async def _finish_when_ready(
        self,
        roles: list[str],
        credit: int,
        timings: list[Timing],
        usage: dict[str, int],
        last_output: Mapping[str, Any],
    ) -> None:
        await self._wait_for_replicas(roles)
        await self.finish(credit, timings, usage, last_output)

    async def _output_then_finish(
        self, last_output: Mapping[str, Any], credit: int, timings: list[Timing], usage: dict
    ) -> None:
        await self.output(last_output)
        await self.finish(credit, timings, usage)

    def _close_branches(
        self, credit: int, timings: list[Timing], usage: dict[str, int]
    ) -> Awaitable[None] | None:
        """Each branch's last chunk, with its share of ``credit`` (the extra, the timings and
        the usage ride on the first); sent in order while the peers' queues take them."""
        share, extra = divmod(credit, len(self.branches))
        closing: list[tuple[Branch, Call, dict]] = []
        for i, branch in enumerate(self.branches.values()):
            data, tensors = ({}, {}) if branch.stream else (branch.data, branch.tensors)
            if i == 0:
                msg = self._chunk(branch, data, True, share + extra, timings, usage)
            else:
                msg = self._chunk(branch, data, True, share, None, None)
            closing.append((branch, msg, tensors))
        for i, (branch, msg, tensors) in enumerate(closing):
            if tensors:
                sent = self._try_deliver(branch, msg, tensors)
            else:
                sent = self.router.outbox.try_send(branch.record.endpoint, [encode(msg)])
            if not sent:
                return self._deliver_all(closing[i:])  # in order: after one waits, the rest do
            self._sent(branch)
            self.router.policies[branch.role].on_done(branch.record.actor_id)
        return None

    def _try_deliver(self, branch: Branch, msg: Call, tensors: dict) -> bool:
        """Export ``tensors`` for the branch's replica and send now if its queue takes it
        (no Task for a hop with tensors); else take the refs back, for ``_deliver`` to
        export afresh (it may retry elsewhere), and return False."""
        link = self.router.link(branch.record)
        frames: list[Any] = [b""]
        msg.tensors = export_tensors(dict(tensors), frames, link)
        try:
            frames[0] = encode(msg)
            if self.router.outbox.try_send(branch.record.endpoint, frames):
                return True
        except BaseException:
            revoke_tensors(msg.tensors.values(), link.pid)
            msg.tensors = {}
            raise
        revoke_tensors(msg.tensors.values(), link.pid)
        msg.tensors = {}
        return False

    async def _deliver_all(self, closing: list[tuple[Branch, Call, dict]]) -> None:
        for branch, msg, tensors in closing:
            await self._deliver(branch, msg, tensors)
            self.router.policies[branch.role].on_done(branch.record.actor_id)
