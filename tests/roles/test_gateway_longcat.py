"""The gateway in front of the five-role LongCat deployment, through the official openai
client over loopback HTTP: media in, image and streamed audio out, a cached second turn;
the OpenAI protocol as real clients speak it: stateless multi-turn that hits the prefix
cache, sessions that never drop an edited history, and the standard fields honoured or
refused (one deployment for all of it: a start is seconds)."""

from __future__ import annotations

import base64
import io
import json
import os
import tempfile
from pathlib import Path

import openai
import pytest
from PIL import Image

import omniflow
from tests.helpers import cli, prebuilt_longcat
from tests.roles.media import image_bytes, wav_bytes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MODEL = "lcgw"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp("lcgw")
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    text = (ROOT / "configs" / "longcat.toml").read_text()
    (work / "lcgw.toml").write_text(text.replace('name = "longcat"', 'name = "lcgw"'))
    prebuilt_longcat(work)
    cli("up", "lcgw.toml", "--detach", "--port", "0", cwd=work)
    state = omniflow.runtime.find_deployment("lcgw")
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    cli("down", "--name", "lcgw", check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def ask(client, parts, **kwargs):
    kwargs.setdefault("seed", 0)  # what a sampled reply happens to be never decides a test
    messages = [{"role": "user", "content": parts}]
    return client.chat.completions.create(model="lcgw", messages=messages, **kwargs)


def test_chat_with_an_image_and_one_with_audio(client):
    text_only = ask(client, "what is this", max_tokens=4)
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(96, 64, seed=5))}}
    with_image = ask(client, [{"type": "text", "text": "what is this"}, image], max_tokens=4)
    audio = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav_bytes(0.8)).decode(), "format": "wav"},
    }
    with_audio = ask(client, [{"type": "text", "text": "what is this"}, audio], max_tokens=4)
    for reply in (text_only, with_image, with_audio):
        assert isinstance(reply.choices[0].message.content, str)
        assert reply.usage.completion_tokens > 0
    # the media's tokens are part of the prompt
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens
    assert with_audio.usage.prompt_tokens > text_only.usage.prompt_tokens


def test_image_output_is_an_image_url_part(client):
    reply = ask(
        client, "draw", modalities=["text", "image"], extra_body={"params": {"image_grid": [2, 3]}}
    )
    parts = reply.choices[0].message.content
    images = [p for p in parts if p["type"] == "image_url"]
    assert len(images) == 1
    url = images[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert png.size == (96, 64)  # 3 x 2 tokens: max(16, ceil(28 n / 16) * 16) px a side


def test_a_streamed_image_comes_as_an_event_of_its_own(client):
    stream = ask(client, "draw", modalities=["text", "image"], stream=True)
    images = [
        part
        for c in list(stream)
        if c.choices
        for part in (c.choices[0].delta.model_extra or {}).get("images", [])
    ]
    assert len(images) == 1 and images[0]["image_url"]["url"].startswith("data:image/png;base64,")


def test_audio_output_streams_in_several_chunks(client):
    stream = ask(
        client,
        "say",
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
        extra_body={"params": {"audio_chunks": 3, "audio_chunk_tokens": 2}},
    )
    chunks = list(stream)
    audio = [
        c.choices[0].delta.audio.data for c in chunks if c.choices and c.choices[0].delta.audio
    ]
    assert len(audio) >= 2  # separate events as the decoder made them, not one at the end
    pcm = b"".join(base64.b64decode(a) for a in audio)
    assert len(pcm) == 3 * 2 * 1920 * 2  # 1920 PCM16 samples per audio token
    # "length" when the text before the audio was cut by max_tokens
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_non_streamed_audio_is_a_wav(client):
    reply = ask(
        client, "say", modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}
    )
    wav = base64.b64decode(reply.choices[0].message.audio.data)
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"


@pytest.mark.parametrize("stream", [False, True])
def test_a_spoken_reply_resent_by_its_audio_id_is_the_speech_it_was(client, stream):
    """OpenAI's way to resend a spoken turn, {"role": "assistant", "audio": {"id": ...}}:
    the gateway puts back its transcript, the llm the speech it made, and the next turn's
    prompt is cached through the speech, as when the transcript itself is resent."""
    turn1 = [{"role": "user", "content": f"speak to me at length, stream {stream}"}]
    spoken = dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    first = chat(client, turn1, seed=3, stream=stream, **spoken)
    if stream:
        chunks = list(first)
        (audio_id,) = {c.choices[0].delta.audio.id for c in chunks if c.choices and
                       c.choices[0].delta.audio}  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        first = chat(client, turn1, seed=3, **spoken)  # its usage, the same turn again
    else:
        audio_id, text = first.choices[0].message.audio.id, first.choices[0].message.content
    assert first.choices[0].message.audio.transcript == text
    follow = {"role": "user", "content": "and then?"}
    by_id = chat(client, [*turn1, {"role": "assistant", "audio": {"id": audio_id}}, follow])
    by_text = chat(client, [*turn1, {"role": "assistant", "content": text}, follow])
    assert by_id.usage.prompt_tokens == by_text.usage.prompt_tokens
    # the first turn's prompt and its speech (start, audio tokens, end), less a page
    said = first.usage.prompt_tokens + first.usage.completion_tokens
    assert by_id.usage.prompt_tokens_details.cached_tokens >= said - 16
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, [*turn1, {"role": "assistant", "audio": {"id": "audio-nope"}}, follow])
    assert refused.value.response.json()["error"]["param"] == "messages[1].audio.id"


