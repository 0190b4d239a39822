"""DeepSeek-V2 (MLA + DeepSeekMoE) on latent pages: greedy outputs equal transformers'
`DeepseekV2ForCausalLM` token for token, batched with mixed lengths, chunked, over cached
prefixes, through preemption and the host/SSD tiers; the cache holds the latent only, and a KV lease hands
those latents to a borrower."""

import os
import uuid

import pytest
import torch
from conftest import hf_greedy, random_prompts

from omniflow.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from omniflow.engine.kv_pages import KVCachePages
from omniflow.kv.share import KVLeaseView
from omniflow.memory import PagePool
from omniflow.models import MLAConfig, build_tiny_model, load_config
from omniflow.models.deepseek.mla import latent_causal_attention

# deepseek-v2-tiny: q_lora_rank, YaRN (mscale_all_dim 0.8), group-limited top-3 of 8 experts
# in 4 groups, routed_scaling_factor 2.5, first_k_dense_replace 1. The lite one: no
# q_lora_rank, greedy routing.
MLA_PRESETS = ["deepseek-v2-tiny", "deepseek-v2-lite-tiny"]
MIXED_LENGTHS = (3, 17, 9, 40, 1, 25)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-models")
    return {
        preset: build_tiny_model(root / preset, preset, seed=11 + i, max_shard_bytes=60_000)
        for i, preset in enumerate(MLA_PRESETS)
    }


@pytest.mark.parametrize("preset", MLA_PRESETS)
def test_batched_greedy_equals_transformers(mla_models, preset):
    path = mla_models[preset]
    prompts = random_prompts(MIXED_LENGTHS, seed=5)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, device="cpu", page_size=8)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_cached_prefixes_and_chunks_equal_transformers(mla_models):
    path = mla_models["deepseek-v2-tiny"]
    shared = random_prompts((24,), seed=9)[0]
    tails = random_prompts((5, 11, 2), seed=10)
    prompts = [shared + tail for tail in tails]
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, device="cpu", page_size=4, max_num_batched_tokens=16)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.cached_tokens >= 24 for o in rest)


def test_preemption_recomputes_the_same_tokens(mla_models):
    path = mla_models["deepseek-v2-lite-tiny"]
    prompts = random_prompts((20, 14, 9, 30), seed=12)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    # 14 pages of 4: each request fits alone (<= 46 tokens), not all of them together.
    engine = LLMEngine(path, EngineConfig(device="cpu", page_size=4, num_pages=14))
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY)
    sequences = dict(engine.sequences)
    produced: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for delta in engine.run_to_completion():
        produced[delta.request_id] += delta.token_ids
    assert [produced[f"r{i}"] for i in range(len(prompts))] == expected
    assert sum(s.num_preemptions for s in sequences.values()) > 0
    assert engine.allocator.usage().free_pages == 14


@pytest.mark.parametrize("tier", ["host", "ssd"])
def test_latent_pages_round_trip_the_tiers(mla_models, tmp_path, tier):
    path = mla_models["deepseek-v2-tiny"]
    prompts = random_prompts((24,) * 5, seed=13)
    expected = hf_greedy(path, prompts[:1], GREEDY.max_tokens)
    # SSD: a one-page host tier, so demoted pages spill on to SSD.
    host = 1 << 20 if tier == "host" else 1
    ssd = {} if tier == "host" else {"ssd_kv_dir": str(tmp_path), "ssd_kv_bytes": 1 << 20}
    llm = LLM(path, device="cpu", page_size=4, num_pages=24, host_kv_bytes=host, **ssd)
    engine = llm.engine
    for prompt in prompts:  # 24 device pages: later prompts push the first one's pages down
        llm.generate([prompt], GREEDY)
    again = llm.generate(prompts[:1], GREEDY)[0]
    assert again.token_ids == expected[0]
    assert again.cached_tokens == 20  # promoted back from the lower tier
    pages = KVCachePages(engine.cache).read_pages([0])
    assert pages.shape[1:] == (2, *engine.cache.keys.shape[:2], 4, engine.cache.keys.shape[-1])
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_are_the_latent_only(mla_models, dtype):
    path = mla_models["deepseek-v2-tiny"]
    config = load_config(path)
    assert isinstance(config, MLAConfig)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype=str(dtype)[6:], num_pages=8))
    cache = engine.cache
    stored = cache.keys.numel() + cache.values.numel()
    per_token = stored * cache.keys.element_size() // (cache.num_pages * cache.page_size)
    element = torch.empty((), dtype=dtype).element_size()
    expected = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers
    assert per_token == expected * element


def test_bf16_generates_close_to_float32(mla_models):
    path = mla_models["deepseek-v2-tiny"]
    prompts = random_prompts((12, 7), seed=14)
    full = LLM(path, device="cpu", dtype="float32").generate(prompts, GREEDY)
    bf16 = LLM(path, device="cpu", dtype="bfloat16", cpu_kernels=False)
    assert bf16.engine.runner.kernels is None  # PyTorch ops (tests/kernels: on the kernels)
    half = bf16.generate(prompts, GREEDY)
    # bf16 rounding may flip a late near-tie; the first tokens agree.
    assert [o.token_ids[:2] for o in half] == [o.token_ids[:2] for o in full]


def test_float16_is_refused(mla_models):
    with pytest.raises(ValueError, match="overflow"):
        LLMEngine(mla_models["deepseek-v2-tiny"], EngineConfig(device="cpu", dtype="float16"))


def test_sharded_lite_layout_loads_every_tensor(tmp_path):
    path = build_tiny_model(tmp_path, "deepseek-v2-lite-tiny", max_shard_bytes=20_000)
    assert (path / "model.safetensors.index.json").is_file()
    engine = LLMEngine(path, EngineConfig(device="cpu", num_pages=4))
    assert engine.model.config.q_lora_rank is None


@torch.inference_mode()
def test_a_lease_of_latent_pages_reads_the_latents(mla_models):
    path = mla_models["deepseek-v2-tiny"]
    pool = PagePool.create(f"omniflow-mla-lease-{uuid.uuid4().hex[:8]}", 256 << 12, 4096)
    try:
        config = EngineConfig(device="cpu", page_size=4, num_pages=16, share_kv=True)
        engine = LLMEngine(path, config, kv_pool=pool)
        prompt = random_prompts((10,), seed=15)[0]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        engine.add_request("lent", prompt, params, lend_kv_to=os.getpid())
        deltas = engine.run_to_completion()
        [lease] = [d.kv_lease for d in deltas if d.kv_lease is not None]
        tokens = prompt + [t for d in deltas for t in d.token_ids][:-1]  # the computed ones
        model = engine.model
        seen = {}
        plain = latent_causal_attention(model.config.softmax_scale)

        def recording(layer_index, q, k, v):
            seen[layer_index] = k[:, 0]
            return plain(layer_index, q, k, v)

        model.forward(torch.tensor(tokens), torch.arange(len(tokens)), recording)
        with KVLeaseView(pool, lease) as view:
            assert lease.num_tokens == len(tokens)
            for layer in range(view.num_layers):
                first, second = view.layer(layer)  # [1, tokens, half] each
                latents = torch.cat((first[0], second[0]), dim=-1)[:, : seen[layer].shape[1]]
                torch.testing.assert_close(latents, seen[layer])
        engine.close()
    finally:
        pool.unlink()
        pool.close()
