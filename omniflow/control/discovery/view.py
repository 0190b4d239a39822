"""A live, local view of the deployment's actors: list once, then follow the watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from omniflow.control.discovery.base import Registry, actors_prefix, decode_record
from omniflow.messages import ActorRecord

log = logging.getLogger(__name__)
_RESYNC_MIN_S = 0.2  # first wait before listing and watching again after the watch broke
_RESYNC_MAX_S = 2.0


class RegistryView:
    def __init__(self, registry: Registry, deployment: str) -> None:
        self._registry = registry
        self._prefix = actors_prefix(deployment)
        self._records: dict[str, ActorRecord] = {}
        self._by_role: dict[str, list[ActorRecord]] = {}
        self._seen_ready: set[str] = set()  # roles this view has seen with a ready replica
        self._flags: set[tuple[str, str]] = set()  # (role, meta key) seen set to True
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        # Called with the record of a replica that left the view (deleted, or replaced by
        # another process of the same replica): a client ends what it sent there.
        self.on_gone: Callable[[ActorRecord], None] | None = None

    async def start(self) -> None:
        # A watch of every change after the listing (none lost between the two).
        listed, events = await self._registry.list_watch(self._prefix)
        for key, value in listed:
            self._set(key, value)
        self._reindex()
        self._task = asyncio.create_task(self._follow(events), name="registry-view")

    async def _follow(self, events) -> None:
        """Apply the watch's events; when the watch breaks (the registry went away), keep
        routing on the last view and list + watch afresh until the registry answers."""
        delay = _RESYNC_MIN_S
        while True:
            try:
                async for event in events:
                    log.debug("registry %s %s", event.kind, event.key)
                    old = self._records.get(event.key)
                    if event.kind == "put":
                        self._set(event.key, event.value)
                    else:
                        self._records.pop(event.key, None)
                    self._reindex()
                    self._left(old, self._records.get(event.key))
                    delay = _RESYNC_MIN_S
                log.warning("the registry watch ended; keeping the last view")
            except Exception as e:
                log.warning("the registry watch failed (%s); keeping the last view", e)
            finally:
                with contextlib.suppress(Exception):
                    await events.aclose()
            events = await self._resync(delay)
            delay = min(delay * 2, _RESYNC_MAX_S)

    async def _resync(self, delay: float) -> Any:
        """A new watch, then the whole listing in place of the records (what changed while
        the watch was away is then known); retried every ``delay`` seconds until it works."""
        while True:
            await asyncio.sleep(delay)
            try:
                listed, events = await self._registry.list_watch(self._prefix)
            except Exception as e:
                log.debug("the registry is still away: %s", e)
                continue
            old, self._records = self._records, {}
            for key, value in listed:
                self._set(key, value)
            self._reindex()
            for key, record in old.items():
                self._left(record, self._records.get(key))
            log.info("the registry is back: %d actors listed", len(self._records))
            return events

    def _left(self, old: ActorRecord | None, new: ActorRecord | None) -> None:
        if old is None or self.on_gone is None or (new is not None and new.pid == old.pid):
            return
        try:
            self.on_gone(old)
        except Exception:
            log.exception("on_gone failed for %s/%d", old.role, old.replica)

    def _set(self, key: str, value: bytes) -> None:
        try:
            self._records[key] = decode_record(value)
        except Exception:  # a foreign or corrupt record must not stop routing
            log.warning("ignoring an unreadable actor record at %s", key)

    def _reindex(self) -> None:
        by_role: dict[str, list[ActorRecord]] = {}
        for rec in self._records.values():
            if rec.state == "ready":
                by_role.setdefault(rec.role, []).append(rec)
            for key, value in rec.meta.items():
                if value is True:
                    self._flags.add((rec.role, key))
        for recs in by_role.values():
            recs.sort(key=lambda r: r.replica)
        self._by_role = by_role
        self._seen_ready.update(by_role)
        self._changed.set()
        self._changed = asyncio.Event()

    def replicas(self, role: str) -> list[ActorRecord]:
        return self._by_role.get(role, [])

    def flagged(self, role: str, key: str) -> bool:
        """Whether a replica of ``role`` ever published ``meta[key] = True`` here (it stays
        known after the replica dies: what a role can do outlives one replica)."""
        return (role, key) in self._flags

    def lost(self, role: str) -> bool:
        """``role`` had a ready replica in this view and has none now. Right after a start
        a role may simply not have reached this view yet: that is not lost."""
        return role in self._seen_ready and not self._by_role.get(role)

    def all(self) -> list[ActorRecord]:
        return sorted(self._records.values(), key=lambda r: (r.role, r.replica))

    def find(self, actor_id: str) -> ActorRecord | None:
        role, _, replica = actor_id.rpartition("/")
        for rec in self._by_role.get(role, ()):
            if str(rec.replica) == replica:
                return rec
        return None

    async def wait_for(
        self, role: str, timeout: float, exclude_pids: frozenset[int] = frozenset()
    ) -> list[ActorRecord]:
        """The replicas of ``role``, waiting up to ``timeout`` for one to appear (one whose
        pid is not in ``exclude_pids``: a dead process still listed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not [r for r in self.replicas(role) if r.pid not in exclude_pids]:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.replicas(role)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
