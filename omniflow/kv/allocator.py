"""The page allocation interface the engine uses for its paged KV cache.

Kept small on purpose, so the scheduler does not depend on the radix tree
(omniflow/kv/radix.py) that implements it. The result types live in
omniflow/kv/pages.py so the cache layer need not import the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from omniflow.kv.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch

if TYPE_CHECKING:
    from omniflow.kv.radix import PendingPromotion

__all__ = ["ExtraKeys", "OutOfPages", "PageAllocator", "PageUsage", "PrefixMatch"]


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

    def start_promotion(self, nodes: list[Any], device_pages: list[int]) -> PendingPromotion:
        """Copy lower-tier nodes (a match's ``lower``) into device_pages the caller holds."""
        ...

    def finish_promotion(self, pending: PendingPromotion) -> bool:
        """After the copy: True if the nodes hold the device pages now."""
        ...

    def cancel_promotion(self, nodes: Sequence[Any]) -> None:
        """Give back a match's ``lower`` nodes unpromoted."""
        ...
