"""Paged KV cache and the attention over it, in plain PyTorch.

K/V live in fixed-size pages: a flat pool of slots per layer, page p owning slots
p*page_size .. p*page_size+page_size-1. A step's rows are single-token decodes (batched
over ragged block tables by gathering each sequence's slots) followed by prefill chunks
(each over its cached prefix plus its new tokens, causal within the chunk).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padded gather slots must hold finite values, since a masked
        # score's zero weight times a NaN would still poison the output.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element

    def slots(self, page_ids: list[int], start: int, end: int) -> list[int]:
        size = self.page_size
        return [page_ids[i // size] * size + i % size for i in range(start, end)]


class PrefillSegment(NamedTuple):
    row_start: int
    row_end: int
    context_start: int  # tokens already in the cache before this chunk
    context_slots: torch.Tensor | None  # slots of all context_start + chunk tokens, or None
    causal_mask: torch.Tensor | None  # [chunk, context] bool, True = may attend


class AttentionBatch(NamedTuple):
    slot_mapping: torch.Tensor  # [rows] where each row's new K/V is written
    num_decode_rows: int
    decode_slots: torch.Tensor | None  # [decodes, longest context] gathered slots, padded
    decode_mask: torch.Tensor | None  # [decodes, longest context] bool, True = valid
    prefills: list[PrefillSegment]


def build_attention_batch(
    cache: KVCache,
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    device: torch.device,
) -> AttentionBatch:
    """decodes: (page_ids, context length including the new token) per decode row;
    prefills: (page_ids, context_start, chunk length) per prefill chunk, rows after decodes."""
    slot_mapping: list[int] = []
    decode_slots = decode_mask = None
    if decodes:
        size = cache.page_size
        longest = max(length for _, length in decodes)
        widest = -(-longest // size)
        tables = torch.tensor(
            [
                page_ids[:widest] + [0] * (widest - len(page_ids[:widest]))
                for page_ids, _ in decodes
            ],
            dtype=torch.long,
            device=device,
        )
        positions = torch.arange(longest, device=device)
        # Padded positions gather slots of page 0: finite values, masked out below.
        decode_slots = tables[:, positions // size] * size + positions % size
        lengths = torch.tensor([length for _, length in decodes], device=device)
        decode_mask = positions[None, :] < lengths[:, None]
        for page_ids, length in decodes:
            slot_mapping.append(page_ids[(length - 1) // size] * size + (length - 1) % size)
    segments = []
    row = len(decodes)
    for page_ids, context_start, chunk in prefills:
        slot_mapping += cache.slots(page_ids, context_start, context_start + chunk)
        context_slots = mask = None
        if context_start > 0:
            end = context_start + chunk
            context_slots = torch.tensor(cache.slots(page_ids, 0, end), device=device)
            query_positions = torch.arange(context_start, end, device=device)
            mask = torch.arange(end, device=device)[None, :] <= query_positions[:, None]
        segments.append(PrefillSegment(row, row + chunk, context_start, context_slots, mask))
        row += chunk
    return AttentionBatch(
        torch.tensor(slot_mapping, dtype=torch.long, device=device),
        len(decodes),
        decode_slots,
        decode_mask,
        segments,
    )


class PagedAttention:
    """The `AttentionFn` the decoder calls per layer, bound to one step's AttentionBatch."""

    def __init__(self, cache: KVCache, batch: AttentionBatch, scale: float):
        self.cache = cache
        self.batch = batch
        self.scale = scale

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        batch = self.batch
        layer_keys = self.cache.keys[layer_index]
        layer_values = self.cache.values[layer_index]
        layer_keys.index_copy_(0, batch.slot_mapping, k)
        layer_values.index_copy_(0, batch.slot_mapping, v)
        outputs = []
        if batch.num_decode_rows:
            outputs.append(self._decode(q[: batch.num_decode_rows], layer_keys, layer_values))
        for segment in batch.prefills:
            rows = slice(segment.row_start, segment.row_end)
            outputs.append(
                self._prefill(segment, q[rows], k[rows], v[rows], layer_keys, layer_values)
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode(self, q, layer_keys, layer_values) -> torch.Tensor:
        # Grouped matmuls instead of scaled_dot_product_attention: on CPU, SDPA with a mask
        # and enable_gqa takes a slow path (~8x slower at batch 32 in our measurements).
        slots = self.batch.decode_slots
        decodes, longest = slots.shape
        kv_heads, head_dim = layer_keys.shape[1:]
        keys = layer_keys.index_select(0, slots.view(-1)).view(decodes, longest, kv_heads, head_dim)
        values = layer_values.index_select(0, slots.view(-1)).view(keys.shape)
        grouped_q = q.view(decodes, kv_heads, -1, head_dim)
        scores = torch.matmul(grouped_q, keys.permute(0, 2, 3, 1)).float() * self.scale
        scores.masked_fill_(~self.batch.decode_mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(values.dtype)
        return torch.matmul(probs, values.transpose(1, 2)).reshape(q.shape)

    def _prefill(self, segment: PrefillSegment, q, k, v, layer_keys, layer_values):
        if segment.context_slots is None:
            keys, values, mask, causal = k, v, None, True
        else:
            keys = layer_keys.index_select(0, segment.context_slots)
            values = layer_values.index_select(0, segment.context_slots)
            mask, causal = segment.causal_mask, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
