"""Continuous batching: which tokens of which requests run in the next model step.

Every step carries one chunk per scheduled sequence: the last sampled token of a decoding
sequence, or the next slice of a prompt (chunked prefill), within a token budget. Requests
join between steps when their first chunk's pages are free. When a running sequence needs
a page and none is free, the newest running sequence is preempted: its pages are released
(full ones stay in the prefix cache) and it is recomputed later. Because every request's
whole length fits the pool (checked on admission by the engine), the oldest sequence can
always proceed: no deadlock, no crash.

A guided request is a pair (Sequence.partner): the conditional leader and the unconditional
follower are admitted, scheduled, preempted and freed together, and sample in the same
step. A sequence with a block step (Sequence.block) runs its pending prefix, then the
block's rows over scratch slots after it; the block never counts as computed.

With KV tiers below the device (omniflow.kv.tiers), a prefix hit may continue in host-pool or
SSD pages. The request then takes device pages for them and waits in ``promoting`` while the
tiers' thread copies them up; other requests keep running. When the copy is done it goes
back to the head of the queue holding its whole prefix, and is admitted like any other.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, NamedTuple

from omniflow.engine.sequence import Sequence, SequenceStatus
from omniflow.kv.allocator import PageAllocator

if TYPE_CHECKING:
    from omniflow.kv.radix import PendingPromotion


class ScheduledChunk(NamedTuple):
    sequence: Sequence
    start: int  # first token index of the chunk (= tokens already computed)
    num_tokens: int
    block: int = 0  # block-step rows after the tokens (slots past them, never committed)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so a token is sampled after it."""
        return self.start + self.num_tokens == len(self.sequence) and self.sequence.block is None

    @property
    def num_rows(self) -> int:
        return self.num_tokens + self.block


def _fit(sequence: Sequence, budget: int) -> tuple[int, int]:
    """(tokens, block rows) of sequence's next chunk within budget rows."""
    num_tokens = min(sequence.num_pending_tokens, budget)
    block = sequence.block
    if block is None or num_tokens < sequence.num_pending_tokens:
        return num_tokens, 0
    rows = len(block.rows)
    return num_tokens, rows if budget - num_tokens >= rows else 0


def _completes(sequence: Sequence, fit: tuple[int, int]) -> bool:
    """Whether a chunk of this fit ends in a sample or the block's output."""
    if fit[0] < sequence.num_pending_tokens:
        return False
    return sequence.block is None or fit[1] > 0


