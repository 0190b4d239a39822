"""HunyuanImage-3.0 as published: the tiny builder's folder layout, strict loading at role
load (a renamed, missing, extra or mis-shaped tensor names itself, the role and the
folder), generation_config.json's sampler defaults and the flow-match schedule against
diffusers' FlowMatchEulerDiscreteScheduler."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniflow.models.flow_matching import model_time, shifted_sigmas
from omniflow.models.hunyuan_image3.config import (
    RELEASE_GENERATION,
    HunyuanImage3Config,
    generation_defaults,
)
from omniflow.models.hunyuan_image3.model import backbone_checkpoint_names
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts
from omniflow.models.hunyuan_image3.tokens import SPECIAL_TOKENS
from omniflow.models.loader import checkpoint_files
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3
from omniflow.roles.hunyuan_backbone import Backbone, image_parts
from omniflow.roles.options import HunyuanAROptions, VAEDecoderOptions

IMAGE_PARTS = (
    "vae.",
    "vision_model.",
    "vision_aligner.",
    "timestep_emb.",
    "patch_embed.",
    "time_embed.",
    "final_layer.",
    "time_embed_2.",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_hunyuan_image3(tmp_path_factory.mktemp("published") / "tiny", seed=5)


def names_in(folder):
    names = set()
    for file in checkpoint_files(folder):
        names |= set(load_file(str(file)))
    return names


def test_the_folder_has_the_published_layout(folder):
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "hunyuan_image_3_moe"
    assert raw["architectures"] == ["HunyuanImage3ForCausalMM"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / s).is_file() for s in shards)
    names = names_in(folder)
    assert set(index["weight_map"]) == names
    config = HunyuanImage3Config.from_dict(raw)
    backbone = {n for n in names if not n.startswith(IMAGE_PARTS)}
    assert backbone == backbone_checkpoint_names(config)
    assert {n.split(".")[0] + "." for n in names - backbone} == set(IMAGE_PARTS)
    assert names - backbone == set(HunyuanImage3Parts(config).state_dict())
    assert "model.layers.1.mlp.experts.3.gate_and_up_proj.weight" in names
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate.wg.weight" in names
    generation = json.loads((folder / "generation_config.json").read_text())
    assert set(RELEASE_GENERATION) <= set(generation)
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    added = {entry["content"] for entry in vocab}
    assert set(SPECIAL_TOKENS) <= added
    assert {"<boi>", "<eoi>", "<img>", "<timestep>", "<cfg>", "<img_ratio_32>"} <= added


def test_generation_defaults_come_from_the_folder_or_the_release(folder, tmp_path):
    got = generation_defaults(folder)
    assert (got.steps, got.guidance_scale, got.flow_shift) == (8, 2.5, 3.0)
    release = generation_defaults(tmp_path)  # no generation_config.json
    assert (release.steps, release.guidance_scale, release.flow_shift) == (50, 5.0, 3.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"flow_shift": 0}))
    with pytest.raises(ValueError, match="flow_shift"):
        generation_defaults(tmp_path)


def copy_of(folder, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    for file in folder.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    return out


def edit(folder, change):
    """Apply change(tensors) to the shard holding the first tensor it names, keeping the
    index in step (a renamed or extra tensor is indexed where it lies)."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name, _ = change(None)
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    _, tensors = change(tensors)
    save_file(tensors, str(shard))
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard.name}
    index["weight_map"] |= {n: shard.name for n in tensors}
    index_file.write_text(json.dumps(index))


QKV = "model.layers.1.self_attn.qkv_proj.weight"
EXPERT = "model.layers.0.mlp.experts.2.down_proj.weight"


def renamed(t):
    if t is not None:
        t["model.layers.1.self_attn.qkv.weight"] = t.pop(QKV)
    return QKV, t


def missing(t):
    if t is not None:
        del t[EXPERT]
    return EXPERT, t


