"""Real media files for role tests (PNG/JPEG through Pillow, WAV through ``wave``) and a driver."""

from __future__ import annotations

import asyncio
import inspect
import io
import struct
import wave
import zlib

import numpy as np
from PIL import Image

from omniflow.runtime.actor import Actor, Context, Request


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def png_claiming_size(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR is rewritten to claim width x height (CRC fixed)."""
    data = bytearray(image_bytes(8, 8))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def wav_bytes(
    seconds: float, rate: int = 16000, channels: int = 1, width: int = 2, freq: float = 440.0
) -> bytes:
    frames = int(seconds * rate)
    t = np.arange(frames) / rate
    tone = 0.3 * np.sin(2 * np.pi * freq * t)
    samples = np.repeat(tone[:, None], channels, axis=1)
    if width == 2:
        raw = (samples * 32767).astype("<i2").tobytes()
    else:
        raw = ((samples + 1.0) * 127.5).astype(np.uint8).tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(raw)
    return buffer.getvalue()


def make_ctx(role: str, request_id: str = "r1") -> Context:
    return Context(request_id, role, 0, deadline=0, sink=None)


def make_request(
    data=None, tensors=None, params=None, request_id: str = "r1", seq: int = 0, last: bool = True
) -> Request:
    return Request(request_id, data or {}, tensors or {}, params or {}, "", seq, last)


async def drive(actor: Actor, request: Request, ctx: Context) -> list:
    """Every output of one ``handle`` call, whether it is a coroutine or an async generator."""
    result = actor.handle(request, ctx)
    if inspect.isasyncgen(result):
        return [out async for out in result]
    out = await result
    return [] if out is None else [out]


def run(coro):
    return asyncio.run(coro)
