"""HunyuanImage-3 denoising as block steps: paired CFG, lent contexts, 2D positions,
seeded determinism, through the real loader, engine and page pool."""

import asyncio
import os
import uuid
from dataclasses import replace

import pytest
import torch

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.async_engine import AsyncEngine
from omniflow.engine.heads import Guidance
from omniflow.engine.llm_engine import EngineConfig
from omniflow.memory import PagePool
from omniflow.models import load_decoder, load_tokenizer
from omniflow.models.hunyuan_image3.parts import load_image_parts
from omniflow.models.hunyuan_image3.tokens import (
    ImageTokens,
    context_ids,
    image_block,
    unconditional_ids,
)
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3
from omniflow.roles.hunyuan_denoise import denoise, denoise_async
from omniflow.roles.hunyuan_prompt import condition_image_prompt

PAGE = 4
GRID = (3, 4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_hunyuan_image3(tmp_path_factory.mktemp("hunyuan") / "tiny", seed=5)


@pytest.fixture(scope="module")
def parts(folder):
    return load_image_parts(folder)


@pytest.fixture(scope="module")
def prompts(folder):
    """(conditional context, unconditional context) token ids of one prompt."""
    tokenizer = load_tokenizer(folder)
    tokens = ImageTokens.from_tokenizer(tokenizer)
    prompt = tokenizer.encode("a red cube on a blue floor", add_special_tokens=False)
    cond = context_ids(tokens, prompt, 256, 16)
    return cond, context_ids(tokens, unconditional_ids(tokens, prompt), 256, 16)


@pytest.fixture
def pool():
    pool = PagePool.create(f"omniflow-h23-{uuid.uuid4().hex[:8]}", 256 << 12, 4096)
    yield pool
    pool.unlink()
    pool.close()


def engine_for(folder, pool=None, share=False, num_pages=64):
    config = EngineConfig(device="cpu", page_size=PAGE, num_pages=num_pages, share_kv=share)
    return LLMEngine(folder, config, kv_pool=pool)


def block_rows(parts, context_len, grid=GRID, t=700.0, seed=0):
    latent = torch.randn(
        parts.config.latent_channels, *grid, generator=torch.Generator().manual_seed(seed)
    )
    rows = torch.cat((parts.timestep_row(t), parts.image_rows(latent, t)))
    return rows, image_block(context_len, grid).positions


def run_block(engine, request_id, context_id, rows, positions, causal_rows=0):
    engine.block_step(request_id, context_id, rows, positions, causal_rows)
    [delta] = [d for d in engine.run_to_completion() if d.request_id == request_id]
    assert delta.finish_reason == "stop"
    return delta.hidden


def test_paired_cfg_in_one_forward_equals_two_separate_forwards(folder, parts, prompts):
    cond, uncond = prompts
    rows, positions = block_rows(parts, len(cond))
    paired = engine_for(folder)
    paired.keep_context("pair", cond, guidance=Guidance(uncond, 5.0, combine=False))
    run_block(paired, "warm", "pair", rows, positions)  # computes both prompts
    before = paired.stats["rows_forwarded"]
    paired.block_step("s", "pair", rows, positions)
    [delta] = paired.step()  # both halves in one forward
    assert delta.request_id == "s" and delta.finish_reason == "stop"
    assert paired.stats["rows_forwarded"] - before == 2 * len(rows)
    separate = engine_for(folder)
    separate.keep_context("c", cond)
    separate.keep_context("u", uncond)
    alone = [run_block(separate, f"s{k}", k, rows, positions) for k in ("c", "u")]
    torch.testing.assert_close(delta.hidden, torch.cat(alone), atol=1e-5, rtol=1e-5)
    # combine=True mixes the hidden states with the scale instead
    mixed = engine_for(folder)
    mixed.keep_context("pair", cond, guidance=Guidance(uncond, 5.0))
    combined = run_block(mixed, "s", "pair", rows, positions)
    torch.testing.assert_close(
        combined, alone[1] + 5.0 * (alone[0] - alone[1]), atol=1e-4, rtol=1e-4
    )


def lend_prompt(lender, request_id, prompt):
    """The lender runs a prompt (one sampled token, never run) and lends its KV to us."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    lender.add_request(request_id, prompt, params, lend_kv_to=os.getpid())
    [last] = [d for d in lender.run_to_completion() if d.finish_reason is not None]
    assert last.kv_lease.num_tokens == len(prompt)
    return last.kv_lease


def test_block_steps_over_a_lent_context_match_a_computed_one(folder, parts, prompts, pool):
    start = pool.stats()
    cond, uncond = prompts
    lender = engine_for(folder, pool, share=True)
    leases = [lend_prompt(lender, rid, p) for rid, p in (("c", cond), ("u", uncond))]
    borrower = engine_for(folder, pool)
    guidance = Guidance(uncond, 4.0, combine=False, lease=leases[1])
    borrower.keep_context("ctx", cond, guidance=guidance, lease=leases[0])
    computed = engine_for(folder)
    computed.keep_context("ctx", cond, guidance=Guidance(uncond, 4.0, combine=False))
    for step in range(3):
        rows, positions = block_rows(parts, len(cond), t=900.0 - 300 * step, seed=step)
        lent = run_block(borrower, f"s{step}", "ctx", rows, positions)
        own = run_block(computed, f"s{step}", "ctx", rows, positions)
        torch.testing.assert_close(lent, own, atol=1e-5, rtol=1e-5)
    # The borrower forwarded the block rows alone: zero prompt rows, zero prompt tokens.
    assert borrower.stats["rows_forwarded"] == 3 * 2 * len(rows)
    assert borrower.stats["prompt_tokens_computed"] == 0
    assert computed.stats["rows_forwarded"] == len(cond) + len(uncond) + 3 * 2 * len(rows)
    # Lent pages stay locked in the lender while borrowed; released, they come back.
    lender.step()
    assert lender.allocator.usage().free_pages < lender.allocator.usage().total_pages
    borrower.release("ctx")
    lender.step()  # reaps both leases
    usage = lender.allocator.usage()
    assert usage.free_pages == usage.total_pages
    borrower.close()
    lender.close()
    assert pool.stats() == start


def test_closing_the_borrower_hands_back_its_leases(folder, parts, prompts, pool):
    start = pool.stats()
    cond, _ = prompts
    lender = engine_for(folder, pool, share=True)
    lease = lend_prompt(lender, "c", cond)
    # Pages for the block's rows alone: the lent prompt takes none of the borrower's.
    rows = 1 + GRID[0] * GRID[1]
    borrower = engine_for(folder, pool, num_pages=-(-rows // PAGE))
    assert borrower.capacity_tokens < len(cond)
    borrower.keep_context("ctx", cond, lease=lease)
    run_block(borrower, "s", "ctx", *block_rows(parts, len(cond)))
    borrower.close()  # without release
    lender.step()
    usage = lender.allocator.usage()
    assert usage.free_pages == usage.total_pages
    lender.close()
    assert pool.stats() == start


def test_a_lease_that_does_not_fit_is_refused_and_handed_back(folder, prompts, pool):
    cond, _ = prompts
    lender = engine_for(folder, pool, share=True)
    lease = lend_prompt(lender, "c", cond)
    borrower = engine_for(folder, pool)
    with pytest.raises(ValueError, match="request ctx: lease holds"):
        borrower.keep_context("ctx", cond[:-1], lease=lease)
    assert not borrower.kept
    lender.step()  # the refused lease was closed: the lender frees its pages
    assert lender.allocator.usage().free_pages == lender.allocator.usage().total_pages
    no_pool = engine_for(folder)
    with pytest.raises(ValueError, match="lease needs the engine built with"):
        no_pool.keep_context("ctx", cond, lease=lease)
    with pytest.raises(ValueError, match="guidance.lease applies to keep_context"):
        borrower.add_request("r", cond, guidance=Guidance(cond, 2.0, lease=lease))
    lender.close()


def test_a_context_refused_before_its_leases_are_read_hands_them_back(folder, prompts, pool):
    start = pool.stats()
    cond, uncond = prompts
    lender = engine_for(folder, pool, share=True)
    borrower = engine_for(folder, pool)
    borrower.keep_context("ctx", cond)  # the id is taken
    leases = [lend_prompt(lender, rid, p) for rid, p in (("c", cond), ("u", uncond))]
    guidance = Guidance(uncond, 4.0, combine=False, lease=leases[1])
    with pytest.raises(ValueError, match="ctx"):
        borrower.keep_context("ctx", cond, guidance=guidance, lease=leases[0])
    lender.step()  # both leases were given back unread: the lender frees their pages
    assert lender.allocator.usage().free_pages == lender.allocator.usage().total_pages
    borrower.release("ctx")
    lender.close()
    borrower.close()
    assert pool.stats() == start


def test_2d_positions_matter_and_text_positions_are_diagonal(folder, parts, prompts):
    cond, _ = prompts
    engine = engine_for(folder)
    engine.keep_context("ctx", cond)
    rows, positions = block_rows(parts, len(cond))
    hidden = run_block(engine, "a", "ctx", rows, positions)
    swapped = run_block(engine, "b", "ctx", rows, positions.flip(1))
    assert not torch.allclose(hidden[1:], swapped[1:], atol=1e-3)
    flat = torch.arange(len(cond), len(cond) + len(rows))
    diagonal = run_block(engine, "c", "ctx", rows, torch.stack((flat, flat), 1))
    torch.testing.assert_close(run_block(engine, "d", "ctx", rows, flat), diagonal)
    with pytest.raises(ValueError, match=r"expected \[n, 64\] / \[n\] or \[n, 2\]"):
        engine.block_step("e", "ctx", rows, positions[:, :1].T)
    with pytest.raises(ValueError, match=r"request e: causal_rows=99 outside \[0, 13\]"):
        engine.block_step("e", "ctx", rows, positions, causal_rows=99)
    assert "ctx" in engine.kept  # a refused step leaves the context as it was


def test_same_seed_same_latent_bytes_sync_and_async(folder, parts, prompts):
    cond, uncond = prompts

    class Steps(list):
        def append_pair(self, done, total):
            self.append((done, total))

    def run_seed(seed):
        engine = engine_for(folder)
        engine.keep_context("ctx", cond, guidance=Guidance(uncond, 5.0, combine=False))
        seen = Steps()
        latent = denoise(engine, parts, "ctx", len(cond), GRID, 3, 5.0, seed, seen.append_pair)
        return latent, seen

    first, seen = run_seed(11)
    again, _ = run_seed(11)
    other, _ = run_seed(12)
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert first.shape == (parts.config.latent_channels, *GRID)
    assert first.numpy().tobytes() == again.numpy().tobytes()
    assert not torch.equal(first, other)

    async def on_async_engine():
        engine = AsyncEngine(engine_for(folder))
        guidance = Guidance(uncond, 5.0, combine=False)
        await engine.keep_context("ctx", cond, guidance=guidance)
        latent = await denoise_async(engine, parts, "ctx", len(cond), GRID, 3, 5.0, 11)
        await engine.close()
        return latent

    assert asyncio.run(on_async_engine()).numpy().tobytes() == first.numpy().tobytes()


def masked_reference(model, ids, spans, rows, block_positions, causal_rows=0):
    """A plain forward over prompt + block: the prompt causal, the block's rows seeing all
    of it and each other (its first causal_rows causally); span rows and positions as
    given. The block's rows before ln_f."""
    x = model.embed(torch.tensor(ids))
    positions = torch.arange(len(ids))[:, None].repeat(1, 2)
    for span in spans:
        x[span.start : span.start + len(span.embeddings)] = span.embeddings
        if span.positions is not None:
            positions[span.start : span.start + len(span.embeddings)] = span.positions
    x = torch.cat((x, rows))
    positions = torch.cat((positions, block_positions))
    count, total = len(ids), len(x)
    mask = torch.ones(total, total).tril().bool()
    mask[count + causal_rows :, :] = True
    cos, sin = model.rotary.cos_sin(positions, x.dtype)

    def attention(layer_index, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(0, 1)

    for layer in model.model.layers:
        x = layer(x, cos, sin, attention)
    return x[count:]


def test_a_condition_image_enters_with_2d_positions_and_conditions_the_block(
    folder, parts, prompts
):
    cond, _ = prompts
    tokens = ImageTokens.from_tokenizer(load_tokenizer(folder))
    image = torch.randint(0, 256, (32, 48, 3), generator=torch.Generator().manual_seed(2))
    image = image.to(torch.uint8)
    ids, spans = condition_image_prompt(parts, tokens, image, start=1)
    assert spans[0].positions is not None and len(spans[0].embeddings) == 1 + 2 * 3
    context = [cond[0], *ids, *cond[1:]]  # <bos> image prompt <boi> <size> <ratio>
    engine = engine_for(folder)
    engine.keep_context("ti2i", context, embeddings=spans)
    rows, positions = block_rows(parts, len(context))
    hidden = run_block(engine, "s", "ti2i", rows, positions, causal_rows=1)
    with torch.inference_mode():
        expected = masked_reference(engine.model, context, spans, rows, positions, 1)
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
    # The causal <timestep> row sees the context alone: as if it ran without the image.
    alone = run_block(engine, "t", "ti2i", rows[:1], positions[:1])
    torch.testing.assert_close(hidden[:1], alone, atol=1e-5, rtol=1e-5)
    both_ways = run_block(engine, "b", "ti2i", rows, positions)
    assert not torch.allclose(both_ways[:1], alone, atol=1e-3)
    flat = [span._replace(positions=None, content_hash=("1d", i)) for i, span in enumerate(spans)]
    engine.keep_context("flat", context, embeddings=flat)
    flat_hidden = run_block(engine, "f", "flat", rows, positions, causal_rows=1)
    assert not torch.allclose(flat_hidden, hidden, atol=1e-3)
    other = torch.zeros_like(image)
    _, other_spans = condition_image_prompt(parts, tokens, other, start=1)
    engine.keep_context("other", context, embeddings=other_spans)
    other_hidden = run_block(engine, "o", "other", rows, positions, causal_rows=1)
    assert not torch.allclose(other_hidden, hidden, atol=1e-3)
    with pytest.raises(ValueError, match="multiples of 16"):
        condition_image_prompt(parts, tokens, image[:20], start=1)


def test_the_ar_step_picks_a_ratio_and_lends_the_prefix_through_it(folder, parts, pool):
    """The AR side of the handoff: one step restricted to the ratio tokens picks the size,
    a continuation runs that token and lends the whole prefix; diffusion borrows it."""
    start = pool.stats()
    tokenizer = load_tokenizer(folder)
    tokens = ImageTokens.from_tokenizer(tokenizer)
    prompt = tokenizer.encode("a tall tower", add_special_tokens=False)
    head = [tokens.bos, *prompt, tokens.boi, tokens.sizes[256]]
    lender = engine_for(folder, pool, share=True)
    ratios = list(tokens.ratios)
    pick = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=ratios)
    lender.add_request("ar", head, pick, keep=True)
    [picked] = [d for d in lender.run_to_completion() if d.finish_reason is not None]
    [ratio] = picked.token_ids
    assert ratio in ratios
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=1, allowed_token_ids=ratios)
    lender.add_request("ar-seeded", head, seeded)
    assert [d for d in lender.run_to_completion() if d.token_ids][0].token_ids[0] in ratios
    # The picked token is the kept sequence's last: continuing with nothing new runs it.
    lender.add_request(
        "ar2", [], SamplingParams(max_tokens=1), continue_from="ar", lend_kv_to=os.getpid()
    )
    [last] = [d for d in lender.run_to_completion() if d.finish_reason is not None]
    context = head + [ratio]
    assert last.kv_lease.num_tokens == len(context)
    assert context == context_ids(tokens, prompt, 256, tokens.ratio_of(ratio))
    borrower = engine_for(folder, pool)
    borrower.keep_context("ctx", context, lease=last.kv_lease)
    computed = engine_for(folder)
    computed.keep_context("ctx", context)
    rows, positions = block_rows(parts, len(context))
    torch.testing.assert_close(
        run_block(borrower, "s", "ctx", rows, positions),
        run_block(computed, "s", "ctx", rows, positions),
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="allowed_token_ids"):
        lender.add_request("bad", head, SamplingParams(allowed_token_ids=[10**6]))
    borrower.close()
    lender.step()
    lender.close()
    assert pool.stats() == start


