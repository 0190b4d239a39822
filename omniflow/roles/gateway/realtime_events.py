"""The OpenAI Realtime client events /v1/realtime reads, as msgspec Structs tagged by
``type``, and the decoding that names a bad field (``item.content[0].type``).

Unknown fields are ignored (clients send many); known ones are type-checked. What this
gateway cannot do is refused by name, never ignored: server turn detection, an audio format
other than PCM16, tools.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from omniflow.roles.gateway.schema import ApiError

PCM_RATE = 24000  # OpenAI's audio/pcm rate, and the audio decoder's


class AudioFormat(msgspec.Struct):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Annotated[int, Meta(ge=8000, le=48000)] = PCM_RATE


class AudioInput(msgspec.Struct):
    format: AudioFormat | None = None
    turn_detection: Any = None
    transcription: Any = None
    noise_reduction: Any = None


class AudioOutput(msgspec.Struct):
    format: AudioFormat | None = None
    voice: Any = None
    speed: float | None = None


class AudioConfig(msgspec.Struct):
    input: AudioInput | None = None
    output: AudioOutput | None = None


Modalities = list[Literal["text", "audio"]]
MaxTokens = Annotated[int, Meta(ge=1)] | Literal["inf"]


class SessionConfig(msgspec.Struct):
    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: AudioConfig | None = None
    max_output_tokens: MaxTokens | None = None
    tools: list[Any] | None = None
    # An extension: params passed to the roles as they are (audio_chunks, temperature, ...)
    params: dict[str, Any] | None = None


class _Event(msgspec.Struct, tag_field="type"):
    event_id: str | None = None


class SessionUpdate(_Event, tag="session.update"):
    session: SessionConfig = msgspec.field(default_factory=SessionConfig)


class AudioAppend(_Event, tag="input_audio_buffer.append"):
    audio: str = ""


class AudioCommit(_Event, tag="input_audio_buffer.commit"):
    pass


class AudioClear(_Event, tag="input_audio_buffer.clear"):
    pass


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class InputAudio(msgspec.Struct, tag="input_audio", tag_field="type"):
    audio: str
    transcript: str | None = None


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str


class PlainText(msgspec.Struct, tag="text", tag_field="type"):
    text: str


Part = InputText | InputAudio | OutputText | PlainText


class Item(msgspec.Struct):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[Part]
    id: str | None = None


class ItemCreate(_Event, tag="conversation.item.create"):
    item: Item | None = None
    previous_item_id: str | None = None


class ResponseConfig(msgspec.Struct):
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    conversation: str | None = None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None


class ResponseCreate(_Event, tag="response.create"):
    response: ResponseConfig | None = None


class ResponseCancel(_Event, tag="response.cancel"):
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ResponseCreate
    | ResponseCancel
)
_decoder = msgspec.json.Decoder(ClientEvent)
_KNOWN = [
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "response.create",
    "response.cancel",
]


def decode_event(text: str | bytes) -> Any:
    """A client event; an ``ApiError`` whose ``param`` names the bad field otherwise."""
    try:
        return _decoder.decode(text)
    except msgspec.ValidationError as e:
        message = str(e)
        where = re.search(r"at `\$\.?(.*)`", message)
        param = where.group(1) if where else None
        if param == "type" and "Invalid value" in message:
            kind = _type_of(text)
            message = f"unsupported event type {kind!r}; this server reads {', '.join(_KNOWN)}"
        elif "missing required field `type`" in message:
            param, message = "type", "an event needs its type"
        raise ApiError(400, message.replace("`$.", "`"), param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the event is not valid JSON: {e}", "event") from None
    except RecursionError:
        raise ApiError(400, "the event is not valid JSON: nested too deep", "event") from None


def _type_of(text: str | bytes) -> str:
    return str(field_of(text, "type") or "?")


def field_of(text: str | bytes, key: str) -> Any:
    """``key`` of an event that did not decode (its ``event_id``, for the error), or None."""
    try:
        value = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return None
    return value.get(key) if isinstance(value, dict) else None


def check_session(config: SessionConfig) -> None:
    """Refuse by name what this gateway cannot honour."""
    audio = config.audio
    if audio is not None and audio.input is not None and audio.input.turn_detection is not None:
        raise ApiError(
            400,
            "server turn detection is not supported: set it to null and commit the buffer",
            "session.audio.input.turn_detection",
        )
    if audio is not None and audio.output is not None and audio.output.format is not None:
        if audio.output.format.rate != PCM_RATE:
            raise ApiError(
                400, f"output audio is PCM16 at {PCM_RATE} Hz", "session.audio.output.format.rate"
            )
    if config.tools:
        raise ApiError(400, "tools are not supported by this deployment", "session.tools")
