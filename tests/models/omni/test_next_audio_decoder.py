"""LongCat-Next's audio decoder against the published layout and equations.

Source: the checkpoint's ``modular_longcat_next_audio.py`` (meituan-longcat/LongCat-Next; read
in a public adapted copy): ``LongcatNextAudioVQBridger.decode``, ``CasualConvTranspose1d``,
``OmniWhisperTransformerLayer``, ``MelSpecRefineNet``, ``LongcatNextAudioDecoder``,
``FlowmatchingPrenet``, ``ConditionalDecoder`` (+ ``CausalResnetBlock1D``, ``CausalBlock1D``,
``BasicTransformerBlock``, ``TimestepEmbedding``, ``SinusoidalPosEmb``), ``ConditionalCFM``
and ``LongcatNextAudioTokenizer.decode``. The names below are written from those module
definitions; the published tensor counts per part (149 / 163 / 910) are from an inventory of
the published ``model.safetensors.index.json``. The reference forward is a float64
transcription of those classes' forwards, written here independently of the implementation.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniflow.models.omni.checkpoint import INDEX_FILE, CheckpointError
from omniflow.models.omni.next_audio_decoder import NextAudioDecoder, load_next_audio_decoder
from omniflow.models.omni.next_builder import build_tiny_next, tiny_config

F = torch.nn.functional
A = "model.audio_tokenizer."


# ---- published names and shapes -----------------------------------------------------------


def _whisper_layer(p: str, d: int, ffn: int, rms: bool) -> dict[str, tuple[int, ...]]:
    n = {f"{p}self_attn.k_proj.weight": (d, d)}
    for proj in ("q_proj", "v_proj", "out_proj"):
        n |= {f"{p}self_attn.{proj}.weight": (d, d), f"{p}self_attn.{proj}.bias": (d,)}
    n |= {f"{p}fc1.weight": (ffn, d), f"{p}fc1.bias": (ffn,)}
    n |= {f"{p}fc2.weight": (d, ffn), f"{p}fc2.bias": (d,)}
    for norm in ("self_attn_layer_norm", "final_layer_norm"):
        n[f"{p}{norm}.weight"] = (d,)
        if not rms:
            n[f"{p}{norm}.bias"] = (d,)
    return n


def _deconv(p: str, cin: int, cout: int, k: int) -> dict[str, tuple[int, ...]]:
    return {
        p + "conv.weight": (cin, cout, k),
        p + "conv.bias": (cout,),
        p + "norm.weight": (cout,),
        p + "norm.bias": (cout,),
    }


def decoder_names(ac) -> dict[str, tuple[int, ...]]:
    """``LongcatNextAudioDecoder``'s state dict (names → shapes) for ``audio_config`` ac."""
    d, k = ac["d_model"], ac["decoder_kernel_size"]
    mels = ac["vocoder_config"]["num_mel_bins"]
    rows = ac["max_audio_seconds"] * ac["sampling_rate"] // ac["hop_length"]
    n = _deconv("dconv1.", d, d, k) | {"positional_embedding": (rows, d)}
    for i in range(ac["decoder_layers"]):
        n |= _whisper_layer(f"layers.{i}.", d, ac["decoder_ffn_dim"], rms=False)
    n |= {"layer_norm.weight": (d,), "layer_norm.bias": (d,)} | _deconv("dconv2.", d, mels, k)
    width, j = mels, 0
    for out in ac["vocoder_config"]["channels"][:-1]:
        n |= {f"post_net.layers.{j}.weight": (out, width, 5), f"post_net.layers.{j}.bias": (out,)}
        n |= {f"post_net.layers.{j + 1}.weight": (out,), f"post_net.layers.{j + 1}.bias": (out,)}
        width, j = out, j + 3
    n |= {f"post_net.layers.{j}.weight": (mels, width, 1), f"post_net.layers.{j}.bias": (mels,)}
    return n


