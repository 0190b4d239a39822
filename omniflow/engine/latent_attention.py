"""MLA's attention over latent pages, in plain PyTorch.

A latent page holds, per token and attention layer, only MLA's [latent ‖ rotary key]
(kv_lora_rank + qk_rope_head_dim values): its first half in `KVCache.keys`, the rest in
`KVCache.values` (one kv head, head_dim = half of it, rounded up). Keys and values having
one shape, pages of latents are pages like any other to the prefix cache, preemption, the
host/SSD tiers (kv_pages.py) and KV leases; only attention reads them differently.

Attention is MQA in the absorbed form (models/deepseek/mla.py): the query [rows, heads, D] scores
against the whole latent vector and the output is the weighted latent [rows, heads, rank].
With omniflow's CPU kernels (a bf16 model on CPU), decode rows read the pages in place on
them (kernels/latent_attention.c) instead of gathering them: engine/cpu_attention.py.
"""

from __future__ import annotations

import torch

from omniflow.engine.paged_attention import AttentionBatch, KVCache, PrefillSegment


class LatentPagedAttention:
    """The `AttentionFn` of an MLA decoder, bound to one step's AttentionBatch (no mirror;
    built with decode masks): the PyTorch reference path."""

    def __init__(self, cache: KVCache, batch: AttentionBatch, scale: float):
        self.cache = cache
        self.batch = batch
        self.scale = scale

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [rows, heads, D]; k [rows, 1, D] the new latents; v [rows, 1, rank] a view of
        them (the cache keeps k alone) -> [rows, heads, rank]."""
        batch, rank = self.batch, v.shape[-1]
        half = self.cache.keys.shape[-1]
        firsts = self.cache.keys[layer_index, 0].view(-1, half)  # [slots, half]
        seconds = self.cache.values[layer_index, 0].view(-1, half)
        latents = k[:, 0]
        firsts.index_copy_(0, batch.slot_mapping, latents[:, :half])
        seconds[:, : latents.shape[1] - half].index_copy_(0, batch.slot_mapping, latents[:, half:])
        width = latents.shape[1]
        outputs = []
        decodes = batch.num_decode_rows
        if decodes:
            outputs.append(self._decode_rows(layer_index, q[:decodes], width, rank))
        for segment in batch.prefills:
            rows = slice(segment.row_start, segment.row_end)
            outputs.append(self._prefill(layer_index, segment, q[rows], latents[rows], rank))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode_rows(self, layer_index: int, q, width: int, rank: int) -> torch.Tensor:
        batch = self.batch
        if batch.decode_pages is None or batch.decode_bias is None:
            raise RuntimeError("latent decode rows need block tables and decode masks")
        context = self._gather(layer_index, batch.decode_pages, width)
        context = context.view(q.shape[0], -1, width)  # [decodes, ctx, D]
        return self._attend(q, context, rank, batch.decode_bias[: q.shape[0]])

    def _gather(self, layer_index: int, pages: torch.Tensor, width: int) -> torch.Tensor:
        """[len(pages) * page_size, D]: the latents of those pages, in order."""
        half = self.cache.keys.shape[-1]
        firsts = self.cache.keys[layer_index, 0].index_select(0, pages).view(-1, half)
        seconds = self.cache.values[layer_index, 0].index_select(0, pages).view(-1, half)
        return torch.cat((firsts, seconds[:, : width - half]), dim=-1)

    def _prefill(
        self, layer_index: int, segment: PrefillSegment, q, latents, rank: int
    ) -> torch.Tensor:
        tokens = q.shape[0]
        if segment.context_pages is None:
            chunks, length = segment.num_chunks, segment.context_len
            context = latents.view(chunks, length, -1)
            causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
            bias = torch.zeros(causal.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~causal, float("-inf"))
            out = self._attend(q.view(chunks, length, *q.shape[1:]), context, rank, bias[None])
            return out.reshape(tokens, *out.shape[2:])
        context = self._gather(layer_index, segment.context_pages, latents.shape[1])
        context = context[: segment.context_len]
        bias = torch.zeros((tokens, segment.context_len), dtype=q.dtype, device=q.device)
        if not segment.bidirectional:
            assert segment.causal_mask is not None, "a prefill over cached context has a mask"
            bias.masked_fill_(~segment.causal_mask, float("-inf"))
        return self._attend(q[None], context[None], rank, bias[None])[0]

    def _attend(self, q, context, rank: int, bias) -> torch.Tensor:
        """q [batch, rows, heads, D] or [batch, heads, D] (one row), context [batch, ctx, D],
        bias broadcast to scores [batch, (rows x heads), ctx] -> like q with rank columns."""
        one_row = q.dim() == 3
        batch, heads, width = q.shape[0], q.shape[-2], q.shape[-1]
        flat = q.reshape(batch, -1, width) * self.scale  # [batch, rows * heads, D]
        if not one_row:
            rows = q.shape[1]
            bias = bias.repeat_interleave(heads, dim=-2)[:, : rows * heads]
        scores = torch.baddbmm(bias, flat, context.transpose(1, 2))
        probs = scores.float().softmax(-1).to(context.dtype)
        out = torch.bmm(probs, context[..., :rank])
        return out.view(*q.shape[:-1], rank)
