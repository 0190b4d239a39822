"""The llm role's part of the published LongCat-Next folder: LongCat-Flash decoder layers
(checked against transformers' `LongcatFlashModel`), the n-gram input embedding (the in-test
reference of test_next_layout.py), `lm_head` over the text vocabulary + specials, the codes
heads, strict loading and only the LLM's tensors read."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniflow.engine import LLM, SamplingParams
from omniflow.models.loader import NEXT_LLM_PREFIXES, load_decoder
from omniflow.models.omni.checkpoint import INDEX_FILE, CheckpointError, read_config
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_media import load_next_media_heads
from omniflow.models.omni.next_vision import load_next_vision
from omniflow.models.omni.ngram import NgramEmbedding
from tests.hf_longcat import load_stacked_experts
from tests.models.omni.test_next_layout import _head_reference, _ngram_reference, _tensors

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
EXPERT = "model.layers.1.mlp.experts.{}.down_proj.weight"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("next-llm") / "ckpt", seed=3)


def _hf_decoder(config: dict, t: dict):
    """transformers' LongcatFlashModel on the folder's layer tensors (experts stacked)."""
    import transformers

    keys = (
        "hidden_size num_layers num_attention_heads num_key_value_heads ffn_hidden_size "
        "expert_ffn_hidden_size n_routed_experts zero_expert_num moe_topk "
        "routed_scaling_factor q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim "
        "head_dim v_head_dim rms_norm_eps max_position_embeddings rope_theta vocab_size"
    ).split()
    hf_config = transformers.LongcatFlashConfig(**{k: config[k] for k in keys})
    model = transformers.LongcatFlashModel(hf_config).eval()
    prefixes = ("model.layers.", "model.norm.", "model.embed_tokens.")
    load_stacked_experts(
        model, {n[len("model.") :]: v for n, v in t.items() if n.startswith(prefixes)}
    )
    return model


def _reference_greedy(folder, prompt: list[int], steps: int) -> list[int]:
    """Full recompute per token: in-test n-gram embedding -> transformers' decoder ->
    lm_head, argmax."""
    config, t = read_config(folder, "test"), _tensors(folder)
    decoder = _hf_decoder(config, t)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            word = t["model.embed_tokens.weight"][ids]
            embeds = _ngram_reference(ids, word, t, config)
            hidden = decoder(inputs_embeds=embeds[None]).last_hidden_state[0, -1]
            ids.append(int((t["lm_head.weight"] @ hidden).argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_transformers_decoder_over_the_reference_ngram(folder):
    config = read_config(folder, "test")
    special = config["visual_config"]["image_start_token_id"]
    prompts = [[1, 17, 400, 33, 9, 90, 91], [1, 5, 2, 7, special, 8, 9, 10, 11, 12, 13]]
    llm = LLM(folder, device="cpu", page_size=4)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [_reference_greedy(folder, p, GREEDY.max_tokens) for p in prompts]
    # The same tokens again, the prompt from the prefix cache: the n-gram context of the
    # first uncached row comes from the sequence, not from the cached pages.
    again = llm.generate(prompts[:1], GREEDY)[0]
    assert again.token_ids == got[0] and again.cached_tokens > 0


def test_rows_equal_the_whole_sequence(folder):
    """NgramEmbedding.rows on rows cut anywhere (what a prefill chunk or decode step has)
    equals its forward over the whole sequence."""
    config, t = read_config(folder, "test"), _tensors(folder)
    ngram = NgramEmbedding(config)
    ngram.load_state_dict(
        {n[len("model.ngram_embeddings.") :]: v for n, v in t.items() if "ngram" in n}
    )
    ids = torch.tensor([1, 40, 41, 2, 42, 43, 44, 45, 0, 46])
    word = t["model.embed_tokens.weight"][ids]
    with torch.no_grad():
        whole = ngram(ids, word)
        prev = torch.tensor(
            [[int(ids[p - s]) if p >= s else -1 for s in (1, 2, 3)] for p in range(10)]
        )
        for lo, hi in ((0, 3), (3, 4), (4, 10)):
            part = ngram.rows(ids[lo:hi], prev[lo:hi], word[lo:hi])
            torch.testing.assert_close(part, whole[lo:hi])


def test_llm_reads_only_its_part(folder, tmp_path):
    """Only tensors under the LLM's prefixes are read: a folder whose vision and audio
    tokenizers and heads are gone still loads, and only shards holding LLM tensors open."""
    copy = tmp_path / "llm-only"
    shutil.copytree(folder, copy)
    index = json.loads((copy / INDEX_FILE).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(copy / shard))
        kept = {n: v for n, v in tensors.items() if n.startswith(NEXT_LLM_PREFIXES)}
        save_file(kept, str(copy / shard))
    index["weight_map"] = {
        n: s for n, s in index["weight_map"].items() if n.startswith(NEXT_LLM_PREFIXES)
    }
    (copy / INDEX_FILE).write_text(json.dumps(index))
    model = load_decoder(copy, device="cpu")
    names = {n for n, _ in model.named_parameters()}
    assert "model.ngram_embeddings.embedders.0.weight" in names
    assert not any("visual" in n or "audio" in n for n in names)
    assert model.lm_head.weight.shape[0] == read_config(folder, "t")["text_vocab_size"] + 53


def test_codes_heads_embed_as_the_encoders_do(folder):
    """A generated image token goes back in as the vision encoder embeds a seen one."""
    image, audio = load_next_media_heads(folder, placeholder_id=0)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    codes = image.codes(hidden)
    assert codes.shape == (3, 8) and int(codes.max()) < 32
    vision = load_next_vision(folder)
    torch.testing.assert_close(image.embed(codes), vision.embed(codes))
    # Level by level (the checkpoint's autoregressive depth loop), written out here over
    # the in-test head reference and the word embedding's code rows.
    config, t = read_config(folder, "t"), _tensors(folder)
    for head, prefix, offset in (
        (image, "visual_head.", "visual_offset"),
        (audio, "audio_head.", "audio_offset"),
    ):
        sizes = head.sizes
        first = [config[offset] + sum(sizes[:level]) for level in range(8)]
        previous, total, want = torch.zeros(3, 7, 64), torch.zeros(3, 64), []
        for level in range(8):
            logits = _head_reference(hidden, t, prefix, 8, previous)[level]
            code = logits[:, : sizes[level]].argmax(-1)
            want.append(code)
            if level < 7:
                total = total + t["model.embed_tokens.weight"][first[level] + code]
                previous[:, level] = total
        assert torch.equal(head.codes(hidden), torch.stack(want, -1))


def test_a_generated_audio_row_goes_back_in_as_published(folder):
    """As the published get_audio_embeddings builds a generated audio step's input: level 0
    equal to 0 gives no audio embedding; the end-of-audio flag (the codebook size) gives
    <longcat_audiogen_end>'s word embedding (the step's ext id), no codes."""
    _, audio = load_next_media_heads(folder, placeholder_id=0)
    codes = torch.tensor(
        [[0, 3, 1, 2, 0, 1, 2, 3], [audio.end_code] + [0] * 7, [1, 3, 1, 2, 0, 1, 2, 3]]
    )
    rows = audio.embed(codes)
    end = read_config(folder, "t")["audio_config"]["audiogen_end_token_id"]
    assert not rows[0].any() and rows[2].any()
    torch.testing.assert_close(rows[1], _tensors(folder)["model.embed_tokens.weight"][end])


def test_the_image_head_guides_each_level_s_logits_as_published(folder):
    """CFG as the published depth_transformer_forward_new runs it: each level's logits of
    both halves (both reading the ids chosen before), uncond + s * (cond - uncond), the
    class past the codebook left out; not the head over guided hidden states."""
    image, _ = load_next_media_heads(folder, placeholder_id=0)
    generator = torch.Generator().manual_seed(2)
    cond, uncond = (torch.randn(3, 64, generator=generator) for _ in range(2))
    scale = torch.tensor([3.0, 1.0, 5.0])
    config, t = read_config(folder, "t"), _tensors(folder)
    sizes = image.sizes
    first = [config["visual_offset"] + sum(sizes[:level]) for level in range(8)]
    previous, total, want = torch.zeros(3, 7, 64), torch.zeros(3, 64), []
    for level in range(8):
        c = _head_reference(cond, t, "visual_head.", 8, previous)[level]
        u = _head_reference(uncond, t, "visual_head.", 8, previous)[level]
        code = (u + scale[:, None] * (c - u))[:, : sizes[level]].argmax(-1)
        want.append(code)
        if level < 7:
            total = total + t["model.embed_tokens.weight"][first[level] + code]
            previous[:, level] = total
    got = image.guided_codes(cond, uncond, scale)
    assert torch.equal(got, torch.stack(want, -1))
    assert not torch.equal(got, image.codes(uncond + scale[:, None] * (cond - uncond)))


def _rewrite(folder, tmp_path, edit):
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    index = json.loads((copy / INDEX_FILE).read_text())
    shard = index["weight_map"][EXPERT.format(0)]
    tensors = load_file(str(copy / shard))
    edit(tensors)
    save_file(tensors, str(copy / shard))
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n in tensors} | {
        n: s for n, s in index["weight_map"].items() if s != shard
    }
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    (copy / INDEX_FILE).write_text(json.dumps(index))
    return copy


def _extra(t):
    t[EXPERT.format(6)] = t[EXPERT.format(0)].clone()  # the config has 6 routed experts


def _renamed(t):
    t["model.layers.1.mlp.experts.0.down.weight"] = t.pop(EXPERT.format(0))


def _missing(t):
    del t[EXPERT.format(0)]


def _misshaped(t):
    t[EXPERT.format(0)] = t[EXPERT.format(0)][:, :-1].contiguous()


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_extra, r"experts\.6\.down_proj\.weight.*expert 6, but the config has 6"),
        (_renamed, r"experts\.0\.down\.weight' has no place"),
        (_missing, r"experts\.0\.down_proj\.weight missing"),
        (_misshaped, r"experts\.0\.down_proj\.weight has shape \[64, 31\], expected \[64, 32\]"),
    ],
)
def test_llm_role_setup_fails_naming_tensor_role_and_folder(folder, tmp_path, edit, needle):
    from omniflow.roles.llm import LLMRole

    copy = _rewrite(folder, tmp_path, edit)
    actor = LLMRole("llm", 0, {"model_path": str(copy), "threads": 1})

    async def setup():
        try:
            await actor.setup()
        finally:
            await actor.close()

    with pytest.raises(CheckpointError, match=rf"role llm: model folder {copy}: .*{needle}"):
        asyncio.run(setup())


def test_generation_config_defaults(tmp_path):
    from omniflow.roles.llm import generation_defaults

    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "do_sample": False, "top_k": 5, "max_new_tokens": 99})
    )
    assert generation_defaults(tmp_path) == {"top_k": 5, "max_tokens": 99, "temperature": 0.0}
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json: not JSON"):
        generation_defaults(tmp_path)


@pytest.mark.slow
def test_up_fails_naming_the_extra_tensor(folder, tmp_path, monkeypatch):
    """`omniflow up` on a folder with one expert too many: the error names it."""
    import tempfile

    from tests.helpers import cli

    copy = _rewrite(folder, tmp_path, _extra)
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    config = tmp_path / "broken.toml"
    config.write_text(
        'name = "lc-broken"\nregistry = "embedded"\n'
        '[roles.llm]\nactor = "omniflow.roles.llm:LLMRole"\n'
        f'[roles.llm.options]\nmodel_path = "{copy}"\n'
        '[graph]\nedges = [{ from = "input", to = "llm" }]\n'
        "[runtime]\nstart_timeout_s = 60\n"
    )
    try:
        out = cli("up", str(config), "--detach", check=False)
    finally:
        cli("down", "--name", "lc-broken", check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"role llm: model folder {copy}" in text
    assert "model.layers.1.mlp.experts.6.down_proj.weight" in text
