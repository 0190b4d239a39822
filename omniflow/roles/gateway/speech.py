"""/v1/audio/speech: text to speech through the llm's audio tokens and the audio decoder,
streamed chunk by chunk as the decoder makes them: raw audio (``wav`` with a streaming
header, or ``pcm``: 16-bit mono), or server-sent ``speech.audio.delta`` events ended by
``speech.audio.done`` (``stream_format: "sse"``)."""

from __future__ import annotations

import base64
import contextlib
import struct
from collections.abc import AsyncGenerator
from typing import Any, cast

from omniflow.roles.gateway.http import SSE_HEADERS, Send, event
from omniflow.roles.gateway.metrics import AudioClock
from omniflow.roles.gateway.replies import AUDIO_RATE
from omniflow.runtime.client import Output, Result


def wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (sizes 0xFFFFFFFF)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + (b"data" + struct.pack("<I", unknown))
    )


async def stream_speech(
    send: Send,
    stream: AsyncGenerator[Output | Result, None],
    response_format: str,
    sse: bool,
    clock: AudioClock,
) -> tuple[int, Result | None]:
    """Send each audio chunk as it comes; (status, the request's result)."""
    opened = False
    count = 0

    async def open_(rate: int) -> None:
        nonlocal opened
        if sse:
            headers = SSE_HEADERS
        else:
            kind = b"audio/wav" if response_format == "wav" else b"audio/pcm"
            headers = [(b"content-type", kind), (b"x-sample-rate", str(rate).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        opened = True
        if not sse and response_format == "wav":
            await send({"type": "http.response.body", "body": wav_header(rate), "more_body": True})

    async with contextlib.aclosing(cast(Any, stream)) as items:
        async for item in items:
            if isinstance(item, Result):
                clock.done(item)
                if not opened:
                    await open_(AUDIO_RATE)
                body = b""
                if sse:
                    body = event({"type": "speech.audio.done", "usage": _usage(item, count)})
                await send({"type": "http.response.body", "body": body})
                return 200, item
            pcm = item.data.get("audio_chunk")
            if not isinstance(pcm, (bytes, bytearray)):
                continue
            clock.chunk(item.role, item.data, AUDIO_RATE)
            if not opened:
                await open_(int(item.data.get("sample_rate", AUDIO_RATE)))
            count += 1
            if sse:
                payload = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()}
                body = event(payload)
            else:
                body = bytes(pcm)
            await send({"type": "http.response.body", "body": body, "more_body": True})
    raise AssertionError("a stream ended without its Result")


def _usage(result: Result, chunks: int) -> dict[str, int]:
    prompt = result.usage.get("prompt_tokens", 0)
    output = result.usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output}
