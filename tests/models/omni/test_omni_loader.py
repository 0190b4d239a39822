"""config.json + model.safetensors: bit-exact round trips, seeded builds, strict loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniflow.models.omni import (
    KINDS,
    ModelFormatError,
    build_tiny,
    ensure_model,
    load_model,
    save_model,
)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_save_load_round_trip_is_bit_exact(tmp_path, kind):
    config_cls, model_cls = KINDS[kind]
    torch.manual_seed(11)
    model = model_cls(config_cls()).eval()
    save_model(model, kind, tmp_path / kind)
    loaded = load_model(kind, tmp_path / kind)
    assert loaded.config == model.config
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), name


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = load_file(str(build_tiny("depth_head", tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(build_tiny("depth_head", tmp_path / "b", seed=3) / "model.safetensors"))
    c = load_file(str(build_tiny("depth_head", tmp_path / "c", seed=4) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_build_overrides_reach_the_config(tmp_path):
    path = build_tiny("depth_head", tmp_path / "head", hidden_size=48)
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 48
    assert load_model("depth_head", path).in_proj.in_features == 48


def test_ensure_model_keeps_an_existing_model(tmp_path):
    path = build_tiny("depth_head", tmp_path / "v", seed=1)
    before = (path / "model.safetensors").read_bytes()
    ensure_model("depth_head", path, seed=2)
    assert (path / "model.safetensors").read_bytes() == before
    ensure_model("depth_head", tmp_path / "fresh", seed=2)
    assert (tmp_path / "fresh" / "config.json").is_file()


def test_wrong_kind_missing_folder_unknown_field(tmp_path):
    path = build_tiny("depth_head", tmp_path / "v")
    with pytest.raises(ModelFormatError, match="holds a 'depth_head' model"):
        load_model("code_embedder", path)
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model("depth_head", tmp_path / "nothing")
    with pytest.raises(ModelFormatError, match="unknown model kind"):
        load_model("nope", path)
    config = json.loads((path / "config.json").read_text())
    config["bogus"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="bogus"):
        load_model("depth_head", path)


def test_missing_tensor_is_named(tmp_path):
    path = build_tiny("depth_head", tmp_path / "v")
    state = load_file(str(path / "model.safetensors"))
    del state["in_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="in_proj.weight"):
        load_model("depth_head", path)