def _resnet(p: str, din: int, dout: int, tdim: int) -> dict[str, tuple[int, ...]]:
    n = {p + "mlp.1.weight": (dout, tdim), p + "mlp.1.bias": (dout,)}
    for b, cin in (("block1", din), ("block2", dout)):
        n |= {f"{p}{b}.block.0.weight": (dout, cin, 3), f"{p}{b}.block.0.bias": (dout,)}
        n |= {f"{p}{b}.block.2.weight": (dout,), f"{p}{b}.block.2.bias": (dout,)}
    return n | {p + "res_conv.weight": (dout, din, 1), p + "res_conv.bias": (dout,)}


def _tblock(p: str, dim: int, fc) -> dict[str, tuple[int, ...]]:
    inner = fc["num_heads"] * fc["attention_head_dim"]
    n = {f"{p}{x}.{t}": (dim,) for x in ("norm1", "norm3") for t in ("weight", "bias")}
    n |= {f"{p}attn1.to_{x}.weight": (inner, dim) for x in ("q", "k", "v")}
    n |= {p + "attn1.to_out.0.weight": (dim, inner), p + "attn1.to_out.0.bias": (dim,)}
    n |= {p + "ff.net.0.proj.weight": (4 * dim, dim), p + "ff.net.0.proj.bias": (4 * dim,)}
    return n | {p + "ff.net.2.weight": (dim, 4 * dim), p + "ff.net.2.bias": (dim,)}


def _stage(p: str, din: int, dout: int, tdim: int, fc, resample: str | None):
    n = _resnet(p + "0.", din, dout, tdim)
    for j in range(fc["n_blocks"]):
        n |= _tblock(f"{p}1.{j}.", dout, fc)
    if resample == "causal":
        n |= {p + "2.weight": (dout, dout, 3), p + "2.bias": (dout,)}
    elif resample is not None:  # Downsample1D conv / Upsample1D conv-transpose
        n |= {p + "2.conv.weight": (dout, dout, 3 if resample == "down" else 4)}
        n |= {p + "2.conv.bias": (dout,)}
    return n


def flow_names(fc) -> dict[str, tuple[int, ...]]:
    """``LongcatNextAudioFlowMatchingDecoder``'s state dict (prenet + conditional_decoder)."""
    pd = fc["prenet_d_model"]
    n = {"prenet.positional_embedding": (fc["prenet_max_source_positions"], pd)}
    n |= {
        "prenet.in_mlp.0.weight": (4 * pd, fc["prenet_in_dim"]),
        "prenet.in_mlp.0.bias": (4 * pd,),
    }
    n |= {"prenet.in_mlp.2.weight": (pd, 4 * pd), "prenet.in_mlp.2.bias": (pd,)}
    for i in range(fc["prenet_nlayers"]):
        n |= _whisper_layer(f"prenet.transformer_layers.{i}.", pd, fc["prenet_ffn_dim"], rms=True)
    n |= {"prenet.final_norm.weight": (pd,), "prenet.out_proj.weight": (fc["prenet_out_dim"], pd)}
    c, mels = "conditional_decoder.", fc["in_channels"]
    ch = list(fc["channels"])
    width, tdim = 2 * mels + fc["spk_emb_dim"], 4 * ch[0]
    n |= {c + "time_mlp.linear_1.weight": (tdim, width), c + "time_mlp.linear_1.bias": (tdim,)}
    n |= {c + "time_mlp.linear_2.weight": (tdim, tdim), c + "time_mlp.linear_2.bias": (tdim,)}
    out = width
    for i, x in enumerate(ch):
        last = i == len(ch) - 1
        n |= _stage(f"{c}down_blocks.{i}.", out, x, tdim, fc, "causal" if last else "down")
        out = x
    for i in range(fc["num_mid_blocks"]):
        n |= _stage(f"{c}mid_blocks.{i}.", out, out, tdim, fc, None)
    ups = ch[::-1] + [ch[0]]
    for i in range(len(ups) - 1):
        last = i == len(ups) - 2
        kind = "causal" if last else "up"
        n |= _stage(f"{c}up_blocks.{i}.", 2 * ups[i], ups[i + 1], tdim, fc, kind)
    n |= {c + "final_block.block.0.weight": (ups[-1], ups[-1], 3)}
    n |= {c + "final_block.block.0.bias": (ups[-1],), c + "final_block.block.2.weight": (ups[-1],)}
    n |= {c + "final_block.block.2.bias": (ups[-1],)}
    return n | {c + "final_proj.weight": (mels, ups[-1], 1), c + "final_proj.bias": (mels,)}