def _hold_back(sequence: Sequence, fit: tuple[int, int]) -> tuple[int, int]:
    """The fit, short of completing: so a pair's two halves complete in the same step."""
    if sequence.block is not None:
        return fit[0], 0
    return fit[0] - 1, 0


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
        self.promoting: dict[Sequence, PendingPromotion] = {}
        self.num_preemptions = 0  # since start: /metrics' omniflow_preemptions_total
        self.prefix_hit_tokens = 0  # prompt tokens first admitted from the prefix cache

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
            if sequence.status is not SequenceStatus.RUNNING or sequence.follows:
                continue  # preempted earlier in this loop, or scheduled with its leader
            fits = self._fits(sequence, budget)
            if not self._reserve_pages(sequence, fits):
                continue
            for member, (num_tokens, block) in fits:
                start = member.num_computed_tokens
                chunks.append(ScheduledChunk(member, start, num_tokens, block))
                budget -= num_tokens + block
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            sequence = self.waiting[0]
            admitted = self._admit_group(sequence, budget)
            if sequence in self.promoting:
                self.waiting.popleft()  # it waits for its pages; the next one may go
                continue
            if admitted is None:
                break  # first come, first served: never let later requests overtake
            self.waiting.popleft()
            chunks += admitted
            budget -= sum(chunk.num_rows for chunk in admitted)
        return chunks

    def _fits(self, sequence: Sequence, budget: int) -> list[tuple[Sequence, tuple[int, int]]]:
        """The next chunk of a sequence, or of both halves of a pair (follower first), each
        (tokens, block rows); the pair's halves complete in the same step or neither does."""
        follower = sequence.partner
        if follower is None:
            fit = _fit(sequence, budget)
            return [(sequence, fit)] if sum(fit) > 0 else []
        second = _fit(follower, budget)
        first = _fit(sequence, budget - sum(second))
        if _completes(follower, second) != _completes(sequence, first):
            if _completes(follower, second):
                second = _hold_back(follower, second)
            else:
                first = _hold_back(sequence, first)
        return [(m, f) for m, f in ((follower, second), (sequence, first)) if sum(f) > 0]

    def _reserve_pages(
        self, sequence: Sequence, fits: list[tuple[Sequence, tuple[int, int]]]
    ) -> bool:
        needed = sum(self.pages_needed(member, sum(fit)) for member, fit in fits)
        while self.allocator.usage().free_pages < needed:
            victim = self.running[-1]
            victim = victim.partner if victim.follows and victim.partner else victim
            self.preempt(victim)
            if victim is sequence:
                return False
        for member, fit in fits:
            member.page_ids += self.allocator.allocate(self.pages_needed(member, sum(fit)))
        return True

    def _admit_group(self, sequence: Sequence, budget: int) -> list[ScheduledChunk] | None:
        """Admit a sequence, or a pair's leader with its follower (both or neither)."""
        follower = sequence.partner
        if follower is None:
            chunk = self._admit(sequence, budget)
            return None if chunk is None else [chunk]
        if self.enable_prefix_caching:
            for member in (follower, sequence):
                if not member.page_ids:
                    self._match(member)
        fits = self._fits(sequence, budget)
        needed = sum(self.pages_needed(member, sum(fit)) for member, fit in fits)
        if not fits or self.allocator.usage().free_pages < needed:
            for member in (follower, sequence):
                if member.status is not SequenceStatus.KEPT:  # a kept half keeps its pages
                    self._release(member)
            return None
        chunks = []
        for member in (follower, sequence):
            if member.num_cached_tokens is None:
                member.num_cached_tokens = member.num_computed_tokens
            member.status = SequenceStatus.RUNNING
            self.running.append(member)
        for member, fit in fits:
            member.page_ids += self.allocator.allocate(self.pages_needed(member, sum(fit)))
            chunks.append(ScheduledChunk(member, member.num_computed_tokens, *fit))
        return chunks

    def _match(self, sequence: Sequence) -> None:
        """Take the prefix cache's pages for a pair's half. Lower-tier pages are not
        promoted for pairs (both halves start together): they are recomputed."""
        match = self.allocator.match_prefix(sequence.token_ids[:-1], self._extra_keys(sequence))
        if match.lower:
            self.allocator.cancel_promotion(match.lower)
        sequence.page_ids = match.page_ids
        sequence.num_computed_tokens = match.num_tokens

    def _admit(self, sequence: Sequence, budget: int) -> ScheduledChunk | None:
        kept = sequence.status is SequenceStatus.KEPT  # requeued: holds its pages as it waits
        if self.enable_prefix_caching and not sequence.page_ids:
            # Leave at least one token to compute: its logits give the next token.
            match = self.allocator.match_prefix(sequence.token_ids[:-1], self._extra_keys(sequence))
            sequence.page_ids = match.page_ids
            sequence.num_computed_tokens = match.num_tokens
            if match.lower and self._start_promotion(sequence, list(match.lower)):
                return None
        num_tokens, block = _fit(sequence, budget)
        needed = self.pages_needed(sequence, num_tokens + block)
        if self.allocator.usage().free_pages < needed or num_tokens + block == 0:
            if not kept:
                self._release(sequence)
            return None
        if sequence.num_cached_tokens is None:  # the first admission's hit (not a re-admission's)
            sequence.num_cached_tokens = sequence.num_computed_tokens
            self.prefix_hit_tokens += sequence.num_computed_tokens
        sequence.page_ids += self.allocator.allocate(needed)
        sequence.status = SequenceStatus.RUNNING
        self.running.append(sequence)
        return ScheduledChunk(sequence, sequence.num_computed_tokens, num_tokens, block)

    def _start_promotion(self, sequence: Sequence, nodes: list[Any]) -> bool:
        """Take device pages for a lower-tier continuation of the prefix and start copying."""
        wanted = sum(len(node.page_keys) for node in nodes)
        # Keep room for the rest of the prompt's first chunk, or promoting would only stall.
        if self.allocator.usage().free_pages < wanted + 1:
            self.allocator.cancel_promotion(nodes)
            return False
        pages = self.allocator.allocate(wanted)
        sequence.page_ids += pages
        self.promoting[sequence] = self.allocator.start_promotion(nodes, pages)
        return True

    def _finish_promotions(self) -> None:
        done = [s for s, pending in self.promoting.items() if pending.future.done()]
        for sequence in reversed(done):  # oldest ends up first in the queue
            self._finish_promotion(sequence)
            self.waiting.appendleft(sequence)

    def _finish_promotion(self, sequence: Sequence) -> None:
        pending = self.promoting.pop(sequence)
        if self.allocator.finish_promotion(pending):
            sequence.num_computed_tokens += pending.num_pages * self.page_size
        # On failure the pages stay with the sequence, to be filled by computing them.

    @staticmethod
    def _extra_keys(sequence: Sequence):
        return None if sequence.extra_keys is None else sequence.extra_keys[: len(sequence) - 1]

    def preempt(self, sequence: Sequence) -> None:
        """Release a running sequence (a pair's leader: both halves) and queue it again."""
        for member in _members(sequence):
            if member in self.running:
                self.running.remove(member)
            self._release(member)
            member.status = SequenceStatus.WAITING
            member.num_preemptions += 1
        self.num_preemptions += 1
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
        """End a sequence (a pair's leader: both halves) and free its pages."""
        for member in _members(sequence):
            self._leave(member)
            self._release(member)
            member.status = SequenceStatus.FINISHED
            member.finish_reason = reason

    def keep(self, sequence: Sequence) -> None:
        """Stop scheduling a sequence (and its follower) but hold its pages: KEPT, for a
        continuation or block steps (requeue) or `finish`."""
        for member in _members(sequence):
            self._leave(member)
            member.status = SequenceStatus.KEPT

    def requeue(self, sequence: Sequence) -> None:
        """A kept sequence (a pair's leader) has work again: first in line, still KEPT (it
        holds its pages) until admitted."""
        self.waiting.appendleft(sequence)

    def _leave(self, sequence: Sequence) -> None:
        if sequence in self.promoting:  # waits for the copy into its pages to end
            self._finish_promotion(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    def _release(self, sequence: Sequence) -> None:
        """Give back a sequence's pages; full ones it computed stay in the prefix cache."""
        self.allocator.free(sequence.page_ids)
        sequence.page_ids = []
        sequence.num_computed_tokens = 0


def _members(sequence: Sequence) -> list[Sequence]:
    """A sequence and, if it leads a pair, its follower."""
    partner = sequence.partner
    return [sequence] if partner is None or sequence.follows else [sequence, partner]