def test_a_second_turn_of_a_session_shows_cached_tokens(client):
    first = ask(client, "turn one", user="gw-session-1", max_tokens=4)
    history = [
        {"role": "user", "content": "turn one"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "turn two"},
    ]
    second = client.chat.completions.create(
        model="lcgw", messages=history, user="gw-session-1", max_tokens=4
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_images_generations(client):
    result = client.images.generate(
        model="lcgw",
        prompt="a cat",
        n=2,
        size="64x96",
        response_format="b64_json",
        extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 1.5},
    )
    assert len(result.data) == 2
    for item in result.data:
        png = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert png.format == "PNG" and png.size == (64, 96)
    # no size: the pipeline's default, a side the token grid gives (4 tokens, 112 px)
    plain = client.images.generate(model="lcgw", prompt="a cat", response_format="b64_json",
                                   extra_body={"seed": 3, "num_inference_steps": 1})  # fmt: skip
    png = Image.open(io.BytesIO(base64.b64decode(plain.data[0].b64_json)))
    assert png.size == (112, 112)


def _log(role: str) -> str:
    state = omniflow.runtime.find_deployment("lcgw")
    return (Path(state["run_dir"]) / "logs" / f"{role}-0.log").read_text()


def test_a_param_of_the_wrong_type_is_a_400_naming_it_not_an_internal_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "draw", modalities=["text", "image"], extra_body={"params": {"cfg_scale": "x"}})
    assert "params.cfg_scale: Expected `float`, got `str`" in str(caught.value)
    assert "Traceback" not in _log("llm")
    assert ask(client, "still here", max_tokens=2).choices[0].message.content is not None


def test_send_checks_params_against_what_the_longcat_roles_declare(client, tmp_path):
    def send(*args):
        return cli("send", "--name", "lcgw", "-o", str(tmp_path), *args, check=False)

    typo = send("-t", "hi", "-p", "max_token=2")
    assert typo.returncode == 2
    assert "--param max_token: no role of lcgw reads it (did you mean max_tokens?)" in typo.stderr
    wrong = send("-t", "hi", "--want", "image", "-p", "cfg_scale=abc")
    assert wrong.returncode == 2 and '--param cfg_scale="abc"' in wrong.stderr
    odd = send("-t", "hi", "--want", "image", "--size", "60x64")  # 60 px is no longcat side
    assert odd.returncode == 2 and "60 px is not a longcat image side" in odd.stderr
    grid = send("-t", "hi", "--want", "image", "-p", "image_grid=[2,40]")
    assert grid.returncode == 2  # the range is the llm's to check: bad_request, exit 2
    assert "[bad_request] llm: params.image_grid[1]: Expected `int` <= 32" in grid.stderr
    ok = send("-t", "hi", "--want", "image", "--seed", "3", "--steps", "2", "--cfg-scale", "1.5")
    assert ok.returncode == 0, ok.stderr
    assert list(tmp_path.glob("*.png"))


def test_send_takes_a_32_bit_float_wav(client, tmp_path):
    import numpy as np

    from omniflow.roles.audio_encoder import read_wav
    from omniflow.roles.options import ACCEPTED_RATES
    from tests.roles.test_audio_encoder import _float_wav

    samples, rate = read_wav(wav_bytes(0.5, rate=16000), ACCEPTED_RATES)
    path = tmp_path / "float.wav"
    path.write_bytes(_float_wav(samples[:, None].astype(np.float32), rate))
    sent = cli(
        "send", "--name", "lcgw", "-o", str(tmp_path), "-t", "hear", "-a", str(path), "--json"
    )
    assert sent.returncode == 0, sent.stderr


