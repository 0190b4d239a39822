"""Contiguous copies of the decoding sequences' K/V, so batched decode attention reads each
context in place instead of gathering every page of every sequence at every step.

The pages in KVCache stay the source of truth; the mirror is a cache of them. Slot i holds
the context of decode row i, in [layers, slots, kv_heads, capacity, head_dim], so the rows
of a step are one strided batch for bmm. A slot is filled from the pages when its sequence
starts decoding (or after anything that may have changed its pages), then only the new
token's K/V are written to it each step, next to the page write. A slot is refilled when:
its sequence left the decode set for a step (finished, aborted, preempted, back to prefill),
its sequence was preempted (its pages were recomputed or replaced), its page table no longer
starts with the pages the slot was filled from, or a page it mirrors was written from
outside a model step (KVCache.note_written, e.g. tier promotion).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from omniflow.engine.paged_attention import DecodeRows, KVCache
from omniflow.engine.sequence import Sequence

DEFAULT_MIN_BYTES = 64 << 20


class _Slot:
    __slots__ = ("sequence", "valid", "pages", "preemptions", "position")

    def __init__(self, sequence: Sequence):
        self.sequence = sequence
        self.valid = 0  # leading tokens of the context whose K/V the slot holds
        self.pages: list[int] = []  # the page ids those tokens were copied from
        self.preemptions = sequence.num_preemptions
        self.position = 0  # this step's new token


class MirroredDecodes(NamedTuple):
    order: list[int]  # decode indices in slot order: row i of the step reads slot i
    rows: DecodeRows


class DecodeMirror:
    def __init__(self, cache: KVCache, max_bytes: int | None = None):
        self.cache = cache
        # Default budget: a quarter of the page pool, but never so little that small pools
        # (tests, tiny models) lose the fast path.
        pool_bytes = 2 * cache.keys.numel() * cache.keys.element_size()
        self.max_bytes = max(pool_bytes // 4, DEFAULT_MIN_BYTES) if max_bytes is None else max_bytes
        layers, kv_heads, _, _, head_dim = cache.keys.shape
        self._shape = (layers, kv_heads, head_dim)
        # In the cache's dtype: decode attention reads it in place.
        self.keys = self.values = cache.keys.new_zeros((layers, 0, kv_heads, 0, head_dim))
        self.slots: list[_Slot] = []

    def _bytes(self, num_slots: int, capacity: int) -> int:
        layers, kv_heads, head_dim = self._shape
        per_token = 2 * layers * kv_heads * head_dim * self.keys.element_size()
        return num_slots * capacity * per_token

    def clear(self) -> None:
        self.slots = []

    def prepare(self, decodes: list[tuple[Sequence, int]]) -> MirroredDecodes | None:
        """decodes: (sequence, position of its new token) per decode row. Brings every slot up
        to date with the pages; returns the rows in slot order, or None when the contexts do
        not fit the budget (the caller then gathers from the pages)."""
        positions = {sequence: position for sequence, position in decodes}
        widest = max(positions.values()) + 1
        if not self._reserve(len(decodes), widest):
            self.clear()
            return None
        self._release_absent(positions)
        known = {slot.sequence for slot in self.slots}
        self.slots += [_Slot(s) for s, _ in decodes if s not in known]
        written = self.cache.take_written_pages()
        for slot in self.slots:
            slot.position = positions[slot.sequence]
            self._validate(slot, written)
            if slot.valid < slot.position:
                self._fill(slot)
        index = {sequence: i for i, (sequence, _) in enumerate(decodes)}
        return MirroredDecodes([index[slot.sequence] for slot in self.slots], self._rows(widest))

    def commit(self) -> None:
        """After the model step: every slot also holds its new token."""
        size = self.cache.page_size
        for slot in self.slots:
            slot.valid = slot.position + 1
            slot.pages = slot.sequence.page_ids[: -(-slot.valid // size)]

    def _reserve(self, num_slots: int, capacity: int) -> bool:
        _, have_slots, _, have_capacity, _ = self.keys.shape
        if num_slots <= have_slots and capacity <= have_capacity:
            return True
        size = self.cache.page_size
        # Grow geometrically so a long generation reallocates O(log n) times.
        slots = max(num_slots, min(2 * have_slots, num_slots + 16))
        tokens = max(capacity, have_capacity, min(2 * have_capacity, capacity + 1024))
        tokens = -(-tokens // size) * size
        if self._bytes(slots, tokens) > self.max_bytes:
            slots, tokens = (
                max(num_slots, have_slots),
                max(-(-capacity // size) * size, have_capacity),
            )
            if self._bytes(slots, tokens) > self.max_bytes:
                return False
        layers, kv_heads, head_dim = self._shape
        keys = self.keys.new_zeros((layers, slots, kv_heads, tokens, head_dim))
        values = torch.zeros_like(keys)
        keys[:, :have_slots, :, :have_capacity] = self.keys
        values[:, :have_slots, :, :have_capacity] = self.values
        self.keys, self.values = keys, values
        return True

    def _release_absent(self, positions: dict[Sequence, int]) -> None:
        """Drop slots whose sequence is not decoding now; move the last slots into the holes
        so the occupied slots stay 0..n-1."""
        slots = self.slots
        kept = [i for i, slot in enumerate(slots) if slot.sequence in positions]
        if len(kept) == len(slots):
            return
        holes = [i for i in range(len(kept)) if slots[i].sequence not in positions]
        movers = [i for i in kept if i >= len(kept)]
        for hole, mover in zip(holes, movers, strict=True):
            valid = slots[mover].valid
            self.keys[:, hole, :, :valid] = self.keys[:, mover, :, :valid]
            self.values[:, hole, :, :valid] = self.values[:, mover, :, :valid]
            slots[hole] = slots[mover]
        del slots[len(kept) :]

    def _validate(self, slot: _Slot, written: set[int]) -> None:
        sequence = slot.sequence
        if sequence.num_preemptions != slot.preemptions:
            slot.preemptions, slot.valid, slot.pages = sequence.num_preemptions, 0, []
        elif sequence.page_ids[: len(slot.pages)] != slot.pages:
            slot.valid, slot.pages = 0, []
        elif written and not written.isdisjoint(slot.pages):
            first = min(i for i, page in enumerate(slot.pages) if page in written)
            slot.valid = first * self.cache.page_size
            slot.pages = slot.pages[:first]

    def _fill(self, slot: _Slot) -> None:
        """Copy context tokens valid..position-1 of one sequence from its pages."""
        size = self.cache.page_size
        start, end = slot.valid, slot.position
        page_ids = slot.sequence.page_ids[start // size : -(-end // size)]
        pages = torch.tensor(page_ids, dtype=torch.long, device=self.keys.device)
        index = self.slots.index(slot)
        offset = start - start // size * size
        for source, target in ((self.cache.keys, self.keys), (self.cache.values, self.values)):
            layers, kv_heads, _, _, head_dim = source.shape
            gathered = source.index_select(2, pages).view(layers, kv_heads, -1, head_dim)
            target[:, index, :, start:end] = gathered[:, :, offset : offset + end - start]
        slot.valid = end
        slot.pages = slot.sequence.page_ids[: -(-end // size)]

    def _rows(self, widest: int) -> DecodeRows:
        device = self.keys.device
        _, _, kv_heads, capacity, _ = self.keys.shape
        positions = torch.tensor([slot.position for slot in self.slots], device=device)
        heads = torch.arange(kv_heads, device=device)
        rows = torch.arange(len(self.slots), device=device)
        write_index = ((rows[:, None] * kv_heads + heads) * capacity + positions[:, None]).view(-1)
        valid = torch.arange(widest, device=device)[None, :] <= positions[:, None]
        bias = torch.zeros(valid.shape, dtype=self.keys.dtype, device=device)
        bias.masked_fill_(~valid, float("-inf"))
        bias = bias.repeat_interleave(kv_heads, 0)[:, None, :]
        return DecodeRows(self.keys, self.values, write_index, bias)
