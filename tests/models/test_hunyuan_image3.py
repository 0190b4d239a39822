"""The tiny HunyuanImage-3 family: build and load through the real loaders, the backbone
against a plain re-implementation of the reference's layer over the raw checkpoint tensors,
2D rotary, the sequence helpers and flow matching."""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from omniflow.models import load_decoder, load_tokenizer
from omniflow.models.flow_matching import euler_step, shifted_sigmas
from omniflow.models.hunyuan_image3.model import HunyuanImage3LM
from omniflow.models.hunyuan_image3.parts import load_image_parts
from omniflow.models.hunyuan_image3.tokens import (
    NUM_RATIOS,
    ImageTokens,
    context_ids,
    grid_of_ratio,
    image_block,
    image_sequence,
    ratio_grids,
    ratio_of_size,
    unconditional_ids,
)
from omniflow.models.llama.decoder import causal_attention
from omniflow.models.loader import checkpoint_files
from omniflow.models.tiny.hunyuan_image3 import build_tiny_hunyuan_image3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_hunyuan_image3(tmp_path_factory.mktemp("hunyuan") / "tiny", seed=3)


def raw_tensors(folder):
    tensors = {}
    for file in checkpoint_files(folder):
        tensors |= load_file(str(file))
    return tensors


def test_build_is_deterministic_sharded_and_has_the_special_tokens(folder, tmp_path):
    files = checkpoint_files(folder)
    assert len(files) > 1 and (folder / "model.safetensors.index.json").is_file()
    again = build_tiny_hunyuan_image3(tmp_path / "again", seed=3)
    assert [f.read_bytes() for f in files] == [f.read_bytes() for f in checkpoint_files(again)]
    other = build_tiny_hunyuan_image3(tmp_path / "other", seed=4)
    assert files[0].read_bytes() != checkpoint_files(other)[0].read_bytes()
    tokens = ImageTokens.from_tokenizer(load_tokenizer(folder))
    ids = {tokens.boi, tokens.eoi, tokens.img, tokens.timestep, tokens.cfg, *tokens.ratios}
    assert len(ids) == 5 + NUM_RATIOS and len(tokens.sizes) == 3
    model = load_decoder(folder, "cpu")
    assert max(ids | set(tokens.sizes.values())) < model.config.vocab_size


