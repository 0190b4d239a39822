"""DeepSeek-V2 folders load into MLADecoderLM whichever way the experts are stored (one
tensor per expert, as V2-Lite and transformers' save_pretrained write them, or transformers'
fused in-memory tensors), and a plain forward equals transformers' logits."""

import shutil

import pytest
import torch
from safetensors.torch import save_file

from omniflow.models import MLADecoderLM, build_tiny_model, load_decoder


def hf_model(path):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def assert_same_logits(model, hf):
    ids = torch.tensor([[5, 17, 33, 2, 99, 100, 7, 8, 250, 3]])
    expected = hf(ids).logits[0]
    got = model.logits(model.hidden_states(model.embed(ids[0])))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", ["deepseek-v2-tiny", "deepseek-v2-lite-tiny"])
def test_per_expert_and_saved_folders_equal_transformers(tmp_path, preset):
    path = build_tiny_model(tmp_path / "ours", preset, max_shard_bytes=40_000)
    hf = hf_model(path)
    model = load_decoder(path, "cpu", "float32")
    assert isinstance(model, MLADecoderLM)
    assert_same_logits(model, hf)
    hf.save_pretrained(tmp_path / "saved")
    assert_same_logits(load_decoder(tmp_path / "saved", "cpu", "float32"), hf)


def test_fused_expert_tensors_load(tmp_path):
    path = build_tiny_model(tmp_path / "ours", "deepseek-v2-tiny")
    hf = hf_model(path)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(path / "config.json", fused / "config.json")
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(fused / "model.safetensors"))
    assert_same_logits(load_decoder(fused, "cpu", "float32"), hf)


def test_routers_stay_float32_in_a_bf16_model(tmp_path):
    path = build_tiny_model(tmp_path, "deepseek-v2-tiny")
    model = load_decoder(path, "cpu", "bfloat16")
    router = model.model.layers[1].mlp.gate.weight
    assert router.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
