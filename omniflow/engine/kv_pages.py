"""The engine's KVCache seen as whole pages, for the KV tiers below it (omniflow.kv.tiers).

A page's content is every layer's keys and values for its tokens: [2, layers, kv_heads,
page_size, head_dim]. Demotion reads pages out to the host pool; promotion writes them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omniflow.engine.paged_attention import KVCache


class KVCachePages:
    def __init__(self, cache: KVCache):
        self.cache = cache
        layers, kv_heads, _, page_size, head_dim = cache.keys.shape
        self.page_shape: tuple[int, ...] = (2, layers, kv_heads, page_size, head_dim)
        self.dtype = cache.keys.dtype

    def _index(self, page_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(page_ids), dtype=torch.long, device=self.cache.keys.device)

    def read_pages(self, page_ids: Sequence[int]) -> torch.Tensor:
        index = self._index(page_ids)
        out = torch.empty((len(page_ids), *self.page_shape), dtype=self.dtype)
        for which, table in enumerate((self.cache.keys, self.cache.values)):
            # One gather where the cache lives, then one strided copy into page-major
            # order (stacking first, then making that contiguous, cost 4x as much on CPU).
            out[:, which].copy_(table.index_select(2, index).permute(2, 0, 1, 3, 4))
        return out

    def write_pages(self, page_ids: Sequence[int], data: torch.Tensor) -> None:
        index = self._index(page_ids)
        data = data.to(self.cache.keys.device)
        self.cache.keys.index_copy_(2, index, data[:, 0].permute(1, 2, 0, 3, 4))
        self.cache.values.index_copy_(2, index, data[:, 1].permute(1, 2, 0, 3, 4))
        self.cache.note_written(page_ids)  # the decode mirror must not keep old copies
