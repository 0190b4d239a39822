"""Tiny builders write the Hugging Face layout; the loader reads it back, sharded or not;
the decoder's logits and RoPE variants match transformers on the same weights."""

import json
import os

import pytest
import torch

from omniflow.models import (
    DecoderConfig,
    build_tiny_model,
    checkpoint_files,
    load_decoder,
    load_tokenizer,
)
from omniflow.models.layers.rope import compute_inv_freq
from omniflow.models.llama.decoder import causal_attention

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def our_logits(path, token_ids):
    model = load_decoder(path, device="cpu")
    with torch.inference_mode():
        return model(torch.tensor(token_ids), torch.arange(len(token_ids)), causal_attention)


def hf_logits(path, token_ids):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]


def test_sharded_and_single_file_checkpoints_load_the_same(tmp_path):
    single = build_tiny_model(tmp_path / "single", "llama-gqa", seed=3)
    sharded = build_tiny_model(tmp_path / "sharded", "llama-gqa", seed=3, max_shard_bytes=50_000)
    assert len(checkpoint_files(single)) == 1
    assert len(checkpoint_files(sharded)) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_decoder(single, "cpu"), load_decoder(sharded, "cpu")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("llama-mha", {}),
        ("llama-mha", {"attention_bias": True}),
        ("llama-gqa", {}),
        ("qwen2-tied-odd-heads", {}),
        ("llama-mha", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (
            "llama-mha",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
    ],
)
def test_logits_match_transformers(tmp_path, preset, overrides):
    path = build_tiny_model(tmp_path / "m", preset, seed=5, **overrides)
    token_ids = list(range(3, 40))
    torch.testing.assert_close(our_logits(path, token_ids), hf_logits(path, token_ids))


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 3.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_rope_inverse_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "rope_theta": 5000.0,
    }
    if scaling:
        raw["rope_scaling"] = dict(scaling)
    ours, our_scale = compute_inv_freq(DecoderConfig.from_dict(raw), seq_len=100)
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        theirs = 1.0 / (5000.0 ** (torch.arange(0, 16, 2).float() / 16))
        their_scale = 1.0
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=100)
    torch.testing.assert_close(ours, theirs)
    assert our_scale == pytest.approx(their_scale)


def test_bad_folders_give_clear_errors(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama-mha", max_shard_bytes=50_000)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_decoder(tmp_path, "cpu")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        load_decoder(path, "cpu")
    (path / "config.json").write_text(
        json.dumps({**config, "rope_scaling": {"rope_type": "longrope"}})
    )
    with pytest.raises(NotImplementedError, match="longrope"):
        load_decoder(path, "cpu")
    (path / "config.json").write_text(json.dumps(config))
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="absent"):
        load_decoder(path, "cpu")


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path / "m", "llama-mha")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_decoder(path, "cpu")


def test_tiny_tokenizer_round_trips_and_knows_eos(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama-mha")
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode("Hello world, the engine samples tokens.")
    assert ids[0] == tokenizer.tokenizer.token_to_id("<s>")
    assert tokenizer.decode(ids) == "Hello world, the engine samples tokens."
    assert tokenizer.eos_token_ids == (tokenizer.tokenizer.token_to_id("</s>"),)
    assert tokenizer.vocab_size <= DecoderConfig.from_folder(path).vocab_size


def test_models_package_imports_nothing_of_ours():
    from pathlib import Path

    import omniflow.models

    for file in Path(omniflow.models.__file__).parent.glob("*.py"):
        for line in file.read_text().splitlines():
            if line.startswith(("import omniflow", "from omniflow")):
                assert line.startswith("from omniflow.models"), f"{file.name}: {line}"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0}])
def test_rotary_rows_looked_up_equal_the_computed_ones(scaling):
    """On CPU cos_sin reads rows of a table it grows as positions do: bit for bit what
    computing them gives, in bf16 and float32, before and after a growth."""
    from omniflow.models.layers.rope import RotaryEmbedding

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 256,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 4096,
    }
    if scaling:
        raw["rope_scaling"] = {**scaling, "original_max_position_embeddings": 1024}
    rotary = RotaryEmbedding(DecoderConfig.from_dict(raw))
    generator = torch.Generator().manual_seed(3)
    for longest in (40, 1040, 3000):  # within the first table, then two growths
        positions = torch.randint(0, longest, (300,), generator=generator)
        for dtype in (torch.bfloat16, torch.float32):
            looked_up = rotary.cos_sin(positions, dtype)
            computed = rotary._computed(positions, dtype)
            assert all(torch.equal(a, b) for a, b in zip(looked_up, computed, strict=True))
    assert rotary._tables[torch.bfloat16][0].shape[0] == 4096
