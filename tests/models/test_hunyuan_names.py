"""The tiny builder writes exactly the published checkpoint's parameter names and shapes.

The published ``model.safetensors.index.json`` could not be read here, so the expected
list is derived in this test from the release's module definitions, independently of our
modules: ``hunyuan_image_3/hunyuan.py`` (HunyuanImage3Model: wte, layers with
HunyuanImage3SDPAAttention, HunyuanMoE / HunyuanTopKGate / HunyuanMLP, ln_f; lm_head;
TimestepEmbedder, ResBlock, UNetDown, UNetUp(out_norm=True)), ``autoencoder_kl_3d.py``
(Encoder, Decoder with reversed widths, ResnetBlock, AttnBlock, DownsampleDCAE /
UpsampleDCAE) and ``siglip2.py`` (Siglip2VisionTransformer, LightProjector). No biases in
the backbone (attention_bias, mlp_bias false, as the release's config)."""

import json
import math

import pytest
from safetensors import safe_open

from omniflow.models.loader import checkpoint_files
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3


def linear(names, prefix, out, into, bias=True):
    names[f"{prefix}.weight"] = (out, into)
    if bias:
        names[f"{prefix}.bias"] = (out,)


def norm(names, prefix, size, bias=True):
    names[f"{prefix}.weight"] = (size,)
    if bias:
        names[f"{prefix}.bias"] = (size,)


def conv(names, prefix, out, into, kernel, dims=2):
    names[f"{prefix}.weight"] = (out, into, *(kernel,) * dims)
    names[f"{prefix}.bias"] = (out,)


