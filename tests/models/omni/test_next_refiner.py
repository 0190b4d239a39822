"""The refiner's base transformer, scheduler and the whole image decoder path against in-test
references written from the published ``refiner_modules.py`` (``Transformer2DModel``,
``TransformerBlock``, ``RotaryPosEmbed``, ``FlowMatchEulerDiscreteScheduler``) and
``image_refiner.py`` (``RefinerPipeline._denoise_once``), with diffusers' ``AutoencoderKL``."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from einops import rearrange
from safetensors.torch import load_file, save_file

from omniflow.models.omni.checkpoint import CheckpointError, read_tensors
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_image_decoder import CODEBOOK, load_next_image_decoder
from omniflow.models.omni.next_refiner import PREFIX, schedule
from tests.models.omni.test_next_vit_decoder import _reference as vit_reference

F = torch.nn.functional


class Recorder(dict):
    """A state dict that remembers which names the reference read."""

    def __init__(self, tensors):
        super().__init__({k: v.double() for k, v in tensors.items()})
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("next-refiner") / "next", seed=4)


def _vdc(folder):
    return json.loads((folder / "config.json").read_text())["visual_decoder_config"]


def _file(folder):
    return load_file(str(folder / _vdc(folder)["weight_path"]))


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, axes):
    """x [T, H, D]: interleaved pairs as complex numbers, turned per axis by pos·10000^(-2i/d)."""
    turns = []
    for axis, d in enumerate(axes):
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = pos[:, axis, None].double() * freq
        turns.append(torch.polar(torch.ones_like(angle), angle))
    turn = torch.cat(turns, -1)[:, None]
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * turn).flatten(-2)


def _block(s, p, c, x, pos, temb):
    eps, heads, kv = c["norm_eps"], c["num_attention_heads"], c["num_kv_heads"]

    def lin(y, n):
        return y @ s[p + n + ".weight"].T + (s[p + n + ".bias"] if p + n + ".bias" in s else 0)

    if temb is None:
        h = _rms(x, s[p + "norm1.weight"], eps)
    else:
        sm, gm, sf, gf = lin(F.silu(temb), "norm1.linear").chunk(4, -1)
        h = _rms(x, s[p + "norm1.norm.weight"], eps) * (1 + sm)
    hd = c["hidden_size"] // heads
    q = _rms(lin(h, "attn.to_q").view(-1, heads, hd), s[p + "attn.norm_q.weight"], 1e-5)
    k = _rms(lin(h, "attn.to_k").view(-1, kv, hd), s[p + "attn.norm_k.weight"], 1e-5)
    v = lin(h, "attn.to_v").view(-1, kv, hd)
    q, k = _rope(q, pos, c["axes_dim_rope"]), _rope(k, pos, c["axes_dim_rope"])
    outs = []
    for head in range(heads):
        g = head // (heads // kv)
        outs.append(torch.softmax(q[:, head] @ k[:, g].T / math.sqrt(hd), -1) @ v[:, g])
    a = lin(torch.cat(outs, -1), "attn.to_out.0")

    def ff(y):
        return lin(
            F.silu(lin(y, "feed_forward.linear_1")) * lin(y, "feed_forward.linear_3"),
            "feed_forward.linear_2",
        )

    if temb is None:
        x = x + _rms(a, s[p + "norm2.weight"], eps)
        return x + _rms(ff(_rms(x, s[p + "ffn_norm1.weight"], eps)), s[p + "ffn_norm2.weight"], eps)
    x = x + gm.tanh() * _rms(a, s[p + "norm2.weight"], eps)
    f = ff(_rms(x, s[p + "ffn_norm1.weight"], eps) * (1 + sf))
    return x + gf.tanh() * _rms(f, s[p + "ffn_norm2.weight"], eps)


def _positions(start, rows, cols):
    return torch.tensor([[start, r, q] for r in range(rows) for q in range(cols)])


def reference_transformer(s, c, latent, t, caption, ref):
    """One image: latent [C, H, W], t a float, caption [L, text_dim], ref [C, H', W'] or None."""
    P, pt = c["patch_size"], PREFIX

    def lin(y, n):
        return y @ s[pt + n + ".weight"].T + s[pt + n + ".bias"]

    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    angle = c["timestep_scale"] * t * freqs
    temb = lin(
        F.silu(
            lin(
                torch.cat([angle.cos(), angle.sin()]),
                "time_caption_embed.timestep_embedder.linear_1",
            )
        ),
        "time_caption_embed.timestep_embedder.linear_2",
    )
    text = _rms(
        caption.double(), s[pt + "time_caption_embed.caption_embedder.0.weight"], c["norm_eps"]
    )
    text = lin(text, "time_caption_embed.caption_embedder.1")
    cap_len = text.shape[0]
    cap_pos = torch.arange(cap_len)[:, None].repeat(1, 3)
    for i in range(c["num_refiner_layers"]):
        text = _block(s, f"{pt}context_refiner.{i}.", c, text, cap_pos, None)
    pieces, positions, shift = [text], [cap_pos], cap_len
    if ref is not None:
        rh, rw = ref.shape[1] // P, ref.shape[2] // P
        r = rearrange(ref.double(), "c (h p1) (w p2) -> (h w) (p1 p2 c)", p1=P, p2=P)
        r = lin(r, "ref_image_patch_embedder") + s[pt + "image_index_embedding"][0]
        rpos = _positions(cap_len, rh, rw)
        for i in range(c["num_refiner_layers"]):
            r = _block(s, f"{pt}ref_image_refiner.{i}.", c, r, rpos, temb)
        pieces.append(r)
        positions.append(rpos)
        shift += max(rh, rw)
    h, w = latent.shape[1] // P, latent.shape[2] // P
    x = lin(
        rearrange(latent.double(), "c (h p1) (w p2) -> (h w) (p1 p2 c)", p1=P, p2=P), "x_embedder"
    )
    npos = _positions(shift, h, w)
    for i in range(c["num_refiner_layers"]):
        x = _block(s, f"{pt}noise_refiner.{i}.", c, x, npos, temb)
    joint, pos = torch.cat(pieces + [x]), torch.cat(positions + [npos])
    for i in range(c["num_layers"]):
        joint = _block(s, f"{pt}layers.{i}.", c, joint, pos, temb)
    joint = F.layer_norm(joint, joint.shape[-1:], eps=1e-6) * (
        1 + lin(F.silu(temb), "norm_out.linear_1")
    )
    out = lin(joint, "norm_out.linear_2")[-h * w :]
    return rearrange(out, "(h w) (p1 p2 c) -> c (h p1) (w p2)", h=h, w=w, p1=P, p2=P)


def test_refiner_transformer_matches_reference(folder):
    model = load_next_image_decoder(folder, "image_decoder").image_refiner.base_transformer
    c = _vdc(folder)["transformer_config"]
    s = Recorder({k: v for k, v in _file(folder).items() if k.startswith(PREFIX)})
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(2, 4, 6, 8, generator=g)
    ref = torch.randn(2, 4, 8, 6, generator=g)
    caption = torch.randn(2, 5, c["text_feat_dim"], generator=g)
    t = torch.tensor([0.25, 0.7])
    with torch.no_grad():
        with_ref = model(latent, t, caption, ref)
        without = model(latent, t, caption, None)
    for b in range(2):
        want = reference_transformer(s, c, latent[b], float(t[b]), caption[b], ref[b])
        torch.testing.assert_close(with_ref[b].double(), want, rtol=1e-4, atol=1e-4)
        want = reference_transformer(s, c, latent[b], float(t[b]), caption[b], None)
        torch.testing.assert_close(without[b].double(), want, rtol=1e-4, atol=1e-4)
    # The builder's file holds exactly the names the published forward reads (and
    # image_index_embedding's 5 rows, of which one image uses the first).
    assert s.read == set(s), sorted(set(s) - s.read)
    assert s[PREFIX + "image_index_embedding"].shape[0] == 5


@pytest.mark.parametrize(("steps", "tokens", "shift"), [(4, 192, True), (3, 48, False)])
def test_schedule_is_the_published_one(steps, tokens, shift):
    times = np.linspace(0, 1, steps + 1, dtype=np.float32)[:-1]
    if shift:
        m = np.sqrt(tokens) / 40
        times = times / (m - m * times + times)
    want = torch.cat([torch.from_numpy(np.asarray(times)).to(torch.float32), torch.ones(1)])
    assert torch.equal(schedule(steps, tokens, shift), want)


def _reference_latent(folder, codes, grid, steps, text_scale, image_scale, seed):
    """RefinerPipeline._denoise_once on decode_image's inputs, in float64 where ours is float32."""
    config = json.loads((folder / "config.json").read_text())
    vdc = config["visual_decoder_config"]
    tensors = _file(folder)
    books = read_tensors(folder, [CODEBOOK.format(i) for i in range(8)], "t")
    rows = sum(books[CODEBOOK.format(i)][codes[:, i]] for i in range(8))
    vit = {
        k.removeprefix("image_decoder."): v
        for k, v in tensors.items()
        if k.startswith("image_decoder.")
    }
    picture = vit_reference(vit, vdc["image_decoder_config"], rows, grid).float()
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
    img = torch.clamp((picture * std + mean) / (1 / 255) / 255.0, 0, 1)[None] * 2 - 1
    base = 16
    H, W = img.shape[-2:]
    target = (max(base, math.ceil(H / base) * base), max(base, math.ceil(W / base) * base))
    img = F.interpolate(img, size=target, mode="bilinear", align_corners=False)
    vae = AutoencoderKL(**vdc["vae_config"])
    vae.load_state_dict(
        {
            k.removeprefix("image_refiner.vae."): v
            for k, v in tensors.items()
            if k.startswith("image_refiner.vae.")
        }
    )
    with torch.no_grad():
        z = vae.eval().encode(img).latent_dist.sample(torch.Generator().manual_seed(seed + 1))
    ref = ((z - vae.config.shift_factor) * vae.config.scaling_factor)[0]
    x = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed))[0].double()
    caption = (
        rows.double() @ tensors["image_refiner.cond_proj.weight"].double().T
        + tensors["image_refiner.cond_proj.bias"].double()
    )
    s, c = Recorder(tensors), vdc["transformer_config"]
    times = np.linspace(0, 1, steps + 1, dtype=np.float32)[:-1]
    m = np.sqrt(ref.shape[1] * ref.shape[2]) / 40
    times = list(times / (m - m * times + times)) + [1.0]
    for i in range(steps):
        t = float(np.float32(times[i]))
        text = reference_transformer(s, c, x, t, caption, ref)
        ref_only = reference_transformer(s, c, x, t, torch.zeros_like(caption), ref)
        uncond = reference_transformer(s, c, x, t, torch.zeros_like(caption), None)
        v = uncond + image_scale * (ref_only - uncond) + text_scale * (text - ref_only)
        x = x + (float(np.float32(times[i + 1])) - t) * v
    return x


