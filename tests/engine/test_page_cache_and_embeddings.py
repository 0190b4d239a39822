"""The hash-chained prefix page cache, and multimodal embedding spans."""

import pytest
import torch
from conftest import random_prompts

from omniflow.engine import (
    EmbeddingSpan,
    HashPrefixPageCache,
    LLMEngine,
    OutOfPages,
    SamplingParams,
)
from omniflow.engine.llm_engine import EngineConfig


def test_match_acquires_and_free_keeps_pages_matchable():
    cache = HashPrefixPageCache(num_pages=4, page_size=2)
    tokens = [1, 2, 3, 4, 5]
    pages = cache.allocate(3)
    cache.insert(tokens, pages)  # two full pages published; the partial third is not
    assert cache.usage().cached_pages == 2
    match = cache.match_prefix(tokens)
    assert match == (pages[:2], 4, ())
    assert cache.ref_counts[pages[0]] == 2
    cache.free(pages)
    cache.free(match.page_ids)
    assert cache.usage().free_pages == 4
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4  # still cached after free


def test_chained_keys_need_the_whole_prefix():
    cache = HashPrefixPageCache(num_pages=4, page_size=2)
    pages = cache.allocate(2)
    cache.insert([1, 2, 3, 4], pages)
    assert cache.match_prefix([9, 9, 3, 4]).num_tokens == 0  # same page, other prefix
    assert cache.match_prefix([1, 2, 9, 9]).num_tokens == 2


def test_extra_keys_separate_equal_placeholder_ids():
    cache = HashPrefixPageCache(num_pages=4, page_size=2)
    pages = cache.allocate(2)
    cache.insert([7, 7, 7, 7], pages, extra_keys=["img-a"] * 4)
    assert cache.match_prefix([7, 7, 7, 7], extra_keys=["img-b"] * 4).num_tokens == 0
    assert cache.match_prefix([7, 7, 7, 7]).num_tokens == 0
    assert cache.match_prefix([7, 7, 7, 7], extra_keys=["img-a"] * 4).num_tokens == 4


def test_eviction_reuses_least_recently_freed_and_out_of_pages():
    cache = HashPrefixPageCache(num_pages=2, page_size=2)
    first = cache.allocate(1)
    cache.insert([1, 2], first)
    cache.free(first)
    second = cache.allocate(2)  # takes the blank page, then evicts the cached one
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    with pytest.raises(OutOfPages):
        cache.allocate(1)
    cache.free(second)
    with pytest.raises(RuntimeError, match="freed more often"):
        cache.free(second)


def test_embedding_spans_replace_token_embeddings(llama_path):
    engine = LLMEngine(llama_path, EngineConfig(device="cpu", page_size=4))
    [prompt] = random_prompts((12,), seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(request_id, token_ids, spans):
        engine.add_request(request_id, token_ids, params, spans)
        deltas = engine.run_to_completion()
        return [t for d in deltas for t in d.token_ids], deltas[-1].num_cached_tokens

    plain, _ = run("plain", prompt, None)
    # The real embeddings of positions 2..7, given as a span over placeholder ids, change nothing.
    real = engine.model.embed(torch.tensor(prompt[2:8]))
    placeholder = prompt[:2] + [0] * 6 + prompt[8:]
    same, _ = run("same", placeholder, [EmbeddingSpan(2, real, "hash-real")])
    assert same == plain
    other = torch.randn(6, engine.model.config.hidden_size) * 3
    different, cached = run("other", placeholder, [EmbeddingSpan(2, other, "hash-other")])
    assert different != plain
    assert cached == 0  # equal placeholder ids, other content hash: no false prefix hit
    again, cached = run("again", placeholder, [EmbeddingSpan(2, other, "hash-other")])
    assert again == different and cached == 8


def test_embedding_span_shape_is_checked(llama_path):
    engine = LLMEngine(llama_path, EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match="r1.*embeddings\\[0\\]"):
        engine.add_request("r1", [3, 4, 5], SamplingParams(), [EmbeddingSpan(1, torch.zeros(5, 3))])
