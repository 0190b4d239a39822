"""An engine's side of moving a prefix's KV pages to or from another replica.

The holder pins the device pages of the longest prefix its radix tree holds, reads them out
(a copy: after that the pin can go) and unpins. The puller holds what it has of the prefix
already, reserves pages for the rest, writes the pulled pages into them and publishes the
whole prefix in its tree, as if it had computed it; or gives everything back on failure.
The socket side is transport/kv_pull.py; the engine never sees it.

``KVTransfer`` touches the allocator, so its methods run on the engine thread (between
steps), except ``read`` and ``write``: they touch only pages the caller holds (pinned, or
reserved and in nobody's tree), as the KV tiers' promotion does on its worker thread.
``EnginePrefixes`` is the asyncio face over an ``AsyncEngine``: what the KV pull server
reads from and what a pull writes into.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omniflow.engine.async_engine import AsyncEngine
from omniflow.engine.kv_pages import KVCachePages
from omniflow.engine.llm_engine import LLMEngine
from omniflow.engine.sequence import EmbeddingSpan, key_spans
from omniflow.kv.pages import OutOfPages

Keys = Sequence[Hashable | None] | None


def span_keys(prompt_len: int, spans: list[EmbeddingSpan], num_tokens: int) -> list | None:
    """The prefix keys of a prompt's first num_tokens positions, as the engine keys them
    (None: all text)."""
    if not any(span.content_hash is not None for span in spans):
        return None
    keys: list[Hashable | None] = [None] * prompt_len
    key_spans(keys, spans)
    return keys[:num_tokens]


class KVTransfer:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pages = KVCachePages(engine.cache)
        self.page_shape = self.pages.page_shape
        self.dtype = self.pages.dtype
        self.page_size = engine.cache.page_size
        self.page_nbytes = int(torch.Size(self.page_shape).numel()) * self.dtype.itemsize

    def pin(self, token_ids: Sequence[int], extra_keys: Keys = None) -> tuple[list[int], int]:
        """Hold the device pages of the longest cached prefix of token_ids: (pages, tokens).
        Lower-tier continuations are left where they are (not promoted for a pull)."""
        allocator: Any = self.engine.allocator
        match = allocator.match_prefix(token_ids, extra_keys)
        if match.lower:
            allocator.cancel_promotion(match.lower)
        return list(match.page_ids), match.num_tokens

    def unpin(self, pages: Sequence[int]) -> None:
        if pages:
            self.engine.allocator.free(pages)

    def cached_tokens(self, token_ids: Sequence[int], extra_keys: Keys = None) -> int:
        """How many leading tokens of token_ids this engine holds in device pages now."""
        pages, tokens = self.pin(token_ids, extra_keys)
        self.unpin(pages)
        return tokens

    def reserve(self, num_pages: int) -> list[int] | None:
        """Fresh pages for pulled KV (held by the caller), or None if they do not fit."""
        try:
            return self.engine.allocator.allocate(num_pages)
        except OutOfPages:
            return None

    def publish(self, token_ids: Sequence[int], extra_keys: Keys, pages: Sequence[int]) -> None:
        """The prefix's pages (held, in order) now hold its KV: into the tree, and let go."""
        end = len(pages) * self.page_size
        keys = None if extra_keys is None else list(extra_keys)[:end]
        self.engine.allocator.insert(list(token_ids)[:end], list(pages), keys)
        self.unpin(pages)

    def read(self, pages: Sequence[int]) -> torch.Tensor:
        """[len(pages), *page_shape], a CPU copy (any thread; the pages must be held)."""
        return self.pages.read_pages(pages)

    def write(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Store data [len(pages), *page_shape] (any thread; pages reserved by the caller)."""
        self.pages.write_pages(pages, data)


class EnginePrefixes:
    """KV pages of an ``AsyncEngine``'s prefix cache, for the KV pull server and pulls."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        backend = engine.backend
        if not isinstance(backend, LLMEngine):
            raise TypeError(f"KV pulls need an LLMEngine backend, not {type(backend).__name__}")
        self.transfer = KVTransfer(backend)
        self.page_shape = self.transfer.page_shape
        self.dtype = self.transfer.dtype
        self.page_size = self.transfer.page_size
        self.page_nbytes = self.transfer.page_nbytes

    # ------------------------------------------------------------ the holder's side

    async def pin(self, token_ids: list[int], extra_keys: Keys) -> tuple[list[int], int]:
        return await self.engine.call(lambda: self.transfer.pin(token_ids, extra_keys))

    async def read(self, pages: list[int]) -> torch.Tensor:
        return await asyncio.to_thread(self.transfer.read, pages)

    async def unpin(self, pages: list[int]) -> None:
        await self.engine.call(lambda: self.transfer.unpin(pages))

    # ------------------------------------------------------------ the puller's side

    async def cached_tokens(self, token_ids: list[int], extra_keys: Keys = None) -> int:
        return await self.engine.call(lambda: self.transfer.cached_tokens(token_ids, extra_keys))

    def importer(self, token_ids: list[int], extra_keys: Keys = None) -> PrefixImport:
        return PrefixImport(self, list(token_ids), extra_keys)


class PrefixImport:
    """One pull into this engine: ``begin`` holds what it has of the prefix (``held_pages``),
    ``reserve``/``write`` take the pulled pages, then ``publish`` or ``abandon`` (on every
    path: until then the pages are held)."""

    def __init__(self, prefixes: EnginePrefixes, token_ids: list[int], extra_keys: Keys) -> None:
        self.prefixes = prefixes
        self.token_ids, self.extra_keys = token_ids, extra_keys
        self.page_shape, self.dtype = prefixes.page_shape, prefixes.dtype
        self.held: list[int] = []
        self.reserved: list[int] = []

    @property
    def held_pages(self) -> int:
        return len(self.held)

    async def begin(self) -> int:
        """Hold the prefix's pages this engine has already; how many."""
        self.held, _ = await self.prefixes.pin(self.token_ids, self.extra_keys)
        return len(self.held)

    async def reserve(self, num_pages: int) -> bool:
        transfer = self.prefixes.transfer
        pages = await self.prefixes.engine.call(lambda: transfer.reserve(num_pages))
        if pages is None:
            return False
        self.reserved = pages
        return True

    async def write(self, offset: int, data: torch.Tensor) -> None:
        """Pulled pages offset..offset+len(data) of the reserved ones."""
        pages = self.reserved[offset : offset + len(data)]
        if len(pages) != len(data):
            raise ValueError(f"{len(data)} pulled pages at {offset}: {len(self.reserved)} reserved")
        await asyncio.to_thread(self.prefixes.transfer.write, pages, data)

    async def publish(self) -> None:
        transfer, pages = self.prefixes.transfer, self.held + self.reserved
        self.held, self.reserved = [], []
        await self.prefixes.engine.call(
            lambda: transfer.publish(self.token_ids, self.extra_keys, pages)
        )

    async def abandon(self) -> None:
        """Give back whatever is held (nothing after ``publish``)."""
        transfer, pages = self.prefixes.transfer, self.held + self.reserved
        self.held, self.reserved = [], []
        if pages:
            await self.prefixes.engine.call(lambda: transfer.unpin(pages))