def extra(t):
    if t is not None:
        t["model.layers.0.mlp.experts.9.down_proj.weight"] = t[EXPERT].clone()
    return EXPERT, t


def misshaped(t):
    if t is not None:
        t[EXPERT] = t[EXPERT][:, :-1].contiguous()
    return EXPERT, t


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (renamed, "model.layers.1.self_attn.qkv.weight"),
        (missing, EXPERT),
        (extra, "model.layers.0.mlp.experts.9.down_proj.weight"),
        (misshaped, EXPERT),
    ],
)
def test_backbone_load_names_tensor_role_and_folder(folder, tmp_path, change, named):
    model = copy_of(folder, tmp_path)
    edit(model, change)
    opts = HunyuanAROptions(model_path=str(model), share_weights=False)
    with pytest.raises(ValueError) as caught:
        Backbone.load(opts, None, "ar")
    message = str(caught.value)
    assert named in message and "role 'ar'" in message and str(model) in message


def vae_change(t):
    name = "vae.decoder.conv_in.weight"
    if t is not None:
        t[name] = t[name][:1].contiguous()
    return name, t


def test_vae_decoder_load_names_a_misshaped_vae_tensor(folder, tmp_path):
    model = copy_of(folder, tmp_path)
    edit(model, vae_change)
    with pytest.raises(ValueError) as caught:
        image_parts(VAEDecoderOptions(model_path=str(model)), "vae_decoder")
    message = str(caught.value)
    assert "vae.decoder.conv_in.weight" in message and "role 'vae_decoder'" in message
    assert str(model) in message


@pytest.mark.parametrize(("steps", "shift"), [(8, 3.0), (50, 3.0), (20, 1.0), (13, 7.5)])
def test_schedule_matches_diffusers_flow_match_euler(steps, shift):
    diffusers = pytest.importorskip("diffusers")
    # The release's sigmas: linspace(1, 0, N + 1), shifted s x / (1 + (s - 1) x),
    # timesteps sigma * 1000. diffusers reproduces them with the shift applied to its own
    # linspace(1, 1/N) sigmas (static shifting) and a terminal 0.
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False
    )
    sigmas = torch.linspace(1.0, 0.0, steps + 1)[:-1].numpy()
    scheduler.set_timesteps(sigmas=sigmas)
    ours = shifted_sigmas(steps, shift)
    torch.testing.assert_close(ours, scheduler.sigmas.float(), atol=1e-6, rtol=1e-6)
    times = torch.tensor([model_time(s) for s in ours[:-1]])
    torch.testing.assert_close(times, scheduler.timesteps.float(), atol=1e-3, rtol=1e-6)
    # And one Euler step is diffusers' step.
    sample, velocity = torch.randn(2, 4, 4), torch.randn(2, 4, 4)
    theirs = scheduler.step(velocity, scheduler.timesteps[0], sample).prev_sample
    mine = sample + (float(ours[1]) - float(ours[0])) * velocity
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_vit_matches_transformers_siglip2_vision_model(folder):
    transformers = pytest.importorskip("transformers")
    from omniflow.models.hunyuan_image3.parts import load_image_parts

    raw = json.loads((folder / "config.json").read_text())
    parts = load_image_parts(folder)
    config = transformers.Siglip2VisionConfig(**raw["vit"])
    theirs = transformers.Siglip2VisionModel(config).eval()
    # The published names (vision_model.*, head included) are those of transformers'
    # Siglip2VisionTransformer (4.x: Siglip2VisionModel.vision_model; 5.x: the model's own).
    ours = {
        k.removeprefix("vision_model."): v
        for k, v in parts.state_dict().items()
        if k.startswith("vision_model.")
    }
    getattr(theirs, "vision_model", theirs).load_state_dict(ours, strict=True)
    torch.manual_seed(0)
    for shape in ((4, 4), (2, 8), (3, 5)):
        h, w = shape
        pixels = torch.rand(1, 3, h * 8, w * 8) * 2 - 1
        patches, got_shape = parts.vision_model.patchify(pixels)
        assert got_shape == shape
        padded = torch.zeros(1, 16, patches.shape[-1])
        padded[:, : h * w] = patches
        mask = torch.zeros(1, 16, dtype=torch.long)
        mask[:, : h * w] = 1
        with torch.inference_mode():
            expected = theirs(
                pixel_values=padded,
                pixel_attention_mask=mask,
                spatial_shapes=torch.tensor([shape]),
            ).last_hidden_state[:, : h * w]
            got = parts.vision_model.forward_patches(patches, shape)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The aligner: Linear, GELU, Linear under vision_aligner.layers.{0,2}.
    rows = torch.randn(5, raw["vit"]["hidden_size"])
    t = parts.state_dict()
    first = rows @ t["vision_aligner.layers.0.weight"].T + t["vision_aligner.layers.0.bias"]
    second = torch.nn.functional.gelu(first) @ t["vision_aligner.layers.2.weight"].T
    with torch.inference_mode():
        aligned = parts.vision_aligner(rows)
    torch.testing.assert_close(aligned, second + t["vision_aligner.layers.2.bias"])


