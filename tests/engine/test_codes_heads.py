"""Codes heads and guided pairs through the engine, against the full-recompute oracle."""

import pytest
import torch
from compute_flow import (
    GreedyHead,
    LogitGuidedHead,
    TanhHead,
    codes_of,
    recompute_codes,
    run,
)
from conftest import random_prompts

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.heads import Guidance, guided
from omniflow.engine.llm_engine import EngineConfig

UNCOND = [1, 5]


@pytest.fixture
def engine(llama_path):
    return LLMEngine(
        llama_path, EngineConfig(page_size=4, num_pages=256, max_num_batched_tokens=512)
    )


def add_codes(engine, rid, prompt, n, head, cfg=None):
    guidance = None if cfg is None else Guidance(UNCOND, cfg)
    engine.add_request(
        rid, prompt, SamplingParams(max_tokens=n, temperature=0.0), head=head, guidance=guidance
    )


@pytest.mark.parametrize("cfg", [None, 3.0])
def test_codes_equal_the_recompute_reference_alone_and_batched(engine, cfg):
    head = GreedyHead(engine.model.config.hidden_size)
    prompts = random_prompts([9, 23, 14], seed=4)
    expected = [
        recompute_codes(engine.model, head, p, 10, None if cfg is None else UNCOND, cfg or 1.0)[0]
        for p in prompts
    ]
    add_codes(engine, "alone", prompts[0], 10, head, cfg)
    assert torch.equal(codes_of(run(engine)["alone"]), expected[0])
    for index, prompt in enumerate(prompts):
        add_codes(engine, f"r{index}", prompt, 10, head, cfg)
    out = run(engine)
    for index in range(len(prompts)):
        assert torch.equal(codes_of(out[f"r{index}"]), expected[index])
        assert out[f"r{index}"][-1].finish_reason == "length"