def published_names(config) -> dict[str, tuple[int, ...]]:
    """Every audio-decoder tensor (full names → shapes) of a published-layout checkpoint."""
    ac = config["audio_config"]
    n = {A + "audio_decoder." + k: v for k, v in decoder_names(ac).items()}
    n |= {
        A + "audio_flow_matching_decoder." + k: v
        for k, v in flow_names(ac["flow_matching_config"]).items()
    }
    return n


def test_name_lists_give_the_published_tensor_counts():
    """With the published layer counts the lists hold as many tensors as the published index
    does under each prefix (149, 163, 910)."""
    ac = copy.deepcopy(tiny_config()["audio_config"])
    ac["decoder_layers"] = 8
    ac["vocoder_config"]["channels"] = [64] * 5
    fc = ac["flow_matching_config"]
    fc |= {"prenet_nlayers": 12, "n_blocks": 4, "num_mid_blocks": 12, "channels": [256]}
    flow = flow_names(fc)
    assert len(decoder_names(ac)) == 149
    assert sum(k.startswith("prenet.") for k in flow) == 163
    assert sum(k.startswith("conditional_decoder.") for k in flow) == 910


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("next-audio-dec") / "next", seed=6)


def _all(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_builder_writes_exactly_the_published_names_and_shapes(folder):
    config = json.loads((folder / "config.json").read_text())
    stored = _all(folder)
    ours = {
        k: tuple(t.shape)
        for k, t in stored.items()
        if k.startswith((A + "audio_decoder.", A + "audio_flow_matching_decoder."))
    }
    assert ours == published_names(config)
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert set(ours) <= set(index)


# ---- the published forward, float64 ---------------------------------------------------------


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _mish(x):
    return x * torch.tanh(F.softplus(x))


def _ln(x, w, b, eps=1e-5):
    """LayerNorm over the last axis."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _lin(x, sd, p, bias=True):
    y = x @ sd[p + ".weight"].t()
    return y + sd[p + ".bias"] if bias else y


def _softmax_attention(q, k, v, bias):
    """q, k, v [H, T, hd]; bias [T, T] added to the scores."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(scores, -1) @ v


def _causal(t):
    return torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)


def _whisper(x, sd, p, heads, rms):
    """``OmniWhisperTransformerLayer`` on x [T, d], causal."""
    t, d = x.shape

    def norm(y, name):
        if rms:
            return _rms(y, sd[f"{p}{name}.weight"])
        return _ln(y, sd[f"{p}{name}.weight"], sd[f"{p}{name}.bias"])

    h = norm(x, "self_attn_layer_norm")
    q = _lin(h, sd, p + "self_attn.q_proj").view(t, heads, -1).transpose(0, 1)
    k = _lin(h, sd, p + "self_attn.k_proj", bias=False).view(t, heads, -1).transpose(0, 1)
    v = _lin(h, sd, p + "self_attn.v_proj").view(t, heads, -1).transpose(0, 1)
    a = _softmax_attention(q, k, v, _causal(t)).transpose(0, 1).reshape(t, d)
    x = x + _lin(a, sd, p + "self_attn.out_proj")
    h = norm(x, "final_layer_norm")
    return x + _lin(_gelu(_lin(h, sd, p + "fc1")), sd, p + "fc2")


