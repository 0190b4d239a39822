"""Multimodal embedding spans: they replace token embeddings and key the prefix cache."""

import pytest
import torch
from conftest import random_prompts

from omniflow.engine import EmbeddingSpan, LLMEngine, SamplingParams
from omniflow.engine.llm_engine import EngineConfig


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
