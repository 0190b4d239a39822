"""audio_encoder role driven in-process: WAV parsing, resampling, cache and bad inputs."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from omniflow.roles.audio_encoder import AudioEncoderRole, read_wav, resample
from omniflow.roles.options import ACCEPTED_RATES
from omniflow.runtime.actor import BadRequest
from tests.roles.media import drive, make_ctx, make_request, run, wav_bytes


def _actor(models_root, **options):
    options.setdefault("model_path", str(models_root / "audio"))
    options.setdefault("build_tiny", True)
    return AudioEncoderRole("audio_encoder", 0, options)


async def _encode(actor, audio):
    ctx = make_ctx("audio_encoder")
    (out,) = await drive(actor, make_request({"audio": audio}), ctx)
    return out, ctx


def _encode_all(models_root, clips, **options):
    async def main():
        actor = _actor(models_root, **options)
        await actor.setup()
        try:
            return [await _encode(actor, clip) for clip in clips]
        finally:
            await actor.close()

    return run(main())


def test_mono_16k_contract_and_cache_hit(models_root):
    clip = wav_bytes(1.0)
    (out, ctx), (again, ctx2) = _encode_all(models_root, [clip, clip])
    assert out["audio_codes"].shape == (13, 8) and out["audio_codes"].dtype == torch.int64
    assert out["audio_embeds"].shape == (13, 64) and out["audio_embeds"].dtype == torch.float32
    assert out["audio_seconds"] == pytest.approx(1.0)
    assert len(out["audio_hash"]) == 32
    assert ctx.usage == {} and ctx2.usage == {"encoder_cache_hits": 1}
    assert torch.equal(out["audio_codes"], again["audio_codes"])


@pytest.mark.parametrize(("rate", "channels"), [(48000, 2), (44100, 1), (24000, 2), (8000, 1)])
def test_other_rates_and_stereo_are_resampled(models_root, rate, channels):
    ((out, _),) = _encode_all(models_root, [wav_bytes(1.0, rate=rate, channels=channels)])
    assert out["audio_codes"].shape == (13, 8)
    assert out["audio_seconds"] == pytest.approx(1.0)


def test_resample_keeps_duration_and_tone():
    rate, target = 48000, 16000
    t = torch.arange(rate) / rate
    tone = torch.sin(2 * torch.pi * 440 * t)
    out = resample(tone, rate, target)
    assert out.numel() == target
    expected = torch.sin(2 * torch.pi * 440 * torch.arange(target) / target)
    assert (out - expected).abs().max() < 1e-3


def _truncated_data() -> bytes:
    return wav_bytes(1.0)[:-5000]


def _truncated_header() -> bytes:
    return wav_bytes(1.0)[:30]


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        (_truncated_data(), "truncated WAV"),
        (_truncated_header(), "unreadable WAV"),
        (b"RIFF nonsense", "unreadable WAV"),
        (wav_bytes(0.5, rate=11025), "unsupported sample rate 11025 Hz"),
        (wav_bytes(0.5, width=1), "16-bit"),
        (wav_bytes(0.0), "empty WAV"),
        ({"not": "bytes"}, "expected WAV bytes"),
    ],
    ids=["truncated", "truncated-header", "garbage", "rate", "8-bit", "empty", "wrong-type"],
)
def test_bad_audio(models_root, audio, message):
    async def main():
        actor = _actor(models_root)
        await actor.setup()
        try:
            with pytest.raises(BadRequest, match=message) as error:
                await _encode(actor, audio)
            assert error.value.field == "audio"
            out, _ = await _encode(actor, wav_bytes(0.2))  # still serving
            return out
        finally:
            await actor.close()

    assert run(main())["audio_codes"].shape == (3, 8)


def test_limits_are_options(models_root):
    async def main():
        actor = _actor(models_root, max_seconds=0.5, sample_rates=[16000])
        await actor.setup()
        try:
            with pytest.raises(BadRequest, match="max_seconds"):
                await _encode(actor, wav_bytes(1.0))
            with pytest.raises(BadRequest, match="accepted: 16000"):
                await _encode(actor, wav_bytes(0.2, rate=48000))
        finally:
            await actor.close()

    run(main())


def _float_wav(
    samples: np.ndarray, rate: int, dtype: str = "<f4", extensible: bool = False
) -> bytes:
    """A WAV of IEEE float samples [frames, channels] (tag 3, or 0xFFFE with a float GUID)."""
    frames, channels = samples.shape
    bits = np.dtype(dtype).itemsize * 8
    block = channels * bits // 8
    head = struct.pack(
        "<HHIIHH", 0xFFFE if extensible else 3, channels, rate, rate * block, block, bits
    )
    if extensible:  # cbSize, valid bits, channel mask, then the subformat GUID (tag first)
        head += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", 3) + bytes(14)
    data = samples.astype(dtype).tobytes()
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(head)) + head
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    ("dtype", "extensible", "channels"),
    [("<f4", False, 1), ("<f4", True, 2), ("<f8", False, 1)],
    ids=["float32", "float32-extensible-stereo", "float64"],
)
def test_float_wav_reads_as_the_same_samples_as_pcm16(dtype, extensible, channels):
    pcm = wav_bytes(0.5, rate=24000, channels=channels)
    expected, rate = read_wav(pcm, ACCEPTED_RATES)
    frames = np.repeat(expected[:, None], channels, axis=1)
    got, got_rate = read_wav(_float_wav(frames, 24000, dtype, extensible), ACCEPTED_RATES)
    assert got_rate == rate == 24000 and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_float_wav_is_encoded_like_its_pcm16_twin(models_root):
    pcm = wav_bytes(0.4)
    samples, _ = read_wav(pcm, ACCEPTED_RATES)
    floats = _float_wav(samples[:, None], 16000)
    (a, _), (b, _) = _encode_all(models_root, [pcm, floats])
    assert torch.equal(a["audio_codes"], b["audio_codes"])
