"""Equal-length fresh prompts share one attention call; outputs still equal transformers'."""

import torch
from conftest import hf_greedy, random_prompts

from omniflow.engine import LLM, SamplingParams
from omniflow.engine.paged_attention import KVCache, PrefillSpec, build_attention_batch


def test_equal_length_prompts_equal_transformers(tiny_models):
    path = tiny_models["llama-gqa"]
    prompts = random_prompts((16, 16, 16, 9, 16, 16, 5), seed=31)
    expected = hf_greedy(path, prompts, 10)
    llm = LLM(path, device="cpu", page_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_only_adjacent_fresh_equal_chunks_merge():
    cache = KVCache(1, 16, 4, 1, 2, torch.float32, torch.device("cpu"))
    specs = [([0, 1], 0, 6), ([2, 3], 0, 6), ([4, 5], 0, 5), ([6, 7], 4, 2), ([8, 9], 0, 6)]
    prefills = [PrefillSpec(*spec) for spec in specs]
    batch = build_attention_batch(cache, [], prefills, cache.keys.device, cache.keys.dtype)
    spans = [(s.row_start, s.row_end, s.num_chunks) for s in batch.prefills]
    assert spans == [(0, 12, 2), (12, 17, 1), (17, 19, 1), (19, 25, 1)]
