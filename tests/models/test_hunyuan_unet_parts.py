"""HunyuanImage-3's diffusion-side modules against second implementations, on tiny random
weights under the published names:

- an in-test functional reference written from the release's ``hunyuan_image_3/hunyuan.py``
  equations (``timestep_embedding``, ``TimestepEmbedder``, ``ResBlock`` with adaptive group
  norm, ``UNetDown``, ``UNetUp(out_norm=True)``), reading the raw tensors by name;
- diffusers' ``get_timestep_embedding`` + ``TimestepEmbedding`` and ``ResnetBlock2D``
  (``time_embedding_norm="scale_shift"``), which compute the same functions, loaded from
  the same tensors under their own names.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import TimestepEmbedding, get_timestep_embedding
from diffusers.models.resnet import ResnetBlock2D

from omniflow.models.hunyuan_image3.config import HunyuanImage3Config
from omniflow.models.hunyuan_image3.parts import HunyuanImage3Parts, load_image_parts
from omniflow.models.tiny.hunyuan_image3 import TINY_HUNYUAN_IMAGE3, build_tiny_hunyuan_image3

TIMES = torch.tensor([0.0, 1.0, 37.5, 999.0])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_hunyuan_image3(tmp_path_factory.mktemp("unet") / "tiny", seed=11)


def randomised(patch_size: int) -> tuple[HunyuanImage3Parts, dict[str, torch.Tensor]]:
    """Parts at a patch size with every tensor random (the release zero-initialises some
    convs; random ones exercise every term)."""
    raw = dict(TINY_HUNYUAN_IMAGE3, patch_size=patch_size)
    parts = HunyuanImage3Parts(HunyuanImage3Config.from_dict(raw))
    generator = torch.Generator().manual_seed(patch_size)
    state = {
        name: torch.randn(t.shape, generator=generator) * (0.3 if t.dim() > 1 else 1.0)
        for name, t in parts.state_dict().items()
    }
    parts.load_state_dict(state, strict=True)
    return parts.eval(), state


# --- the reference, from the release's equations -------------------------------------------


def ref_frequencies(t, dim=256, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half).float() / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def ref_timestep_embedder(w, p, t):
    h = F.linear(ref_frequencies(t), w[f"{p}.mlp.0.weight"], w[f"{p}.mlp.0.bias"])
    return F.linear(F.gelu(h), w[f"{p}.mlp.2.weight"], w[f"{p}.mlp.2.bias"])


def ref_resblock(w, p, x, emb, up=False, down=False):
    """ResBlock: in_layers (GroupNorm(32), SiLU, [resample], conv3x3), emb_layers (SiLU,
    Linear -> scale, shift), out_layers (GroupNorm * (1 + scale) + shift, SiLU, conv3x3),
    skip (identity or 1x1 conv) of the resampled input."""

    def resample(v):
        if up:
            return F.interpolate(v, scale_factor=2, mode="nearest")
        return F.avg_pool2d(v, kernel_size=2, stride=2) if down else v

    h = F.group_norm(x, 32, w[f"{p}.in_layers.0.weight"], w[f"{p}.in_layers.0.bias"])
    h = resample(F.silu(h))
    x = resample(x)
    h = F.conv2d(h, w[f"{p}.in_layers.2.weight"], w[f"{p}.in_layers.2.bias"], padding=1)
    e = F.linear(F.silu(emb), w[f"{p}.emb_layers.1.weight"], w[f"{p}.emb_layers.1.bias"])
    scale, shift = e[..., None, None].chunk(2, dim=1)
    h = F.group_norm(h, 32, w[f"{p}.out_layers.0.weight"], w[f"{p}.out_layers.0.bias"])
    h = h * (1.0 + scale) + shift
    h = F.conv2d(F.silu(h), w[f"{p}.out_layers.3.weight"], w[f"{p}.out_layers.3.bias"], padding=1)
    skip = f"{p}.skip_connection.weight"
    if skip in w:
        x = F.conv2d(x, w[skip], w[f"{p}.skip_connection.bias"])
    return x + h


def ref_patch_embed(w, patch, latent, t):
    """UNetDown: conv3x3, then one ResBlock (patch 1) or patch // 2 down ResBlocks; rows in
    (h w) order. Its time embedding is time_embed's."""
    emb = ref_timestep_embedder(w, "time_embed", t)
    x = F.conv2d(latent, w["patch_embed.model.0.weight"], w["patch_embed.model.0.bias"], padding=1)
    for i in range(1, 2 if patch == 1 else patch // 2 + 1):
        x = ref_resblock(w, f"patch_embed.model.{i}", x, emb, down=patch > 1)
    b, c, h, wd = x.shape
    return x.reshape(b, c, h * wd).transpose(1, 2), (h, wd)


def ref_final_layer(w, patch, rows, t, grid):
    """UNetUp (out_norm): ResBlock(s) (up for patch > 1), then GroupNorm, SiLU, conv3x3. Its
    time embedding is time_embed_2's."""
    emb = ref_timestep_embedder(w, "time_embed_2", t)
    x = rows.transpose(1, 2).reshape(rows.shape[0], rows.shape[2], *grid)
    blocks = 1 if patch == 1 else patch // 2
    for i in range(blocks):
        x = ref_resblock(w, f"final_layer.model.{i}", x, emb, up=patch > 1)
    p = f"final_layer.model.{blocks}"
    x = F.silu(F.group_norm(x, 32, w[f"{p}.0.weight"], w[f"{p}.0.bias"]))
    return F.conv2d(x, w[f"{p}.2.weight"], w[f"{p}.2.bias"], padding=1)


def folder_tensors(parts):
    return {k: v.detach() for k, v in parts.state_dict().items()}


def test_timestep_embedders_match_the_reference_and_diffusers(folder):
    parts = load_image_parts(folder)
    w = folder_tensors(parts)
    hidden = parts.config.hidden_size
    for name in ("timestep_emb", "time_embed", "time_embed_2"):
        ours = getattr(parts, name)(TIMES)
        torch.testing.assert_close(ours, ref_timestep_embedder(w, name, TIMES))
        theirs = TimestepEmbedding(256, hidden, act_fn="gelu")
        theirs.load_state_dict(
            {
                "linear_1.weight": w[f"{name}.mlp.0.weight"],
                "linear_1.bias": w[f"{name}.mlp.0.bias"],
                "linear_2.weight": w[f"{name}.mlp.2.weight"],
                "linear_2.bias": w[f"{name}.mlp.2.bias"],
            }
        )
        freqs = get_timestep_embedding(TIMES, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
        torch.testing.assert_close(ours, theirs(freqs))
    # The <timestep> row the roles use is timestep_emb's.
    torch.testing.assert_close(
        parts.timestep_row(37.5), ref_timestep_embedder(w, "timestep_emb", TIMES[2:3])
    )


@pytest.mark.parametrize("patch", [1, 2, 4])
def test_patch_embed_and_final_layer_match_the_reference(patch):
    parts, w = randomised(patch)
    latent = torch.randn(2, parts.config.latent_channels, 8, 12)
    t = torch.tensor([250.0, 900.0])
    rows, h, wd = parts.patch_embed(latent, parts.time_embed(t))
    want, grid = ref_patch_embed(w, patch, latent, t)
    assert (h, wd) == grid == (8 // patch, 12 // patch)
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)
    hidden = torch.randn(2, h * wd, parts.config.hidden_size)
    out = parts.final_layer(hidden, parts.time_embed_2(t), h, wd)
    torch.testing.assert_close(
        out, ref_final_layer(w, patch, hidden, t, grid), rtol=1e-4, atol=1e-4
    )
    assert out.shape == latent.shape


def test_the_roles_entry_points_match_the_reference(folder):
    """image_rows (a latent at time t -> its rows) and velocity (rows -> prediction) as the
    ar and diffusion roles call them, on the folder's weights."""
    parts = load_image_parts(folder)
    w = folder_tensors(parts)
    latent = torch.randn(parts.config.latent_channels, 4, 6)
    want, grid = ref_patch_embed(w, 1, latent[None], torch.tensor([600.0]))
    torch.testing.assert_close(parts.image_rows(latent, 600.0), want[0], rtol=1e-4, atol=1e-4)
    hidden = torch.randn(3, 24, parts.config.hidden_size)
    want = ref_final_layer(w, 1, hidden, torch.full((3,), 600.0), grid)
    torch.testing.assert_close(parts.velocity(hidden, 600.0, grid), want, rtol=1e-4, atol=1e-4)


def diffusers_resblock(w, p, channels, out, emb, up=False, down=False):
    block = ResnetBlock2D(
        in_channels=channels,
        out_channels=out,
        temb_channels=emb,
        groups=32,
        eps=1e-5,  # nn.GroupNorm's default, which the release uses
        time_embedding_norm="scale_shift",
        up=up,
        down=down,
    )
    names = {
        "norm1": "in_layers.0",
        "conv1": "in_layers.2",
        "time_emb_proj": "emb_layers.1",
        "norm2": "out_layers.0",
        "conv2": "out_layers.3",
        "conv_shortcut": "skip_connection",
    }
    state = {}
    for key in block.state_dict():
        module, leaf = key.rsplit(".", 1)
        state[key] = w[f"{p}.{names[module]}.{leaf}"]
    block.load_state_dict(state, strict=True)
    return block.eval()


@pytest.mark.parametrize("patch", [1, 2])
def test_resblocks_match_diffusers_resnet_block_scale_shift(patch):
    parts, w = randomised(patch)
    hidden, width = parts.config.hidden_size, parts.config.patch_embed_hidden_dim
    t = torch.tensor([120.0, 880.0])
    emb = parts.time_embed(t)
    x = torch.randn(2, width, 8, 8)
    block = diffusers_resblock(w, "patch_embed.model.1", width, hidden, hidden, down=patch > 1)
    torch.testing.assert_close(
        parts.patch_embed.model[1](x, emb), block(x, emb), rtol=1e-4, atol=1e-4
    )
    y = torch.randn(2, hidden, 4, 4)
    block = diffusers_resblock(w, "final_layer.model.0", hidden, width, hidden, up=patch > 1)
    torch.testing.assert_close(
        parts.final_layer.model[0](y, emb), block(y, emb), rtol=1e-4, atol=1e-4
    )
