"""The llm role's media as the published LongCat-Next routes them: text with audio made
beside it in one decode (params.audio_text parallel, the default), or all before it
(serial), a model without the audiotext tokens refusing parallel by name; an image
between its anyres prefix and <longcat_img_end>, a newline after each row."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omniflow.engine import Spoken
from omniflow.models.loader import load_tokenizer
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.models.omni.next_media import SpeechTokens, load_next_media_heads
from omniflow.roles.llm import LLMRole
from omniflow.roles.llm_media import Stage, media_layout, media_stages, spoken_layout
from omniflow.runtime.actor import BadRequest, Request
from tests.helpers import prebuilt_longcat
from tests.roles.media import drive, make_ctx, make_request

PARAMS = {"want": "text,audio", "max_tokens": 5, "audio_chunks": 3, "audio_chunk_tokens": 2}


def kinds(outs) -> list[str]:
    """The llm's outputs in the order it made them: text deltas and audio chunks."""
    return ["audio" if "audio_codes" in o else "text" for o in outs]


def test_parallel_text_rides_with_the_audio_serial_comes_first(tmp_path):
    """The llm role in-process on the tiny published-layout folder: the order it makes
    its outputs in, mode by mode, and what they hold."""
    prebuilt_longcat(tmp_path)
    model = tmp_path / "models" / "longcat-tiny" / "next"

    async def main():
        actor = LLMRole("llm", 0, {"model_path": str(model), "kv_cache_mb": 8, "threads": 1})
        await actor.setup()
        try:
            got = {}
            for mode in ("", "parallel", "serial"):
                params = {**PARAMS, "audio_text": mode, "seed": 11}
                ctx = make_ctx("llm", f"r-{mode}")
                request = make_request({"text": "say"}, params=params, request_id=f"r-{mode}")
                got[mode] = (await drive(actor, request, ctx), ctx.usage)
            return got
        finally:
            await actor.close()

    got = asyncio.run(main())
    for mode, (outs, usage) in got.items():
        order = kinds(outs)
        audio = [o["audio_codes"] for o in outs if "audio_codes" in o]
        assert sum(a.shape[0] for a in audio) == 6, mode  # 1 token first, then 2, 2, 1
        assert usage["completion_tokens"] == 5, mode  # the text's tokens
        assert "".join(o.get("text", "") for o in outs), mode
        last_text = max(i for i, k in enumerate(order) if k == "text")
        if mode == "serial":  # the whole text stage first
            assert order.index("audio") > last_text
        else:  # the first audio chunk comes with the second step, before the text ends
            assert order.index("audio") < last_text
    assert kinds(got[""][0]) == kinds(got["parallel"][0])


def test_parallel_on_a_model_without_audiotext_tokens_is_refused_by_name():
    """The stand-in layout's heads (omni/) have no audiotext tokens: the default goes
    serial, an explicit parallel is a bad request naming params.audio_text."""
    head = SimpleNamespace(key="audio", placeholder_id=0)  # no speech tokens
    stage = Stage(head, 6, 2, None, None, 1)
    role = SimpleNamespace(path=Path("/models/x"), llm=SimpleNamespace(eos_token_ids={2}))
    want = {"text", "audio"}
    assert LLMRole._spoken(role, {}, want, [stage], [], 5) is None
    with pytest.raises(BadRequest, match="audiotext tokens") as e:
        LLMRole._spoken(role, {"audio_text": "parallel"}, want, [stage], [], 5)
    assert e.value.field == "params.audio_text"
    head.speech = SpeechTokens(6, 7, 9, 8)
    spoken = LLMRole._spoken(role, {}, want, [stage], [], 5)
    assert spoken is not None and spoken.start_id == 7 and spoken.end_ids == {9, 2}
    assert spoken.audio_tokens is None  # parallel
    serial = LLMRole._spoken(role, {"audio_text": "serial"}, want, [stage], [], 5)
    assert serial is not None and serial.audio_tokens == 6  # the text, then 6 audio tokens
    assert LLMRole._spoken(role, {}, want, [stage], [3], 5) is None  # migrated: serial