def test_vit_grid_matches_siglip2_image_processor():
    siglip2 = pytest.importorskip("transformers.models.siglip2.image_processing_pil_siglip2")
    get_image_size_for_max_num_patches = siglip2.get_image_size_for_max_num_patches

    from omniflow.models.hunyuan_image3.vit import grid_size

    for height, width in ((64, 64), (100, 37), (17, 300), (8, 8), (1024, 768)):
        for patches in (16, 256, 1024):
            assert grid_size(height, width, 16, patches) == get_image_size_for_max_num_patches(
                height, width, 16, patches
            )


# The VAE, written here from the release's AutoencoderKLConv3D as plain functions over the
# checkpoint's vae.* tensors (einops patterns spelled with reshape/permute).
def _gn(x, t, name):
    return torch.nn.functional.group_norm(x, 32, t[name + ".weight"], t[name + ".bias"], 1e-6)


def _conv(x, t, name):
    weight = t[name + ".weight"]
    return torch.nn.functional.conv3d(x, weight, t[name + ".bias"], padding=weight.shape[-1] // 2)


def _res(x, t, p):
    silu = torch.nn.functional.silu
    h = _conv(
        silu(_gn(_conv(silu(_gn(x, t, p + "norm1")), t, p + "conv1"), t, p + "norm2")),
        t,
        p + "conv2",
    )
    return (_conv(x, t, p + "nin_shortcut") if p + "nin_shortcut.weight" in t else x) + h


def _attn(x, t, p):
    b, c, f, hh, w = x.shape
    h = _gn(x, t, p + "norm")
    q, k, v = (_conv(h, t, p + n).reshape(b, c, -1).transpose(1, 2) for n in "qkv")
    weights = (q @ k.transpose(1, 2) / c**0.5).softmax(-1)
    out = (weights @ v).transpose(1, 2).reshape(b, c, f, hh, w)
    return x + _conv(out, t, p + "proj_out")


def _mid(x, t, p):
    return _res(_attn(_res(x, t, p + "mid.block_1."), t, p + "mid.attn_1."), t, p + "mid.block_2.")


def _s2c(x, r1):  # b c (f r1) (h r2) (w r3) -> b (r1 r2 r3 c) f h w
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // r1, r1, h // 2, 2, w // 2, 2)
    return x.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(b, -1, f // r1, h // 2, w // 2)


def _c2s(x, r1):  # b (r1 r2 r3 c) f h w -> b c (f r1) (h r2) (w r3)
    b, n, f, h, w = x.shape
    x = x.reshape(b, r1, 2, 2, n // (4 * r1), f, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, n // (4 * r1), f * r1, h * 2, w * 2)


def reference_vae_encode(t, cfg, image):
    x = image[:, :, None].expand(-1, -1, cfg["ffactor_temporal"], -1, -1)
    widths, spatial = cfg["block_out_channels"], cfg["ffactor_spatial"]
    h = _conv(x, t, "vae.encoder.conv_in")
    for i in range(len(widths)):
        p = f"vae.encoder.down.{i}."
        for j in range(cfg["layers_per_block"]):
            h = _res(h, t, f"{p}block.{j}.")
        if p + "downsample.conv.weight" in t:
            r1 = 2 if i >= torch.log2(torch.tensor(spatial / cfg["ffactor_temporal"])) else 1
            out = _s2c(_conv(h, t, p + "downsample.conv"), r1)
            short = _s2c(h, r1)
            b, c, f, hh, w = short.shape
            h = out + short.view(b, out.shape[1], c // out.shape[1], f, hh, w).mean(2)
    h = _mid(h, t, "vae.encoder.")
    z2 = 2 * cfg["latent_channels"]
    b, c, f, hh, w = h.shape
    short = h.reshape(b, z2, c // z2, f, hh, w).mean(2)
    moments = _conv(
        torch.nn.functional.silu(_gn(h, t, "vae.encoder.norm_out")), t, "vae.encoder.conv_out"
    )
    mean = (moments + short).chunk(2, dim=1)[0]
    return (mean[:, :, 0] - (cfg["shift_factor"] or 0.0)) * cfg["scaling_factor"]


def reference_vae_decode(t, cfg, latent):
    z = (latent / cfg["scaling_factor"] + (cfg["shift_factor"] or 0.0))[:, :, None]
    widths = cfg["block_out_channels"][::-1]
    h = _conv(z, t, "vae.decoder.conv_in") + z.repeat_interleave(widths[0] // z.shape[1], 1)
    h = _mid(h, t, "vae.decoder.")
    for i in range(len(widths)):
        p = f"vae.decoder.up.{i}."
        for j in range(cfg["layers_per_block"] + 1):
            h = _res(h, t, f"{p}block.{j}.")
        if p + "upsample.conv.weight" in t:
            r1 = 2 if 2**i < cfg["ffactor_temporal"] else 1
            up = _conv(h, t, p + "upsample.conv")
            h = _c2s(up, r1) + _c2s(h.repeat_interleave(up.shape[1] // h.shape[1], 1), r1)
    frames = _conv(
        torch.nn.functional.silu(_gn(h, t, "vae.decoder.norm_out")), t, "vae.decoder.conv_out"
    )
    assert frames.shape[2] == cfg["ffactor_temporal"]  # one latent frame -> 4, keep the last
    return frames[:, :, -1]


def test_vae_matches_the_release_equations(folder):
    from omniflow.models.hunyuan_image3.parts import load_image_parts

    cfg = json.loads((folder / "config.json").read_text())["vae"]
    assert (cfg["latent_channels"], cfg["ffactor_spatial"], cfg["ffactor_temporal"]) == (32, 16, 4)
    parts = load_image_parts(folder)
    t = {k: v for k, v in parts.state_dict().items() if k.startswith("vae.")}
    assert all(v.dtype == torch.float32 for v in t.values())
    tensors = {}
    for file in checkpoint_files(folder):
        tensors |= {k: v for k, v in load_file(str(file)).items() if k.startswith("vae.")}
    assert set(tensors) == set(t) and all(tensors[k].dtype == torch.float32 for k in t)
    torch.manual_seed(0)
    image = torch.rand(1, 3, 48, 32) * 2 - 1
    latent = torch.randn(1, 32, 3, 2)
    with torch.inference_mode():
        encoded = parts.vae.encode(image)
        decoded = parts.vae.decode(latent)
        expected_latent = reference_vae_encode(t, cfg, image)
        expected_pixels = reference_vae_decode(t, cfg, latent).clamp(-1, 1)
    assert encoded.shape == (1, 32, 3, 2) and decoded.shape == (1, 3, 48, 32)
    torch.testing.assert_close(encoded, expected_latent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, expected_pixels, atol=1e-4, rtol=1e-4)