def _deconv_ref(x, sd, p, stride):
    """``CasualConvTranspose1d`` on x [C, L]: transposed conv, GroupNorm(1), right cut."""
    w = sd[p + "conv.weight"]  # [cin, cout, k]
    cin, cout, k = w.shape
    length = x.shape[1]
    y = torch.zeros(cout, (length - 1) * stride + k, dtype=torch.float64)
    for i in range(length):  # each input frame adds its kernel at i * stride
        y[:, i * stride : i * stride + k] += torch.einsum("c,cok->ok", x[:, i], w)
    y = y + sd[p + "conv.bias"][:, None]
    y = (y - y.mean()) / torch.sqrt(y.var(unbiased=False) + 1e-5)
    y = y * sd[p + "norm.weight"][:, None] + sd[p + "norm.bias"][:, None]
    return y[:, : y.shape[1] - max(0, k - stride)]


def _nearest(x, size):
    """Nearest resize of x [C, L] to ``size`` frames: frame i reads floor(i * L / size)."""
    idx = [math.floor(i * x.shape[1] / size) for i in range(size)]
    return x[:, idx]


def _conv(x, w, b, left, right):
    """Conv1d of x [C, L] with zero padding ``left`` / ``right``."""
    return F.conv1d(F.pad(x, (left, right))[None], w, b)[0]


def _decoder_ref(sd, codes, ac):
    """``LongcatNextAudioTokenizer.decode`` up to the flow decoder's input, [T, D]."""
    b = A + "audio_bridge_model."
    levels = codes.shape[1]
    total = sum(sd[f"{b}vq_list.{i}.codebook.embed"][codes[:, i]] for i in range(levels))
    x = _lin(total, sd, b + "proj_decoder")  # [n, d]
    p = A + "audio_decoder."
    x = _deconv_ref(x.t(), sd, p + "dconv1.", ac["avg_pooler"]).t()
    x = x + sd[p + "positional_embedding"][: x.shape[0]]
    for i in range(ac["decoder_layers"]):
        x = _whisper(x, sd, f"{p}layers.{i}.", ac["decoder_attention_heads"], rms=False)
    hidden = _ln(x, sd[p + "layer_norm.weight"], sd[p + "layer_norm.bias"])
    if ac["flow_matching_config"]["use_hidden_states_before_dconv2"]:
        return hidden
    coarse = _deconv_ref(hidden.t(), sd, p + "dconv2.", ac["decoder_stride_size"])
    vc = ac["vocoder_config"]
    frames = int(
        torch.tensor([coarse.shape[1]], dtype=torch.float32)
        * ac["hop_length"]
        / ac["sampling_rate"]
        * vc["sampling_rate"]
        / vc["hop_length"]
    )
    coarse = _nearest(coarse, frames)
    y, j = coarse, 0
    for _ in vc["channels"][:-1]:
        y = _conv(y, sd[f"{p}post_net.layers.{j}.weight"], sd[f"{p}post_net.layers.{j}.bias"], 2, 2)
        y = (y - y.mean()) / torch.sqrt(y.var(unbiased=False) + 1e-5)
        y = y * sd[f"{p}post_net.layers.{j + 1}.weight"][:, None]
        y = _mish(y + sd[f"{p}post_net.layers.{j + 1}.bias"][:, None])
        j += 3
    y = _conv(y, sd[f"{p}post_net.layers.{j}.weight"], sd[f"{p}post_net.layers.{j}.bias"], 0, 0)
    return (y + coarse).t()


def _prenet_ref(sd, feats, fc):
    p = A + "audio_flow_matching_decoder.prenet."
    size = int(feats.shape[0] * fc["prenet_target_mel_length_scale_ratio"])
    x = _nearest(feats.t(), size).t()
    x = _lin(F.silu(_lin(x, sd, p + "in_mlp.0")), sd, p + "in_mlp.2")
    for i in range(fc["prenet_nlayers"]):
        x = _whisper(x, sd, f"{p}transformer_layers.{i}.", fc["prenet_attention_heads"], rms=True)
    return _lin(_rms(x, sd[p + "final_norm.weight"]), sd, p + "out_proj", bias=False).t()


