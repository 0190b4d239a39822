"""Block steps: rows bidirectional among themselves, causal to a kept prefix, never cached."""

import pytest
import torch
from compute_flow import embed
from conftest import random_prompts

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.heads import Guidance, guided
from omniflow.engine.llm_engine import EngineConfig


@pytest.fixture
def engine(llama_path):
    config = EngineConfig(page_size=4, num_pages=256, max_num_batched_tokens=64)
    return LLMEngine(llama_path, config)


@torch.inference_mode()
def reference(model, prefix, rows, positions):
    """A plain forward over prefix + block under an explicit mask: causal over the prefix,
    the block's rows seeing the whole prefix and each other. Returns the block's rows."""
    x = torch.cat([embed(model, prefix), rows])
    total, count = x.shape[0], len(prefix)
    mask = torch.ones(total, total).tril().bool()
    mask[count:, :] = True  # block rows: all of the prefix, all of the block
    at = torch.cat([torch.arange(count), positions])
    cos, sin = model.rotary.cos_sin(at, x.dtype)

    def attention(layer_index, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(0, 1)

    for layer in model.model.layers:
        x = layer(x, cos, sin, attention)
    return model.model.norm(x)[count:]


def block(model, n, start, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, model.config.hidden_size, generator=generator) * 0.5
    return rows, torch.arange(start, start + n)


def hidden_of(deltas, request_id):
    [delta] = [d for d in deltas if d.request_id == request_id]
    assert delta.finish_reason == "stop"
    return delta.hidden


def test_block_steps_match_the_masked_reference_and_reuse_the_prefix(engine):
    prefix = random_prompts([61], seed=1)[0]  # prefix + block exceed a step's 64 rows
    engine.keep_context("ctx", prefix)
    for step in range(4):  # one per denoising step, the rows changing each time
        rows, positions = block(engine.model, 12, len(prefix), seed=step)
        engine.block_step(f"s{step}", "ctx", rows, positions)
        hidden = hidden_of(engine.run_to_completion(), f"s{step}")
        expected = reference(engine.model, prefix, rows, positions)
        torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
    # The prefix went through the model once, the blocks each time.
    assert engine.stats["rows_forwarded"] == len(prefix) + 4 * 12
    sequence = engine.kept["ctx"]
    assert sequence.num_computed_tokens == len(prefix) == len(sequence)
    # Block K/V never enter the prefix cache: only the prefix's full pages are there.
    assert engine.allocator.match_prefix(prefix + [0] * 12).num_tokens == len(prefix) // 4 * 4
    engine.release("ctx")
    assert not engine.kept


def test_block_steps_of_different_requests_batch_in_one_step(engine):
    prefixes = random_prompts([9, 15], seed=2)
    for index, prefix in enumerate(prefixes):
        engine.keep_context(f"c{index}", prefix)
    blocks = [block(engine.model, 6, len(p), seed=10 + i) for i, p in enumerate(prefixes)]
    for index, (rows, positions) in enumerate(blocks):
        engine.block_step(f"b{index}", f"c{index}", rows, positions)
    deltas = engine.step()  # both prefixes and both blocks fit one step
    assert not engine.has_unfinished_requests()
    for index, prefix in enumerate(prefixes):
        expected = reference(engine.model, prefix, *blocks[index])
        torch.testing.assert_close(hidden_of(deltas, f"b{index}"), expected, atol=1e-4, rtol=1e-4)


def test_guided_block_steps_pair_in_one_forward(engine):
    prefix, uncond = random_prompts([21, 3], seed=3)
    engine.keep_context("ctx", prefix, guidance=Guidance(uncond, 4.0))
    for step in range(3):
        rows, positions = block(engine.model, 8, len(prefix), seed=20 + step)
        engine.block_step(f"s{step}", "ctx", rows, positions)
        deltas = engine.run_to_completion()
        cond = reference(engine.model, prefix, rows, positions)
        base = reference(engine.model, uncond, rows, positions)
        torch.testing.assert_close(
            hidden_of(deltas, f"s{step}"), guided(cond, base, 4.0), atol=1e-3, rtol=1e-3
        )
    assert engine.stats["rows_forwarded"] == len(prefix) + len(uncond) + 3 * 2 * 8


def test_a_kept_context_continues_with_text_after_block_steps(engine):
    prefix = random_prompts([10], seed=4)[0]
    engine.keep_context("ctx", prefix)
    engine.block_step("s", "ctx", *block(engine.model, 5, len(prefix), seed=5))
    engine.run_to_completion()
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("more", [], greedy, continue_from="ctx")
    tokens = [t for d in engine.run_to_completion() for t in d.token_ids]
    engine.add_request(
        "fresh",
        prefix,
        greedy,
    )
    assert [t for d in engine.run_to_completion() for t in d.token_ids] == tokens


def test_aborting_a_block_step_keeps_its_context(engine):
    prefix = random_prompts([10], seed=6)[0]
    engine.keep_context("ctx", prefix)
    engine.block_step("s", "ctx", *block(engine.model, 5, len(prefix), seed=7))
    engine.abort("s")
    [delta] = engine.step()
    assert delta.finish_reason == "abort"
    assert "ctx" in engine.kept
    with pytest.raises(ValueError, match="not kept"):
        engine.block_step("t", "nope", *block(engine.model, 5, len(prefix), seed=7))


def test_a_request_id_never_changes_through_block_steps_and_a_continuation(engine):
    """Each request runs on a Sequence made with its id; a kept context goes on as a new
    Sequence (its successor), and every sequence seen keeps the id it was made with."""
    prefix, uncond = random_prompts([9, 3], seed=8)
    engine.keep_context("ctx", prefix, guidance=Guidance(uncond, 2.0))
    seen = {}

    def note():
        for sequence in [*engine.kept.values(), *engine.sequences.values()]:
            for member in (sequence, sequence.partner):
                if member is not None:
                    seen.setdefault(id(member), (member, member.request_id))

    note()
    engine.block_step("s", "ctx", *block(engine.model, 4, len(prefix), seed=9))
    note()
    engine.run_to_completion()
    note()
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("more", [5], greedy, continue_from="ctx", guidance=Guidance([6], 2.0))
    note()
    deltas = engine.run_to_completion()
    assert {d.request_id for d in deltas} == {"more"}
    ids = sorted(rid for _, rid in seen.values())
    # ctx kept, then stepped as s and parked as ctx again; the unconditional half runs the
    # block step as it is (ctx/uncond) and goes on as more/uncond
    assert ids == ["ctx", "ctx", "ctx/uncond", "more", "more/uncond", "s"]
    assert all(sequence.request_id == rid for sequence, rid in seen.values())
    with pytest.raises(AttributeError):
        next(iter(seen.values()))[0].request_id = "renamed"
