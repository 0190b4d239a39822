"""The one config.json reader (models/config_keys.py): errors name the key and the file."""

import json

import pytest

from omniflow.models.loader import load_config

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def write(folder, raw):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_a_config_reads_with_its_defaults(tmp_path):
    config = load_config(write(tmp_path / "m", {**LLAMA, "num_key_value_heads": None}))
    assert (config.num_key_value_heads, config.head_dim, config.rms_norm_eps) == (2, 8, 1e-6)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "vocab_size: missing"),
        ({**LLAMA, "hidden_size": "wide"}, "hidden_size = 'wide': expected int"),
        ({**LLAMA, "rms_norm_eps": [1]}, "rms_norm_eps = [1]: expected float"),
        (
            {**LLAMA, "architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": "x"},
            "kv_lora_rank = 'x': expected int",
        ),
        (
            {**LLAMA, "architectures": ["HunyuanImage3ForCausalMM"], "patch_size": None},
            "patch_size = None: expected int",
        ),
    ],
)
def test_a_bad_key_is_named_with_its_file(tmp_path, raw, message):
    folder = write(tmp_path / "m", raw)
    with pytest.raises(ValueError, match="config.json") as error:
        load_config(folder)
    assert str(error.value).startswith(f"{folder / 'config.json'}: {message}")
