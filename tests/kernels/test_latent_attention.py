"""MLA's decode attention over latent pages on the CPU kernels (kernels/latent_attention.c)
against the float32 reference and the engine's PyTorch path, and MLA models on the kernels
(norms, silu * up, latent decode attention) against PyTorch ops."""

import pytest
import torch

from omniflow.engine import LLM, SamplingParams
from omniflow.engine.cpu_attention import CpuLatentAttention
from omniflow.engine.latent_attention import LatentPagedAttention
from omniflow.engine.paged_attention import KVCache, build_attention_batch
from omniflow.kernels import cpu_kernels, unavailable_reason
from omniflow.models import build_tiny_model

kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(
    kernels is None, reason=f"CPU kernels unavailable: {unavailable_reason()}"
)
BF16 = torch.bfloat16


def latent_cache(width: int, pages: int, page_size: int, seed: int) -> KVCache:
    """One layer of latent pages: a token's first ceil(width / 2) values in keys, the rest
    in values, as engine/latent_attention.py stores them."""
    half = -(-width // 2)
    cache = KVCache(1, pages, page_size, 1, half, BF16, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator).to(BF16))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator).to(BF16))
    return cache


def reference(q, cache, tables, lengths, width, rank, scale):
    """float32 attention of each row's query over its tokens' latents."""
    half, size = cache.keys.shape[-1], cache.page_size
    out = []
    for row, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        pages = torch.tensor(table)
        firsts = cache.keys[0, 0].index_select(0, pages).reshape(-1, half)
        seconds = cache.values[0, 0].index_select(0, pages).reshape(-1, half)
        latents = torch.cat((firsts, seconds[:, : width - half]), -1)[:length].float()
        probs = (q[row].float() @ latents.T * scale).softmax(-1)
        out.append(probs @ latents[:, :rank])
        assert len(table) * size >= length
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "width", "rank", "page_size", "threads"),
    [(4, 48, 32, 4, 2), (16, 576, 512, 16, 2), (3, 20, 12, 5, 1), (2, 33, 17, 8, 2)],
)
def test_latent_decode_attention_equals_float32_over_ragged_pages(
    heads, width, rank, page_size, threads
):
    lengths = [1, 70, page_size, 3 * page_size + 1, 130]
    tables, at = [], 1
    for length in lengths:  # scattered, non-contiguous pages per row
        count = -(-length // page_size)
        tables.append(list(range(at + count - 1, at - 1, -1)))
        at += count + 1
    cache = latent_cache(width, at + 1, page_size, seed=heads)
    q = (torch.randn(len(lengths), heads, width, generator=torch.Generator().manual_seed(3))).to(
        BF16
    )
    widest = max(map(len, tables))
    padded = torch.tensor([t + [0] * (widest - len(t)) for t in tables])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.latent_decode_attention(
            q, cache.keys[0, 0], cache.values[0, 0], padded, torch.tensor(lengths), rank, 0.1
        )
    finally:
        torch.set_num_threads(previous)
    expected = reference(q, cache, tables, lengths, width, rank, 0.1)
    assert out.dtype == BF16 and out.shape == (len(lengths), heads, rank)
    # float32 throughout, one rounding at the end: within one bf16 step of the reference.
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-3)


@needs_kernels
def test_latent_decode_attention_refuses_what_it_cannot_read():
    cache = latent_cache(48, 4, 4, seed=1)
    q = torch.zeros(1, 2, 48, dtype=BF16)
    tables, lengths = torch.zeros(1, 1, dtype=torch.long), torch.tensor([2])
    with pytest.raises(ValueError, match="unsupported"):  # rank wider than the latent
        kernels.latent_decode_attention(
            q, cache.keys[0, 0], cache.values[0, 0], tables, lengths, 64, 1.0
        )
    with pytest.raises(ValueError, match="strided"):
        kernels.latent_decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2),
            cache.keys[0, 0],
            cache.values[0, 0],
            tables,
            lengths,
            32,
            1.0,
        )


@needs_kernels
def test_engine_latent_attention_on_kernels_equals_its_pytorch_path():
    width, rank, size = 48, 32, 4
    cache = latent_cache(width, 12, size, seed=7)
    decodes = [([3, 1, 5], 10), ([7], 2), ([2, 9, 4, 8], 16)]
    q = torch.randn(3, 4, width, generator=torch.Generator().manual_seed(8)).to(BF16)
    latents = torch.randn(3, 1, width, generator=torch.Generator().manual_seed(9)).to(BF16)
    outs = []
    for use in (None, kernels):
        step = cache.keys.clone(), cache.values.clone()
        layer = KVCache(1, 12, size, 1, cache.keys.shape[-1], BF16, torch.device("cpu"))
        layer.keys.copy_(step[0])
        layer.values.copy_(step[1])
        batch = build_attention_batch(
            layer, decodes, [], torch.device("cpu"), BF16, decode_masks=use is None
        )
        attention = (
            LatentPagedAttention(layer, batch, 0.2)
            if use is None
            else CpuLatentAttention(layer, batch, 0.2, use)
        )
        outs.append(attention(0, q, latents, latents[..., :rank]).float())
    # Both write the new latents first; the kernel keeps float32 where PyTorch rounds scores
    # and probabilities to bf16, so they agree to a few bf16 steps.
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.02)


def agree_until_a_near_tie(tokens, reference, margin=0.05):
    """tokens equal the float32 reference's up to its first step whose top two logprobs lie
    within `margin` (there bf16 rounding may pick either, and the two may part ways)."""
    for index, (token, expected) in enumerate(zip(tokens, reference.token_ids, strict=True)):
        top = sorted(reference.top_logprobs[index].values(), reverse=True)
        if top[0] - top[1] < margin:
            return index
        assert token == expected, f"step {index}: {token} != {expected}"
    return len(tokens)


@needs_kernels
@pytest.mark.parametrize("preset", ["deepseek-v2-tiny", "longcat-flash-tiny"])
def test_mla_models_on_the_kernels_pick_the_float32_tokens(tmp_path, preset):
    path = build_tiny_model(tmp_path / preset, preset, seed=21)
    prompts = [[5, 9, 2, 7, 30, 11, 4], [8, 1, 6], list(range(3, 40))]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    full = LLM(path, device="cpu", dtype="float32").generate(prompts, greedy)
    on = LLM(path, device="cpu", dtype="bfloat16")
    off = LLM(path, device="cpu", dtype="bfloat16", cpu_kernels=False)
    assert on.engine.runner.latent_kernels and off.engine.runner.kernels is None
    agreed = 0
    for outputs in (on.generate(prompts, greedy), off.generate(prompts, greedy)):
        for output, reference in zip(outputs, full, strict=True):
            agreed += agree_until_a_near_tie(output.token_ids, reference)
    assert agreed >= 2 * len(prompts)  # the tokens before the first near-tie, at least