def _cblock(sd, p, x):
    """``CausalBlock1D`` (mask all ones): causal conv(3), LayerNorm over channels, Mish."""
    y = _conv(x, sd[p + "block.0.weight"], sd[p + "block.0.bias"], 2, 0)
    return _mish(_ln(y.t(), sd[p + "block.2.weight"], sd[p + "block.2.bias"]).t())


def _resnet_ref(sd, p, x, temb):
    h = _cblock(sd, p + "block1.", x) + _lin(_mish(temb), sd, p + "mlp.1")[:, None]
    return _cblock(sd, p + "block2.", h) + _conv(
        x, sd[p + "res_conv.weight"], sd[p + "res_conv.bias"], 0, 0
    )


def _tblock_ref(sd, p, x, fc):
    """``BasicTransformerBlock`` on x [T, C]; attention in blocks of 100 frames."""
    t = x.shape[0]
    heads = fc["num_heads"]
    h = _ln(x, sd[p + "norm1.weight"], sd[p + "norm1.bias"])
    q, k, v = (
        _lin(h, sd, f"{p}attn1.to_{n}", bias=False).view(t, heads, -1).transpose(0, 1)
        for n in ("q", "k", "v")
    )
    block = torch.arange(t) // 100
    bias = torch.where(block[None, :] <= block[:, None], 0.0, float("-inf")).double()
    a = _softmax_attention(q, k, v, bias).transpose(0, 1).reshape(t, -1)
    x = x + _lin(a, sd, p + "attn1.to_out.0")
    h = _ln(x, sd[p + "norm3.weight"], sd[p + "norm3.bias"])
    return x + _lin(_gelu(_lin(h, sd, p + "ff.net.0.proj")), sd, p + "ff.net.2")


def _stage_ref(sd, p, x, temb, fc):
    x = _resnet_ref(sd, p + "0.", x, temb).t()
    for j in range(fc["n_blocks"]):
        x = _tblock_ref(sd, f"{p}1.{j}.", x, fc)
    return x.t()


def _unet_ref(sd, x, mu, t, fc):
    """``ConditionalDecoder.forward`` (one U-Net level, as the tiny and published configs)."""
    c = A + "audio_flow_matching_decoder.conditional_decoder."
    width = 2 * fc["in_channels"] + fc["spk_emb_dim"]
    half = width // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    emb = torch.cat([torch.sin(1000 * t * freqs), torch.cos(1000 * t * freqs)])
    temb = _lin(F.silu(_lin(emb, sd, c + "time_mlp.linear_1")), sd, c + "time_mlp.linear_2")
    x = torch.cat([x, mu], 0)
    x = _stage_ref(sd, c + "down_blocks.0.", x, temb, fc)
    skip = x
    x = _conv(x, sd[c + "down_blocks.0.2.weight"], sd[c + "down_blocks.0.2.bias"], 2, 0)
    for i in range(fc["num_mid_blocks"]):
        x = _stage_ref(sd, f"{c}mid_blocks.{i}.", x, temb, fc)
    x = _stage_ref(sd, c + "up_blocks.0.", torch.cat([x, skip], 0), temb, fc)
    x = _conv(x, sd[c + "up_blocks.0.2.weight"], sd[c + "up_blocks.0.2.bias"], 2, 0)
    x = _cblock(sd, c + "final_block.", x)
    return _conv(x, sd[c + "final_proj.weight"], sd[c + "final_proj.bias"], 0, 0)


def _cfm_ref(sd, mu, noise, fc):
    """``ConditionalCFM.forward``: Euler over cosine-bent times, guidance against mu = 0."""
    n = fc["diffusion_steps"]
    rate = fc["cfm_params"]["inference_cfg_rate"]
    ts = [1 - math.cos(i / n * 0.5 * math.pi) for i in range(n + 1)]
    x = noise
    for i in range(n):
        v = _unet_ref(sd, x, mu, ts[i], fc)
        v = (1 + rate) * v - rate * _unet_ref(sd, x, torch.zeros_like(mu), ts[i], fc)
        x = x + (ts[i + 1] - ts[i]) * v
    return x


