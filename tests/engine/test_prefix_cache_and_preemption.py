"""Cached-prefix, uncached and preempted runs produce identical greedy tokens."""

from conftest import hf_greedy, random_prompts

from omniflow.engine import LLM, LLMEngine, SamplingParams
from omniflow.engine.llm_engine import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_cached_prefix_gives_identical_tokens(tiny_models):
    path = tiny_models["llama-gqa"]
    [shared] = random_prompts((48,), seed=11)
    suffixes = random_prompts((5, 9, 3), seed=12)
    prompts = [shared + suffix for suffix in suffixes]
    uncached = LLM(path, device="cpu", page_size=8, enable_prefix_caching=False)
    cached = LLM(path, device="cpu", page_size=8)
    cached.generate([shared], SamplingParams(temperature=0.0, max_tokens=1))
    expected = uncached.generate(prompts, GREEDY)
    got = cached.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.cached_tokens for o in got] == [48, 48, 48]
    assert [o.cached_tokens for o in expected] == [0, 0, 0]


def test_full_prompt_hit_still_computes_last_token(tiny_models):
    path = tiny_models["llama-mha"]
    [prompt] = random_prompts((32,), seed=5)
    llm = LLM(path, device="cpu", page_size=8)
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.cached_tokens == 24  # the last page holds the token whose logits are needed


def test_generated_pages_are_reused_by_a_follow_up_turn(tiny_models):
    path = tiny_models["llama-mha"]
    [prompt] = random_prompts((20,), seed=6)
    llm = LLM(path, device="cpu", page_size=4)
    first = llm.generate([prompt], GREEDY)[0]
    follow_up = prompt + first.token_ids + [5, 6, 7]
    [second] = llm.generate([follow_up], GREEDY)
    # 20 prompt + 15 computed output tokens (the last sampled one never ran): 8 full pages.
    assert second.cached_tokens == 32


def test_preemption_under_small_page_budget_gives_identical_tokens(tiny_models):
    path = tiny_models["qwen2-tied-odd-heads"]
    prompts = random_prompts((30, 12, 25, 7, 18, 22), seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = hf_greedy(path, prompts, params.max_tokens)
    # 14 pages of 4 tokens: every request fits alone (<= 54 tokens) but not all together.
    for prefix_caching in (True, False):
        config = EngineConfig(
            device="cpu",
            page_size=4,
            num_pages=14,
            enable_prefix_caching=prefix_caching,
        )
        engine = LLMEngine(path, config)
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, params)
        sequences = dict(engine.sequences)
        produced = {f"r{i}": [] for i in range(len(prompts))}
        for delta in engine.run_to_completion():
            produced[delta.request_id] += delta.token_ids
        assert [produced[f"r{i}"] for i in range(len(prompts))] == expected
        assert sum(s.num_preemptions for s in sequences.values()) > 0
        assert engine.allocator.usage().free_pages == 14


def test_request_larger_than_the_pool_is_rejected_not_deadlocked(tiny_models):
    path = tiny_models["llama-mha"]
    engine = LLMEngine(path, EngineConfig(device="cpu", page_size=4, num_pages=4))
    try:
        engine.add_request("big", list(range(3, 13)), SamplingParams(max_tokens=8))
    except ValueError as error:
        assert "big" in str(error) and "KV cache" in str(error)
    else:
        raise AssertionError("oversized request was accepted")
