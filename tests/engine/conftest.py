import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from omniflow.models import build_tiny_model  # noqa: E402

EQUALITY_PRESETS = ["llama-mha", "llama-gqa", "qwen2-tied-odd-heads"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        preset: build_tiny_model(root / preset, preset, seed=index, max_shard_bytes=60_000)
        for index, preset in enumerate(EQUALITY_PRESETS)
    }


@pytest.fixture(scope="session")
def llama_path(tiny_models):
    return tiny_models["llama-mha"]


def random_prompts(lengths, seed=0, vocab=500):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(path, prompts, max_new_tokens):
    """transformers' greedy generate, one prompt at a time (no padding to blur numerics)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy_with(model, prompts, max_new_tokens)


def hf_greedy_with(model, prompts, max_new_tokens):
    """Greedy generate of a loaded transformers model, one prompt at a time."""
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
