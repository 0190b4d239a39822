"""The radix tree's evictable device leaves (kv/radix.py), kept as the tree changes (as
SGLang's ``evictable_leaves``) so an eviction takes the least recently used one in
O(log n) instead of walking every node: a heap of (last_access, seq, node) with lazy
deletion. A node has at most one live entry, the one at the last access ``queued`` records;
the others are stale and skipped when popped."""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

Node = TypeVar("Node")


class LeafQueue(Generic[Node]):
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Node]] = []
        self._queued: dict[Node, int] = {}
        self._seq = itertools.count()  # ties in last access: first queued, first out
        self.probes = 0  # heap entries popped (a test counts them: no walk over the tree)

    def __len__(self) -> int:
        return len(self._queued)

    def queued(self, node: Node, last_access: int) -> bool:
        return self._queued.get(node) == last_access

    def push(self, node: Node, last_access: int) -> None:
        """Queue ``node`` at ``last_access`` (its earlier entry, if any, goes stale)."""
        if self._queued.get(node) == last_access:
            return
        self._queued[node] = last_access
        heapq.heappush(self._heap, (last_access, next(self._seq), node))
        if len(self._heap) > 2 * len(self._queued) + 64:  # mostly stale: rebuild
            self._heap = [e for e in self._heap if self._queued.get(e[2]) == e[0]]
            heapq.heapify(self._heap)

    def discard(self, node: Node) -> None:
        self._queued.pop(node, None)

    def pop(self) -> tuple[Node, int] | None:
        """(node, the last access it was queued at) with the oldest live entry, off the
        queue; None when it is empty."""
        while self._heap:
            self.probes += 1
            last_access, _, node = heapq.heappop(self._heap)
            if self._queued.get(node) == last_access:
                del self._queued[node]
                return node, last_access
        return None
