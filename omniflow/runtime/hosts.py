"""One deployment over several hosts on one etcd: each host's share, and the keys they meet at.

Every host runs ``omniflow up CONFIG --host-id NAME`` on the same etcd. Its supervisor
claims replica numbers (a role replicated on three hosts gets ``llm/0``, ``llm/1``,
``llm/2``, one per claim, on its lease), publishes the config (so a client on any
machine needs only the registry and the name) and its host record, and watches the
deployment's ``down`` key: ``omniflow down --all`` puts it and every host stops its
share. A host that dies stops refreshing its leases: its records, claims and actors
leave everyone's view within ``ttl_s``.

    /omniflow/NAME/config          the config, as JSON (no lease: it outlives hosts)
    /omniflow/NAME/hosts/HOST      HostRecord, on the host supervisor's lease
    /omniflow/NAME/slots/ROLE/N    the host that runs replica N of ROLE, on that lease
    /omniflow/NAME/down            put by `down --all`: {"timeout": seconds}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from omniflow.control.discovery import Registry, RegistryError, open_registry
from omniflow.runtime.config import Config, ConfigError, from_json, parse, to_json

if TYPE_CHECKING:
    from omniflow.control.discovery.etcd import EtcdRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REPLICA_SLOTS = 4096  # a role's replica numbers searched for a free one
_DOWN_RETRY_S = 1.0


class HostRecord(msgspec.Struct, omit_defaults=True):
    """What the registry knows of one host's share."""

    host: str
    roles: list[str]
    address: str = ""
    pid: int = 0
    run_dir: str = ""
    started: float = 0.0


class DownRequest(msgspec.Struct, omit_defaults=True):
    timeout: float | None = None
    at: float = 0.0


def config_key(name: str) -> str:
    return f"/omniflow/{name}/config"


def hosts_prefix(name: str) -> str:
    return f"/omniflow/{name}/hosts/"


def down_key(name: str) -> str:
    return f"/omniflow/{name}/down"


def slot_key(name: str, role: str, index: int) -> str:
    return f"/omniflow/{name}/slots/{role}/{index}"


def is_multi_host(config: Config) -> bool:
    """Whether this config runs as one host's share: named hosts on etcd."""
    return config.registry.startswith("etcd://") and bool(config.runtime.host_id or config.hosts)