def test_text_and_codes_batched_produce_what_each_produces_alone(engine):
    head = GreedyHead(engine.model.config.hidden_size)
    text_prompt, codes_prompt = random_prompts([12, 17], seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    engine.add_request("text", text_prompt, params)
    text_alone = [t for d in run(engine)["text"] for t in d.token_ids]
    add_codes(engine, "codes", codes_prompt, 8, head, 2.0)
    codes_alone = codes_of(run(engine)["codes"])
    engine.add_request("text2", text_prompt, params)
    add_codes(engine, "codes2", codes_prompt, 8, head, 2.0)
    out = run(engine)
    assert [t for d in out["text2"] for t in d.token_ids] == text_alone
    assert torch.equal(codes_of(out["codes2"]), codes_alone)


def test_a_guided_pair_runs_in_one_step_and_equals_two_separate_forwards(engine):
    head = GreedyHead(engine.model.config.hidden_size)
    prompt = random_prompts([21], seed=6)[0]
    steps = []
    execute = engine.runner.execute

    def recording(chunks):
        steps.append([(c.sequence.follows, c.samples) for c in chunks])
        return execute(chunks)

    engine.runner.execute = recording
    add_codes(engine, "pair", prompt, 6, head, 2.5)
    run(engine)
    for chunks in steps:  # every sampling step holds both halves
        sampling = sorted(follows for follows, samples in chunks if samples)
        assert sampling in ([], [False, True])
    _, states = recompute_codes(engine.model, head, prompt, 6, UNCOND, 2.5)
    torch.testing.assert_close(torch.cat(head.seen[-6:]), states, atol=1e-4, rtol=1e-4)


def test_guided_text_combines_the_hidden_states_before_lm_head(engine):
    prompt = random_prompts([11], seed=7)[0]
    engine.add_request(
        "t",
        prompt,
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
        guidance=Guidance(UNCOND, 1.5),
    )
    tokens = [t for d in run(engine)["t"] for t in d.token_ids]
    model, context, uncond = engine.model, list(prompt), list(UNCOND)
    with torch.inference_mode():
        for token in tokens:
            cond = model.hidden_states(model.embed(torch.tensor(context)))[-1:]
            base = model.hidden_states(model.embed(torch.tensor(uncond)))[-1:]
            assert int(model.logits(guided(cond, base, 1.5)).argmax()) == token
            context.append(token)
            uncond.append(token)


def test_abort_and_preemption_free_both_halves_of_a_pair(llama_path):
    config = EngineConfig(page_size=4, num_pages=14, max_num_batched_tokens=64)
    engine = LLMEngine(llama_path, config)
    head = GreedyHead(engine.model.config.hidden_size)
    free = engine.allocator.usage().free_pages
    add_codes(engine, "pair", random_prompts([10], seed=8)[0], 20, head, 2.0)
    engine.step()
    engine.step()
    pair = engine.sequences["pair"]
    assert pair.page_ids and pair.partner.page_ids
    engine.abort("pair")
    assert not pair.page_ids and not pair.partner.page_ids
    assert engine.allocator.usage().free_pages == free
    run(engine)
    # Preemption: a pair and a long text request do not fit together; the pair is newer.
    engine.add_request(
        "long", random_prompts([30], seed=9)[0], SamplingParams(max_tokens=20, ignore_eos=True)
    )
    add_codes(engine, "pair2", random_prompts([10], seed=8)[0], 12, head, 2.0)
    seen_preempted = False
    while engine.has_unfinished_requests():
        engine.step()
        pair = engine.sequences.get("pair2")
        if pair is not None and pair.num_preemptions:
            seen_preempted = True
            assert pair.partner.num_preemptions == pair.num_preemptions
            if pair.status.value == "waiting":
                assert not pair.page_ids and not pair.partner.page_ids
    assert seen_preempted
    assert engine.allocator.usage().free_pages == free


def test_kept_media_tokens_are_a_prefix_cache_hit_for_the_next_turn(llama_path):
    """A turn: text, then media tokens continuing it (no recompute); the next turn's prompt
    repeats all of it, the media tokens keyed by their ids, and is served from the cache."""
    engine = LLMEngine(llama_path, EngineConfig(page_size=4, num_pages=128))
    head = GreedyHead(engine.model.config.hidden_size)
    prompt = random_prompts([10], seed=10)[0]
    engine.add_request(
        "text", prompt, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0), keep=True
    )
    text = [t for d in run(engine)["text"] for t in d.token_ids]
    computed = engine.stats["prompt_tokens_computed"]
    add = dict(head=head, guidance=Guidance(UNCOND, 2.0), continue_from="text")
    engine.add_request("image", [], SamplingParams(max_tokens=12, temperature=0.0), **add)
    out = run(engine)["image"]
    assert engine.stats["prompt_tokens_computed"] == computed + 1 + len(UNCOND)  # no re-prefill
    assert out[0].num_cached_tokens == len(prompt) + len(text) - 1
    codes = codes_of(out)
    expected, _ = recompute_codes(engine.model, head, prompt + text, 12, UNCOND, 2.0)
    # The recompute oracle feeds the text tokens as ids; the engine ran them the same way.
    assert torch.equal(codes, expected)
    # Next turn: everything so far, the media tokens as one span keyed per token.
    from omniflow.engine import EmbeddingSpan
    from omniflow.engine.heads import codes_key

    start = len(prompt) + len(text)
    rows = head.embed(codes)
    span = EmbeddingSpan(start, rows, [codes_key(head, ids) for ids in codes])
    history = prompt + text + [head.placeholder_id] * len(codes) + [7, 8, 9]
    engine.add_request("next", history, SamplingParams(max_tokens=1), [span])
    cached = run(engine)["next"][0].num_cached_tokens
    # Every media token whose K/V was computed (all but the last) sits in full pages.
    assert cached == (start + len(codes) - 1) // 4 * 4
    assert cached > start
    engine.release("image")
    assert not engine.kept


def test_codes_in_bf16_on_the_cpu_kernels_path(llama_path):
    """The kernels' per-layer path (bf16 on CPU) serves codes and pairs too."""
    config = EngineConfig(page_size=4, num_pages=256, dtype="bfloat16")
    engine = LLMEngine(llama_path, config)
    head = GreedyHead(engine.model.config.hidden_size)
    prompts = random_prompts([9, 23], seed=4)
    expected = [recompute_codes(engine.model, head, p, 6, UNCOND, 3.0)[0] for p in prompts]
    for index, prompt in enumerate(prompts):
        add_codes(engine, f"r{index}", prompt, 6, head, 3.0)
    out = run(engine)
    for index in range(len(prompts)):
        assert torch.equal(codes_of(out[f"r{index}"]), expected[index])


def test_a_bad_continuation_leaves_the_kept_sequence_as_it_was(engine):
    prompt = random_prompts([10], seed=11)[0]
    engine.add_request("t", prompt, SamplingParams(max_tokens=2, ignore_eos=True), keep=True)
    run(engine)
    kept = engine.kept["t"]
    before = (list(kept.token_ids), list(kept.page_ids))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("c", [10**6], SamplingParams(max_tokens=2), continue_from="t")
    with pytest.raises(ValueError, match="uncond.*vocabulary"):
        guidance = Guidance([10**6], 2.0)
        engine.add_request(
            "c", [], SamplingParams(max_tokens=2), continue_from="t", guidance=guidance
        )
    with pytest.raises(ValueError, match="not kept"):
        engine.add_request("c", [], SamplingParams(max_tokens=2), continue_from="nope")
    assert engine.kept["t"] is kept and (kept.token_ids, kept.page_ids) == before
    engine.release("t")
    assert engine.allocator.usage().free_pages == engine.cache.num_pages