def _reference_mel(sd, codes, config, noise):
    ac = config["audio_config"]
    fc = ac["flow_matching_config"]
    mu = _prenet_ref(sd, _decoder_ref(sd, codes, ac), fc)
    return _cfm_ref(sd, mu, noise, fc).t()


def _codes(sizes, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, s, (n,), generator=g) for s in sizes], 1)


def _check(model, sd, config, n, seed):
    codes = _codes(model.codebook_sizes, n, seed)
    frames = 4 * n  # dconv1 x4 (50 Hz), ratio 1: the mel hop is 480 at 24 kHz
    noise = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(seed))
    got = model.mel(codes, noise)
    want = _reference_mel({k: v.double() for k, v in sd.items()}, codes, config, noise[0].double())
    assert got.shape == (frames, 80)
    scale = max(1.0, float(want.abs().max()))
    assert float((got.double() - want).abs().max()) <= 1e-4 * scale


@pytest.mark.parametrize("n", [1, 7, 30])
def test_mel_matches_the_published_forward(folder, n):
    """The loaded role model (hidden states before dconv2 feed the flow, as the tiny config
    says); 30 tokens = 120 frames spans two of the flow's 100-frame attention blocks."""
    config = json.loads((folder / "config.json").read_text())
    model = load_next_audio_decoder(folder)
    _check(model, _all(folder), config, n, seed=n)


def test_mel_matches_the_published_forward_through_the_post_net():
    """``use_hidden_states_before_dconv2`` false: dconv2 and post_net make the prenet's input."""
    config = tiny_config()
    fc = config["audio_config"]["flow_matching_config"]
    fc |= {"use_hidden_states_before_dconv2": False, "prenet_in_dim": 80}
    torch.manual_seed(3)
    model = NextAudioDecoder(config).eval()
    for book in model.codebooks:
        book.data.normal_(0, 0.5)
    sd = {
        A + "audio_bridge_model.proj_decoder." + k: v
        for k, v in model.proj_decoder.state_dict().items()
    }
    for i, book in enumerate(model.codebooks):
        sd[f"{A}audio_bridge_model.vq_list.{i}.codebook.embed"] = book.data
    for part in ("audio_decoder", "audio_flow_matching_decoder"):
        sd |= {f"{A}{part}.{k}": v for k, v in getattr(model, part).state_dict().items()}
    _check(model, sd, config, 5, seed=11)


def _damaged(folder, tmp_path, damage):
    copy_ = tmp_path / damage
    shutil.copytree(folder, copy_)
    tensors = _all(copy_)
    for shard in copy_.glob("model-*.safetensors"):
        shard.unlink()
    name = A + "audio_decoder.layers.1.fc1.weight"
    if damage == "renamed":
        tensors[name.replace("fc1", "fc_1")] = tensors.pop(name)
    elif damage == "missing":
        del tensors[A + "audio_flow_matching_decoder.prenet.final_norm.weight"]
    elif damage == "extra":
        tensors[A + "audio_flow_matching_decoder.conditional_decoder.mid_blocks.9.0.mlp.1.bias"] = (
            torch.zeros(32)
        )
    else:
        tensors[A + "audio_bridge_model.proj_decoder.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(copy_ / "model-00001-of-00001.safetensors"))
    index = {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (copy_ / INDEX_FILE).write_text(json.dumps(index))
    return copy_


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("renamed", "tensor model.audio_tokenizer.audio_decoder.layers.1.fc1.weight missing"),
        (
            "missing",
            "tensor model.audio_tokenizer.audio_flow_matching_decoder.prenet.final_norm.weight missing",
        ),
        (
            "extra",
            "unexpected tensor model.audio_tokenizer.audio_flow_matching_decoder.conditional_decoder.mid_blocks.9",
        ),
        ("misshaped", "tensor model.audio_tokenizer.audio_bridge_model.proj_decoder.weight in"),
    ],
)
def test_a_damaged_checkpoint_fails_naming_tensor_role_and_folder(folder, tmp_path, damage, needle):
    bad = _damaged(folder, tmp_path, damage)
    with pytest.raises(CheckpointError) as error:
        load_next_audio_decoder(bad)
    assert needle in str(error.value)
    assert "role audio_decoder" in str(error.value) and str(bad) in str(error.value)


