"""KV pages between the replicas of one role, for an actor that keeps a prefix cache.

The worker hands a ``KVPeers`` to an actor with ``uses_kv_peers`` (the llm role), before
it registers. The actor serves its engine's pages (``serve``: a KV pull server on an
endpoint of its own, published in its registry record under ``KV_PULL_META``), asks who
holds a prefix (``holders``: the replicas whose routing summary names it, the same summary
``prefix_aware`` routes by) and pulls from one of them (``pull``). The sockets and the
protocol are transport/kv_pull.py; the engine's side is engine/kv_transfer.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import zmq

from omniflow.content import SUMMARY_META
from omniflow.control.discovery.view import RegistryView
from omniflow.kv.pull_cost import PullCost
from omniflow.messages import ActorRecord
from omniflow.transport.kv_pull import (
    KVPuller,
    KVPullError,
    KVPullServer,
    PrefixSink,
    PrefixSource,
    PullResult,
)
from omniflow.transport.security import Keys

KV_PULL_META = "kv_pull"  # a replica's KV pull server endpoint, in its registry record
__all__ = ["KV_PULL_META", "KVPeers", "KVPullError", "PullResult"]


class KVPeers:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        keys: Keys | None,
        view: RegistryView,
        role: str,
        replica: int,
        host: str,
        advertise: str = "",
    ) -> None:
        self.ctx, self.keys, self.view = ctx, keys, view
        self.advertise = advertise  # the address other hosts dial (tcp: the bind may be 0.0.0.0)
        self.role, self.replica, self.host = role, replica, host
        self._bind = endpoint
        self.server: KVPullServer | None = None
        self._summaries: dict[str, tuple[ActorRecord, frozenset[int]]] = {}

    def serve(self, source: PrefixSource, ttl_s: float = 10.0) -> str:
        """Start serving ``source``'s pages; the endpoint to publish under KV_PULL_META."""
        if self.server is None:
            self.server = KVPullServer(
                self.ctx, self._bind, source, self.keys, ttl_s, advertise=self.advertise
            )
            self.server.start()
        return self.server.endpoint

    def holders(self, summary_key: int) -> list[ActorRecord]:
        """Other replicas of this role that publish ``summary_key`` and serve KV pulls: this
        host's first, then the least loaded."""
        found = []
        for record in self.view.replicas(self.role):
            if record.replica == self.replica or KV_PULL_META not in record.meta:
                continue
            if summary_key in self._summary(record):
                found.append(record)
        found.sort(key=lambda r: (r.host != self.host, r.inflight))
        return found

    def _summary(self, record: ActorRecord) -> frozenset[int]:
        seen = self._summaries.get(record.actor_id)
        if seen is None or seen[0] is not record:  # a newer record: read its summary again
            summary = record.meta.get(SUMMARY_META)
            keys = frozenset(k for k in summary if isinstance(k, int)) if summary else frozenset()
            seen = self._summaries[record.actor_id] = (record, keys)
        return seen[1]

    async def pull(
        self,
        holder: ActorRecord,
        request_id: str,
        token_ids: Sequence[int],
        extra_keys: Sequence[Hashable | None] | None,
        sink: PrefixSink,
        held_pages: int,
        cost: PullCost,
        timeout_s: float = 10.0,
    ) -> PullResult:
        """Pull token_ids's prefix from ``holder`` into ``sink`` if ``cost`` says it pays
        (transport/kv_pull.py's ``KVPuller.pull``; raises ``KVPullError``)."""
        puller = KVPuller(self.ctx, cost, self.keys, timeout_s)
        endpoint: Any = holder.meta[KV_PULL_META]
        return await puller.pull(endpoint, request_id, token_ids, extra_keys, sink, held_pages)

    async def close(self) -> None:
        """Stop serving (every pin released); idempotent."""
        server, self.server = self.server, None
        if server is not None:
            await server.close()
