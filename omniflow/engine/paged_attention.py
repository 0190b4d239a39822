"""Paged KV cache and the attention over it, in plain PyTorch.

K/V live in fixed-size pages, head-major: per layer a [kv_heads, pages, page_size, head_dim]
tensor, so gathering a block table copies whole pages per head and yields, without any
transpose, the [kv_heads, tokens, head_dim] layout the matmuls want. A step's rows are
single-token decodes (batched over ragged block tables) followed by prefill chunks (each
over its cached prefix plus its new tokens, causal within the chunk). Decode rows read either
the pages (gathered per step) or a DecodeMirror's contiguous copy of them (DecodeRows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from omniflow.kv.share import KVLeaseView


def sdpa_decode(cache: torch.Tensor) -> bool:
    """Whether decode attention over this K/V runs as SDPA (half precision on CPU) rather
    than as batched matmuls. On CPU, bmm copies strided bf16 operands first (it runs them at
    half its float32 speed), while SDPA's CPU kernel reads bf16/fp16 K/V in place and
    accumulates in float32: half the bytes of a float32 copy. With one query row per
    sequence and a mask, SDPA is no faster than bmm in float32."""
    return cache.device.type == "cpu" and cache.dtype in (torch.bfloat16, torch.float16)


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
        self.num_kv_heads = num_kv_heads
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        # Zeroed, not empty: padded gathers read unused slots, and although their scores are
        # masked, a zero weight times a NaN left in memory would still poison the output.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._written_pages: set[int] = set()
        self._written_lock = threading.Lock()

    def note_written(self, page_ids: Iterable[int]) -> None:
        """Record pages whose K/V were written outside a model step (e.g. promoted back from
        a host or SSD tier; from any thread). The decode mirror refreshes its copies of them
        instead of serving their old contents."""
        with self._written_lock:
            self._written_pages.update(page_ids)

    def take_written_pages(self) -> set[int]:
        """The pages noted since the last call."""
        with self._written_lock:
            pages, self._written_pages = self._written_pages, set()
        return pages

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
    context_pages: torch.Tensor | None  # pages holding all context + chunk tokens, or None
    context_len: int  # tokens in those pages once the chunk is written
    causal_mask: torch.Tensor | None  # [chunk, context_len] bool, True = may attend
    # Equal-length chunks without cached context share one segment: one batched attention
    # call instead of one per prompt.
    num_chunks: int = 1
    # A block step's rows: they see all of the context and each other (causal_mask None).
    bidirectional: bool = False
    # A lent context's K/V (kv/share.py KVLeaseView): ahead of the pages' tokens.
    lent: KVLeaseView | None = None
    # Of a block: its first rows, which attend causally among the block's rows.
    causal_rows: int = 0


class DecodeRows(NamedTuple):
    """Decode rows served from a DecodeMirror: row i attends over slot i's context."""

    keys: torch.Tensor  # [layers, slots, kv_heads, capacity, head_dim]
    values: torch.Tensor
    write_index: torch.Tensor  # [rows * kv_heads] flat (slot, head, position) of each new K/V
    bias: torch.Tensor  # [rows * kv_heads, 1, widest context]: 0 / -inf


class AttentionBatch(NamedTuple):
    slot_mapping: torch.Tensor  # [rows] slot (page * page_size + offset) of each new K/V
    num_decode_rows: int
    decode_pages: torch.Tensor | None  # [decodes * widest table] block tables, padded, flat
    decode_bias: torch.Tensor | None  # [kv_heads * decodes, 1, widest * page_size]: 0 / -inf
    prefills: list[PrefillSegment]
    mirrored: DecodeRows | None = None  # set: decodes read the mirror, not decode_pages
    decode_lengths: torch.Tensor | None = None  # [decodes] context lengths, with the new token


class DecodeSpec(NamedTuple):
    """One decode row of a step, as the runner hands it to build_attention_batch: its new
    token attends to the first context_len tokens of page_ids (the new token included)."""

    page_ids: list[int]
    context_len: int


class PrefillSpec(NamedTuple):
    """One prefill chunk of a step, as the runner hands it to build_attention_batch: rows
    after the decode rows, attending to the chunk's context (its first context_start tokens,
    in page_ids) and causally to themselves. bidirectional: a block step's rows, attending to
    all their context and all of themselves (their first causal_rows causally), after a lent
    context's K/V (a KVLeaseView) where given."""

    page_ids: list[int]
    context_start: int
    num_tokens: int
    bidirectional: bool = False
    lent: KVLeaseView | None = None
    causal_rows: int = 0


