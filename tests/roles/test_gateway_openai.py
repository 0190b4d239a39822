"""The OpenAI protocol as real clients speak it, through the official openai client against
the LongCat tiny roles (encoders + llm): stateless multi-turn that hits the prefix cache,
sessions that never drop an edited history, and the standard fields honoured or refused."""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path

import openai
import pytest

import omniflow
from tests.helpers import cli, prebuilt_longcat
from tests.roles.media import image_bytes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MODEL = "lcoa"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp(MODEL)
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    text = (ROOT / "configs" / "longcat.toml").read_text()
    text = text.replace('name = "longcat"', f'name = "{MODEL}"')
    for role in ("image_decoder", "audio_decoder"):  # text out only: a quicker start
        start = text.index(f"[roles.{role}]")
        text = text[:start] + text[text.index("\n\n", text.index(f"[roles.{role}.options]")) :]
    text = text.replace(
        '  { from = "llm", to = "image_decoder", when = "has:image_codes" },\n', ""
    ).replace(
        '  { from = "llm", to = "audio_decoder", when = "has:audio_codes", stream = true },\n', ""
    )
    (work / f"{MODEL}.toml").write_text(text)
    prebuilt_longcat(work)
    cli("up", f"{MODEL}.toml", "--detach", "--port", "0", cwd=work)
    state = omniflow.runtime.find_deployment(MODEL)
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    cli("down", "--name", MODEL, check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def chat(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def image_part(seed: int) -> dict:
    data = base64.b64encode(image_bytes(96, 64, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def test_a_stateless_three_turn_dialogue_reuses_every_earlier_token(client):
    turn1 = [{"role": "user", "content": [image_part(11), {"type": "text", "text": "what?"}]}]
    first = chat(client, turn1)
    history = [*turn1, {"role": "assistant", "content": first.choices[0].message.content}]
    history.append({"role": "user", "content": "and its colour?"})
    second = chat(client, history)
    history += [
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "thanks"},
    ]
    third = chat(client, history)
    # Without the image the same dialogue is shorter by the image's tokens: turn 3 had them.
    no_image = [{"role": "user", "content": [{"type": "text", "text": "what?"}]}, *history[1:]]
    blind = chat(client, no_image)
    image_tokens = third.usage.prompt_tokens - blind.usage.prompt_tokens
    assert image_tokens >= 6  # 96x64 pixels: a 3x2 grid of 16-pixel tokens at least
    # Turn 3's cache hit covers turn 1's prompt (the image's span by its hash) and reply,
    # and turn 2's, up to the last whole KV page.
    page = 16
    covered = second.usage.prompt_tokens + second.usage.completion_tokens - 1
    assert third.usage.prompt_tokens_details.cached_tokens >= covered // page * page
    assert third.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - page
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens


def test_a_session_with_an_edited_history_is_prompted_whole(client):
    turn1 = [{"role": "user", "content": "my name is Ann"}]
    first = chat(client, turn1, extra_body={"session": "edit-1"})
    edited = [
        {"role": "user", "content": "my name is Bob, a much longer name to tell apart"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "what is my name?"},
    ]
    with_session = chat(client, edited, extra_body={"session": "edit-1"})
    stateless = chat(client, edited)
    assert with_session.usage.prompt_tokens == stateless.usage.prompt_tokens
    # A history that extends the session's goes on from the session: all of it cached.
    extended = [
        *edited,
        {"role": "assistant", "content": with_session.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    third = chat(client, extended, extra_headers={"X-Session-Id": "edit-1"})
    assert third.usage.prompt_tokens == chat(client, extended).usage.prompt_tokens
    assert third.usage.prompt_tokens_details.cached_tokens > with_session.usage.prompt_tokens // 2


def test_user_is_a_label_not_a_session(client):
    one = chat(client, [{"role": "user", "content": "first chat"}], user="ann")
    other = [
        {"role": "system", "content": "a system prompt that must not be dropped"},
        {"role": "user", "content": "second chat"},
    ]
    two = chat(client, other, user="ann")
    assert two.usage.prompt_tokens == chat(client, other).usage.prompt_tokens
    assert one.usage.prompt_tokens < two.usage.prompt_tokens


def test_finish_reason_is_length_when_max_tokens_cuts(client):
    reply = chat(client, [{"role": "user", "content": "count"}], max_completion_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_stop_n_seed_logprobs_and_penalties(client):
    ask = [{"role": "user", "content": "tell me"}]
    greedy = chat(client, ask, temperature=0, max_tokens=16).choices[0].message.content
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    assert stop.strip(), greedy
    cut = chat(client, ask, temperature=0, max_tokens=16, stop=[stop])
    assert cut.choices[0].message.content == greedy[: greedy.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    two = chat(client, ask, n=2, seed=5, temperature=1.0)
    assert [c.index for c in two.choices] == [0, 1]
    again = chat(client, ask, n=2, seed=5, temperature=1.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]
    # Greedy: a sampled token can be part of a UTF-8 character, whose own text is "\ufffd".
    scored = chat(client, ask, logprobs=True, top_logprobs=2, max_tokens=4, temperature=0)
    entries = scored.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries) == scored.choices[0].message.content
    penalised = chat(client, ask, presence_penalty=1.5, frequency_penalty=1.0)
    assert penalised.usage.completion_tokens > 0


def test_stream_usage_only_when_asked(client):
    ask = [{"role": "user", "content": "stream"}]
    plain = list(chat(client, ask, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason
    counted = list(chat(client, ask, stream=True, stream_options={"include_usage": True}))
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == 6
    assert counted[-2].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": "x"}], **extra)
    assert caught.value.body["param"] == param


def test_completions_take_the_prompt_as_it_is(client):
    reply = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, logprobs=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 3
    assert choice.logprobs.tokens and "".join(choice.logprobs.tokens) == choice.text
    # no chat template: the prompt's own tokens and <s>
    assert reply.usage.prompt_tokens <= 4
    streamed = list(
        client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices)
