"""Chat templates: loaded from a checkpoint as transformers loads them, rendered in a sandbox,
cut at media markers and replies; prompts of a resent dialogue extend the earlier ones."""

from __future__ import annotations

import json

import pytest
import torch

from omniflow.models.text_tokenizer import TextTokenizer
from omniflow.models.tiny.tokenizer import build_tiny_tokenizer, save_tiny_tokenizer
from omniflow.roles.chat_template import ChatTemplate, TemplateError, load_chat_template
from omniflow.roles.llm_prompt import PromptBuilder, StopText, request_messages
from omniflow.runtime.actor import BadRequest

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(build_tiny_tokenizer(400), folder)
    return folder


def test_the_tiny_tokenizer_ships_a_template_that_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    source, config = load_chat_template(tiny)
    assert source == json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "and now?"},
    ]
    ours = ChatTemplate(source, config).render(messages)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.startswith("<s>system: be brief</s>\n") and ours.endswith("assistant: ")


def test_override_file_and_checkpoint_jinja(tiny, tmp_path):
    (tmp_path / "chat_template.jinja").write_text("JINJA{{ messages[0]['content'] }}")
    assert load_chat_template(tmp_path)[0].startswith("JINJA")
    assert load_chat_template(tiny, CHATML)[0] == CHATML
    file = tmp_path / "mine.jinja"
    file.write_text("MINE")
    assert load_chat_template(tiny, str(file))[0] == "MINE"


def test_the_sandbox_keeps_a_template_from_python():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])
    with pytest.raises(TemplateError, match="line 1"):
        ChatTemplate("{% for %}")


def test_media_go_where_the_template_puts_them():
    template = ChatTemplate(CHATML, {"image_token": "<|image_pad|>"})
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]},
        {"role": "assistant", "content": "a cat"},
    ]
    kinds = [(p.kind, p.text) for p in template.pieces(messages, add_generation_prompt=False)]
    assert kinds == [
        ("text", "<|im_start|>user\nsee<|vision_start|>"),
        ("image", ""),
        ("text", "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"),
        ("reply", "a cat"),
        ("text", "<|im_end|>\n"),
    ]
    with pytest.raises(TemplateError, match="0 image marker"):
        ChatTemplate(CHATML).pieces(messages)  # its image_token is not the default


def _media(n_rows: list[int]) -> dict:
    rows = [(f"h{i}", torch.randn(n, 8)) for i, n in enumerate(n_rows)]
    return {"image": rows, "audio": []}


def test_a_resent_dialogue_extends_the_earlier_prompt_and_reply(tiny):
    tokenizer = TextTokenizer.from_folder(tiny)
    builder = PromptBuilder(tokenizer, ChatTemplate(*load_chat_template(tiny)), placeholder=0)
    image = {"type": "image"}
    turn1 = [{"role": "user", "content": [image, {"type": "text", "text": "what is it"}]}]
    media1 = _media([5])
    msgs1, whole = request_messages({"messages": turn1}, "", media1)
    assert whole and msgs1[0]["content"][0] == {"type": "image", "hash": "h0"}
    prompt1, spans1 = builder.full(msgs1, media1)
    reply_ids = tokenizer.encode(" a dog", add_special_tokens=False)[::-1][:3]  # odd ids
    reply = tokenizer.decode(reply_ids)
    builder.remember(reply, reply_ids)
    turn3 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "hue?"}]
    msgs3, _ = request_messages({"messages": turn3}, "", media1)
    prompt3, spans3 = builder.full(msgs3, media1)
    assert prompt3[: len(prompt1) + len(reply_ids)] == prompt1 + reply_ids
    assert [s.content_hash for s in spans3] == [("image", "h0")] == [s.content_hash for s in spans1]
    assert spans3[0].start == spans1[0].start == len(tokenizer.encode("<s>user: ", False))
    # As a session's continuation: the session's tokens, then exactly what the whole adds.
    following, _ = builder.continuation(msgs3[:2], msgs3, media1, len(prompt1) + len(reply_ids))
    assert prompt1 + reply_ids + following == prompt3


def test_request_messages_checks_media_counts():
    with pytest.raises(BadRequest, match="more image parts"):
        request_messages(
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "",
            {
                "image": [],
                "audio": [],
            },
        )
    msgs, whole = request_messages({}, "hi", _media([2]))
    assert not whole and msgs[0]["content"][-1] == {"type": "text", "text": "hi"}


def test_stop_text_cuts_a_stop_string_split_over_deltas():
    stop = StopText(["END"])
    out = [stop.push(p, False) for p in ["hello E", "N", "D more"]]
    assert "".join(out) == "hello " and stop.push("x", True) == ""
    assert StopText([]).push("as is", False) == "as is"


def test_spoken_replies_are_kept_within_their_bytes(tiny):
    """The speech kept for resent spoken replies is bounded by its rows' bytes: the oldest
    goes first, one kept again is the newest, one past the whole budget is not kept; a
    kept one is prompted as its speech (its tokens, its span after <audiogen_start>)."""
    tokenizer = TextTokenizer.from_folder(tiny)
    builder = PromptBuilder(tokenizer, ChatTemplate(*load_chat_template(tiny)), placeholder=0)
    builder.max_spoken_bytes = 1000
    rows = torch.zeros(10, 10)  # 400 bytes
    for text in ("one", "two", "one", "three"):
        builder.remember_spoken(text, [7, 8, 0, 9], 1, rows, [("k", text)])
    assert list(builder.spoken) == ["one", "three"] and builder.spoken_bytes == 800
    builder.remember_spoken("long", [7], 1, torch.zeros(30, 10), [])
    assert "long" not in builder.spoken
    dialogue = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "three"}]
    messages, _ = request_messages({"messages": dialogue}, "", {"image": [], "audio": []})
    tokens, spans = builder.full(messages, {"image": [], "audio": []})
    (span,) = spans
    assert tokens[span.start - 1 : span.start + 3] == [7, 8, 0, 9]
    assert span.content_hash == [("k", "three")]
