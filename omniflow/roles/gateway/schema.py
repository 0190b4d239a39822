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

from omniflow.runtime.image_grid import DEFAULT_GRID, SizeError, longcat_grid

# What msgpack and the roles take: 64-bit integers (a seed leaves room for n choices).
Tokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


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
    403: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
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


class AssistantAudio(msgspec.Struct):
    id: str  # a reply's message.audio.id: the turn it stands for


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    audio: AssistantAudio | None = None  # an assistant turn resent by its audio's id


class AudioOut(msgspec.Struct):
    format: Literal["wav", "pcm16"] = "wav"
    voice: str = ""


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct):
    type: str = "text"


class ChatRequest(msgspec.Struct):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: AudioOut | None = None
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    n: Annotated[int, Meta(ge=1, le=8)] = 1
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    user: str | None = None  # a label (logs, metrics): OpenAI's end user, not a conversation
    # Extensions (the openai client's extra_body): the session (or an X-Session-Id header)
    # for multi-turn state and affinity, a deadline in seconds, and params passed to the
    # roles as they are.
    session: str | None = None
    timeout: Annotated[float, Meta(gt=0)] | None = None
    params: dict[str, Any] = {}


class CompletionRequest(msgspec.Struct):
    model: str
    prompt: str | Annotated[list[str], Meta(min_length=1, max_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Tokens | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    n: Annotated[int, Meta(ge=1, le=8)] = 1
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None
    timeout: Annotated[float, Meta(gt=0)] | None = None
    params: dict[str, Any] = {}


class SpeechRequest(msgspec.Struct):
    input: Annotated[str, Meta(min_length=1, max_length=4096)]
    model: str | None = None
    voice: str | dict[str, Any] = ""
    response_format: str = "wav"
    stream_format: str = "audio"
    speed: float = 1.0
    instructions: str = ""
    timeout: Annotated[float, Meta(gt=0)] | None = None
    params: dict[str, Any] = {}

    def check(self) -> None:
        if self.response_format not in ("wav", "pcm"):
            raise ApiError(
                400, f"response_format {self.response_format!r}: wav or pcm", "response_format"
            )
        if self.stream_format not in ("sse", "audio"):
            raise ApiError(400, "stream_format: sse or audio", "stream_format")
        if self.speed != 1.0:
            raise ApiError(400, "speed other than 1.0 is not supported", "speed")


class ImageRequest(msgspec.Struct):
    prompt: str
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=8)] = 1
    # None: the pipeline's default (128x128 where the roles read ``size``; longcat: 4x4
    # tokens, 112x112 px)
    size: Annotated[str, Meta(max_length=32)] | None = None
    response_format: Literal["b64_json"] = "b64_json"
    seed: Seed | None = None
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


def refuse_unsupported(req: ChatRequest) -> None:
    """Fields this deployment cannot honour: a 400 naming each, never silence."""
    if req.tools or req.functions:
        raise ApiError(400, "tool calls are not supported by this deployment", "tools")
    if req.tool_choice not in (None, "none"):
        raise ApiError(400, "tool calls are not supported by this deployment", "tool_choice")
    if req.response_format is not None and req.response_format.type != "text":
        kind = req.response_format.type
        raise ApiError(
            400, f"response_format {kind!r} is not supported; only text", "response_format"
        )


