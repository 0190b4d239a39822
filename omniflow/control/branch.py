"""One branch of a fanout: the replica a request's outputs to one role go to, and what
waits to go there on a plain edge (merged until the producer finishes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniflow.messages import ActorRecord, Join


class Branch:
    __slots__ = ("role", "record", "stream", "join", "seq", "data", "tensors", "loops")

    def __init__(
        self,
        role: str,
        record: ActorRecord,
        stream: bool,
        join: Join | None,
        loops: dict[str, int],
    ) -> None:
        self.role = role
        self.loops = loops
        self.record = record
        self.stream = stream
        self.join = join
        self.seq = 0
        self.data: dict[str, Any] = {}
        self.tensors: dict[str, Any] = {}


def merge(into: dict[str, Any], data: Mapping[str, Any]) -> None:
    """Outputs merged for a plain edge: text concatenates, lists extend, the rest replaces."""
    for key, value in data.items():
        prev = into.get(key)
        if isinstance(prev, str) and isinstance(value, str):
            into[key] = prev + value
        elif isinstance(prev, list) and isinstance(value, list):
            into[key] = prev + value
        else:
            into[key] = value
