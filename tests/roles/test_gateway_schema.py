"""The gateway's request handling without a server: bodies, media, sessions, sizes."""

from __future__ import annotations

import base64
import json

import pytest

from omniflow.roles.gateway.schema import (
    ApiError,
    ChatRequest,
    ImageRequest,
    chat_inputs,
    chat_params,
    decode_body,
    image_params,
    media_bytes,
    refuse_unsupported,
)


def test_a_local_path_is_read_only_when_allowed(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(b"png bytes")
    assert media_bytes(str(path), "p", allow_local_paths=True) == b"png bytes"
    assert media_bytes(f"file://{path}", "p", allow_local_paths=True) == b"png bytes"
    with pytest.raises(ApiError) as info:
        media_bytes(str(path), "p", allow_local_paths=False)
    assert info.value.status == 400 and info.value.param == "p"


def test_data_urls_decode_and_remote_urls_are_refused():
    url = "data:image/png;base64," + base64.b64encode(b"abc").decode()
    assert media_bytes(url, "p", False) == b"abc"
    for bad in ("https://example.com/cat.png", "data:image/png;base64,@@@"):
        with pytest.raises(ApiError):
            media_bytes(bad, "p", True)


def _chat(messages, **extra) -> ChatRequest:
    return decode_body(
        json.dumps({"model": "m", "messages": messages, **extra}).encode(), ChatRequest
    )


DIALOGUE = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "eno"},
    {"role": "user", "content": [{"type": "text", "text": "two"}]},
]


def test_the_whole_dialogue_goes_as_messages_with_every_turns_media():
    image = "data:image/png;base64," + base64.b64encode(b"img").decode()
    turns = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
        *DIALOGUE,
    ]
    inputs, want = chat_inputs(_chat(turns, session="s1"), False)
    assert want == ["text"] and inputs["image"] == b"img"
    assert inputs["messages"][0] == {"role": "user", "content": [{"type": "image"}]}
    assert inputs["messages"][1] == {"role": "assistant", "content": "a cat"}
    assert inputs["messages"][2:] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "eno"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
    ]
    assert inputs["text"].endswith("system: be brief\nuser: one\nassistant: eno\nuser: two")


def test_modalities_and_sampling_become_params():
    req = _chat(
        DIALOGUE,
        modalities=["audio", "text"],
        max_completion_tokens=7,
        seed=3,
        stop="END",
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
    )
    _, want = chat_inputs(req, False)
    assert want == ["text", "audio"]
    assert chat_params(req, want) == {
        "want": "text,audio",
        "max_tokens": 7,
        "seed": 3,
        "stop": ["END"],
        "logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
    }


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_fields_the_deployment_cannot_honour_are_refused_by_name(extra, param):
    with pytest.raises(ApiError) as info:
        refuse_unsupported(_chat(DIALOGUE, **extra))
    assert info.value.status == 400 and info.value.param == param
    refuse_unsupported(_chat(DIALOGUE, response_format={"type": "text"}))


def test_no_user_message_is_a_400_naming_messages():
    with pytest.raises(ApiError) as info:
        chat_inputs(_chat([{"role": "system", "content": "x"}]), False)
    assert info.value.param == "messages"


def test_size_maps_onto_the_token_grid():
    req = decode_body(b'{"prompt": "cat", "size": "64x96", "num_inference_steps": 3}', ImageRequest)
    assert image_params(req) == {"want": "image", "image_grid": [3, 2], "steps": 3}
    # LongCat-Next's sides: n tokens are max(16, ceil(28 n / 16) * 16) px; 18 tokens: 512 px.
    assert image_params(ImageRequest(prompt="x", size="512x896"))["image_grid"] == [32, 18]
    assert image_params(ImageRequest(prompt="x", size="112x32"))["image_grid"] == [1, 4]
    for size in ("100x100", "big", "2048x32", "128x128", "1024x1024"):
        with pytest.raises(ApiError) as info:
            image_params(ImageRequest(prompt="x", size=size))
        assert info.value.param == "size"
    # no size: longcat's default grid (the default works on every pipeline)
    assert image_params(ImageRequest(prompt="x"))["image_grid"] == [4, 4]
    assert image_params(ImageRequest(prompt="x"), sized=True)["size"] == "128x128"
    with pytest.raises(ApiError, match=r"nearest: \[112, 144\]"):
        image_params(ImageRequest(prompt="x", size="128x128"))
