"""The Registry protocol every discovery backend implements.

Keys are strings under a deployment prefix; values are bytes (actor records are
msgspec-JSON). A key put with a ``ttl`` lives on a lease that the owner keeps
alive; when the owner stops refreshing (it died), the key disappears within the
TTL and watchers see a ``delete``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

import msgspec

from omniflow.messages import ActorRecord


class WatchEvent(NamedTuple):
    kind: str  # "put" | "delete"
    key: str
    value: bytes


Items = list[tuple[str, bytes]]  # a listing: (key, value) in key order


class RegistryError(RuntimeError):
    """A registry operation failed (backend unreachable, barrier timed out, ...)."""


class Registry(Protocol):
    async def put(self, key: str, value: bytes, ttl: float = 0.0) -> None:
        """Store ``value`` at ``key``; with ``ttl`` > 0 the key lives on this client's lease."""

    async def keepalive(self) -> None:
        """Refresh this client's lease (call at least every ttl/3)."""

    async def delete(self, key: str) -> None: ...

    async def list(self, prefix: str) -> list[tuple[str, bytes]]: ...

    def watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """Events for keys under ``prefix`` from now on, until the iterator is closed."""

    async def list_watch(self, prefix: str) -> tuple[Items, AsyncIterator[WatchEvent]]:
        """The keys under ``prefix`` and a watch of every change after that listing."""

    async def barrier(self, name: str, n: int, member: str, timeout: float) -> None:
        """Return once ``n`` distinct members arrived at barrier ``name``; raise on timeout."""

    async def close(self) -> None: ...


_record_json = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(ActorRecord)


def actors_prefix(deployment: str) -> str:
    return f"/omniflow/{deployment}/actors/"


def actor_key(deployment: str, role: str, replica: int) -> str:
    return f"{actors_prefix(deployment)}{role}/{replica}"


def encode_record(record: ActorRecord) -> bytes:
    return _record_json.encode(record)


def decode_record(value: bytes) -> ActorRecord:
    return _record_decoder.decode(value)


async def list_actors(registry: Registry, deployment: str) -> list[ActorRecord]:
    items = await registry.list(actors_prefix(deployment))
    return sorted((decode_record(v) for _, v in items), key=lambda r: (r.role, r.replica))
