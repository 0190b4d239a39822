"""The OpenAI request bodies the gateway accepts, as msgspec Structs, and what they become.

Unknown fields are ignored (OpenAI clients send many); known ones are type-checked, and a
wrong one is a 400 that names it (``messages[0].content[1].type``).
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``kind`` (``type``), ``param`` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _KINDS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        code = _CODES.get(self.status)
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}
        }


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
_CODES = {413: "request_too_large", 429: "overloaded", 503: "no_replica", 504: "deadline"}


class ImageUrl(msgspec.Struct):
    url: str
    detail: str = "auto"


class InputAudio(msgspec.Struct):
    data: str
    format: str = "wav"


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class AudioPart(msgspec.Struct, tag="input_audio", tag_field="type"):
    input_audio: InputAudio


Part = TextPart | ImagePart | AudioPart


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None


class AudioOut(msgspec.Struct):
    format: Literal["wav", "pcm16"] = "wav"
    voice: str = ""


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: AudioOut | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions (the openai client's extra_body): the session for multi-turn affinity,
    # a deadline in seconds, and params passed to the roles as they are.
    session: str | None = None
    timeout: Annotated[float, Meta(gt=0)] | None = None
    params: dict[str, Any] = {}


class ImageRequest(msgspec.Struct):
    prompt: str
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=8)] = 1
    size: str = "128x128"
    response_format: Literal["b64_json"] = "b64_json"
    seed: int | None = None
    num_inference_steps: Annotated[int, Meta(ge=1, le=200)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0)] | None = None
    user: str | None = None
    timeout: Annotated[float, Meta(gt=0)] | None = None


def decode_body(body: bytes, cls: type[Any]) -> Any:
    """``body`` as ``cls``; a 400 naming the field on malformed JSON or a wrong type."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        text = str(e)
        where = re.search(r"at `\$\.?(.*)`", text)
        param = where.group(1) if where else None
        if param is not None and param.startswith("["):
            param = param[1:]
        raise ApiError(400, text.replace("`$.", "`"), param or None) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", "body") from None
    except RecursionError:  # found by tests/security: [[[[... past the decoder's stack
        raise ApiError(400, "the body is not valid JSON: nested too deep", "body") from None


_DATA_URL = re.compile(r"^data:([\w/+.-]*)(;[\w=.-]+)*;base64,(.*)$", re.S)


def media_bytes(url: str, param: str, allow_local_paths: bool) -> bytes:
    """The bytes an ``image_url`` names: a base64 data URL, or a local file when allowed."""
    match = _DATA_URL.match(url)
    if match:
        return b64(match.group(3), param)
    if url.startswith(("http://", "https://")):
        raise ApiError(400, "remote URLs are not fetched: send a data URL", param)
    if not allow_local_paths:
        raise ApiError(400, "local paths are not allowed here ([gateway] allow_local_paths)", param)
    path = Path(url.removeprefix("file://"))
    try:
        return path.read_bytes()
    except OSError as e:
        raise ApiError(400, f"cannot read {path}: {e.strerror}", param) from None


def b64(text: str, param: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "not valid base64", param) from None


def chat_inputs(
    req: ChatRequest, session: str, allow_local_paths: bool
) -> tuple[dict[str, Any], list[str]]:
    """The deployment's inputs for a chat: text, and the last user turn's image and audio.

    With a session the deployment holds the earlier turns, so only the last user message
    goes; without one the whole dialogue goes as text.
    """
    last = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=-1)
    if last < 0:
        raise ApiError(400, "no message with role user", "messages")
    texts: list[str] = []
    images: list[bytes] = []
    audio: list[bytes] = []
    for i, message in enumerate(req.messages):
        if session and i != last:
            continue
        parts = message.content
        if isinstance(parts, str):
            text = parts
        elif parts is None:
            text = ""
        else:
            words = []
            for j, part in enumerate(parts):
                where = f"messages[{i}].content[{j}]"
                if isinstance(part, TextPart):
                    words.append(part.text)
                elif i != last:
                    continue  # media of earlier turns: only a session keeps it
                elif isinstance(part, ImagePart):
                    images.append(
                        media_bytes(part.image_url.url, f"{where}.image_url.url", allow_local_paths)
                    )
                else:
                    if part.input_audio.format != "wav":
                        raise ApiError(400, "only wav audio is read", f"{where}.input_audio.format")
                    audio.append(b64(part.input_audio.data, f"{where}.input_audio.data"))
            text = " ".join(words)
        if session or len(req.messages) == 1:
            texts.append(text)
        elif text:
            texts.append(f"{message.role}: {text}")
    inputs: dict[str, Any] = {"text": "\n".join(texts)}
    if len(images) == 1:
        inputs["image"] = images[0]
    elif images:
        inputs["images"] = images
    if len(audio) > 1:
        raise ApiError(400, "one audio input per turn", f"messages[{last}].content")
    if audio:
        inputs["audio"] = audio[0]
    want = sorted(set(req.modalities or ["text"]), key=["text", "image", "audio"].index)
    return inputs, want


def chat_params(req: ChatRequest, want: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = dict(req.params)
    if req.modalities is not None:
        params["want"] = ",".join(want)
    max_tokens = req.max_completion_tokens or req.max_tokens
    for key, value in (
        ("max_tokens", max_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("seed", req.seed),
    ):
        if value is not None:
            params[key] = value
    return params


def image_params(req: ImageRequest, sized: bool = False) -> dict[str, Any]:
    """The sampling knobs, and ``size``: passed on as is where the roles read ``size``
    (``sized``), else ("WxH", multiples of 32) as longcat's token grid."""
    params: dict[str, Any] = {"want": "image"}
    if sized:
        params["size"] = req.size
        return _knobs(req, params)
    match = re.fullmatch(r"(\d+)x(\d+)", req.size)
    if not match or int(match.group(1)) % 32 or int(match.group(2)) % 32:
        raise ApiError(400, f"expected WIDTHxHEIGHT in multiples of 32, got {req.size!r}", "size")
    width, height = int(match.group(1)) // 32, int(match.group(2)) // 32
    if not (1 <= width <= 32 and 1 <= height <= 32):
        raise ApiError(400, "each side must be 32..1024 pixels", "size")
    params["image_grid"] = [height, width]
    return _knobs(req, params)


def _knobs(req: ImageRequest, params: dict[str, Any]) -> dict[str, Any]:
    if req.seed is not None:
        params["seed"] = req.seed
    if req.num_inference_steps is not None:
        params["steps"] = req.num_inference_steps
    if req.guidance_scale is not None:
        params["cfg_scale"] = req.guidance_scale
    return params
