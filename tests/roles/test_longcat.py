"""The LongCat-style five-role deployment end to end, with real processes and real files."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tempfile
import wave
from pathlib import Path

import pytest
from PIL import Image

import omniflow
from omniflow.memory import pid_alive
from tests.helpers import cli
from tests.roles.media import image_bytes, png_claiming_size, wav_bytes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    work = tmp_path_factory.mktemp("longcat")
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    # Run from a scratch folder: the tiny models are built under its models/ on first start.
    (work / "configs").mkdir()
    (work / "configs" / "longcat.toml").write_text((ROOT / "configs" / "longcat.toml").read_text())
    (work / "cat.png").write_bytes(image_bytes(96, 64))
    (work / "hi.wav").write_bytes(wav_bytes(1.0))
    cli("up", "configs/longcat.toml", "--detach", cwd=work)
    state = omniflow.runtime.find_deployment("longcat")
    yield state, work
    cli("down", "--name", "longcat", check=False)
    os.environ.pop("OMNIFLOW_RUN_ROOT", None)


def call(state, inputs, **kwargs):
    async def run():
        conn = await omniflow.connect(run_dir=state["run_dir"])
        try:
            events = [e async for e in conn.stream(inputs, timeout=120, **kwargs)]
            return events[:-1], events[-1]
        finally:
            await conn.close()

    return asyncio.run(run())


def roles_of(outputs):
    return {o.role for o in outputs}


def test_text_only(longcat):
    # Seeded: unseeded, the tiny model's first token is EOS ~0.75% of the time (no text).
    outs, result = call(longcat[0], {"text": "hello"}, params={"seed": 7})
    assert roles_of(outs) == {"llm"}
    assert "".join(o.data["text"] for o in outs)
    assert [t.role for t in result.timings] == ["llm"]
    assert result.usage["completion_tokens"] > 0


@pytest.mark.parametrize("kind", ["image", "audio", "both"])
def test_media_in(longcat, kind):
    inputs = {"text": "what is this"}
    if kind in ("image", "both"):
        inputs["image"] = image_bytes(96, 64, seed=3)
    if kind in ("audio", "both"):
        inputs["audio"] = wav_bytes(0.8)
    outs, result = call(longcat[0], inputs)
    assert roles_of(outs) == {"llm"}
    ran = {t.role for t in result.timings}
    assert ("vision_encoder" in ran) == (kind in ("image", "both"))
    assert ("audio_encoder" in ran) == (kind in ("audio", "both"))
    # the media's tokens are part of the LLM's prompt
    text_only = call(longcat[0], {"text": "what is this"})[1].usage["prompt_tokens"]
    assert result.usage["prompt_tokens"] > text_only


def test_image_out_is_a_png_of_the_expected_size(longcat):
    outs, result = call(
        longcat[0], {"text": "draw"}, params={"want": "text,image", "image_grid": [2, 3]}
    )
    images = [o for o in outs if o.role == "image_decoder"]
    assert len(images) == 1
    png = Image.open(io.BytesIO(images[0].data["image"]))
    assert png.format == "PNG"
    assert png.size == (96, 64) == (images[0].data["width"], images[0].data["height"])


def test_audio_out_streams_in_chunks(longcat):
    outs, result = call(
        longcat[0],
        {"text": "say"},
        params={"want": "audio", "audio_chunks": 3, "audio_chunk_tokens": 2},
    )
    chunks = [o for o in outs if o.role == "audio_decoder"]
    assert len(chunks) >= 2  # arrived as separate outputs before the request ended
    assert [c.data["index"] for c in chunks] == list(range(len(chunks)))
    assert all(c.data["sample_rate"] == 24000 for c in chunks)
    samples = sum(len(c.data["audio_chunk"]) // 2 for c in chunks)
    assert samples == 3 * 2 * 1920  # 1920 samples (80 ms at 24 kHz) per audio token


def test_everything_at_once_through_the_cli(longcat):
    state, work = longcat
    proc = cli(
        "send",
        "--name",
        "longcat",
        "--text",
        "all of it",
        "--image",
        "cat.png",
        "--audio",
        "hi.wav",
        "--want",
        "text,image,audio",
        "--seed",
        "1",
        "--out",
        "out",
        "--json",
        cwd=work,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["text"]
    pngs = [f for f in report["files"] if f.endswith(".png")]
    wavs = [f for f in report["files"] if f.endswith(".wav")]
    assert len(pngs) == 1 and len(wavs) == 1
    assert Image.open(work / pngs[0]).size == (112, 112)  # 4 x 4 tokens: 28 * 4 px
    with wave.open(str(work / wavs[0])) as w:
        assert w.getframerate() == 24000
        assert w.getnframes() == 3 * 4 * 1920  # default: 3 chunks of 4 tokens
    assert set(report["timings_ms"]) == {
        "vision_encoder",
        "audio_encoder",
        "llm",
        "image_decoder",
        "audio_decoder",
    }
    assert "cached_tokens" in report["usage"]


def test_second_turn_of_a_session_reuses_the_cache(longcat):
    state, work = longcat
    first = json.loads(
        cli(
            "send",
            "--name",
            "longcat",
            "--text",
            "turn one",
            "--image",
            "cat.png",
            "--session",
            "s-42",
            "--json",
            cwd=work,
        ).stdout
    )
    second = json.loads(
        cli(
            "send",
            "--name",
            "longcat",
            "--text",
            "turn two",
            "--session",
            "s-42",
            "--json",
            cwd=work,
        ).stdout
    )
    assert first["usage"]["cached_tokens"] == 0
    assert second["usage"]["cached_tokens"] > 0


def test_next_turn_reuses_the_kv_of_the_image_the_last_turn_generated(longcat):
    state = longcat[0]
    params = {"want": "text,image", "image_grid": [8, 8], "max_tokens": 5}
    outs, first = call(state, {"text": "draw a cat"}, session="gen-1", params=params)
    assert any(o.role == "image_decoder" for o in outs)
    history = first.usage["prompt_tokens"] + first.usage["completion_tokens"]
    _, second = call(state, {"text": "and now?"}, session="gen-1")
    # The 64 generated image tokens follow the history; all but the last page are cached.
    assert second.usage["cached_tokens"] >= history + 64 - 16


def test_same_image_later_is_a_hit_a_different_one_is_not(longcat):
    state = longcat[0]
    a, b = image_bytes(64, 64, seed=11), image_bytes(64, 64, seed=12)  # equal token counts
    call(state, {"text": "x", "image": a}, session="mm-1")
    same = call(state, {"text": "x", "image": a})[1].usage
    other = call(state, {"text": "x", "image": b})[1].usage
    assert same.get("encoder_cache_hits") == 1
    assert same["cached_tokens"] > other["cached_tokens"]


@pytest.mark.parametrize(
    "inputs, field, words",
    [
        ({"text": "x", "image": b"\x89PNG\r\n\x1a\nnot really"}, "image", "unreadable"),
        ({"text": "x", "image": png_claiming_size(10000, 10000)}, "image", "exceeds the limit"),
        ({"text": "x", "audio": wav_bytes(1.0)[:30]}, "audio", ""),
        ({"text": "x", "audio": wav_bytes(0.5, rate=11025)}, "audio", "11025"),
    ],
)
def test_bad_inputs_get_clear_errors_and_the_deployment_keeps_serving(
    longcat, inputs, field, words
):
    state = longcat[0]
    with pytest.raises(omniflow.RequestFailed) as info:
        call(state, inputs)
    assert info.value.code == "bad_request"
    assert field in str(info.value) and words in str(info.value)
    outs, _ = call(state, {"text": "still there"})
    assert outs
    status = json.loads(cli("status", "--name", "longcat", "--json").stdout)
    assert len(status["actors"]) == 6 and all(pid_alive(a["pid"]) for a in status["actors"])
