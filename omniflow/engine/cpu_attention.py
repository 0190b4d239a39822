"""Attention on omniflow's CPU kernels (omniflow.kernels: AMX tiles, or AVX-512 BF16
without AMX), for a bf16 model on CPU: the reference classes with the steps the kernels
take overridden. Everything they do not take (mirrored decode rows, bidirectional blocks,
heads the kernels refuse) runs the reference path's code."""

from __future__ import annotations

import torch

from omniflow.engine.latent_attention import LatentPagedAttention
from omniflow.engine.paged_attention import AttentionBatch, KVCache, PagedAttention, PrefillSegment
from omniflow.kernels import CpuKernels


class CpuPagedAttention(PagedAttention):
    """The kernels write the new K/V, run decode attention over the pages in place (a batch
    built without decode masks: tables and lengths) and prefill attention where
    `context_attention_supported` takes these heads."""

    def __init__(self, cache: KVCache, batch: AttentionBatch, scale: float, kernels: CpuKernels):
        super().__init__(cache, batch, scale)
        self.kernels = kernels
        self._on_kernels: bool | None = None  # prefill attention on the kernels, once known

    def _write(self, k, v, layer_keys: torch.Tensor, layer_values: torch.Tensor) -> None:
        self.kernels.kv_write(k, v, layer_keys, layer_values, self.batch.slot_mapping)

    def _decode_rows(self, layer_index: int, q, k, v, layer_keys, layer_values) -> torch.Tensor:
        batch = self.batch
        if batch.mirrored is not None or batch.decode_bias is not None:
            return super()._decode_rows(layer_index, q, k, v, layer_keys, layer_values)
        if batch.decode_pages is None or batch.decode_lengths is None:
            raise RuntimeError("decode rows without masks need block tables and lengths")
        tables = batch.decode_pages.view(q.shape[0], -1)
        return self.kernels.decode_attention(
            q, layer_keys, layer_values, tables, batch.decode_lengths, self.scale
        )

    def _prefill_on_kernels(self, heads: int) -> bool:
        if self._on_kernels is None:
            keys = self.cache.keys
            self._on_kernels = self.kernels.context_attention_supported(
                heads, keys.shape[1], keys.shape[-1]
            )
        return self._on_kernels

    def _prefill(self, segment: PrefillSegment, q, k, v, layer_keys, layer_values, layer: int):
        pages = segment.context_pages
        if pages is None or segment.bidirectional or not self._prefill_on_kernels(q.shape[1]):
            return super()._prefill(segment, q, k, v, layer_keys, layer_values, layer)
        # Over the pages in place: no gathered copy of the context, no mask.
        start = segment.context_len - q.shape[0]
        return self.kernels.context_attention(q, layer_keys, layer_values, pages, start, self.scale)

    def _prefill_fresh(self, segment: PrefillSegment, q, k, v):
        if not self._prefill_on_kernels(q.shape[1]):
            return super()._prefill_fresh(segment, q, k, v)
        return self.kernels.chunks_attention(q, k, v, segment.num_chunks, self.scale)


class CpuLatentAttention(LatentPagedAttention):
    """MLA's decode rows over the latent pages in place (kernels/latent_attention.c; a batch
    built without decode masks); prefill on the reference path."""

    def __init__(self, cache: KVCache, batch: AttentionBatch, scale: float, kernels: CpuKernels):
        super().__init__(cache, batch, scale)
        self.kernels = kernels

    def _decode_rows(self, layer_index: int, q, width: int, rank: int) -> torch.Tensor:
        batch = self.batch
        if batch.decode_pages is None or batch.decode_lengths is None:
            raise RuntimeError("latent decode rows on the kernels need block tables and lengths")
        return self.kernels.latent_decode_attention(
            q,
            self.cache.keys[layer_index, 0],
            self.cache.values[layer_index, 0],
            batch.decode_pages.view(q.shape[0], -1),
            batch.decode_lengths,
            rank,
            self.scale,
        )