def test_a_folder_without_the_decoder_config_is_named(folder, tmp_path):
    """A tiny folder built before the published audio decoder: its config lacks the keys."""
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    del config["audio_config"]["flow_matching_config"]
    (old / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="audio_config lacks 'flow_matching_config'") as e:
        load_next_audio_decoder(old)
    assert "role audio_decoder" in str(e.value) and str(old) in str(e.value)


@pytest.mark.slow
def test_up_fails_naming_the_renamed_tensor(folder, tmp_path, monkeypatch):
    """`omniflow up` with the audio decoder on a folder with one tensor renamed."""
    import tempfile

    from tests.helpers import cli

    bad = _damaged(folder, tmp_path, "renamed")
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    config = tmp_path / "broken.toml"
    config.write_text(
        'name = "lc-audio-broken"\nregistry = "embedded"\n'
        '[roles.audio_decoder]\nactor = "omniflow.roles.audio_decoder:AudioDecoderRole"\n'
        f'[roles.audio_decoder.options]\nmodel_path = "{bad}"\n'
        '[graph]\nedges = [{ from = "input", to = "audio_decoder" }]\n'
        "[runtime]\nstart_timeout_s = 60\n"
    )
    try:
        out = cli("up", str(config), "--detach", check=False)
    finally:
        cli("down", "--name", "lc-audio-broken", check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "role audio_decoder" in text and str(bad) in text
    assert "model.audio_tokenizer.audio_decoder.layers.1.fc1.weight missing" in text


def test_blocks_match_the_packages_they_were_taken_from(folder):
    """Second oracles from pip: the flow U-Net's transformer block is diffusers'
    ``BasicTransformerBlock`` (layer_norm, gelu, unbiased attention) under a 3-D additive mask,
    and the decoder's causal layer is transformers' ``WhisperEncoderLayer`` under a causal
    mask; each loads our block's state dict strictly, so the names are theirs too."""
    from diffusers.models.attention import BasicTransformerBlock
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    from omniflow.models.omni.next_flow_mel import chunk_bias

    model = load_next_audio_decoder(folder)
    fc = tiny_config()["audio_config"]["flow_matching_config"]
    block = model.audio_flow_matching_decoder.conditional_decoder.mid_blocks[0][1][0]
    theirs = BasicTransformerBlock(
        32, fc["num_heads"], fc["attention_head_dim"], activation_fn="gelu"
    ).eval()
    theirs.load_state_dict(block.state_dict(), strict=True)
    x = torch.randn(1, 130, 32, generator=torch.Generator().manual_seed(1))
    bias = chunk_bias(torch.ones(1, 1, 130))
    with torch.no_grad():
        torch.testing.assert_close(block(x, bias), theirs(x, attention_mask=bias))

    ac = tiny_config()["audio_config"]
    layer = model.audio_decoder.layers[1]
    wconf = WhisperConfig(
        d_model=32,
        encoder_attention_heads=ac["decoder_attention_heads"],
        encoder_ffn_dim=ac["decoder_ffn_dim"],
        activation_function="gelu",
    )
    wconf._attn_implementation = "eager"
    whisper = WhisperEncoderLayer(wconf).eval()
    whisper.load_state_dict(layer.state_dict(), strict=True)
    h = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(2))
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        torch.testing.assert_close(layer(h), whisper(h, causal))
