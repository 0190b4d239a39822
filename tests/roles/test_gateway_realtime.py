"""/v1/realtime over a real WebSocket, in front of the LongCat tiny voice roles (audio
encoder, llm, audio decoder): the openai SDK's realtime client and raw ``websockets``. A
voice turn (PCM16 in, text and audio deltas out), the next turn's cache hit, a barge-in
cancel that frees the llm, and bad events answered by ``error`` naming the field."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import tempfile
import time
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import websockets

import omniflow
from omniflow.runtime.deployment import list_deployment_actors
from tests.helpers import cli, prebuilt_longcat
from tests.roles.test_gateway import KEY, gateway  # noqa: F401  (the echo deployment)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MODEL = "lcrt"
SHORT = {"audio_chunks": 2, "audio_chunk_tokens": 2}
# The first turn then ends past a page boundary (40 prompt + the audiotext start + 8 audio
# tokens; pages of 16): the next turn's cache hit covers its audio positions.
# seeded: an unseeded reply's first text token is now and then its end (no text at all)
LONGER = {"audio_chunks": 2, "audio_chunk_tokens": 4, "seed": 3}


def voice_config() -> str:
    """configs/longcat.toml without the image roles: a quicker start."""
    text = (ROOT / "configs" / "longcat.toml").read_text()
    text = text.replace('name = "longcat"', f'name = "{MODEL}"')
    for role in ("vision_encoder", "image_decoder"):
        start = text.index(f"[roles.{role}]")
        text = text[:start] + text[text.index("\n\n", text.index(f"[roles.{role}.options]")) :]
    for edge in (
        '  { from = "input", to = "vision_encoder", when = "has_image" },\n',
        '  { from = "vision_encoder", to = "llm" },\n',
        '  { from = "llm", to = "image_decoder", when = "has:image_codes" },\n',
    ):
        text = text.replace(edge, "")
    return text


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp(MODEL)
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    (work / f"{MODEL}.toml").write_text(voice_config())
    prebuilt_longcat(work)
    cli("up", f"{MODEL}.toml", "--detach", "--port", "0", cwd=work)
    state = omniflow.runtime.find_deployment(MODEL)
    url = (Path(state["run_dir"]) / "gateway.url").read_text().strip()
    yield url, state
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)  # the echo deployment's teardown popped it
    cli("down", "--name", MODEL, check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def pcm16(seconds: float, rate: int = 24000, freq: float = 330.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def until(events, kind: str, seen: list | None = None) -> dict:
    async for event in events:
        if seen is not None:
            seen.append(event)
        if event["type"] == kind:
            return event
    raise AssertionError(f"the connection closed before {kind}")


async def sdk_turn(connection, pcm: bytes) -> list:
    half = len(pcm) // 2
    await connection.input_audio_buffer.append(audio=b64(pcm[:half]))
    await connection.input_audio_buffer.append(audio=b64(pcm[half:]))
    await connection.input_audio_buffer.commit()
    await connection.response.create()
    events = []
    async for event in connection:
        events.append(event)
        if event.type == "response.done":
            return events
    raise AssertionError("closed before response.done")


def test_a_voice_turn_through_the_openai_sdk_and_the_next_hits_the_cache(deployment):
    url, _ = deployment

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as connection:
            created = await connection.recv()
            assert created.type == "session.created"
            await connection.session.update(
                session={
                    "type": "realtime",
                    "instructions": "be brief",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": None,
                        }
                    },
                    "params": LONGER,
                }
            )
            updated = await connection.recv()
            assert updated.type == "session.updated", updated
            first = await sdk_turn(connection, pcm16(0.5))
            second = await sdk_turn(connection, pcm16(0.4, freq=550.0))
        return first, second

    first, second = asyncio.run(main())
    kinds = [e.type for e in first]
    assert kinds[:2] == ["input_audio_buffer.committed", "conversation.item.added"]
    assert "response.created" in kinds and kinds[-1] == "response.done"
    text = [e.delta for e in first if e.type == "response.output_text.delta"]
    audio = [base64.b64decode(e.delta) for e in first if e.type == "response.output_audio.delta"]
    # 1 token first (sooner), then 4, then the last 3, then the 50 ms the last one held
    # back for a cross-fade (given at the stream's end)
    assert text and len(audio) == 4
    assert sum(map(len, audio)) == 2 * 4 * 1920 * 2  # PCM16, 1920 samples per audio token
    assert kinds.index("response.output_audio.done") > kinds.index("response.output_audio.delta")
    done = first[-1].response
    assert done.status == "completed" and done.audio.output.format.rate == 24000
    assert done.output[0].content[0].text == "".join(text)
    # the second turn goes on from the first one's KV: all of it was prefilled before, the
    # audio positions (their rows hold the text spoken with them) through the page they end
    later = second[-1].response.usage
    assert later.input_token_details.cached_tokens >= first[-1].response.usage.input_tokens
    metrics = httpx2.get(f"{url}/metrics").text  # the audio metrics name route, role, replica
    labels = '{replica="0",role="audio_decoder",route="realtime"}'
    assert f"omniflow_time_to_first_audio_seconds_count{labels} 2.0" in metrics
    assert f"omniflow_audio_real_time_factor_count{labels} 2.0" in metrics


def _llm_inflight(state, roles=("llm",)) -> int:
    records = asyncio.run(list_deployment_actors(state))
    return sum(r.inflight for r in records if r.role in roles)


def _all_inflight(state) -> int:
    return _llm_inflight(state, ("llm", "audio_decoder", "audio_encoder"))


def test_barge_in_cancels_the_response_in_every_role(deployment):
    url, state = deployment
    ws_url = url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    long = {"audio_chunks": 64, "audio_chunk_tokens": 16}

    async def main():
        async with websockets.connect(ws_url) as ws:
            events = (json.loads(m) async for m in ws)
            await until(events, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"params": long}}))
            await until(events, "session.updated")
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "talk"}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            created = await until(events, "response.created")
            await until(events, "response.output_audio.delta")
            # records carry inflight from heartbeats (every heartbeat_s): wait for the
            # llm's to show the request it is still generating
            deadline = time.monotonic() + 3
            busy = await asyncio.to_thread(_llm_inflight, state)
            while not busy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                busy = await asyncio.to_thread(_llm_inflight, state)
            await ws.send(json.dumps({"type": "response.cancel"}))
            seen: list = []
            done = await until(events, "response.done", seen)
            assert done["response"]["id"] == created["response"]["id"]
            deadline = time.monotonic() + 3
            while await asyncio.to_thread(_all_inflight, state) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            freed = await asyncio.to_thread(_all_inflight, state)
            # the session goes on: a short turn after the barge-in completes
            await ws.send(json.dumps({"type": "session.update", "session": {"params": SHORT}}))
            await ws.send(json.dumps({"type": "response.create"}))
            after = await until(events, "response.done")
        return busy, done, seen, freed, after

    busy, done, seen, freed, after = asyncio.run(main())
    assert busy == 1  # still generating 1024 audio tokens when the cancel went
    assert done["response"]["status"] == "cancelled"
    assert any(e["type"] == "response.output_audio.done" for e in seen)
    assert freed == 0  # the llm and the audio decoder hold nothing of it
    assert after["response"]["status"] == "completed"


def test_barge_in_and_a_bad_event_through_the_openai_sdk(deployment):
    url, state = deployment

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as connection:
            await connection.session.update(
                session={
                    "type": "realtime",
                    "params": {"audio_chunks": 64, "audio_chunk_tokens": 16},
                }
            )
            await connection.send({"type": "input_audio_buffer.append", "audio": "not base64!"})
            await connection.input_audio_buffer.append(audio=b64(pcm16(0.3)))
            await connection.input_audio_buffer.commit()
            await connection.response.create()
            events = []
            async for event in connection:
                events.append(event)
                if event.type == "response.output_audio.delta":
                    await connection.response.cancel()
                if event.type == "response.done":
                    break
        return events

    events = asyncio.run(main())
    (error,) = [e for e in events if e.type == "error"]
    assert error.error.param == "audio" and error.error.type == "invalid_request_error"
    assert events[-1].response.status == "cancelled"
    deadline = time.monotonic() + 3
    while _all_inflight(state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _all_inflight(state) == 0


def test_bad_events_are_answered_by_an_error_naming_the_field(deployment):
    url, _ = deployment
    ws_url = url.replace("http://", "ws://") + "/v1/realtime"
    bad = [
        ({"type": "input_audio_buffer.append", "audio": 5}, "audio"),
        ({"type": "input_audio_buffer.append", "audio": "%%%"}, "audio"),
        ({"type": "no.such.event"}, "type"),
        ({"event_id": "x"}, "type"),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "picture"}]},
            },
            "item.content[0].type",
        ),
        (
            {
                "type": "session.update",
                "session": {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}},
            },
            "session.audio.input.turn_detection",
        ),
        ({"type": "input_audio_buffer.commit"}, "input_audio_buffer"),
        ({"type": "response.cancel"}, "response_id"),
    ]

    async def main():
        errors = []
        async with websockets.connect(ws_url) as ws:
            events = (json.loads(m) async for m in ws)
            await until(events, "session.created")
            for i, (event, _) in enumerate(bad):
                await ws.send(json.dumps({"event_id": f"evt_{i}", **event}))
                errors.append(await until(events, "error"))
            await ws.send("{not json")
            errors.append(await until(events, "error"))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            cleared = await until(events, "input_audio_buffer.cleared")  # still open
        return errors, cleared

    errors, cleared = asyncio.run(main())
    for (event, param), error in zip(bad, errors, strict=False):
        assert error["error"]["param"] == param, (event, error)
        assert error["error"]["type"] == "invalid_request_error"
    assert errors[0]["error"]["event_id"] == "evt_0"
    assert "no.such.event" in errors[2]["error"]["message"]
    assert errors[-1]["error"]["param"] == "event"
    assert cleared["type"] == "input_audio_buffer.cleared"


def test_an_unknown_model_is_refused_at_the_handshake(deployment):
    url, _ = deployment

    async def main():
        with pytest.raises(websockets.InvalidStatus) as caught:
            async with websockets.connect(
                url.replace("http://", "ws://") + "/v1/realtime?model=nope"
            ):
                pass
        return caught.value.response.status_code

    assert asyncio.run(main()) == 403


def spoken_wav(path: Path, rate: int = 48000) -> None:
    """A voice-like WAV (a falling pitch with two formants, syllable by syllable): what the
    fake microphone plays."""
    t = np.arange(int(1.5 * rate)) / rate
    pitch = 180 - 40 * t
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    sound = sum(np.sin(k * phase) / k for k in range(1, 12))
    formants = 1 + 0.5 * np.sin(2 * np.pi * 700 * t) + 0.3 * np.sin(2 * np.pi * 1200 * t)
    syllables = 0.5 * (1 - np.cos(2 * np.pi * 4 * t))
    samples = 0.2 * sound * formants * syllables / np.max(np.abs(sound * formants))
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())


@pytest.mark.browser
def test_the_playground_voice_mode_in_headless_chromium(deployment, tmp_path):
    from tests.roles.test_gateway import CHROMIUM, _browser_missing

    if not Path(CHROMIUM).exists():
        _browser_missing(f"no {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright import sync_api
    except ImportError:
        _browser_missing("no playwright (the browser extra: pip install -e .[browser])")
    url, _ = deployment
    spoken_wav(tmp_path / "spoken.wav")
    args = [
        "--no-sandbox",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={tmp_path / 'spoken.wav'}",
        "--autoplay-policy=no-user-gesture-required",
    ]
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page()
            sockets: list[str] = []
            page.on("websocket", lambda ws: sockets.append(ws.url))
            page.goto(f"{url}/")
            page.click("#voice")  # talk
            page.wait_for_function(
                "document.getElementById('voice-status').textContent === 'listening'"
            )
            page.wait_for_timeout(1200)  # ~1 s of the file through the microphone
            page.click("#voice")  # send
            page.wait_for_function(
                "document.getElementById('voice-status').textContent.startsWith('completed')",
                timeout=60_000,
            )
            # the reply's audio is scheduled as it comes and has played to its end
            page.wait_for_function(
                "voice.played > 0 && voice.played >= voice.seconds - 1e-6", timeout=20_000
            )
            page.screenshot(path=str(tmp_path / "voice.png"), full_page=True)
            text = page.text_content("#voice-text")
            chunks = page.evaluate("voice.chunks")
            heard = page.evaluate("voice.sent / voice.ctx.sampleRate")  # seconds sent
            status = page.text_content("#voice-status")
            error = page.text_content("#error")
        finally:
            browser.close()
    assert error == ""
    assert text and chunks >= 2, (text, chunks)
    assert heard >= 0.5  # the microphone's audio went up before the commit
    assert "tokens" in status  # usage came back with response.done
    assert sockets == [url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"]
    assert (tmp_path / "voice.png").stat().st_size > 0


def test_the_api_key_goes_as_a_header_or_a_browser_subprotocol(gateway):  # noqa: F811
    """The echo deployment of test_gateway.py, whose [gateway] sets an api_key."""
    url, _ = gateway
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?model=gw"

    async def main():
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url):
                pass
        header = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(ws_url, additional_headers=header) as ws:
            by_header = json.loads(await ws.recv())
        protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
        async with websockets.connect(ws_url, subprotocols=protocols) as ws:
            by_protocol = json.loads(await ws.recv())
            chosen = ws.subprotocol
        return refused.value.response.status_code, by_header, by_protocol, chosen

    status, by_header, by_protocol, chosen = asyncio.run(main())
    assert status == 403
    assert by_header["type"] == by_protocol["type"] == "session.created"
    assert by_protocol["session"]["model"] == "gw" and chosen == "realtime"
