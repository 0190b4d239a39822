"""LongCat-Flash (MLA, dual sublayers, shortcut MoE with zero-computation experts) on latent
pages: greedy outputs equal transformers' `LongcatFlashForCausalLM` token for token, and the
Compute Flow paths (codes heads, guided pairs, block steps) equal their references."""

import pytest
import torch
from compute_flow import GreedyHead, codes_of, embed, recompute_codes, run
from conftest import hf_greedy_with as hf_greedy
from conftest import random_prompts

from omniflow.engine import LLM, LLMEngine, SamplingParams
from omniflow.engine.heads import Guidance
from omniflow.engine.llm_engine import EngineConfig
from omniflow.models import MLAConfig, build_tiny_model, load_config
from omniflow.models.loader import iter_checkpoint_tensors
from tests.hf_longcat import load_stacked_experts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def longcat_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("longcat"), "longcat-flash-tiny", seed=21)


def hf_longcat(path):
    """transformers' model on the folder's weights, per-expert tensors stacked into its fused
    ones."""
    import transformers

    config = transformers.LongcatFlashConfig.from_pretrained(path)
    model = transformers.LongcatFlashForCausalLM(config).eval()
    load_stacked_experts(model, dict(iter_checkpoint_tensors(path)))
    return model


def test_config_reads_longcat_fields(longcat_path):
    config = load_config(longcat_path)
    assert isinstance(config, MLAConfig) and config.is_longcat
    assert (config.zero_expert_num, config.num_experts_per_tok) == (2, 2)
    assert config.kv_layout[0] == 2 * config.num_hidden_layers  # two attention sublayers


def test_batched_greedy_and_cached_prefixes_equal_transformers(longcat_path):
    shared = random_prompts((16,), seed=22)[0]
    prompts = random_prompts((3, 17, 9, 30, 1), seed=23) + [shared + [7, 8], shared + [9]]
    expected = hf_greedy(hf_longcat(longcat_path), prompts, GREEDY.max_tokens)
    llm = LLM(longcat_path, device="cpu", page_size=4)
    got = llm.generate(prompts[:-1], GREEDY) + llm.generate(prompts[-1:], GREEDY)
    assert [o.token_ids for o in got] == expected
    assert got[-1].cached_tokens == 16


@pytest.mark.parametrize("cfg", [None, 3.0])
def test_codes_heads_equal_the_recompute_reference(longcat_path, cfg):
    """The Compute Flow media-token path (codes heads, guided pairs) on latent pages."""
    engine = LLMEngine(longcat_path, EngineConfig(page_size=4, num_pages=128))
    head = GreedyHead(engine.model.config.hidden_size)
    prompts = random_prompts([9, 14], seed=24)
    uncond = None if cfg is None else [1, 5]
    expected = [recompute_codes(engine.model, head, p, 6, uncond, cfg or 1.0)[0] for p in prompts]
    guidance = None if cfg is None else Guidance([1, 5], cfg)
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=6, temperature=0.0)
        engine.add_request(f"r{index}", prompt, params, head=head, guidance=guidance)
    out = run(engine)
    for index in range(len(prompts)):
        assert torch.equal(codes_of(out[f"r{index}"]), expected[index])


@torch.inference_mode()
def test_block_steps_match_the_masked_reference(longcat_path):
    engine = LLMEngine(longcat_path, EngineConfig(page_size=4, num_pages=128))
    model = engine.model
    prefix = random_prompts([13], seed=25)[0]
    engine.keep_context("ctx", prefix)
    generator = torch.Generator().manual_seed(26)
    rows = torch.randn(5, model.config.hidden_size, generator=generator) * 0.5
    positions = torch.arange(len(prefix), len(prefix) + 5)
    engine.block_step("b", "ctx", rows, positions)
    [delta] = [d for d in engine.run_to_completion() if d.request_id == "b"]
    x = torch.cat([embed(model, prefix), rows])
    mask = torch.ones(len(x), len(x)).tril().bool()
    mask[len(prefix) :, :] = True  # block rows: all of the prefix and each other
    cos, sin = model.rotary.cos_sin(torch.cat([torch.arange(len(prefix)), positions]), x.dtype)
    scale = model.config.softmax_scale

    def attention(layer_index, q, k, v):
        scores = torch.einsum("thd,sd->hts", q, k[:, 0]) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("hts,sr->thr", probs, v[:, 0])

    for layer in model.model.layers:
        x = layer(x, cos, sin, attention)
    expected = model.model.norm(x)[len(prefix) :]
    torch.testing.assert_close(delta.hidden, expected, atol=1e-4, rtol=1e-4)
    engine.release("ctx")
