"""LongCat-Flash (MLA, dual sublayers, shortcut MoE with zero-computation experts) on latent
pages: greedy outputs equal transformers' `LongcatFlashForCausalLM` token for token."""

import re

import pytest
import torch
from conftest import random_prompts

from omniflow.engine import LLM, SamplingParams
from omniflow.models import MLAConfig, build_tiny_model, load_config
from omniflow.models.loader import iter_checkpoint_tensors

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def longcat_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("longcat"), "longcat-flash-tiny", seed=21)


def hf_longcat(path):
    """transformers' model on the folder's weights: per-expert tensors stacked into its fused
    ones by hand (its gate_up_proj has rows for the zero experts too, left zero)."""
    import transformers

    config = transformers.LongcatFlashConfig.from_pretrained(path)
    model = transformers.LongcatFlashForCausalLM(config).eval()
    state, experts = {}, {}
    for name, tensor in iter_checkpoint_tensors(path):
        match = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if match:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = tensor
        else:
            state[name] = tensor
    routed, zero = config.n_routed_experts, config.zero_expert_num
    for prefix, parts in experts.items():
        gate_up = [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(routed)]
        gate_up += [torch.zeros_like(gate_up[0])] * zero
        state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(routed)])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def hf_greedy(model, prompts, max_new_tokens):
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


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