def test_an_image_is_laid_out_as_published(tmp_path):
    """The anyres prefix and <longcat_img_start> before the image, the newline after each
    row, <longcat_img_end> after: the stage's prompt, its engine rows and the session's
    tokens and spans agree."""

    folder = build_tiny_next(tmp_path / "ckpt", seed=2)

    tokenizer = load_tokenizer(folder)
    image, audio = load_next_media_heads(folder, placeholder_id=0)
    request = Request("r", {}, {}, {"want": "image", "image_grid": [2, 3]})
    heads = {"image": image, "audio": audio}
    (stage,) = media_stages(request, {"image"}, "torch", heads, folder, tokenizer)
    size = tokenizer.encode("<longcat_img_token_size>2 3</longcat_img_token_size>", False)
    ids = {t: tokenizer.tokenizer.token_to_id(t) for t in ("<longcat_img_token_size>",
           "</longcat_img_token_size>", "<longcat_img_start>", "<longcat_img_newline>",
           "<longcat_img_end>")}  # fmt: skip
    assert size[0] == ids["<longcat_img_token_size>"]
    assert size[-1] == ids["</longcat_img_token_size>"]
    assert stage.prefix == (*size, ids["<longcat_img_start>"])
    assert stage.row_end == (ids["<longcat_img_newline>"], 3)
    assert stage.closing == (ids["<longcat_img_end>"],)
    rows, keys = torch.arange(6.0)[:, None].repeat(1, 4), [("k", i) for i in range(6)]
    tokens, spans = media_layout(stage, [1, 2], [], rows, keys, 0)
    nl = ids["<longcat_img_newline>"]
    assert tokens == [1, 2, *stage.prefix, 0, 0, 0, nl, 0, 0, 0, nl, ids["<longcat_img_end>"]]
    first = 2 + len(stage.prefix)
    assert [s.start for s in spans] == [first, first + 4]
    assert [s.content_hash for s in spans] == [keys[:3], keys[3:]]
    assert torch.equal(spans[1].embeddings, rows[3:])


def flag_always(folder: Path) -> int:
    """Bias the audio head's level 0 to its last class, the end-of-audio flag; its id."""
    import json

    from safetensors.torch import load_file, save_file

    name = "audio_head.heads.0.bias"
    shard = (
        folder
        / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    )
    tensors = load_file(shard)
    tensors[name][-1] = 1e4
    save_file(tensors, shard, metadata={"format": "pt"})
    return tensors[name].shape[0] - 1


@pytest.mark.parametrize("mode", ["parallel", "serial"])
def test_the_end_of_audio_flag_ends_the_audio_there(tmp_path, mode):
    """As LongCat-Next's state machine leaves its audio stage: a level-0 flag (codebook
    size, the head's last class) is the audio's last token, its other levels 0, however
    many tokens were asked for; the session's next turn goes on from it."""
    folder = build_tiny_next(tmp_path / "ckpt", seed=3)
    flag = flag_always(folder)

    async def main():
        actor = LLMRole("llm", 0, {"model_path": str(folder), "kv_cache_mb": 8, "threads": 1})
        await actor.setup()
        try:
            params = {**PARAMS, "audio_text": mode, "seed": 1}
            request = Request("f", {"text": "say"}, {}, params, "flagged")
            outs = await drive(actor, request, make_ctx("llm", "f"))
            after = Request("g", {"text": "and?"}, {}, {"max_tokens": 3, "seed": 2}, "flagged")
            return outs, await drive(actor, after, make_ctx("llm", "g"))
        finally:
            await actor.close()

    outs, following = asyncio.run(main())
    audio = torch.cat([o["audio_codes"] for o in outs if "audio_codes" in o])
    assert audio.shape[0] == 1, audio  # 6 asked for (3 chunks of 2): the flag came first
    assert audio[0, 0] == flag and not audio[0, 1:].any()
    assert any("text" in o for o in following)  # the next turn went on from the flag row