def test_codes_to_latent_matches_the_published_pipeline(folder):
    decoder = load_next_image_decoder(folder, "image_decoder")
    codes = torch.randint(0, 32, (6, 8), generator=torch.Generator().manual_seed(1))
    grid = (2, 3)
    latent = decoder.latent(codes, grid, steps=2, text_scale=2.0, seed=5, image_scale=1.5)
    want = _reference_latent(folder, codes, grid, 2, 2.0, 1.5, 5)
    assert latent.shape == (1, 4, 8, 12)  # 56 x 84 px rounded up to 64 x 96, / 8
    torch.testing.assert_close(latent[0].double(), want, rtol=2e-3, atol=2e-3)
    assert decoder.image_size(grid) == (64, 96)
    pixels = decoder.decode(codes, grid, 2, 2.0, 5)
    assert pixels.shape == (64, 96, 3) and int(pixels.max()) > int(pixels.min())


@pytest.mark.parametrize("damage", ["renamed", "missing", "extra", "misshaped"])
def test_decoder_file_loading_is_strict(folder, tmp_path, damage):
    copy = tmp_path / "next"
    shutil.copytree(folder, copy)
    path = copy / _vdc(folder)["weight_path"]
    tensors = load_file(str(path))
    name = PREFIX + "layers.0.attn.to_q.weight"
    named = name
    if damage == "renamed":
        tensors[PREFIX + "layers.0.attn.to_qq.weight"] = tensors.pop(name)
    elif damage == "missing":
        named = "image_decoder.norm_out.weight"
        del tensors[named]
    elif damage == "extra":
        named = "image_head.extra.weight"
        tensors[named] = torch.zeros(1)
    else:
        named = "image_refiner.cond_proj.weight"
        tensors[named] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as error:
        load_next_image_decoder(copy, "image_decoder")
    assert named in str(error.value) and "role image_decoder" in str(error.value)
    assert str(copy) in str(error.value)