class HostShare:
    """A supervisor's presence in the shared registry: claims, host record, down watch."""

    def __init__(self, config: Config, registry: Registry) -> None:
        if not hasattr(registry, "claim"):
            raise RegistryError(f"{config.registry}: a multi-host deployment needs etcd")
        self.config = config
        self.registry = registry
        self._tasks: list[asyncio.Task] = []

    async def claim_replicas(self, counts: dict[str, int]) -> dict[str, list[int]]:
        """For each role, ``counts[role]`` replica numbers no other host holds (lowest
        first; numbers this host held before its restart are its own again)."""
        me, ttl = self.config.host_id.encode(), self.config.runtime.ttl_s
        claim = cast("EtcdRegistry", self.registry).claim  # checked in __init__
        taken: dict[str, list[int]] = {}
        for role, count in counts.items():
            mine = taken[role] = []
            for index in range(MAX_REPLICA_SLOTS):
                if len(mine) == count:
                    break
                key = slot_key(self.config.name, role, index)
                if await _retried(partial(claim, key, me, ttl)) == me:
                    mine.append(index)
            if len(mine) < count:
                raise RegistryError(f"{role}: no free replica number below {MAX_REPLICA_SLOTS}")
        return taken

    async def announce(self, record: HostRecord) -> None:
        """Publish the config and this host's record; keep the lease alive from here."""
        cfg, put = self.config, self.registry.put
        await _retried(lambda: put(config_key(cfg.name), to_json(shared_config(cfg))))
        value, ttl = msgspec.json.encode(record), cfg.runtime.ttl_s
        await _retried(lambda: put(hosts_prefix(cfg.name) + cfg.host_id, value, ttl=ttl))
        self._tasks.append(asyncio.create_task(self._keepalive(), name="host-keepalive"))

    def on_down(self, stop: Callable[[float | None], None]) -> None:
        """Call ``stop(timeout)`` when ``omniflow down --all`` asks the deployment to stop."""
        self._tasks.append(asyncio.create_task(self._watch_down(stop), name="host-down-watch"))

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.config.runtime.heartbeat_s)
            try:
                await self.registry.keepalive()
            except Exception as e:  # etcd may be briefly away; the TTL is the judge
                log.warning("host %s: keepalive failed: %s", self.config.host_id, e)

    async def _watch_down(self, stop: Callable[[float | None], None]) -> None:
        key = down_key(self.config.name)
        while True:
            events = self.registry.watch(key)
            try:
                async for event in events:
                    if event.kind == "put" and event.key == key:
                        request = msgspec.json.decode(event.value or b"{}", type=DownRequest)
                        log.info("down --all: host %s stops its share", self.config.host_id)
                        stop(request.timeout)
                        return
            except Exception as e:
                log.warning("the down watch failed (%s); watching again", e)
            finally:
                await _close_watch(events)
            await asyncio.sleep(_DOWN_RETRY_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()


def for_host(
    config: Config,
    host_id: str,
    roles: list[str] | None = None,
    address: str | None = None,
    registry: str | None = None,
) -> Config:
    """``config`` as host ``host_id`` runs its share: those ``roles`` (default: its [hosts]
    entry's), its actors on tcp at ``address`` (default: its entry's), on ``registry``."""
    where = config.source or "<config>"
    raw = msgspec.to_builtins(config)
    raw["runtime"] = {**raw.get("runtime", {}), "host_id": host_id}
    if registry is not None:
        raw["registry"] = registry
    hosts = raw.setdefault("hosts", {})
    if host_id not in hosts and roles is None and hosts:
        raise ConfigError(
            f"{where}: host {host_id!r} is not in [hosts] ({', '.join(hosts)}): name its roles "
            "with --roles"
        )
    entry = hosts.setdefault(host_id, {})
    if roles is not None:
        entry["roles"] = roles
    if address is not None:
        entry["address"] = address
    raw["runtime"]["transport"] = "tcp"  # the other hosts reach its actors over tcp
    raw.pop("source", None)
    shared = parse(raw, where)
    shared.source = config.source
    return shared


def with_registry(config: Config, registry: str) -> Config:
    """``config`` on another registry (``omniflow up --registry``), checked again."""
    raw = msgspec.to_builtins(config)
    raw["registry"] = registry
    raw.pop("source", None)
    moved = parse(raw, config.source or "<config>")
    moved.source = config.source
    return moved


async def _retried(operation: Callable[[], Awaitable[T]], attempts: int = 3) -> T:
    """``operation()``, again after a RegistryError (a timeout on a starved machine): each
    one here is idempotent (a claim that did land is found to be this host's)."""
    for attempt in range(attempts - 1):
        try:
            return await operation()
        except RegistryError as e:
            log.warning("registry operation failed (attempt %d): %s", attempt + 1, e)
            await asyncio.sleep(0.5 * (attempt + 1))
    return await operation()


def shared_config(config: Config) -> Config:
    """``config`` as every host and client may read it: no one host's id in it."""
    runtime = msgspec.structs.replace(config.runtime, host_id="")
    return msgspec.structs.replace(config, runtime=runtime)


async def read_config(registry: Registry, name: str) -> Config:
    """The config deployment ``name`` published in ``registry``."""
    found = await registry.list(config_key(name))
    for key, value in found:
        if key == config_key(name):
            return from_json(value)
    raise LookupError(f"no deployment {name!r} in the registry (no key {config_key(name)})")


async def list_hosts(registry: Registry, name: str) -> list[HostRecord]:
    items = await registry.list(hosts_prefix(name))
    return sorted(
        (msgspec.json.decode(value, type=HostRecord) for _, value in items), key=lambda h: h.host
    )


async def stop_all(registry: Registry, name: str, timeout: float) -> list[str]:
    """Ask every host of ``name`` to stop its share; wait until their records are gone
    (at most ``timeout`` + 10 s). The hosts that were up."""
    hosts = [h.host for h in await list_hosts(registry, name)]
    prefix = hosts_prefix(name)
    events = registry.watch(prefix)
    try:
        await registry.put(down_key(name), msgspec.json.encode(DownRequest(timeout, time.time())))
        left = {prefix + h for h in hosts}
        left &= {key for key, _ in await registry.list(prefix)}
        if left:
            async with asyncio.timeout(timeout + 10.0):
                async for event in events:
                    if event.kind == "delete":
                        left.discard(event.key)
                    if not left:
                        break
    finally:
        await _close_watch(events)
        # The key has done its work: a host started later must not read it as a stop.
        await registry.delete(down_key(name))
    return hosts


async def stop_everywhere(address: str, name: str, timeout: float) -> list[str]:
    """``stop_all`` through a registry client of its own."""
    registry = open_registry(address)
    try:
        return await stop_all(registry, name, timeout)
    finally:
        await registry.close()


async def _close_watch(events: Any) -> None:
    """End a registry watch (its ``aclose``), whatever state it is in."""
    with contextlib.suppress(Exception):
        await events.aclose()
