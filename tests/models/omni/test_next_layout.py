"""The published LongCat-Next layout: builder names, strict loading, and equality with the
reference implementations pip ships (transformers' Qwen2.5-VL vision transformer and image
processor, Whisper's encoder) and with in-test references written from the published
equations (residual VQ, the audio bridge, the code embedding)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLVisionConfig, WhisperConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from omniflow.models.omni.checkpoint import INDEX_FILE, CheckpointError, read_config
from omniflow.models.omni.next_audio import load_next_audio
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_vision import load_next_vision
from tests.models.omni.test_next_audio_decoder import (
    published_names as published_audio_decoder_names,
)

V = "model.visual_tokenizer."
A = "model.audio_tokenizer."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("next") / "ckpt", seed=0)


def _tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _published_names(config) -> set[str]:
    """The names vLLM's longcat_next.py and transformers' classes give these parts."""
    vc, ac = config["visual_config"], config["audio_config"]
    names = {"model.embed_tokens.weight"}
    qwen = Qwen2_5_VisionTransformerPretrainedModel(
        Qwen2_5_VLVisionConfig(**{k: v for k, v in vc.items() if k != "vq_config"})
    )
    for n in qwen.state_dict():
        if n.startswith("merger."):
            names.add(V + "visual_bridge_model.bridge." + n[len("merger.") :])
        else:
            names.add(V + "visual_model." + n)
    for i in range(len(vc["vq_config"]["codebook_sizes"])):
        for t in ("embed", "embed_ema", "cluster_size_ema"):
            names.add(f"{V}visual_bridge_model.quantizer.quantize.codebooks.{i}.{t}")
    buf = V + "visual_embedding_layer.pre_buffer."
    names |= {buf + "pre_layernorm.weight", buf + "pre_layernorm.bias"}
    names |= {f"{buf}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    whisper = WhisperEncoder(WhisperConfig(**{k: v for k, v in ac.items() if k != "vq_config"}))
    for n in whisper.state_dict():
        n = "positional_embedding" if n == "embed_positions.weight" else n
        names.add(A + "audio_model." + n)
    bridge = A + "audio_bridge_model."
    for p in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        names.add(bridge + p)
    for p in ("layer_norm", "proj_decoder"):
        names |= {f"{bridge}{p}.weight", f"{bridge}{p}.bias"}
    for i in range(len(ac["vq_config"]["codebook_sizes"])):
        names |= {
            f"{bridge}vq_list.{i}.codebook.{t}" for t in ("embed", "embed_avg", "cluster_size")
        }
    names |= set(published_audio_decoder_names(config))
    names |= _llm_names(config)
    for i in range(config["emb_split_num"] * (config["emb_neighbor_num"] - 1)):
        names |= {f"model.ngram_embeddings.{t}.{i}.weight" for t in ("embedders", "post_projs")}
    for head in ("visual_head.", "audio_head."):
        names |= {
            head + "hidden_norm.weight",
            head + "hidden_proj.weight",
            head + "headnorm.weight",
        }
        names |= {f"{head}heads.{i}.{t}" for i in range(8) for t in ("weight", "bias")}
        layer = head + "transformer_layers.0."
        names |= {f"{layer}{p}.weight" for p in ("layernorm1", "layernorm2", "linear1", "linear2")}
        names |= {f"{layer}{p}.bias" for p in ("linear1", "linear2")}
        attn = layer + "self_attention."
        names |= {f"{attn}{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
        names |= {f"{attn}{p}.bias" for p in ("q_proj", "v_proj", "out_proj")}
    return names


def _llm_names(config) -> set[str]:
    """transformers' LongcatFlashForCausalLM names, its fused experts as the checkpoint holds
    them (one tensor per routed expert; none for the zero experts)."""
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    keys = (
        "hidden_size num_layers num_attention_heads ffn_hidden_size expert_ffn_hidden_size "
        "n_routed_experts zero_expert_num moe_topk q_lora_rank kv_lora_rank "
        "qk_nope_head_dim qk_rope_head_dim head_dim v_head_dim vocab_size"
    ).split()
    model = LongcatFlashForCausalLM(LongcatFlashConfig(**{k: config[k] for k in keys}))
    names = set()
    for n in model.state_dict():
        if n.endswith(".experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            for e in range(config["n_routed_experts"]):
                names |= {f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight"}
        elif n.endswith(".experts.down_proj"):
            base = n[: -len("down_proj")]
            names |= {f"{base}{e}.down_proj.weight" for e in range(config["n_routed_experts"])}
        else:
            names.add(n)
    return names


def test_builder_writes_the_published_names_and_files(folder):
    config = read_config(folder, "test")
    assert config["model_type"] == "longcat_next"
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == _published_names(config)
    assert len(set(index.values())) == 3 and all((folder / s).is_file() for s in index.values())
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    added = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    start = config["visual_config"]["image_start_token_id"]
    assert added[str(start)]["content"] == "<longcat_img_start>"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for content in ("<longcat_img_start>", "<longcat_audiogen_start>", "<longcat_img_pad>"):
        token = next(v for v in added.values() if v["content"] == content)
        assert tokenizer.encode(content, add_special_tokens=False).ids == [
            int(next(k for k, v in added.items() if v is token))
        ]


def _edit(folder, tmp_path, edit) -> object:
    """A copy of ``folder`` with its tensors changed by ``edit`` (one shard, new index)."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    tensors = _tensors(copy)
    for shard in copy.glob("model-*.safetensors"):
        shard.unlink()
    edit(tensors)
    save_file(tensors, str(copy / "model-00001-of-00001.safetensors"))
    index = {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (copy / INDEX_FILE).write_text(json.dumps(index))
    return copy


QKV = V + "visual_model.blocks.0.attn.qkv.weight"
FC1 = A + "audio_model.layers.1.fc1.weight"


def _rename(t):
    t[QKV.replace("qkv", "qkv_fused")] = t.pop(QKV)


def _drop(t):
    del t[FC1]


def _extra(t):
    t[V + "visual_bridge_model.quantizer.quantize.codebooks.8.embed"] = torch.zeros(33, 32)


def _reshape(t):
    t[FC1] = t[FC1][:, :-1].contiguous()


@pytest.mark.parametrize(
    "edit, loader, role, needle",
    [
        (_rename, load_next_vision, "vision_encoder", QKV + " missing"),
        (_drop, load_next_audio, "audio_encoder", FC1 + " missing"),
        (_extra, load_next_vision, "vision_encoder", "unexpected tensor " + V),
        (_reshape, load_next_audio, "audio_encoder", FC1 + " in "),
    ],
)
def test_strict_loading_names_tensor_role_and_folder(folder, tmp_path, edit, loader, role, needle):
    copy = _edit(folder, tmp_path, edit)
    with pytest.raises(CheckpointError) as error:
        loader(copy)
    message = str(error.value)
    assert needle in message and f"role {role}" in message and str(copy) in message


def test_each_role_reads_only_its_prefix(folder, tmp_path):
    # The audio tokenizer loads with the vision tokenizer's tensors gone, and vice versa.
    no_vision = _edit(folder, tmp_path, lambda t: [t.pop(n) for n in list(t) if n.startswith(V)])
    assert load_next_audio(no_vision).encode(torch.zeros(1280)).shape == (1, 8)
    with pytest.raises(CheckpointError, match="role vision_encoder"):
        load_next_vision(no_vision)


def _rvq_reference(x: torch.Tensor, books: list[torch.Tensor]) -> torch.Tensor:
    """Residual VQ from the published equations: level by level, nearest by L2."""
    residual, ids = x.double(), []
    for book in books:
        level = torch.cdist(residual, book.double()).argmin(-1)
        residual = residual - book.double()[level]
        ids.append(level)
    return torch.stack(ids, -1)


def test_vision_matches_transformers_and_reference_rvq(folder):
    config = read_config(folder, "test")
    vc = config["visual_config"]
    tensors = _tensors(folder)
    model = load_next_vision(folder)
    image = torch.randint(
        0, 256, (56, 84, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    # Patches: transformers' Qwen2-VL image processor (no resize: 56x84 is on the grid).
    proc = Qwen2VLImageProcessorPil(
        do_resize=False, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    ref = proc(images=[np.asarray(image)], return_tensors="pt")
    patches, gh, gw = model.patches(image)
    assert ref["image_grid_thw"].tolist() == [[1, gh, gw]]
    torch.testing.assert_close(patches, ref["pixel_values"].float(), atol=1e-5, rtol=1e-5)
    # Encoder + bridge: transformers' vision transformer with the bridge as its merger.
    oracle = Qwen2_5_VisionTransformerPretrainedModel(
        Qwen2_5_VLVisionConfig(**{k: v for k, v in vc.items() if k != "vq_config"})
    )
    state = {
        n[len(V + "visual_model.") :]: t
        for n, t in tensors.items()
        if n.startswith(V + "visual_model.")
    }
    bridge = V + "visual_bridge_model.bridge."
    state |= {"merger." + n[len(bridge) :]: t for n, t in tensors.items() if n.startswith(bridge)}
    oracle.load_state_dict(state, strict=True)
    with torch.no_grad():
        want = oracle(ref["pixel_values"].float(), grid_thw=ref["image_grid_thw"]).pooler_output
    got, grid = model.features(image)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # Codes: RVQ over embed[:-1] (the padding row never chosen).
    books = [
        tensors[f"{V}visual_bridge_model.quantizer.quantize.codebooks.{i}.embed"][:-1]
        for i in range(8)
    ]
    codes = model.encode(image).codes
    assert torch.equal(codes, _rvq_reference(want, books))
    # Embedding: summed word-embedding rows at cumulative offsets, then LayerNorm + SwiGLU.
    sizes = vc["vq_config"]["codebook_sizes"]
    offsets = torch.tensor([config["visual_offset"]] + sizes[:-1]).cumsum(0)
    rows = tensors["model.embed_tokens.weight"][codes + offsets].sum(1)
    buf = V + "visual_embedding_layer.pre_buffer."
    h = torch.nn.functional.layer_norm(
        rows,
        (rows.shape[-1],),
        tensors[buf + "pre_layernorm.weight"],
        tensors[buf + "pre_layernorm.bias"],
        eps=config["rms_norm_eps"],
    )
    g, u, d = (tensors[f"{buf}mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    want_embed = rows + (torch.nn.functional.silu(h @ g.t()) * (h @ u.t())) @ d.t()
    torch.testing.assert_close(model.embed(codes), want_embed, atol=1e-5, rtol=1e-4)


def test_audio_matches_whisper_encoder_and_reference_bridge(folder):
    config = read_config(folder, "test")
    ac = config["audio_config"]
    tensors = _tensors(folder)
    model = load_next_audio(folder)
    # Whisper's own encoder takes exactly 2 * max_source_positions mel frames.
    oracle = WhisperEncoder(WhisperConfig(**{k: v for k, v in ac.items() if k != "vq_config"}))
    prefix = A + "audio_model."
    state = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
    state["embed_positions.weight"] = state.pop("positional_embedding")
    oracle.load_state_dict(state, strict=True)
    mel = torch.randn(
        1, 128, 2 * ac["max_source_positions"], generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        want = oracle(mel).last_hidden_state
        got = model.audio_model(mel)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Bridge from the published equations: SwiGLU over kernel=stride=4 convs + pooled residual.
    b = A + "audio_bridge_model."
    x = want[:, :-2]  # a length that needs padding to a multiple of 4
    xp = torch.nn.functional.pad(x, (0, 0, 0, 2))
    g = torch.nn.functional.conv1d(xp.transpose(1, 2), tensors[b + "gate_proj.weight"], stride=4)
    u = torch.nn.functional.conv1d(xp.transpose(1, 2), tensors[b + "up_proj.weight"], stride=4)
    c = (torch.nn.functional.silu(g) * u).transpose(1, 2) @ tensors[b + "down_proj.weight"].t()
    res = torch.nn.functional.layer_norm(
        c + xp.reshape(1, -1, 128),
        (128,),
        tensors[b + "layer_norm.weight"],
        tensors[b + "layer_norm.bias"],
    )[0]
    with torch.no_grad():
        feats = model.audio_bridge_model.features(x)[0]
    torch.testing.assert_close(feats, res, atol=1e-4, rtol=1e-4)
    books = [tensors[f"{b}vq_list.{i}.codebook.embed"] for i in range(8)]
    codes = model.audio_bridge_model.quantize(res)
    assert torch.equal(codes, _rvq_reference(res, books))
    offsets = torch.tensor(
        [config["audio_offset"]] + ac["vq_config"]["codebook_sizes"][:-1]
    ).cumsum(0)
    want_embed = tensors["model.embed_tokens.weight"][codes + offsets].sum(1)
    torch.testing.assert_close(model.embed(codes), want_embed)
    assert model.encode(torch.zeros(16000)).shape == (13, 8)  # 1 s → 12.5 tokens, rounded up


def _ngram_reference(ids: list[int], word: torch.Tensor, t: dict, config: dict) -> torch.Tensor:
    """The n-gram embedding position by position, from the published equations."""
    n, k, vocab = config["emb_neighbor_num"], config["emb_split_num"], config["text_vocab_size"]
    lo, hi = vocab, config["text_vocab_plus_multimodal_special_token_size"]
    m = config["ngram_vocab_size_ratio"] * vocab
    ctx = [0 if lo <= x < hi else x for x in ids]
    out = []
    for pos in range(len(ids)):
        start = 0
        for s in range(pos):
            if ctx[s] in (0, config["eos_token_id"]):
                start = s + 1
        boundary = ctx[pos] in (0, config["eos_token_id"])
        # The token itself always; its predecessors only inside its segment, and none at a
        # boundary (EOS or 0) position.
        prev = [ctx[pos]] + [
            ctx[pos - s] if pos - s >= start and not boundary else 0 for s in range(1, n)
        ]
        vec = word[pos].clone()
        for i in range(2, n + 1):
            for j in range(k):
                index = (i - 2) * k + j
                size = m + 2 * index + 1
                h = sum(prev[s] * pow(vocab, s, size) for s in range(i)) % size
                if h > 0:
                    e = t[f"model.ngram_embeddings.embedders.{index}.weight"][h]
                    vec = vec + t[f"model.ngram_embeddings.post_projs.{index}.weight"] @ e
        out.append(vec if lo <= ids[pos] < hi else vec / (1 + k * (n - 1)))
    return torch.stack(out)


def test_ngram_embedding_matches_reference(folder):
    from omniflow.models.omni.next_heads import load_next_heads

    config = read_config(folder, "test")
    t = _tensors(folder)
    ngram, _, _ = load_next_heads(folder)
    special = config["visual_config"]["image_start_token_id"]
    ids = [1, 17, 400, 33, 2, 90, 91, special, 92, 93, 94, 0, 5, 6]
    word = t["model.embed_tokens.weight"][ids]
    with torch.no_grad():
        got = ngram(torch.tensor(ids), word)
    torch.testing.assert_close(got, _ngram_reference(ids, word, t, config), atol=1e-6, rtol=1e-5)


def _rms(x, w):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _head_reference(
    hidden: torch.Tensor, t: dict, p: str, depth: int, previous: torch.Tensor
) -> list[torch.Tensor]:
    """The depth head from the published equations (the checkpoint's
    CasualDepthTransformerHead): positions [hidden, previous rows...], one at a time."""
    x = torch.cat([hidden[:, None], previous], 1)
    x = _rms(x, t[p + "hidden_norm.weight"]) @ t[p + "hidden_proj.weight"].t()
    lp = p + "transformer_layers.0."
    a = lp + "self_attention."
    h_in = _rms(x, t[lp + "layernorm1.weight"])
    q = h_in @ t[a + "q_proj.weight"].t() + t[a + "q_proj.bias"]
    k = h_in @ t[a + "k_proj.weight"].t()
    v = h_in @ t[a + "v_proj.weight"].t() + t[a + "v_proj.bias"]
    score = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # one head: dim 128 = head size
    score = score.masked_fill(torch.ones(depth, depth).triu(1).bool(), float("-inf"))
    attn = score.softmax(-1) @ v
    h = x + attn @ t[a + "out_proj.weight"].t() + t[a + "out_proj.bias"]
    w1, w2 = t[lp + "linear1.weight"], t[lp + "linear2.weight"]
    inner = w1.shape[0] // depth
    y = _rms(h, t[lp + "layernorm2.weight"])
    outs = []
    for level in range(depth):
        rows1 = w1.view(inner, depth, -1)[:, level]
        rows2 = w2.view(w2.shape[0], depth, inner)[:, level]
        f = torch.nn.functional.gelu(y[:, level] @ rows1.t()) @ rows2.t()
        z = _rms(h[:, level] + f, t[p + "headnorm.weight"])
        outs.append(z @ t[f"{p}heads.{level}.weight"].t() + t[f"{p}heads.{level}.bias"])
    return outs


def test_depth_heads_match_reference(folder):
    from omniflow.models.omni.next_heads import load_next_heads

    config = read_config(folder, "test")
    t = _tensors(folder)
    _, visual, audio = load_next_heads(folder)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, config["hidden_size"], generator=g)
    previous = torch.randn(3, 7, config["hidden_size"], generator=g) * 0.1
    for head, prefix, sub in (
        (visual, "visual_head.", "visual_config"),
        (audio, "audio_head.", "audio_config"),
    ):
        with torch.no_grad():
            got = head(hidden, previous)
            # Causal over the levels: level l's logits do not read the rows after it.
            later = previous.clone()
            later[:, 3:] = 0
            torch.testing.assert_close(head(hidden, later)[3], got[3])
        want = _head_reference(hidden, t, prefix, 8, previous)
        sizes = config[sub]["vq_config"]["codebook_sizes"]
        assert [g.shape[-1] for g in got] == [n + 1 for n in sizes]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_role_setup_fails_naming_the_renamed_tensor(folder, tmp_path):
    import asyncio

    from omniflow.roles.audio_encoder import AudioEncoderRole
    from omniflow.roles.vision_encoder import VisionEncoderRole

    copy = _edit(folder, tmp_path, _rename)
    for cls, name in ((VisionEncoderRole, "vision_encoder"), (AudioEncoderRole, "audio_encoder")):
        actor = cls(name, 0, {"model_path": str(copy), "threads": 1})

        async def setup(actor=actor):
            try:
                await actor.setup()
            finally:
                await actor.close()

        if name == "vision_encoder":
            with pytest.raises(CheckpointError, match=f"tensor {QKV} missing from {copy}"):
                asyncio.run(setup())
        else:  # the audio role does not read the vision tokenizer's tensors
            asyncio.run(setup())


def test_audio_mel_matches_whisper_feature_extractor(folder):
    from transformers import WhisperFeatureExtractor

    model = load_next_audio(folder)
    gen = torch.Generator().manual_seed(9)
    wave = (torch.randn(16000 * 30, generator=gen) * 0.1).clamp(-1, 1)
    want = WhisperFeatureExtractor(feature_size=128)(
        wave.numpy(), sampling_rate=16000, return_tensors="pt"
    )["input_features"][0]
    with torch.no_grad():
        got = model.mel(wave)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_vision_native_resolution_and_bad_images(folder):
    vision = load_next_vision(folder)
    step = vision.config.pixels_per_token
    for height, width in [(step, step), (2 * step, 3 * step), (5 * step, step)]:
        image = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8)
        codes, grid = vision.encode(image)
        assert grid == (height // step, width // step)
        assert codes.shape == (grid[0] * grid[1], 8) and codes.dtype == torch.int64
        assert vision.embed(codes).shape == (codes.shape[0], vision.config.hidden_size)
    black = torch.zeros(step, step, 3, dtype=torch.uint8)
    assert not torch.equal(vision.encode(black).codes, vision.encode(black + 255).codes)
    with pytest.raises(ValueError, match="multiple"):
        vision.encode(torch.zeros(step + 1, step, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        vision.encode(torch.zeros(step, step, 3))


@pytest.mark.parametrize("seconds", [0.05, 1.0, 2.5])
def test_audio_token_count(folder, seconds):
    audio = load_next_audio(folder)
    samples = int(16000 * seconds)
    codes = audio.encode(torch.sin(torch.arange(samples) * 0.05) * 0.3)
    assert codes.shape == (max(1, -(-samples // 1280)), 8)
    for level, size in enumerate(audio.config.codebook_sizes):
        assert int(codes[:, level].max()) < size
    with pytest.raises(ValueError, match="non-empty"):
        audio.encode(torch.zeros(0))


def test_vision_quant_conv_runs_before_the_codebooks(tmp_path):
    folder = build_tiny_next(tmp_path / "qc", seed=1, quant_conv=True)
    t = _tensors(folder)
    q = V + "visual_bridge_model.quantizer."
    assert q + "quant_conv.1.weight" in t and q + "quant_conv.3.bias" in t
    model = load_next_vision(folder)
    image = torch.randint(0, 256, (56, 56, 3), dtype=torch.uint8)
    bridge, _ = model.features(image)
    h = torch.nn.functional.layer_norm(
        bridge, (32,), t[q + "quant_conv.0.weight"], t[q + "quant_conv.0.bias"]
    )
    h = torch.nn.functional.gelu(h @ t[q + "quant_conv.1.weight"].t() + t[q + "quant_conv.1.bias"])
    h = h @ t[q + "quant_conv.3.weight"].t() + t[q + "quant_conv.3.bias"]
    books = [t[f"{q}quantize.codebooks.{i}.embed"][:-1] for i in range(8)]
    assert torch.equal(model.encode(image).codes, _rvq_reference(h, books))
