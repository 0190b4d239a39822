"""Batched decode attention over ragged block tables equals attention computed one sequence
at a time, in float32 (batched matmuls) and in bf16 (SDPA over the bf16 K/V on CPU)."""

import pytest
import torch

from omniflow.engine.paged_attention import (
    DecodeSpec,
    KVCache,
    PagedAttention,
    build_attention_batch,
    sdpa_decode,
)

PAGE, KV_HEADS, HEADS, DIM = 4, 2, 6, 8
# (page ids, context length including the new token) per decode row: ragged, unordered pages
DECODES = [
    DecodeSpec([3, 5, 7], 10),
    DecodeSpec([1], 3),
    DecodeSpec([2, 8, 9, 10], 16),
    DecodeSpec([4, 6], 5),
]


def reference(cache, q, scale):
    """Each row alone: its context's K/V by slot, kv heads repeated per query-head group."""
    outputs = []
    for row, (page_ids, length) in enumerate(DECODES):
        slots = torch.tensor(cache.slots(page_ids, 0, length))
        keys = cache.keys[0].flatten(1, 2)[:, slots].float()  # [kv_heads, ctx, dim]
        values = cache.values[0].flatten(1, 2)[:, slots].float()
        group = HEADS // KV_HEADS
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = (q[row].float()[:, None, :] @ keys.transpose(1, 2)) * scale  # [heads, 1, ctx]
        outputs.append((scores.softmax(-1) @ values)[:, 0])
    return torch.stack(outputs)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_batched_decode_equals_one_sequence_at_a_time(dtype, tolerance):
    generator = torch.Generator().manual_seed(7)
    cache = KVCache(1, 12, PAGE, KV_HEADS, DIM, dtype, torch.device("cpu"))
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    rows = len(DECODES)
    q = torch.randn(rows, HEADS, DIM, generator=generator).to(dtype)
    k = torch.randn(rows, KV_HEADS, DIM, generator=generator).to(dtype)
    v = torch.randn(rows, KV_HEADS, DIM, generator=generator).to(dtype)
    batch = build_attention_batch(cache, DECODES, [], cache.keys.device, dtype)
    scale = DIM**-0.5
    out = PagedAttention(cache, batch, scale)(0, q, k, v)
    assert sdpa_decode(cache.keys) == (dtype == torch.bfloat16)
    assert out.dtype == dtype and out.shape == (rows, HEADS, DIM)
    # The new tokens' K/V were written at each row's last position, and attended to.
    last = [
        page_ids[(length - 1) // PAGE] * PAGE + (length - 1) % PAGE for page_ids, length in DECODES
    ]
    assert torch.equal(cache.keys[0].flatten(1, 2)[:, last].transpose(0, 1), k)
    torch.testing.assert_close(
        out.float(), reference(cache, q, scale), rtol=tolerance, atol=tolerance
    )