def backbone(names, c):
    heads, kv, dim, hidden = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["attention_head_dim"],
        c["hidden_size"],
    )
    names["model.wte.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(names, f"{p}.input_layernorm", hidden, bias=False)
        norm(names, f"{p}.post_attention_layernorm", hidden, bias=False)
        linear(names, f"{p}.self_attn.qkv_proj", (heads + 2 * kv) * dim, hidden, bias=False)
        linear(names, f"{p}.self_attn.o_proj", hidden, heads * dim, bias=False)
        norm(names, f"{p}.self_attn.query_layernorm", dim, bias=False)
        norm(names, f"{p}.self_attn.key_layernorm", dim, bias=False)
        linear(names, f"{p}.mlp.gate.wg", c["num_experts"], hidden, bias=False)
        inter = c["moe_intermediate_size"]
        for e in range(c["num_experts"]):
            linear(names, f"{p}.mlp.experts.{e}.gate_and_up_proj", 2 * inter, hidden, bias=False)
            linear(names, f"{p}.mlp.experts.{e}.down_proj", hidden, inter, bias=False)
        shared = inter * c["num_shared_expert"]
        linear(names, f"{p}.mlp.shared_mlp.gate_and_up_proj", 2 * shared, hidden, bias=False)
        linear(names, f"{p}.mlp.shared_mlp.down_proj", hidden, shared, bias=False)
    norm(names, "model.ln_f", hidden, bias=False)
    linear(names, "lm_head", c["vocab_size"], hidden, bias=False)


def embedder(names, prefix, hidden):
    linear(names, f"{prefix}.mlp.0", hidden, 256)
    linear(names, f"{prefix}.mlp.2", hidden, hidden)


def resblock(names, p, into, emb, out):
    norm(names, f"{p}.in_layers.0", into)
    conv(names, f"{p}.in_layers.2", out, into, 3)
    linear(names, f"{p}.emb_layers.1", 2 * out, emb)
    norm(names, f"{p}.out_layers.0", out)
    conv(names, f"{p}.out_layers.3", out, out, 3)
    if into != out:
        conv(names, f"{p}.skip_connection", out, into, 1)


def diffusion_side(names, c):
    hidden, width, latent, patch = (
        c["hidden_size"],
        c["patch_embed_hidden_dim"],
        c["vae"]["latent_channels"],
        c["patch_size"],
    )
    for name in ("timestep_emb", "time_embed", "time_embed_2"):
        embedder(names, name, hidden)
    conv(names, "patch_embed.model.0", width, latent, 3)
    if patch == 1:
        resblock(names, "patch_embed.model.1", width, hidden, hidden)
        resblock(names, "final_layer.model.0", hidden, hidden, width)
        last = 1
    else:
        for i in range(patch // 2):
            out = hidden if (i + 1) * 2 == patch else width
            resblock(names, f"patch_embed.model.{i + 1}", width, hidden, out)
            resblock(names, f"final_layer.model.{i}", hidden if i == 0 else width, hidden, width)
        last = patch // 2
    norm(names, f"final_layer.model.{last}.0", width)
    conv(names, f"final_layer.model.{last}.2", latent, width, 3)


def vae_resnet(names, p, into, out):
    norm(names, f"{p}.norm1", into)
    conv(names, f"{p}.conv1", out, into, 3, dims=3)
    norm(names, f"{p}.norm2", out)
    conv(names, f"{p}.conv2", out, out, 3, dims=3)
    if into != out:
        conv(names, f"{p}.nin_shortcut", out, into, 1, dims=3)


def vae_mid(names, p, c):
    vae_resnet(names, f"{p}.mid.block_1", c, c)
    norm(names, f"{p}.mid.attn_1.norm", c)
    for leaf in ("q", "k", "v", "proj_out"):
        conv(names, f"{p}.mid.attn_1.{leaf}", c, c, 1, dims=3)
    vae_resnet(names, f"{p}.mid.block_2", c, c)


def vae(names, v):
    widths, z, blocks = v["block_out_channels"], v["latent_channels"], v["layers_per_block"]
    spatial, temporal = math.log2(v["ffactor_spatial"]), math.log2(v["ffactor_temporal"])
    p = "vae.encoder"
    conv(names, f"{p}.conv_in", widths[0], v["in_channels"], 3, dims=3)
    into = widths[0]
    for i, width in enumerate(widths):
        for j in range(blocks):
            vae_resnet(names, f"{p}.down.{i}.block.{j}", into, width)
            into = width
        if i < spatial:
            out = widths[i + 1] if v.get("downsample_match_channel", True) else into
            factor = 8 if i >= math.log2(v["ffactor_spatial"] // v["ffactor_temporal"]) else 4
            conv(names, f"{p}.down.{i}.downsample.conv", out // factor, into, 3, dims=3)
            into = out
    vae_mid(names, p, into)
    norm(names, f"{p}.norm_out", into)
    conv(names, f"{p}.conv_out", 2 * z, into, 3, dims=3)
    p, widths = "vae.decoder", list(reversed(widths))
    into = widths[0]
    conv(names, f"{p}.conv_in", into, z, 3, dims=3)
    vae_mid(names, p, into)
    for i, width in enumerate(widths):
        for j in range(blocks + 1):
            vae_resnet(names, f"{p}.up.{i}.block.{j}", into, width)
            into = width
        if i < spatial or i < temporal:
            out = widths[i + 1] if v.get("upsample_match_channel", True) else into
            factor = 8 if i < temporal else 4
            conv(names, f"{p}.up.{i}.upsample.conv", out * factor, into, 3, dims=3)
            into = out
    norm(names, f"{p}.norm_out", into)
    conv(names, f"{p}.conv_out", v["out_channels"], into, 3, dims=3)


def vit(names, v, aligner, hidden):
    w, inner, p = v["hidden_size"], v["intermediate_size"], "vision_model"
    linear(names, f"{p}.embeddings.patch_embedding", w, v["num_channels"] * v["patch_size"] ** 2)
    names[f"{p}.embeddings.position_embedding.weight"] = (v["num_patches"], w)
    for i in range(v["num_hidden_layers"]):
        q = f"{p}.encoder.layers.{i}"
        norm(names, f"{q}.layer_norm1", w)
        for leaf in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(names, f"{q}.self_attn.{leaf}", w, w)
        norm(names, f"{q}.layer_norm2", w)
        linear(names, f"{q}.mlp.fc1", inner, w)
        linear(names, f"{q}.mlp.fc2", w, inner)
    norm(names, f"{p}.post_layernorm", w)
    if v.get("vision_use_head", True):
        names[f"{p}.head.probe"] = (1, 1, w)
        names[f"{p}.head.attention.in_proj_weight"] = (3 * w, w)
        names[f"{p}.head.attention.in_proj_bias"] = (3 * w,)
        linear(names, f"{p}.head.attention.out_proj", w, w)
        norm(names, f"{p}.head.layernorm", w)
        linear(names, f"{p}.head.mlp.fc1", inner, w)
        linear(names, f"{p}.head.mlp.fc2", w, inner)
    assert aligner["projector_type"] == "mlp_gelu"
    linear(names, "vision_aligner.layers.0", aligner["n_embed"], aligner["input_dim"])
    for i in range(1, aligner["depth"]):
        linear(names, f"vision_aligner.layers.{2 * i}", aligner["n_embed"], aligner["n_embed"])


def published_names(c):
    names: dict[str, tuple[int, ...]] = {}
    backbone(names, c)
    diffusion_side(names, c)
    vae(names, c["vae"])
    vit(names, c["vit"], c["vit_aligner"], c["hidden_size"])
    return names


def written(folder):
    names = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), "pt") as f:
            names |= {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    return names


VAE_TWO_BLOCKS = {"layers_per_block": 2, "block_out_channels": [32, 32, 64, 64, 64]}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"patch_size": 2, "num_hidden_layers": 1}, {"vae": VAE_TWO_BLOCKS}],
    ids=["shipped", "patch2", "vae2"],
)
def test_the_builder_writes_the_published_names_and_shapes(tmp_path, overrides):
    if "vae" in overrides:
        from omniflow.models.tiny.hunyuan_image3 import TINY_HUNYUAN_IMAGE3

        overrides = {"vae": TINY_HUNYUAN_IMAGE3["vae"] | overrides["vae"]}
    folder = build_tiny_hunyuan_image3(tmp_path / "tiny", seed=1, **overrides)
    config = json.loads((folder / "config.json").read_text())
    assert not config.get("attention_bias") and not config.get("mlp_bias")
    expected, got = published_names(config), written(folder)
    assert sorted(set(got) - set(expected)) == []  # nothing the release lacks
    assert sorted(set(expected) - set(got)) == []  # nothing of the release's missing
    assert {n: s for n, s in got.items() if expected[n] != s} == {}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)


def test_the_vae_decoder_role_reads_the_decoder_alone(tmp_path):
    """vae_decoder's parts hold vae.decoder.* and nothing else, and decode as the whole
    parts do; a bad tensor elsewhere is not its to report."""
    import torch

    from omniflow.models.hunyuan_image3.parts import load_image_parts

    folder = build_tiny_hunyuan_image3(tmp_path / "tiny", seed=4)
    alone = load_image_parts(folder, decoder_only=True)
    names = set(alone.state_dict())
    assert names and all(n.startswith("vae.decoder.") for n in names)
    assert names == {n for n in written(folder) if n.startswith("vae.decoder.")}
    whole = load_image_parts(folder)
    latent = torch.randn(32, 2, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(alone.decode_image(latent), whole.decode_image(latent))