@pytest.mark.parametrize("mode", ["parallel", "serial"])
def test_a_resent_spoken_reply_is_prompted_as_it_was_said(tmp_path, mode):
    """A stateless client resends a spoken turn's text: the llm prompts it as the speech it
    made (the speech tokens, the audio tokens' rows and keys; serial: the text's tokens in
    the speech block too), so the prefix cache serves the whole first turn, speech
    included, as it does for a session."""
    prebuilt_longcat(tmp_path)
    model = tmp_path / "models" / "longcat-tiny" / "next"
    ask = [{"role": "user", "content": "say something long enough to fill a page or two"}]

    async def main():
        actor = LLMRole("llm", 0, {"model_path": str(model), "kv_cache_mb": 8, "threads": 1})
        await actor.setup()
        try:
            params = {**PARAMS, "seed": 4, "audio_text": mode}
            ctx = make_ctx("llm", "s1")
            said = await drive(actor, make_request({"messages": ask}, params=params), ctx)
            reply = "".join(o.get("text", "") for o in said)
            again = [*ask, {"role": "assistant", "content": reply}]
            again.append({"role": "user", "content": "again"})
            ctx2 = make_ctx("llm", "s2")
            request = make_request({"messages": again}, params={"max_tokens": 2}, request_id="s2")
            await drive(actor, request, ctx2)
            # the same two turns in a session: the same prompt
            await drive(actor, Request("t1", {"messages": ask}, {}, params, "sp"), make_ctx("llm"))
            ctx3 = make_ctx("llm", "t2")
            await drive(
                actor, Request("t2", {"messages": again}, {}, {"max_tokens": 2}, "sp"), ctx3
            )
            assert ctx3.usage["prompt_tokens"] == ctx2.usage["prompt_tokens"]
            return reply, ctx.usage, ctx2.usage
        finally:
            await actor.close()

    reply, first, second = asyncio.run(main())
    assert reply
    # 6 audio tokens and the speech markers past the first prompt: all cached but the
    # last page's share (pages of 16)
    spoken = first["prompt_tokens"] + 1 + 1 + 6 + 1  # <audiogen_start>, start, audio, end
    if mode == "serial":  # the text's tokens before the start token
        spoken += first["completion_tokens"]
    assert second["cached_tokens"] >= spoken // 16 * 16 > first["prompt_tokens"] // 16 * 16


@pytest.mark.parametrize(
    "want", [{"want": "image", "image_grid": [2, 3]}, {**PARAMS, "want": "audio"}]
)
def test_media_codes_are_drawn_by_the_request_s_sampling(tmp_path, want):
    """An image's and an audio turn's codes as the published sampler draws them: by the
    request's temperature and seed (the same seed, the same codes; temperature 0, the
    greedy ones, which a seeded draw at temperature 1 is not). No text before them, so
    the codes are all that sampling changes."""
    prebuilt_longcat(tmp_path)
    model = tmp_path / "models" / "longcat-tiny" / "next"
    runs = {"a": {"seed": 5}, "b": {"seed": 5}, "greedy": {"temperature": 0.0}}

    async def main():
        actor = LLMRole("llm", 0, {"model_path": str(model), "kv_cache_mb": 8, "threads": 1})
        await actor.setup()
        try:
            got = {}
            for name, extra in runs.items():
                params = {**want, "max_tokens": 3, **extra}
                request = make_request({"text": "make"}, params=params, request_id=name)
                outs = await drive(actor, request, make_ctx("llm", name))
                key = "image_codes" if "image_grid" in want else "audio_codes"
                got[name] = torch.cat([o[key] for o in outs if key in o])
            return got
        finally:
            await actor.close()

    got = asyncio.run(main())
    assert torch.equal(got["a"], got["b"])
    assert got["a"].shape == got["greedy"].shape
    assert not torch.equal(got["a"], got["greedy"])


def test_a_spoken_turn_that_ended_at_its_flag_has_no_second_audiogen_end():
    """The flag's step feeds <longcat_audiogen_end> (published), so the turn's layout ends
    there; a turn cut by its length gets <longcat_audiogen_end> after its last token."""
    head = SimpleNamespace(key="audio", end_code=99, speech=SpeechTokens(6, 7, 9, 8))
    stage = Stage(head, 2, 2, None, None, 1)
    spoken = Spoken(7, frozenset({9}), 4)
    rows = torch.zeros(3, 4)
    for last, tail in (((99, 0), []), ((5, 1), [8])):
        keys = [("spoken", 3), ((("audio", (4, 2)), -1)), ((("audio", last)), -1)]
        out, spans = spoken_layout(stage, spoken, [1, 2], [], rows, keys, 0)
        assert out == [1, 2, 6, 7, 0, 0, *tail] and spans[0].start == 3
