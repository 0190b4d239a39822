"""Load-balancing policies (placeholder: round_robin only; the full set lands with issue 4)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from omniflow.messages import ActorRecord


class NoReplicaError(LookupError):
    def __init__(self, role: str) -> None:
        super().__init__(f"no live replica of role {role!r}")
        self.role = role


class PickKey(NamedTuple):
    request_id: str = ""
    session: str = ""
    prefix_hashes: tuple[int, ...] = ()


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        if not replicas:
            raise NoReplicaError("?")
        return replicas[next(self._counter) % len(replicas)]

    def on_send(self, actor_id: str) -> None:
        pass

    def on_done(self, actor_id: str) -> None:
        pass


def make_policy(name: str, **options: object) -> RoundRobin:
    if name != "round_robin":
        raise ValueError(f"unknown policy {name!r}")
    return RoundRobin()
