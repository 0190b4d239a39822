"""``audio_encoder`` role: WAV → LongCat-style audio codes and LLM input embeddings.

Input:
    data["audio"]: bytes     a WAV file: 16/32-bit PCM or 32/64-bit float, mono or stereo
                             (averaged to mono), at one of the accepted sample rates
                             (resampled to 16 kHz)
Output:
    audio_embeds:  float32 [N, hidden_size]   one LLM input vector per token (12.5 per second)
    audio_codes:   int64 [N, 8]               RVQ ids
    audio_hash:    str                        blake2b-128 hex of the WAV bytes
    audio_seconds: float                      duration of the input

Options: ``AudioEncoderOptions`` in roles/options.py.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
import torch

from omniflow.content import content_hash
from omniflow.models.omni.checkpoint import ensure_next
from omniflow.models.omni.next_audio import NextAudioTokenizer, load_next_audio
from omniflow.roles.encoder_cache import CachingEncoder, role_cache
from omniflow.roles.options import AudioEncoderOptions, NoParams
from omniflow.runtime.actor import BadRequest, Context, Request

# (format tag, bits per sample) -> numpy dtype and the scale to [-1, 1]
_SAMPLE_TYPES = {
    (1, 16): ("<i2", 1 / 32768.0),
    (1, 32): ("<i4", 1 / 2147483648.0),
    (3, 32): ("<f4", 1.0),
    (3, 64): ("<f8", 1.0),
}
ACCEPTED_FORMATS = "16-bit or 32-bit PCM, 32-bit or 64-bit float"
_EXTENSIBLE = 0xFFFE  # the real tag is the first two bytes of its subformat GUID


def read_wav(data: bytes, accepted_rates: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the sample rate of a WAV file.

    Accepts 16-bit and 32-bit integer PCM and 32-bit and 64-bit IEEE float, mono or stereo
    (averaged), plain or WAVE_FORMAT_EXTENSIBLE. Raises BadRequest("audio", ...) naming
    what is wrong: unreadable, truncated, another sample format, too many channels, or a
    sample rate outside ``accepted_rates``.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise BadRequest("audio", "unreadable WAV: not a RIFF/WAVE file")
    fmt: bytes | None = None
    raw: bytes | None = None
    declared = 0
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8 : pos + 8 + size]
        if kind == b"fmt ":
            fmt = body
        elif kind == b"data":
            raw, declared = body, size
            break
        pos += 8 + size + (size & 1)  # chunks are padded to even sizes
    if fmt is None or len(fmt) < 16:
        raise BadRequest("audio", "unreadable WAV: no fmt chunk")
    if raw is None:
        raise BadRequest("audio", "unreadable WAV: no data chunk")
    tag, channels, rate = struct.unpack_from("<HHI", fmt, 0)
    bits = struct.unpack_from("<H", fmt, 14)[0]
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]
    sample_type = _SAMPLE_TYPES.get((tag, bits))
    if sample_type is None:
        what = {1: "PCM", 3: "float"}.get(tag, f"format tag {tag}")
        raise BadRequest(
            "audio", f"unsupported WAV samples: {bits}-bit {what}; accepted: {ACCEPTED_FORMATS}"
        )
    if channels not in (1, 2):
        raise BadRequest("audio", f"expected mono or stereo, got {channels} channels")
    if rate not in accepted_rates:
        raise BadRequest(
            "audio",
            f"unsupported sample rate {rate} Hz; accepted: {', '.join(map(str, accepted_rates))}",
        )
    frame = bits // 8 * channels
    frames, got = declared // frame, len(raw) // frame
    if got < frames:
        raise BadRequest("audio", f"truncated WAV: header says {frames} frames, data holds {got}")
    if frames == 0:
        raise BadRequest("audio", "empty WAV: no samples")
    dtype, scale = sample_type
    samples = np.frombuffer(raw[: frames * frame], dtype=dtype).astype(np.float32) * scale
    if not np.isfinite(samples).all():
        raise BadRequest("audio", "float WAV holds NaN or infinite samples")
    return samples.reshape(-1, channels).mean(axis=1), rate


def resample(samples: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """Band-limited resampling by FFT: drop (or zero-pad) the spectrum above the new Nyquist."""
    if rate == target:
        return samples
    length = max(1, round(samples.numel() * target / rate))
    spectrum = torch.fft.rfft(samples.double())
    bins = length // 2 + 1
    if bins <= spectrum.numel():
        spectrum = spectrum[:bins]
    else:
        spectrum = torch.cat([spectrum, spectrum.new_zeros(bins - spectrum.numel())])
    return (torch.fft.irfft(spectrum, n=length) * (length / samples.numel())).float()


class AudioEncoderRole(CachingEncoder):
    Options = AudioEncoderOptions
    Params = NoParams
    options: AudioEncoderOptions

    async def setup(self) -> None:
        opts = self.options
        self.sample_rates = tuple(opts.sample_rates)
        self.max_seconds = opts.max_seconds
        self.max_bytes = opts.max_bytes
        self.cache = role_cache(self)  # in the deployment's page pool when there is one
        self.encoded = 0
        self.start_model_thread()
        self.model: NextAudioTokenizer = await self._run(self._load)
        # Warm-up: the first forward pays for allocator and FFT setup; do it before serving.
        await self._run(self.model.encode, torch.zeros(self.model.config.samples_per_token))

    def _load(self) -> NextAudioTokenizer:
        opts = self.options
        if opts.build_tiny:
            ensure_next(opts.model_path, opts.seed, hidden_size=opts.hidden_size)
        return load_next_audio(opts.model_path, opts.device)

    async def handle(self, request: Request, ctx: Context) -> dict[str, Any]:
        clips = request.data.get("audios")
        if clips is None:
            return await self._one(request.data.get("audio"), ctx, "audio")
        if not isinstance(clips, list) or not clips:
            raise BadRequest("audios", "expected a non-empty list of WAV clips")
        outputs = [await self._one(raw, ctx, f"audios[{i}]") for i, raw in enumerate(clips)]
        # Several clips (a dialogue's turns): embeddings back to back, audio_spans per clip.
        return {
            "audio_embeds": torch.cat([o["audio_embeds"] for o in outputs]),
            "audio_spans": [[o["audio_hash"], int(o["audio_embeds"].shape[0])] for o in outputs],
            "audio_seconds": sum(float(o["audio_seconds"]) for o in outputs),
        }

    async def _one(self, raw: Any, ctx: Context, field: str) -> dict[str, Any]:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            got = "nothing" if raw is None else type(raw).__name__
            raise BadRequest(field, f"expected WAV bytes, got {got}")
        data = bytes(raw)
        if len(data) > self.max_bytes:
            raise BadRequest(field, f"{len(data)} bytes exceeds the limit of {self.max_bytes}")
        key = (
            content_hash(data)
            if len(data) < (1 << 20)
            else await asyncio.to_thread(content_hash, data)
        )
        cached = await self.cache.get(key, ctx)
        if cached is not None:
            ctx.add_usage(encoder_cache_hits=1)
            return cached
        output = await self._run(self._encode, data)
        self.encoded += 1
        output["audio_hash"] = key
        return await self.cache.put(key, output, ctx)

    def _encode(self, data: bytes) -> dict[str, Any]:
        samples, rate = read_wav(data, self.sample_rates)
        seconds = samples.shape[0] / rate
        if seconds > self.max_seconds:
            raise BadRequest(
                "audio",
                f"{seconds:.1f} s exceeds the limit of {self.max_seconds} s (option max_seconds)",
            )
        wave_16k = resample(torch.from_numpy(samples), rate, self.model.config.sample_rate)
        codes = self.model.encode(wave_16k)
        return {
            "audio_embeds": self.model.embed(codes).float(),  # on the device: the hop decides
            "audio_codes": codes,
            "audio_seconds": float(seconds),
        }