def build_attention_batch(
    cache: KVCache,
    decodes: Sequence[DecodeSpec],
    prefills: Sequence[PrefillSpec],
    device: torch.device,
    dtype: torch.dtype,
    mirrored: DecodeRows | None = None,
    decode_masks: bool = True,
) -> AttentionBatch:
    """The step's attention metadata, built once per step: decodes, one DecodeSpec per
    decode row (rows first); prefills, one PrefillSpec per prefill chunk, rows after them;
    mirrored: the decode rows' mirror, if they read one instead of gathering pages;
    decode_masks: False when decode attention reads tables and lengths (the CPU kernel), so
    no mask is built."""
    size = cache.page_size
    slot_mapping: list[int] = []
    decode_pages = decode_bias = decode_lengths = None
    if decodes and mirrored is None:
        decode_pages, decode_bias, decode_lengths = _decode_tables(
            cache, decodes, device, dtype, decode_masks
        )
    for page_ids, length in decodes:
        slot_mapping.append(page_ids[(length - 1) // size] * size + (length - 1) % size)
    segments: list[PrefillSegment] = []
    row = len(decodes)
    for spec in prefills:
        page_ids, context_start, chunk = spec.page_ids, spec.context_start, spec.num_tokens
        end = context_start + chunk
        slot_mapping += cache.slots(page_ids, context_start, end)
        if spec.bidirectional:
            block_pages = torch.tensor(page_ids[: -(-end // size)], dtype=torch.long, device=device)
            segments.append(
                PrefillSegment(
                    row_start=row,
                    row_end=row + chunk,
                    context_pages=block_pages,
                    context_len=end,
                    causal_mask=None,
                    bidirectional=True,
                    lent=spec.lent,
                    causal_rows=spec.causal_rows,
                )
            )
            row += chunk
            continue
        last = segments[-1] if segments else None
        fresh = last is not None and last.context_pages is None and not last.bidirectional
        if context_start == 0 and last and fresh and last.context_len == chunk:
            segments[-1] = last._replace(row_end=row + chunk, num_chunks=last.num_chunks + 1)
            row += chunk
            continue
        pages = mask = None
        if context_start > 0:
            pages = torch.tensor(page_ids[: -(-end // size)], dtype=torch.long, device=device)
            query_positions = torch.arange(context_start, end, device=device)
            mask = torch.arange(end, device=device)[None, :] <= query_positions[:, None]
        segments.append(
            PrefillSegment(
                row_start=row,
                row_end=row + chunk,
                context_pages=pages,
                context_len=end,
                causal_mask=mask,
            )
        )
        row += chunk
    return AttentionBatch(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decode_rows=len(decodes),
        decode_pages=decode_pages,
        decode_bias=decode_bias,
        prefills=segments,
        mirrored=mirrored,
        decode_lengths=decode_lengths,
    )


def _decode_tables(
    cache: KVCache,
    decodes: Sequence[DecodeSpec],
    device: torch.device,
    dtype: torch.dtype,
    masks: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The decode rows' block tables (padded to the widest, flat), their masks (None without
    ``masks``) and context lengths."""
    size = cache.page_size
    widest = max(-(-length // size) for _, length in decodes)
    # Padding points at page 0: its values are finite and their scores are masked.
    tables = [
        page_ids[:widest] + [0] * (widest - len(page_ids[:widest])) for page_ids, _ in decodes
    ]
    pages = torch.tensor(tables, dtype=torch.long, device=device).view(-1)
    lengths = torch.tensor([length for _, length in decodes], device=device)
    bias = None
    if masks:
        valid = torch.arange(widest * size, device=device)[None, :] < lengths[:, None]
        bias = torch.zeros(valid.shape, dtype=dtype, device=device)
        bias.masked_fill_(~valid, float("-inf"))
        bias = bias.repeat(cache.num_kv_heads, 1)[:, None, :]
    return pages, bias, lengths


class PagedAttention:
    """The `AttentionFn` the decoder calls per layer, bound to one step's AttentionBatch:
    the PyTorch reference path. The CPU kernels' path (engine/cpu_attention.py) overrides
    the K/V write, the maskless decode and the prefill attention where the kernels fit."""

    def __init__(self, cache: KVCache, batch: AttentionBatch, scale: float):
        self.cache = cache
        self.batch = batch
        self.scale = scale
        # Decode attention's kernel, fixed by the cache (the mirror shares its dtype/device).
        self.sdpa_decode = sdpa_decode(cache.keys)

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        batch = self.batch
        layer_keys = self.cache.keys[layer_index]  # [kv_heads, pages, page_size, head_dim]
        layer_values = self.cache.values[layer_index]
        self._write(k, v, layer_keys, layer_values)
        outputs = []
        decodes = batch.num_decode_rows
        if decodes:
            rows = slice(0, decodes)
            outputs.append(
                self._decode_rows(layer_index, q[rows], k[rows], v[rows], layer_keys, layer_values)
            )
        for segment in batch.prefills:
            rows = slice(segment.row_start, segment.row_end)
            outputs.append(
                self._prefill(
                    segment, q[rows], k[rows], v[rows], layer_keys, layer_values, layer_index
                )
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _write(self, k, v, layer_keys: torch.Tensor, layer_values: torch.Tensor) -> None:
        """The step's new K/V into their slots."""
        kv_heads, pages, size, head_dim = layer_keys.shape
        flat = (kv_heads, pages * size, head_dim)
        slots = self.batch.slot_mapping
        layer_keys.view(flat).index_copy_(1, slots, k.transpose(0, 1))
        layer_values.view(flat).index_copy_(1, slots, v.transpose(0, 1))

    def _decode_rows(self, layer_index: int, q, k, v, layer_keys, layer_values) -> torch.Tensor:
        if self.batch.mirrored is not None:
            return self._decode_mirrored(layer_index, q, k, v)
        return self._decode(q, layer_keys, layer_values)

    def _decode(self, q, layer_keys, layer_values) -> torch.Tensor:
        decodes, heads, head_dim = q.shape
        kv_heads = layer_keys.shape[0]
        decode_bias = self.batch.decode_bias
        if decode_bias is None:
            raise RuntimeError("decode rows in an attention batch built without decode_bias")
        keys = layer_keys.index_select(1, self.batch.decode_pages)
        values = layer_values.index_select(1, self.batch.decode_pages)
        if self.sdpa_decode:
            shape = (kv_heads, decodes, -1, head_dim)
            # decode_bias repeats its rows per kv head, kv-head-major: the first `decodes`.
            return _sdpa_decode(
                q,
                keys.view(shape).transpose(0, 1),
                values.view(shape).transpose(0, 1),
                decode_bias[:decodes],
                self.scale,
            )
        keys = keys.view(kv_heads * decodes, -1, head_dim)  # [kv_heads * decodes, ctx, dim]
        values = values.view(keys.shape)
        grouped_q = (q * self.scale).view(decodes, kv_heads, -1, head_dim)
        grouped_q = grouped_q.transpose(0, 1).reshape(kv_heads * decodes, -1, head_dim)
        out = _attend(grouped_q, keys, values, decode_bias).view(kv_heads, decodes, -1, head_dim)
        return out.transpose(0, 1).reshape(decodes, heads, head_dim)

    def _decode_mirrored(self, layer_index: int, q, k, v) -> torch.Tensor:
        # Slot-major mirror: rows' contexts are one strided batch [rows * kv_heads, ctx, dim],
        # and q needs no transpose to match it.
        rows = self.batch.mirrored
        if rows is None:
            raise RuntimeError("mirrored decode in an attention batch built without a mirror")
        decodes, heads, head_dim = q.shape
        layer_keys, layer_values = rows.keys[layer_index], rows.values[layer_index]
        slots, kv_heads, capacity, _ = layer_keys.shape
        new = (decodes * kv_heads, head_dim)
        layer_keys.view(-1, head_dim).index_copy_(0, rows.write_index, k.reshape(new))
        layer_values.view(-1, head_dim).index_copy_(0, rows.write_index, v.reshape(new))
        widest = rows.bias.shape[-1]
        if self.sdpa_decode:
            # rows.bias repeats its rows per kv head, row-major: every kv_heads-th.
            return _sdpa_decode(
                q,
                layer_keys[:decodes, :, :widest],
                layer_values[:decodes, :, :widest],
                rows.bias.view(decodes, kv_heads, widest)[:, :1],
                self.scale,
            )
        batch = (slots * kv_heads, capacity, head_dim)
        keys = layer_keys.view(batch)[: decodes * kv_heads, :widest]
        values = layer_values.view(batch)[: decodes * kv_heads, :widest]
        grouped_q = (q * self.scale).view(decodes * kv_heads, -1, head_dim)
        out = _attend(grouped_q, keys, values, rows.bias)
        return out.view(decodes, heads, head_dim)

    def _prefill(self, segment: PrefillSegment, q, k, v, layer_keys, layer_values, layer: int):
        if segment.context_pages is None:
            return self._prefill_fresh(segment, q, k, v)
        kv_heads, _, _, head_dim = layer_keys.shape
        shape = (kv_heads, -1, head_dim)
        keys = layer_keys.index_select(1, segment.context_pages).view(shape)
        values = layer_values.index_select(1, segment.context_pages).view(shape)
        keys, values = keys[:, : segment.context_len], values[:, : segment.context_len]
        if segment.lent is not None:  # the lender's pages, read in place (gathered)
            lent_keys, lent_values = segment.lent.layer(layer)
            keys = torch.cat((lent_keys.to(keys.device), keys), dim=1)
            values = torch.cat((lent_values.to(values.device), values), dim=1)
        if segment.bidirectional:
            return self._block(q, keys, values, segment.causal_rows)
        tokens, heads, _ = q.shape
        group = heads // kv_heads
        grouped_q = (q * self.scale).transpose(0, 1).reshape(kv_heads, group * tokens, head_dim)
        mask = segment.causal_mask
        assert mask is not None, "a prefill over cached context has a causal mask"
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~mask, float("-inf"))
        out = _attend(grouped_q, keys, values, bias.repeat(group, 1))
        return out.view(heads, tokens, head_dim).transpose(0, 1)

    def _block(self, q, keys, values, causal: int) -> torch.Tensor:
        """A block's rows over the context and the block: the leading ``causal`` rows with a
        mask (they see the block's rows up to themselves), the rest with none, which runs
        SDPA's fused kernel, never the [heads, rows, context] scores in memory (a mask on
        every row would force its unfused path). 4-d: with 3-d inputs CPU SDPA takes its
        slower path."""

        def attend(rows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                rows.transpose(0, 1)[None],
                keys[None],
                values[None],
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1)

        if not causal:
            return attend(q, None)
        mask = _causal_head_mask(q.shape[0], keys.shape[1], causal, q.device)
        assert mask is not None
        if causal == q.shape[0]:
            return attend(q, mask)
        return torch.cat((attend(q[:causal], mask[:causal]), attend(q[causal:], None)))

    def _prefill_fresh(self, segment: PrefillSegment, q, k, v):
        chunks, tokens = segment.num_chunks, segment.context_len
        # [chunks * tokens, heads, dim] -> [chunks, heads, tokens, dim], as views.
        out = F.scaled_dot_product_attention(
            q.view(chunks, tokens, *q.shape[1:]).transpose(1, 2),
            k.view(chunks, tokens, *k.shape[1:]).transpose(1, 2),
            v.view(chunks, tokens, *v.shape[1:]).transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(q.shape)


def _causal_head_mask(
    rows: int, total: int, causal: int, device: torch.device
) -> torch.Tensor | None:
    """A block's mask [rows, total] (True: may attend) where its first `causal` rows see
    the context and the block's rows up to themselves; None when every row sees all."""
    if not causal:
        return None
    mask = torch.ones(rows, total, dtype=torch.bool, device=device)
    block = torch.arange(rows, device=device)
    mask[:causal, total - rows :] = block[None, :] <= block[:causal, None]
    return mask


def _sdpa_decode(q, keys, values, bias, scale: float) -> torch.Tensor:
    """One new token per sequence: q [rows, heads, dim] over keys/values [rows, kv_heads,
    ctx, dim] (any strides), bias [rows, 1, ctx] (0 / -inf). Grouped-query heads share a
    kv head as transformers' repeat_kv does."""
    rows, heads, head_dim = q.shape
    out = F.scaled_dot_product_attention(
        q.view(rows, heads, 1, head_dim),
        keys,
        values,
        attn_mask=bias.view(rows, 1, 1, -1),
        scale=scale,
        enable_gqa=True,
    )
    return out.view(rows, heads, head_dim)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor):
    """softmax(q @ keys^T + bias) @ values as batched matmuls, softmax in float32.

    q (already scaled) [batch, rows, dim], keys/values [batch, ctx, dim], bias broadcast to
    [batch, rows, ctx] (0 or -inf). Used instead of scaled_dot_product_attention for a
    float32 cache and on GPUs: on CPU in float32, SDPA with a mask and GQA is slower, in
    decode and over a cached context alike. A half-precision CPU cache decodes through SDPA
    instead (`sdpa_decode`).
    """
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2))
    probs = scores.float().softmax(-1).to(values.dtype)
    return torch.bmm(probs, values)
