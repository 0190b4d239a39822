"""Continuous batching: which tokens of which requests run in the next model step.

Every step carries one chunk per scheduled sequence: the last sampled token of a decoding
sequence, or the next slice of a prompt (chunked prefill), within a token budget. Requests
join between steps when their first chunk's pages are free. When a running sequence needs
a page and none is free, the newest running sequence is preempted: its pages are released
(full ones stay in the prefix cache) and it is recomputed later. Because every request's
whole length fits the pool (checked on admission by the engine), the oldest sequence can
always proceed: no deadlock, no crash.

With KV tiers below the device (omniflow.cache.kv), a prefix hit may continue in host-pool or
SSD pages. The request then takes device pages for them and waits in ``promoting`` while the
tiers' thread copies them up; other requests keep running. When the copy is done it goes
back to the head of the queue holding its whole prefix, and is admitted like any other.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

from omniflow.engine.page_allocator import PageAllocator
from omniflow.engine.sequence import Sequence, SequenceStatus


class ScheduledChunk(NamedTuple):
    sequence: Sequence
    start: int  # first token index of the chunk (= tokens already computed)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so a token is sampled after it."""
        return self.start + self.num_tokens == len(self.sequence)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
    ):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.promoting: dict[Sequence, Any] = {}  # sequence -> its PendingPromotion

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.promoting)

    def wait_for_promotions(self, timeout: float) -> None:
        """Block until a promotion finishes (or ``timeout``): for steps with nothing to run."""
        if self.promoting:
            futures = [pending.future for pending in self.promoting.values()]
            wait_futures(futures, timeout, return_when=FIRST_COMPLETED)

    def pages_needed(self, sequence: Sequence, num_tokens: int) -> int:
        total = sequence.num_computed_tokens + num_tokens
        return max(0, -(-total // self.page_size) - len(sequence.page_ids))

    def schedule(self) -> list[ScheduledChunk]:
        self._finish_promotions()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for sequence in list(self.running):
            if budget == 0:
                break
            if sequence.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(sequence.num_pending_tokens, budget)
            if not self._reserve_pages(sequence, num_tokens):
                continue
            chunks.append(ScheduledChunk(sequence, sequence.num_computed_tokens, num_tokens))
            budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            sequence = self.waiting[0]
            chunk = self._admit(sequence, budget)
            if sequence in self.promoting:
                self.waiting.popleft()  # it waits for its pages; the next one may go
                continue
            if chunk is None:
                break  # first come, first served: never let later requests overtake
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _reserve_pages(self, sequence: Sequence, num_tokens: int) -> bool:
        needed = self.pages_needed(sequence, num_tokens)
        while self.allocator.usage().free_pages < needed:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is sequence:
                return False
        sequence.page_ids += self.allocator.allocate(needed)
        return True

    def _admit(self, sequence: Sequence, budget: int) -> ScheduledChunk | None:
        if self.enable_prefix_caching and not sequence.page_ids:
            # Leave at least one token to compute: its logits give the next token.
            match = self.allocator.match_prefix(sequence.token_ids[:-1], self._extra_keys(sequence))
            sequence.page_ids = match.page_ids
            sequence.num_computed_tokens = match.num_tokens
            if match.lower and self._start_promotion(sequence, list(match.lower)):
                return None
        num_tokens = min(sequence.num_pending_tokens, budget)
        needed = self.pages_needed(sequence, num_tokens)
        if self.allocator.usage().free_pages < needed:
            self.allocator.free(sequence.page_ids)
            sequence.page_ids, sequence.num_computed_tokens = [], 0
            return None
        if sequence.num_cached_tokens is None:  # the first admission's hit (not a re-admission's)
            sequence.num_cached_tokens = sequence.num_computed_tokens
        sequence.page_ids += self.allocator.allocate(needed)
        sequence.status = SequenceStatus.RUNNING
        self.running.append(sequence)
        return ScheduledChunk(sequence, sequence.num_computed_tokens, num_tokens)

    def _start_promotion(self, sequence: Sequence, nodes: list[Any]) -> bool:
        """Take device pages for a lower-tier continuation of the prefix and start copying."""
        allocator: Any = self.allocator  # only the radix cache returns lower-tier nodes
        wanted = sum(len(node.page_keys) for node in nodes)
        # Keep room for the rest of the prompt's first chunk, or promoting would only stall.
        if self.allocator.usage().free_pages < wanted + 1:
            allocator.cancel_promotion(nodes)
            return False
        pages = self.allocator.allocate(wanted)
        sequence.page_ids += pages
        self.promoting[sequence] = allocator.start_promotion(nodes, pages)
        return True

    def _finish_promotions(self) -> None:
        done = [s for s, pending in self.promoting.items() if pending.future.done()]
        for sequence in reversed(done):  # oldest ends up first in the queue
            self._finish_promotion(sequence)
            self.waiting.appendleft(sequence)

    def _finish_promotion(self, sequence: Sequence) -> None:
        pending = self.promoting.pop(sequence)
        allocator: Any = self.allocator
        if allocator.finish_promotion(pending):
            sequence.num_computed_tokens += pending.num_pages * self.page_size
        # On failure the pages stay with the sequence, to be filled by computing them.

    @staticmethod
    def _extra_keys(sequence: Sequence):
        return None if sequence.extra_keys is None else sequence.extra_keys[: len(sequence) - 1]

    def preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._release(sequence)
        sequence.status = SequenceStatus.WAITING
        sequence.num_preemptions += 1
        self.waiting.appendleft(sequence)

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """After the model step: the chunks' K/V are in their pages; publish full pages."""
        for chunk in chunks:
            sequence = chunk.sequence
            sequence.num_computed_tokens = chunk.start + chunk.num_tokens
            filled_a_page = (
                sequence.num_computed_tokens // self.page_size > chunk.start // self.page_size
            )
            if self.enable_prefix_caching and filled_a_page:
                computed = sequence.num_computed_tokens
                extra = None if sequence.extra_keys is None else sequence.extra_keys[:computed]
                self.allocator.insert(sequence.token_ids[:computed], sequence.page_ids, extra)

    def finish(self, sequence: Sequence, reason: str) -> None:
        if sequence in self.promoting:  # waits for the copy into its pages to end
            self._finish_promotion(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self._release(sequence)
        sequence.status = SequenceStatus.FINISHED
        sequence.finish_reason = reason

    def _release(self, sequence: Sequence) -> None:
        self.allocator.free(sequence.page_ids)
        sequence.page_ids = []
        sequence.num_computed_tokens = 0