def test_bf16_on_cpu_runs_the_same_steps(folder, parts, prompts):
    """bf16 on CPU: packed weights, the kernels' K/V writes and attention, PyTorch layers."""
    cond, uncond = prompts
    rows, positions = block_rows(parts, len(cond))
    hidden = {}
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(device="cpu", dtype=dtype, page_size=PAGE, num_pages=64)
        engine = LLMEngine(folder, config)
        engine.keep_context("ctx", cond, guidance=Guidance(uncond, 5.0, combine=False))
        hidden[dtype] = run_block(engine, "s", "ctx", rows, positions, causal_rows=1).float()
    torch.testing.assert_close(hidden["bfloat16"], hidden["float32"], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_relayout_off_leaves_every_weight_in_place(folder, parts, prompts, dtype):
    """Weights in shared pages must stay there: relayout_weights=False makes no copies."""
    cond, _ = prompts
    model = load_decoder(folder, "cpu", dtype)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    config = EngineConfig(
        device="cpu", dtype=dtype, page_size=PAGE, num_pages=64, relayout_weights=False
    )
    engine = LLMEngine(model, config)
    engine.keep_context("ctx", cond)
    hidden = run_block(engine, "s", "ctx", *block_rows(parts, len(cond)))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
    relaid = LLMEngine(load_decoder(folder, "cpu", dtype), replace(config, relayout_weights=True))
    relaid.keep_context("ctx", cond)
    expected = run_block(relaid, "s", "ctx", *block_rows(parts, len(cond)))
    torch.testing.assert_close(hidden.float(), expected.float(), atol=0.05, rtol=0.02)
