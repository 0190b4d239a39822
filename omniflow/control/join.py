"""Fan-in: a join role buffers the branches of one request until every part arrived.

The producer that split a request tagged each branch ``Join(role, replica, parts,
part)``; the join's replica keeps each part's chunks (and their frames) until every
part sent its last chunk, then hands one merged Call to its handler.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omniflow.messages import Call, Frame, Timing, add_usage


class JoinBuffer:
    def __init__(self, role: str) -> None:
        self.role = role
        self._parts: dict[str, list[tuple[Call, list[Any]]]] = {}

    def add(self, call: Call, parts: list[Any]) -> tuple[Call, list[Any]] | None:
        """Keep one chunk; once the request's last part is complete, its merged Call."""
        join = call.join
        assert join is not None
        buffered = self._parts.setdefault(call.request_id, [])
        buffered.append((call, parts))
        done = {c.join.part for c, _ in buffered if c.last and c.join is not None}
        if len(done) < join.parts:
            return None
        del self._parts[call.request_id]
        return self._merge(buffered)

    def __len__(self) -> int:
        """Requests with parts waiting here."""
        return len(self._parts)

    def holds(self, request_id: str) -> bool:
        return request_id in self._parts

    def token(self, request_id: str) -> bytes | None:
        """The token of the request's first buffered part (None: none buffered)."""
        parts = self._parts.get(request_id)
        return parts[0][0].token if parts else None

    def waiting(self) -> list[tuple[str, str]]:
        """(request id, reply address) of every request with parts still buffered."""
        return [(rid, parts[0][0].reply_to) for rid, parts in self._parts.items() if parts]

    def expire(self, now: float) -> list[Call]:
        """Forget requests whose deadline passed with parts still missing; their buffered
        chunks, for the caller to fail and release."""
        late = [
            rid
            for rid, parts in self._parts.items()
            if parts and parts[0][0].deadline and parts[0][0].deadline <= now
        ]
        return [call for rid in late for call in self.drop(rid)]

    def has_deadlines(self) -> bool:
        return any(parts and parts[0][0].deadline for parts in self._parts.values())

    def drop(self, request_id: str) -> list[Call]:
        """Forget a request's buffered chunks (cancelled); the caller releases their refs."""
        return [call for call, _ in self._parts.pop(request_id, ())]

    def _merge(self, buffered: list[tuple[Call, list[Any]]]) -> tuple[Call, list[Any]]:
        """One Call holding every part's inputs, in part order; Frame refs renumbered."""
        buffered.sort(key=lambda item: (item[0].join.part if item[0].join else 0, item[0].seq))
        frames: list[Any] = [b""]
        data: dict[str, Any] = {}
        refs: dict[str, Any] = {}
        credit = 0
        timings: list[Timing] = []
        usage: dict[str, int] = {}
        for c, parts in buffered:
            data.update(c.data)
            for name, ref in c.tensors.items():
                if isinstance(ref, Frame):  # it points into this part's own frames
                    frames.append(parts[ref.index])
                    ref = msgspec.structs.replace(ref, index=len(frames) - 1)
                refs[name] = ref
            credit += c.credit
            timings += c.timings
            add_usage(usage, c.usage)
        merged = msgspec.structs.replace(
            buffered[0][0],
            role=self.role,
            data=data,
            tensors=refs,
            seq=0,
            last=True,
            credit=credit,
            join=None,
            timings=timings,
            usage=usage,
        )
        return merged, frames