def chat_inputs(
    req: ChatRequest, allow_local_paths: bool, transcripts: Any = None
) -> tuple[dict[str, Any], list[str]]:
    """The deployment's inputs for a chat: the whole dialogue as ``messages`` (each medium a
    ``{"type": "image"|"audio"}`` part, in the order of ``images`` / ``audios``), every
    turn's media, and ``text`` (the dialogue flattened, for roles that read no messages).

    An assistant message's content goes as its text: generated media are not resent. One
    with no content and ``audio.id`` goes as that reply's transcript (``transcripts``, the
    gateway's: replies.py); an id it does not know is a 400 naming it.
    """
    if not any(m.role == "user" for m in req.messages):
        raise ApiError(400, "no message with role user", "messages")
    messages: list[dict[str, Any]] = []
    texts: list[str] = []
    images: list[bytes] = []
    audio: list[bytes] = []
    for i, message in enumerate(req.messages):
        if message.role == "assistant" and not message.content and message.audio is not None:
            message = msgspec.structs.replace(message, content=_heard(message, i, transcripts))
        content, text = _content(message, i, images, audio, allow_local_paths)
        messages.append({"role": message.role, "content": content})
        if len(req.messages) == 1:
            texts.append(text)
        elif text:
            texts.append(f"{message.role}: {text}")
    inputs: dict[str, Any] = {"text": "\n".join(texts), "messages": messages}
    for key, items in (("image", images), ("audio", audio)):
        if len(items) == 1:
            inputs[key] = items[0]
        elif items:
            inputs[f"{key}s"] = items
    want = sorted(set(req.modalities or ["text"]), key=["text", "image", "audio"].index)
    return inputs, want


def _heard(message: Message, i: int, transcripts: Any) -> str:
    """The transcript of the reply an assistant message names by its audio id."""
    assert message.audio is not None
    text = None if transcripts is None else transcripts.get(message.audio.id)
    if text is None:
        raise ApiError(
            400, f"unknown or expired audio id {message.audio.id!r}", f"messages[{i}].audio.id"
        )
    return text


def _content(
    message: Message, i: int, images: list[bytes], audio: list[bytes], allow_local_paths: bool
) -> tuple[Any, str]:
    """(the message's content as the llm reads it, its text alone)."""
    parts = message.content
    if isinstance(parts, str) or parts is None:
        return parts or "", parts or ""
    words = [p.text for p in parts if isinstance(p, TextPart)]
    if message.role == "assistant":
        return " ".join(words), " ".join(words)
    content: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        if isinstance(part, TextPart):
            content.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            url = part.image_url.url
            images.append(media_bytes(url, f"{where}.image_url.url", allow_local_paths))
            content.append({"type": "image"})
        else:
            if part.input_audio.format != "wav":
                raise ApiError(400, "only wav audio is read", f"{where}.input_audio.format")
            audio.append(b64(part.input_audio.data, f"{where}.input_audio.data"))
            content.append({"type": "audio"})
    return content, " ".join(words)


def chat_params(req: ChatRequest, want: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = dict(req.params)
    if req.modalities is not None:
        params["want"] = ",".join(want)
    max_tokens = req.max_completion_tokens or req.max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _sampling(params, req, max_tokens, stop, logprobs)


def completion_params(req: CompletionRequest) -> dict[str, Any]:
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return _sampling(dict(req.params), req, req.max_tokens, stop, req.logprobs)


def _sampling(
    params: dict[str, Any], req: Any, max_tokens: int | None, stop: Any, logprobs: int | None
) -> dict[str, Any]:
    for key, value in (
        ("max_tokens", max_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("seed", req.seed),
        ("stop", stop or None),
        ("logprobs", logprobs),
        ("presence_penalty", req.presence_penalty),
        ("frequency_penalty", req.frequency_penalty),
    ):
        if value is not None:
            params[key] = value
    return params


def image_params(req: ImageRequest, sized: bool = False) -> dict[str, Any]:
    """The sampling knobs, and ``size``: passed on as is where the roles read ``size``
    (``sized``), else ("WxH", each side a LongCat side) as longcat's token grid."""
    params: dict[str, Any] = {"want": "image"}
    if sized:
        params["size"] = req.size or "128x128"
        return _knobs(req, params)
    try:
        params["image_grid"] = list(DEFAULT_GRID) if req.size is None else longcat_grid(req.size)
    except SizeError as e:
        raise ApiError(400, str(e), "size") from None
    return _knobs(req, params)


def _knobs(req: ImageRequest, params: dict[str, Any]) -> dict[str, Any]:
    if req.seed is not None:
        params["seed"] = req.seed
    if req.num_inference_steps is not None:
        params["steps"] = req.num_inference_steps
    if req.guidance_scale is not None:
        params["cfg_scale"] = req.guidance_scale
    return params