def reference_rope(x, positions, theta):
    """The reference's build_2d_rope frequencies (theta reshaped [d/4, 2]: y, x) applied to
    x [T, heads, d] at positions [T, 2], rotate-half layout."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    angles = (positions[:, None, :].float() * inv.reshape(1, d // 4, 2)).reshape(-1, d // 2)
    angles = angles.repeat(1, 2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    half = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
    return x * cos + half * sin


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_forward(t, config, ids, positions):
    """A causal forward written from the reference's modules, over the raw tensors."""
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps, groups = config.rms_norm_eps, heads // kv
    x = t["model.wte.weight"][ids]
    n = len(ids)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"], eps)
        qkv = (h @ t[p + "self_attn.qkv_proj.weight"].T).reshape(n, kv, groups + 2, d)
        q = qkv[:, :, :groups].reshape(n, heads, d)
        k, v = qkv[:, :, groups], qkv[:, :, groups + 1]
        q = reference_rope(q, positions, config.rope_theta)
        k = reference_rope(k, positions, config.rope_theta)
        q = rms(q, t[p + "self_attn.query_layernorm.weight"], eps)
        k = rms(k, t[p + "self_attn.key_layernorm.weight"], eps)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        x = x + att.transpose(0, 1).reshape(n, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"], eps)

        def mlp(name, rows):
            up, gate = (rows @ t[f"{name}.gate_and_up_proj.weight"].T).chunk(2, dim=-1)
            return (up * F.silu(gate)) @ t[f"{name}.down_proj.weight"].T

        gates = (h @ t[p + "mlp.gate.wg.weight"].T).softmax(-1)
        weight, chosen = gates.topk(config.num_experts_per_tok, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = mlp(p + "mlp.shared_mlp", h)
        for row in range(n):
            for w, e in zip(weight[row], chosen[row], strict=True):
                out[row] += w * mlp(f"{p}mlp.experts.{int(e)}", h[row : row + 1])[0]
        x = x + out
    return x  # before ln_f


def test_backbone_matches_the_reference_layer_over_the_raw_tensors(folder):
    model = load_decoder(folder, "cpu")
    assert isinstance(model, HunyuanImage3LM)
    config = model.config
    assert config.n_routed_experts == 4 and config.num_experts_per_tok == 2
    ids = torch.tensor([1, 40, 77, 5, 300, 9, 12, 8])
    block = image_block(3, (2, 2))  # text, then a timestep and a 2x2 image: 2D positions
    positions = torch.cat((torch.arange(3)[:, None].expand(3, 2), block.positions))
    tensors = raw_tensors(folder)
    with torch.inference_mode():
        ours = model.hidden_states(model.embed(ids), positions)
        expected = reference_forward(tensors, config, ids, positions)
        # Block rows (the image's) come back before ln_f, as the reference's final_layer reads.
        raw = model(ids, positions, causal_attention, hidden=True, unnormed_from=3)
    normed = rms(expected, tensors["model.ln_f.weight"], config.rms_norm_eps)
    torch.testing.assert_close(ours, normed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(raw[:3], normed[:3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(raw[3:], expected[3:], atol=1e-4, rtol=1e-4)


def test_2d_rotary_reduces_to_1d_for_text_and_its_axes_differ(folder):
    model = load_decoder(folder, "cpu")
    rotary = model.rotary
    p = torch.arange(40)
    for one, two in zip(
        rotary.cos_sin(p, torch.float32),
        rotary.cos_sin(torch.stack((p, p), 1), torch.float32),
        strict=True,
    ):
        assert torch.equal(one, two)
    yx = torch.tensor([[3, 9], [9, 3]])
    cos, _ = rotary.cos_sin(yx, torch.float32)
    assert not torch.equal(cos[0], cos[1])


def test_image_parts_load_and_run(folder):
    parts = load_image_parts(folder)
    raw = raw_tensors(folder)
    for name, tensor in parts.state_dict().items():
        assert torch.equal(tensor, raw[name]), name
    latent = torch.randn(32, 3, 5, generator=torch.Generator().manual_seed(0))
    rows = parts.image_rows(latent, 500.0)
    assert rows.shape == (15, 64)
    assert parts.velocity(rows, 500.0, (3, 5)).shape == (32, 3, 5)
    assert not torch.equal(parts.image_rows(latent, 10.0), rows)  # timestep-conditioned
    image = parts.decode_image(latent)
    assert image.shape == (48, 80, 3) and image.dtype == torch.uint8
    assert parts.encode_image(image).shape == (32, 3, 5)
    # SigLIP2: a 3 x 5 patch grid within 16, padded to the processor's 16 (max_num_patches)
    assert parts.vision_model.patch_grid(48, 80) == (3, 5)
    assert parts.vit_rows(image).shape == (16, 64)
    assert parts.timestep_row(0.0).shape == (1, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        parts.encode_image(torch.zeros(20, 32, 3, dtype=torch.uint8))


def test_sequence_layout_ratios_and_positions(folder):
    config = load_decoder(folder, "cpu").config
    tokens = ImageTokens.from_tokenizer(load_tokenizer(folder))
    grids = ratio_grids(config)
    assert len(grids) == NUM_RATIOS and grids[16] == (16, 16)  # 256 px at 16 px a token
    assert grids[0] == (8, 32) and grids[-1] == (32, 8)
    ratios = [h / w for h, w in grids]
    assert ratios == sorted(ratios)
    for index in (0, 7, 16, 30):
        assert ratio_of_size(config, *grid_of_ratio(config, index)) == index
    prompt = [40, 41, 42]
    context = context_ids(tokens, prompt, 256, 16)
    assert context == [tokens.bos, *prompt, tokens.boi, tokens.sizes[256], tokens.ratios[16]]
    full = image_sequence(tokens, prompt, 256, 16, (2, 3))
    assert full[len(context)] == tokens.timestep and full[-1] == tokens.eoi
    assert full[len(context) + 1 : -1] == [tokens.img] * 6
    assert unconditional_ids(tokens, prompt) == [tokens.cfg] * 3
    # The reference's meshgrid: start + (w*h - h)/2 + i, start + (w*h - w)/2 + j, floored.
    block = image_block(len(context), (2, 3))
    start, (h, w) = len(context) + 1, (2, 3)
    ys = torch.linspace(start + (w * h - h) / 2, start + (w * h - h) / 2 + h, h + 1)[:h]
    xs = torch.linspace(start + (w * h - w) / 2, start + (w * h - w) / 2 + w, w + 1)[:w]
    grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij")).reshape(2, -1).T.long()
    assert block.positions[0].tolist() == [len(context)] * 2
    assert torch.equal(block.positions[1:], grid)


def test_flow_matching_sigmas_and_euler():
    sigmas = shifted_sigmas(8)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert torch.all(sigmas[1:] < sigmas[:-1])
    t = 0.25
    assert math.isclose(float(shifted_sigmas(4)[3]), 3 * t / (1 + 2 * t), rel_tol=1e-6)
    x0, noise = torch.randn(4, 2, 2), torch.randn(4, 2, 2)
    x = noise
    for i in range(8):  # the exact velocity takes noise to x0
        x = euler_step(x, noise - x0, float(sigmas[i]), float(sigmas[i + 1]))
    torch.testing.assert_close(x, x0)
    with pytest.raises(ValueError, match="steps"):
        shifted_sigmas(0)


def test_moe_runs_each_expert_on_its_rows_as_the_padded_batch_does(folder):
    """CPU runs each routed expert over its own rows; the padded batched matmul (the GPU's
    path) computes the same rows, whatever the routing's imbalance."""
    model = load_decoder(folder, "cpu")
    moe = model.model.layers[0].mlp
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        weights, ids = moe.route(x)
        flat = ids.view(-1)
        order = flat.argsort(stable=True)
        experts = flat[order]
        counts = torch.bincount(flat, minlength=moe.num_experts)
        places = torch.arange(len(flat)) - (counts.cumsum(0) - counts)[experts]
        grouped = x.index_select(0, order // moe.top_k)
        padded = moe._experts(grouped, experts, places, int(counts.max()))
        by_group = moe._experts_by_group(grouped, counts)
    assert int(counts.max()) > int(counts.min())  # uneven: the padded path pads
    torch.testing.assert_close(by_group, padded, atol=1e-5, rtol=1e-5)
