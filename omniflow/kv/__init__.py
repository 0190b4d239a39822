"""The paged KV allocator: the radix prefix tree over device pages (radix.py), its host and
SSD tiers with promotion (tiers.py), the allocator interface the scheduler calls
(allocator.py), KV leases shared across processes (share.py) and the cost model and tokens
of pulling KV from a peer (pull_cost.py, pull_tokens.py).

The names below import their module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniflow.lazy import exports

_WHERE = {
    "ExtraKeys": "omniflow.kv.pages",
    "OutOfPages": "omniflow.kv.pages",
    "PageAllocator": "omniflow.kv.allocator",
    "PageUsage": "omniflow.kv.pages",
    "PrefixMatch": "omniflow.kv.pages",
    "RadixNode": "omniflow.kv.radix",
    "RadixPrefixCache": "omniflow.kv.radix",
    "Residency": "omniflow.kv.radix",
}

__all__ = [
    "ExtraKeys",
    "OutOfPages",
    "PageAllocator",
    "PageUsage",
    "PrefixMatch",
    "RadixNode",
    "RadixPrefixCache",
    "Residency",
]

if TYPE_CHECKING:
    from omniflow.kv.allocator import PageAllocator
    from omniflow.kv.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch
    from omniflow.kv.radix import RadixNode, RadixPrefixCache, Residency

__getattr__ = exports(__name__, _WHERE)
