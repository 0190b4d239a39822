"""The published ViT decoder (``image_decoder.*``) against an in-test reference forward written
from ``modular_longcat_next_visual.py``'s ``VisionTransformerDecoder`` equations."""

from __future__ import annotations

import pytest
import torch

from omniflow.models.omni.next_vit_decoder import VisionTransformerDecoder


def _config(swiglu: bool, subln: bool) -> dict:
    return {
        "hidden_size": 16,
        "num_attention_heads": 2,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "layer_norm_eps": 1e-6,
        "patch_size": 2,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "codebook_dim": 8,
        "swiglu": swiglu,
        "subln": subln,
        "hidden_act": "gelu",
        "k_bias": False,
    }


def _rms(x, weight, eps):
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)


def _rope(x, pos):
    """Pairs (2i, 2i+1) as complex numbers turned by pos / 10000^(2i/d)."""
    d = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None] * freq)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * turn).flatten(-2)


def _reference(state, c, emb, grid):
    s = {k: v.double() for k, v in state.items()}
    eps, heads, dim = c["layer_norm_eps"], c["num_attention_heads"], c["hidden_size"]

    def lin(x, name):
        out = x @ s[name + ".weight"].T
        return out + s[name + ".bias"] if name + ".bias" in s else out

    x = _rms(lin(emb.double(), "post_quant_conv"), s["post_quant_norm.weight"], eps)
    x = _rms(x, s["patch_unmerger.ln_q.weight"], 1e-6)
    x = lin(torch.nn.functional.gelu(lin(x, "patch_unmerger.mlp.0")), "patch_unmerger.mlp.2")
    x = _rms(x.reshape(-1, dim), s["norm_in.weight"], eps)
    h, w = grid
    width = 2 * w
    pos = torch.tensor([[i // width, i % width] for i in range(x.shape[0])], dtype=torch.float64)
    hd = dim // heads
    for layer in range(c["num_hidden_layers"]):
        p = f"encoder.layers.{layer}."
        y = _rms(x, s[p + "layer_norm1.weight"], eps)
        outs = []
        for head in range(heads):
            cut = slice(head * hd, (head + 1) * hd)
            q, k, v = (lin(y, p + f"self_attn.{n}_proj")[:, cut] for n in "qkv")
            q = torch.cat(
                [_rope(q[:, : hd // 2], pos[:, 0]), _rope(q[:, hd // 2 :], pos[:, 1])], -1
            )
            k = torch.cat(
                [_rope(k[:, : hd // 2], pos[:, 0]), _rope(k[:, hd // 2 :], pos[:, 1])], -1
            )
            outs.append(torch.softmax(q @ k.T / hd**0.5, -1) @ v)
        a = torch.cat(outs, -1)
        if c["subln"]:
            a = _rms(a, s[p + "self_attn.inner_attn_ln.weight"], eps)
        x = x + lin(a, p + "self_attn.out_proj")
        y = _rms(x, s[p + "layer_norm2.weight"], eps)
        if c["swiglu"]:
            inner = torch.nn.functional.silu(lin(y, p + "mlp.w1")) * lin(y, p + "mlp.w2")
            last = "mlp.w3"
        else:
            inner, last = torch.nn.functional.gelu(lin(y, p + "mlp.fc1")), "mlp.fc2"
        if c["subln"]:
            inner = _rms(inner, s[p + "mlp.ffn_ln.weight"], eps)
        x = x + lin(inner, p + last)
    x = _rms(x, s["norm_out.weight"], eps)
    patches = lin(torch.nn.functional.gelu(lin(x, "decoder_head.0")), "decoder_head.2")
    ps = c["patch_size"]
    image = torch.zeros(3, h * 2 * ps, w * 2 * ps, dtype=torch.float64)
    for index, row in enumerate(patches):  # merge windows in order, 2 x 2 patches in each
        token, inside = divmod(index, 4)
        ty, tx = divmod(token, w)
        my, mx = divmod(inside, 2)
        block = row.reshape(3, c["temporal_patch_size"], ps, ps)[:, 0]
        y0, x0 = (2 * ty + my) * ps, (2 * tx + mx) * ps
        image[:, y0 : y0 + ps, x0 : x0 + ps] = block
    return image


@pytest.mark.parametrize(("swiglu", "subln"), [(True, True), (False, False)])
def test_vit_decoder_matches_reference(swiglu, subln):
    c = _config(swiglu, subln)
    torch.manual_seed(0)
    decoder = VisionTransformerDecoder(c)
    with torch.no_grad():
        for p in decoder.parameters():
            p.normal_(0, 0.3)
    grid = (2, 3)
    emb = torch.randn(6, c["codebook_dim"])
    image = decoder(emb, grid)
    assert image.shape == (3, 8, 12)
    expected = _reference(decoder.state_dict(), c, emb, grid)
    torch.testing.assert_close(image.double(), expected, rtol=1e-4, atol=1e-4)


def test_vit_decoder_names_are_the_published_ones():
    """The names of ``VisionTransformerDecoder``'s modules in modular_longcat_next_visual.py."""
    names = set(VisionTransformerDecoder(_config(True, True)).state_dict())
    layer = {
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.inner_attn_ln.weight",
        "self_attn.out_proj.weight",
        "self_attn.out_proj.bias",
        "layer_norm1.weight",
        "layer_norm2.weight",
        "mlp.w1.weight",
        "mlp.w1.bias",
        "mlp.w2.weight",
        "mlp.w2.bias",
        "mlp.w3.weight",
        "mlp.w3.bias",
        "mlp.ffn_ln.weight",
    }
    top = {
        "post_quant_conv.weight",
        "post_quant_conv.bias",
        "post_quant_norm.weight",
        "patch_unmerger.ln_q.weight",
        "norm_in.weight",
        "norm_out.weight",
    }
    top |= {
        f"{m}.{i}.{k}"
        for m in ("patch_unmerger.mlp", "decoder_head")
        for i in (0, 2)
        for k in ("weight", "bias")
    }
    assert names == top | {f"encoder.layers.{i}.{n}" for i in range(2) for n in layer}
