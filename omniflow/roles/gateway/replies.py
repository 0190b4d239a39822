"""The gateway's answers in OpenAI's shapes: chat choices, completion choices, logprobs,
usage, finish reasons, audio as WAV."""

from __future__ import annotations

import base64
import io
import time
import wave
from collections import OrderedDict
from typing import Any

from omniflow.roles.gateway.http import event
from omniflow.runtime.client import Output, Result

AUDIO_RATE = 24000  # the audio decoder's PCM16 rate, when a chunk names none


def text_of(outputs: list[Output]) -> str:
    return "".join(o.data["text"] for o in outputs if isinstance(o.data.get("text"), str))


def finish_reason(outputs: list[Output]) -> str:
    """ "length" when max_tokens cut the text, else "stop" (an end token, a stop string)."""
    for output in reversed(outputs):
        reason = output.data.get("finish_reason")
        if isinstance(reason, str):
            return "length" if reason == "length" else "stop"
    return "stop"


def token_logprobs(outputs: list[Output]) -> list[dict[str, Any]]:
    return [e for o in outputs for e in o.data.get("logprobs") or ()]


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    def one(e: dict[str, Any]) -> dict[str, Any]:
        raw = e.get("bytes")  # the llm's: the token's own bytes
        raw = list(e["token"].encode()) if raw is None else raw
        return {"token": e["token"], "logprob": e["logprob"], "bytes": raw}

    return {
        "content": [
            {**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs", [])]} for e in entries
        ]
    }


def completion_logprobs(entries: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries
        ],
        "text_offset": offsets,
    }


def image_part(output: Output) -> dict[str, Any]:
    mime = output.data.get("mime", "image/png")
    url = f"data:{mime};base64,{base64.b64encode(output.data['image']).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def chat_message(
    request_id: str, outputs: list[Output], audio_format: str, logprobs: bool
) -> dict[str, Any]:
    """One choice of a chat completion."""
    text = text_of(outputs)
    images = [image_part(o) for o in outputs if "image" in o.data]
    pcm = b"".join(o.data["audio_chunk"] for o in outputs if "audio_chunk" in o.data)
    content: Any = [{"type": "text", "text": text}, *images] if images else text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if pcm:
        data = pcm if audio_format == "pcm16" else wav(pcm, rate(outputs))
        message["audio"] = {
            "id": f"audio-{request_id}",
            "data": base64.b64encode(data).decode(),
            "expires_at": int(time.time()) + 3600,
            "transcript": text,
        }
    choice: dict[str, Any] = {"message": message, "finish_reason": finish_reason(outputs)}
    choice["logprobs"] = chat_logprobs(token_logprobs(outputs)) if logprobs else None
    return choice


def rate(outputs: list[Output]) -> int:
    rates = [o.data["sample_rate"] for o in outputs if "sample_rate" in o.data]
    return int(rates[0]) if rates else AUDIO_RATE


def wav(pcm: bytes, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buffer.getvalue()


def usage(totals: list[dict[str, int]]) -> dict[str, Any]:
    """OpenAI's usage of one or more calls (n choices: their sum)."""
    prompt = sum(u.get("prompt_tokens", 0) for u in totals)
    completion = sum(u.get("completion_tokens", 0) for u in totals)
    cached = sum(u.get("cached_tokens", 0) for u in totals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Transcripts:
    """The transcripts of the audio this gateway answered with, by audio id, the newest
    ``size``: a client that resends an assistant turn as ``{"audio": {"id": ...}}`` (as
    OpenAI's API takes it) gets that turn's text back, which the llm prompts as the speech
    it made (roles/llm_prompt.py)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._by_id: OrderedDict[str, str] = OrderedDict()

    def note(self, audio_id: str, text: str) -> None:
        self._by_id[audio_id] = text
        self._by_id.move_to_end(audio_id)
        while len(self._by_id) > self.size:
            self._by_id.popitem(last=False)

    def note_choices(self, choices: list[dict[str, Any]]) -> None:
        for choice in choices:
            audio = choice["message"].get("audio")
            if audio is not None:
                self.note(audio["id"], audio["transcript"])

    def get(self, audio_id: str) -> str | None:
        return self._by_id.get(audio_id)


class ChatChunks:
    """chat.completion.chunk events of one streamed choice."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        transcripts: Transcripts | None = None,
    ) -> None:
        self.request_id, self.logprobs, self.include_usage = request_id, logprobs, include_usage
        self.transcripts, self.text, self.spoke = transcripts, "", False
        self.base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self.started = False
        self.reason = "stop"

    def of(self, output: Output) -> bytes | None:
        if isinstance(output.data.get("finish_reason"), str):
            self.reason = finish_reason([output])
        delta = _delta(output, self.request_id)
        if delta is not None:
            self.text += delta.get("content") or ""
            self.spoke = self.spoke or "audio" in delta
        if delta is None or (delta == {"content": ""} and not output.data.get("logprobs")):
            return None
        if not self.started:
            delta["role"] = "assistant"
            self.started = True
        chunk: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        if self.logprobs and output.data.get("logprobs"):
            chunk["logprobs"] = chat_logprobs(output.data["logprobs"])
        return event({**self.base, "choices": [chunk]})

    def last(self, result: Result) -> bytes:
        if self.spoke and self.transcripts is not None:
            self.transcripts.note(f"audio-{self.request_id}", self.text)
        chunk = {"index": 0, "delta": {}, "finish_reason": self.reason}
        body = event({**self.base, "choices": [chunk]})
        if self.include_usage:
            body += event({**self.base, "choices": [], "usage": usage([result.usage])})
        return body


class TextChunks(ChatChunks):
    """text_completion events of one streamed choice."""

    def __init__(self, request_id, model, logprobs, include_usage, echo) -> None:  # noqa: ANN001
        super().__init__(request_id, model, logprobs, include_usage)
        self.base["object"] = "text_completion"
        self.echo = echo

    def of(self, output: Output) -> bytes | None:
        if isinstance(output.data.get("finish_reason"), str):
            self.reason = finish_reason([output])
        text = output.data.get("text")
        if not isinstance(text, str) or (not text and not output.data.get("logprobs")):
            return None
        if not self.started:
            text, self.started = self.echo + text, True
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
        entries = output.data.get("logprobs")
        choice["logprobs"] = completion_logprobs(entries) if self.logprobs and entries else None
        return event({**self.base, "choices": [choice]})

    def last(self, result: Result) -> bytes:
        choice = {"index": 0, "text": "", "finish_reason": self.reason, "logprobs": None}
        body = event({**self.base, "choices": [choice]})
        if self.include_usage:
            body += event({**self.base, "choices": [], "usage": usage([result.usage])})
        return body


def _delta(output: Output, request_id: str) -> dict[str, Any] | None:
    data = output.data
    text = data.get("text")
    if isinstance(text, str):
        return {"content": text}
    if "audio_chunk" in data:
        pcm = base64.b64encode(data["audio_chunk"]).decode()
        return {"audio": {"id": f"audio-{request_id}", "data": pcm}}
    if "image" in data:
        return {"images": [image_part(output)]}
    return None