def test_the_unconditional_prompt_is_served_from_the_prefix_cache(engine):
    head = GreedyHead(engine.model.config.hidden_size)
    uncond = random_prompts([9], seed=12)[0]
    for rid, seed in (("a", 13), ("b", 14)):
        prompt = random_prompts([6], seed=seed)[0]
        guidance = Guidance(uncond, 2.0)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        engine.add_request(rid, prompt, params, head=head, guidance=guidance)
        follower = engine.sequences[rid].partner
        run(engine)
    assert follower.num_cached_tokens == 8  # the second pair: two full pages of uncond


@pytest.mark.parametrize("cfg", [None, 2.0])
def test_row_ends_are_plain_tokens_between_rows_of_codes(engine, cfg):
    """An image's rows (row_end): after every 3 media tokens the newline token, its own
    embedding, no codes; equal to a recompute that feeds the same rows."""
    head = GreedyHead(engine.model.config.hidden_size)
    prompt = random_prompts([12], seed=12)[0]
    guidance = None if cfg is None else Guidance(UNCOND, cfg)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request("r", prompt, params, head=head, guidance=guidance, row_end=(99, 3))
    out = run(engine)["r"]
    tokens = [t for d in out for t in d.token_ids]
    assert tokens[3] == tokens[7] == 99 and tokens.count(99) == 2
    codes = codes_of(out)
    assert codes.shape[0] == 6
    uncond = None if cfg is None else UNCOND
    with torch.inference_mode():
        want, _ = recompute_codes(engine.model, head, prompt, 8, uncond, cfg or 1.0, (99, 3))
    assert torch.equal(codes, want)


def test_sampled_codes_follow_the_request_params_and_its_seed(engine):
    """Codes are drawn by the request's sampling (as LongCat-Next's published sampler
    draws them): seeded, the same alone and batched; another seed, other codes; top_k 1 is
    the greedy codes."""
    head = GreedyHead(engine.model.config.hidden_size)
    prompt, other = random_prompts([11, 19], seed=13)
    greedy, _ = recompute_codes(engine.model, head, prompt, 10)

    def sampled(rid, seed, prompt=prompt, **extra):
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, **extra)
        engine.add_request(rid, prompt, params, head=head)

    sampled("alone", 7)
    alone = codes_of(run(engine)["alone"])
    sampled("again", 7)
    sampled("seed8", 8)
    sampled("other", 3, other)
    sampled("top1", None, top_k=1)
    out = run(engine)
    assert torch.equal(codes_of(out["again"]), alone)
    assert not torch.equal(alone, greedy)
    assert not torch.equal(codes_of(out["seed8"]), alone)
    assert torch.equal(codes_of(out["top1"]), greedy)


def test_the_repetition_penalty_covers_each_level_s_earlier_codes(engine):
    """Greedy codes with a repetition penalty: each level's logits of the ids that level
    already took are scaled (divided where positive, multiplied where not), against a
    recompute that penalizes in the test."""
    head = GreedyHead(engine.model.config.hidden_size)
    prompt = random_prompts([15], seed=14)[0]
    penalty = 3.0

    def picker(rows):
        def pick(level, logits):
            logits = logits.clone()
            for seen in {int(row[level]) for row in rows}:
                score = logits[0, seen]
                logits[0, seen] = score / penalty if score > 0 else score * penalty
            return logits.argmax(-1)

        return pick

    want, _ = recompute_codes(engine.model, head, prompt, 12, picker=picker)
    plain, _ = recompute_codes(engine.model, head, prompt, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=penalty)
    engine.add_request("r", prompt, params, head=head)
    got = codes_of(run(engine)["r"])
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)


def test_a_head_that_guides_its_logits_gets_both_halves_of_each_pair(engine):
    """A head with guided_codes: the engine hands it each pair's conditional and
    unconditional states (not their guided mix), an unpaired row at scale 1 beside them;
    equal to the recompute that does the same, and not to guidance on hidden states."""
    head = LogitGuidedHead(engine.model.config.hidden_size)
    prompts = random_prompts([10, 16], seed=15)
    want = recompute_codes(engine.model, head, prompts[0], 8, UNCOND, 4.0)[0]
    mixed = recompute_codes(
        engine.model, TanhHead(head.projection.shape[0]), prompts[0], 8, UNCOND, 4.0
    )[0]
    plain = recompute_codes(engine.model, head, prompts[1], 8)[0]
    add_codes(engine, "guided", prompts[0], 8, head, 4.0)
    add_codes(engine, "plain", prompts[1], 8, head)
    out = run(engine)
    assert torch.equal(codes_of(out["guided"]), want)
    assert torch.equal(codes_of(out["plain"]), plain)
    assert not torch.equal(want, mixed)
