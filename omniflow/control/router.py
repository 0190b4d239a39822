"""What every producer in one process shares to route its hops: the plan, the registry
view, the policies and the sockets (``Router``): it picks a replica and sends a message,
its tensors exported for the link to that replica."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any

from omniflow.control.balance import NoReplicaError, PickKey
from omniflow.control.discovery.view import RegistryView
from omniflow.control.graph import Plan
from omniflow.messages import ActorRecord
from omniflow.transport.codec import encode, export_tensors, revoke_tensors
from omniflow.transport.endpoint import Outbox
from omniflow.transport.links import Link

FULL_CREDIT = 1 << 62
NO_LINK = Link()  # what a message without tensors needs to know about its link


class RouteError(RuntimeError):
    """No replica could take a branch; ``code`` is the Fail code to answer with."""

    def __init__(self, code: str, message: str, replica: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.replica = replica  # the actor id of a replica that did not take it, if one


class Router:
    """What every producer in one process shares: the plan, the view, the sockets."""

    def __init__(
        self,
        plan: Plan,
        view: RegistryView,
        outbox: Outbox,
        policies: Mapping[str, Any],
        idempotent: frozenset[str] = frozenset(),
        host: str = "",
    ) -> None:
        self.plan = plan
        self.view = view
        self.outbox = outbox
        self.policies = policies
        self.idempotent = idempotent
        self.host = host

    def pick(
        self,
        role: str,
        key: PickKey,
        exclude: frozenset[str] = frozenset(),
        exclude_pids: frozenset[int] = frozenset(),
    ) -> ActorRecord:
        """A replica of ``role``, but none named in ``exclude`` (actor ids) or running as one
        of ``exclude_pids`` (a dead process; its restarted replica may be picked)."""
        replicas = self.view.replicas(role)
        if exclude or exclude_pids:
            replicas = [
                r for r in replicas if r.actor_id not in exclude and r.pid not in exclude_pids
            ]
        if not replicas:
            raise NoReplicaError(role)
        return self.policies[role].pick(replicas, key)

    def link(self, record: ActorRecord | None) -> Link:
        if record is None:
            return Link()
        return Link(same_host=record.host == self.host, gpus=tuple(record.devices), pid=record.pid)

    def send_now(
        self, address: str, msg: Any, tensors: Mapping[str, Any], link: Link = NO_LINK
    ) -> Awaitable[None] | None:
        """Send ``msg`` if the peer's queue takes it now (None); else the send to await."""
        if tensors:
            frames: list[Any] = [b""]
            msg.tensors = export_tensors(dict(tensors), frames, link)
            frames[0] = encode(msg)
        else:
            frames = [encode(msg)]
        if self.outbox.try_send(address, frames):
            return None
        return self.outbox.send(address, frames)

    async def send(
        self, address: str, msg: Any, tensors: Mapping[str, Any], link: Link = NO_LINK
    ) -> None:
        rest = self.send_now(address, msg, tensors, link)
        if rest is not None:
            await rest


async def revoke_if_unsent(send: Awaitable[None], msg: Any, link: Link) -> None:
    """Await a send to the client; one that fails takes back the pool refs exported for it."""
    try:
        await send
    except BaseException:
        if msg.tensors:
            revoke_tensors(msg.tensors.values(), link.pid)
        raise
