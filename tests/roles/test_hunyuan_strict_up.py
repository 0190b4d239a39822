"""Strict loading as a user meets it: `omniflow up` of a configs/hunyuan_image3.toml-style
deployment over a published-layout folder with one tensor renamed, missing or extra fails
to start, and the error names the tensor, the role and the folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3
from tests.helpers import cli

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "hunyuan_image3.toml"
QKV = "model.layers.1.self_attn.qkv_proj.weight"
FINAL = "final_layer.model.1.2.weight"
VAE = "vae.decoder.conv_out.weight"


def deployment(tmp_path: Path) -> Path:
    """The shipped config over tmp_path/model (no build, no gateway)."""
    text = SHIPPED.read_text()
    text = text.replace('"models/hunyuan-image3-tiny"', '"model"')
    text = text.replace("build_tiny = true", "build_tiny = false")
    text = text.split("[gateway]")[0]
    config = tmp_path / "hunyuan.toml"
    config.write_text(text)
    return config


def change_shard(folder: Path, name: str, change) -> None:
    """change(tensors) in the shard holding name; the index follows."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard))
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard.name}
    index["weight_map"] |= {n: shard.name for n in tensors}
    index_file.write_text(json.dumps(index))


def renamed(t):
    t["model.layers.1.self_attn.qkv.weight"] = t.pop(QKV)


def missing(t):
    del t[FINAL]


def extra(t):
    t["vae.decoder.conv_extra.weight"] = t[VAE].clone()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tensor", "change", "named", "roles"),
    [
        (QKV, renamed, "model.layers.1.self_attn.qkv.weight", ("ar", "diffusion")),
        (FINAL, missing, FINAL, ("ar", "diffusion")),  # vae_decoder reads vae.decoder.* alone
        (VAE, extra, "vae.decoder.conv_extra.weight", ("ar", "diffusion", "vae_decoder")),
    ],
    ids=["renamed", "missing", "extra"],
)
def test_up_refuses_a_folder_with_a_bad_tensor(tmp_path, run_root, tensor, change, named, roles):
    folder = build_tiny_hunyuan_image3(tmp_path / "model", seed=2)
    change_shard(folder, tensor, change)
    config = deployment(tmp_path)
    try:
        proc = cli("up", str(config), "-d", check=False, cwd=tmp_path, timeout=240)
    finally:
        cli("down", "--name", "hunyuan_image3", check=False, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "failed to start" in out, out
    assert named in out, out
    assert str(folder) in out, out
    role = re.search(r"role '(\w+)'", out)
    assert role is not None and role.group(1) in roles, out