def test_speech_streams_sse_deltas_as_the_decoder_makes_them(client):
    import json

    params = {"audio_chunks": 3, "audio_chunk_tokens": 2}
    with client.audio.speech.with_streaming_response.create(
        model="lcgw",
        voice="alloy",
        input="hello there",
        response_format="pcm",
        stream_format="sse",
        extra_body={"params": params},
    ) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == 3 * 2 * 1920 * 2  # 1920 PCM16 samples per audio token
    import httpx

    metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    first = [m for m in metrics.splitlines() if m.startswith("omniflow_time_to_first_audio")]
    assert any('route="speech"' in m and 'role="audio_decoder"' in m for m in first)
    assert (
        'omniflow_audio_real_time_factor_count{replica="0",role="audio_decoder",route="speech"}'
        in metrics
    )


def test_speech_as_a_wav_stream_and_refused_formats(client):
    import wave

    reply = client.audio.speech.create(
        model="lcgw",
        voice="alloy",
        input="hi",
        response_format="wav",
        extra_body={"params": {"audio_chunks": 2, "audio_chunk_tokens": 2}},
    )
    data = reply.read()
    assert data[:4] == b"RIFF"
    with wave.open(io.BytesIO(data[:44] + b"")) as w:  # the streaming header
        assert w.getframerate() > 0 and w.getsampwidth() == 2
    assert len(data) == 44 + 2 * 2 * 1920 * 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="lcgw", voice="alloy", input="hi", response_format="mp3")
    assert caught.value.body["param"] == "response_format"


def test_an_image_edit_goes_through_the_vision_encoder(client):
    def edit(seed_of_image: int):
        source = ("in.png", image_bytes(96, 64, seed=seed_of_image), "image/png")
        return client.images.edit(
            model="lcgw", image=source, prompt="make it blue", size="64x64", extra_body={"seed": 3}
        )

    one, other = edit(1), edit(2)
    png = base64.b64decode(one.data[0].b64_json)
    assert Image.open(io.BytesIO(png)).size == (64, 64)
    assert png != base64.b64decode(other.data[0].b64_json)  # conditioned on the image


def test_send_and_the_gateway_render_one_turn_with_the_same_template(client, tmp_path):
    import json

    sent = cli("send", "--name", "lcgw", "-o", str(tmp_path), "-t", "same words", "--json")
    assert sent.returncode == 0, sent.stderr
    usage = json.loads(sent.stdout.strip().splitlines()[-1])["usage"]
    reply = ask(client, "same words", max_tokens=2)
    assert usage["prompt_tokens"] == reply.usage.prompt_tokens


# `omniflow send --size` on this deployment: its roles read ``image_grid``, and the CLI
# maps the size onto that token grid as the gateway does (a side of n tokens is
# max(16, ceil(28 n / 16) * 16) px); a side that is no LongCat side is refused (exit 2),
# naming --size and the nearest sides, before anything is sent.


def _send(out: Path, *args: str):
    return cli("send", "--name", "lcgw", "--out", str(out), *args, check=False)


def test_send_size_becomes_the_token_grid_and_the_png_has_it(client, tmp_path):
    sent = _send(tmp_path, "-t", "a cat", "--want", "image", "--size", "112x144", "--json")
    assert sent.returncode == 0, sent.stderr
    files = [f for f in json.loads(sent.stdout)["files"] if f.endswith(".png")]
    assert len(files) == 1, sent.stdout
    with Image.open(files[0]) as png:
        assert png.size == (112, 144)  # 4 x 5 tokens


def test_send_refuses_a_side_that_is_no_longcat_side_naming_size(client, tmp_path):
    sent = _send(tmp_path, "-t", "a cat", "--want", "image", "--size", "128x128")
    assert sent.returncode == 2, sent.stderr
    assert "--size 128x128" in sent.stderr and "nearest: [112, 144]" in sent.stderr
    assert "no role" not in sent.stderr
    auto = _send(tmp_path, "-t", "a cat", "--want", "image", "--size", "auto")
    assert auto.returncode == 2 and "--size auto: expected WIDTHxHEIGHT" in auto.stderr
    both = _send(tmp_path, "-t", "x", "--size", "112x112", "-p", "image_grid=[4,4]")
    assert both.returncode == 2 and "give one of them" in both.stderr


# ---------------------------------------------------------------- the OpenAI protocol


def chat(client, messages, **kwargs):
    """A chat completion, seeded unless the test says otherwise: what a sampled reply
    happens to be (an end token first, a special token) never decides a test."""
    kwargs.setdefault("max_tokens", 6)
    kwargs.setdefault("seed", 0)
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
    reply = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=3, logprobs=1, seed=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 3
    assert choice.logprobs.tokens and "".join(choice.logprobs.tokens) == choice.text
    # no chat template: the prompt's own tokens and <s>
    assert reply.usage.prompt_tokens <= 4
    streamed = list(
        client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True, seed=1)
    )
    whole = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, seed=1)
    assert [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
