"""The page allocation interface the engine uses for its paged KV cache.

Kept small on purpose: a later multimodal radix tree (omniflow/cache/) replaces the
hash-chained implementation behind this protocol without touching the scheduler.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

# One optional key per token, mixed into the prefix hash: the content hash of the image or
# audio span the position belongs to, so equal placeholder ids of different media never match.
ExtraKeys = Sequence[Hashable | None]


class PrefixMatch(NamedTuple):
    page_ids: list[int]  # acquired (ref-counted) pages holding the matched prefix, in order
    num_tokens: int  # tokens covered: len(page_ids) * page_size


class PageUsage(NamedTuple):
    total_pages: int
    free_pages: int  # allocatable now, counting cached pages nobody references
    cached_pages: int  # pages reachable through the prefix index


class OutOfPages(RuntimeError):
    pass


class PageAllocator(Protocol):
    page_size: int

    def allocate(self, num_pages: int) -> list[int]:
        """Take num_pages fresh pages (ref count 1) or raise OutOfPages."""
        ...

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced cached pages stay matchable."""
        ...

    def match_prefix(
        self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> PrefixMatch:
        """Acquire the longest run of full cached pages that prefixes token_ids."""
        ...

    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> None:
        """Publish the full pages of token_ids (stored in page_ids) for later matches."""
        ...

    def usage(self) -> PageUsage: ...
