"""``audio_encoder`` role: WAV → LongCat-style audio codes and LLM input embeddings.

Input:
    data["audio"]: bytes     a WAV file: 16-bit PCM, mono or stereo (averaged to mono), at one
                             of the accepted sample rates (resampled to 16 kHz)
Output:
    audio_embeds:  float32 [N, hidden_size]   one LLM input vector per token (12.5 per second)
    audio_codes:   int64 [N, 8]               RVQ ids
    audio_hash:    str                        blake2b-128 hex of the WAV bytes
    audio_seconds: float                      duration of the input

Options: ``AudioEncoderOptions`` in roles/options.py.
"""

from __future__ import annotations

import asyncio
import io
import struct
import wave
from typing import Any

import numpy as np
import torch

from omniflow.content import content_hash
from omniflow.models.omni import AudioTokenizer, ensure_model, load_audio
from omniflow.roles.encoder_cache import CachingEncoder, role_cache
from omniflow.roles.options import AudioEncoderOptions
from omniflow.runtime.actor import BadRequest, Context, Request


def read_wav(data: bytes, accepted_rates: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the sample rate of a 16-bit PCM WAV.

    Raises BadRequest("audio", ...) naming what is wrong: unreadable, truncated, not 16-bit,
    too many channels, or a sample rate outside ``accepted_rates``.
    """
    try:
        with wave.open(io.BytesIO(data), "rb") as reader:
            channels, width, rate = (
                reader.getnchannels(),
                reader.getsampwidth(),
                reader.getframerate(),
            )
            frames = reader.getnframes()
            raw = reader.readframes(frames)
    except (wave.Error, EOFError, ValueError, RuntimeError, struct.error) as e:
        # RuntimeError, struct.error: chunk headers that lie about their sizes
        # (found by tests/security's fuzzing); all mean the bytes are no WAV.
        raise BadRequest("audio", f"unreadable WAV: {type(e).__name__}: {e}") from None
    if width != 2:
        raise BadRequest("audio", f"expected 16-bit PCM, got {8 * width}-bit samples")
    if channels not in (1, 2):
        raise BadRequest("audio", f"expected mono or stereo, got {channels} channels")
    if rate not in accepted_rates:
        raise BadRequest(
            "audio",
            f"unsupported sample rate {rate} Hz; accepted: {', '.join(map(str, accepted_rates))}",
        )
    got = len(raw) // (width * channels)
    if got < frames:
        raise BadRequest("audio", f"truncated WAV: header says {frames} frames, data holds {got}")
    if frames == 0:
        raise BadRequest("audio", "empty WAV: no samples")
    samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
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
    options: AudioEncoderOptions

    async def setup(self) -> None:
        opts = self.options
        self.sample_rates = tuple(opts.sample_rates)
        self.max_seconds = opts.max_seconds
        self.max_bytes = opts.max_bytes
        self.cache = role_cache(self)  # in the deployment's page pool when there is one
        self.encoded = 0
        self.start_model_thread()
        self.model: AudioTokenizer = await self._run(self._load)
        # Warm-up: the first forward pays for allocator and FFT setup; do it before serving.
        await self._run(self.model.encode, torch.zeros(self.model.config.samples_per_token))

    def _load(self) -> AudioTokenizer:
        opts = self.options
        if opts.build_tiny:
            ensure_model("audio", opts.model_path, opts.seed, hidden_size=opts.hidden_size)
        return load_audio(opts.model_path, opts.device)

    async def handle(self, request: Request, ctx: Context) -> dict[str, Any]:
        raw = request.data.get("audio")
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            got = "nothing" if raw is None else type(raw).__name__
            raise BadRequest("audio", f"expected WAV bytes, got {got}")
        data = bytes(raw)
        if len(data) > self.max_bytes:
            raise BadRequest("audio", f"{len(data)} bytes exceeds the limit of {self.max_bytes}")
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
            "audio_embeds": self.model.embed(codes).float().cpu(),
            "audio_codes": codes.cpu(),
            "audio_seconds": float(seconds),
        }
