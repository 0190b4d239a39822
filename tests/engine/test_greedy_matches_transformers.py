"""Greedy outputs equal transformers' generate token for token on the same random weights."""

import pytest
from conftest import EQUALITY_PRESETS, hf_greedy, random_prompts

from omniflow.engine import LLM, SamplingParams

MIXED_LENGTHS = (3, 17, 9, 40, 1, 25)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("preset", EQUALITY_PRESETS)
def test_batched_greedy_equals_transformers(tiny_models, preset):
    path = tiny_models[preset]
    prompts = random_prompts(MIXED_LENGTHS, seed=7)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, device="cpu", page_size=8)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)


def test_chunked_prefill_equals_transformers(tiny_models):
    path = tiny_models["llama-gqa"]
    prompts = random_prompts((70, 33, 5), seed=3)
    expected = hf_greedy(path, prompts, 12)
    # A 16-token budget splits every long prompt into chunks that share steps with decodes.
    llm = LLM(path, device="cpu", page_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_text_prompts_use_the_folder_tokenizer(tiny_models):
    path = tiny_models["llama-mha"]
    llm = LLM(path, device="cpu")
    prompt_ids = llm.tokenizer.encode("Hello world")
    [from_text] = llm.generate("Hello world", GREEDY)
    [from_ids] = llm.generate([prompt_ids], GREEDY)
    assert from_text.prompt_token_ids == prompt_ids
    assert from_text.token_ids == from_ids.token_ids
    assert from_text.text == llm.tokenizer.decode(from_text.token_ids)
