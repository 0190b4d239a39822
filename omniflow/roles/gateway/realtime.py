"""/v1/realtime: a WebSocket speaking the OpenAI Realtime events a voice client needs.

One connection is one session (its id is the deployment's session, so each turn goes on
from the last one's KV): ``session.update``, ``input_audio_buffer.append`` / ``commit`` /
``clear`` (PCM16 at the session's input rate), ``conversation.item.create``,
``response.create`` and ``response.cancel`` in; ``response.output_text.delta``,
``response.output_audio.delta`` / ``done`` (base64 PCM16 at 24 kHz, the rate the session
names), ``response.done`` and ``error`` (naming the bad field) out. A cancel (barge-in)
closes the request's stream, which cancels it in every role it reached.

The first response sends the dialogue so far as messages (instructions as the system
message); each later one sends only the user input since, which the llm prompts after
the session's tokens: nothing already prefilled is prefilled again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec

from omniflow.roles.gateway import realtime_events as ev
from omniflow.roles.gateway.http import Receive, Send, header
from omniflow.roles.gateway.realtime_turn import Turn
from omniflow.roles.gateway.replies import wav
from omniflow.roles.gateway.schema import ApiError, b64

if TYPE_CHECKING:
    from omniflow.roles.gateway.app import GatewayApp

log = logging.getLogger("omniflow.gateway")
_json = msgspec.json.Encoder()
_KEY_PROTOCOL = "openai-insecure-api-key."  # how a browser sends its key (no headers)
_CODES = {429: "overloaded", 503: "no_replica", 504: "deadline"}


class Realtime:
    """Serves /v1/realtime WebSocket connections of one gateway."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self.ids = itertools.count()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        offered = [
            p.strip() for p in (header(scope, b"sec-websocket-protocol") or b"").decode().split(",")
        ]
        try:
            if scope["path"] != "/v1/realtime":
                raise ApiError(404, f"no WebSocket route {scope['path']}")
            self._authorize(scope, offered)
            model = parse_qs(scope.get("query_string", b"").decode()).get("model", [None])[0]
            self.app._check_model(model)
        except ApiError as e:
            log.info("realtime: refused %s: %s", scope["path"], e.message)
            await send({"type": "websocket.close", "code": 1008, "reason": e.message[:120]})
            self.app.metrics.answered("/v1/realtime", e.status)
            return
        accept: dict[str, Any] = {"type": "websocket.accept"}
        chosen = next((p for p in offered if p == "realtime"), None)
        if chosen:
            accept["subprotocol"] = chosen
        await send(accept)
        session = Session(self.app, send, f"sess_{self.app._prefix}{next(self.ids):x}")
        try:
            await session.run(receive)
        finally:
            await session.close()
            self.app.metrics.answered("/v1/realtime", 101)

    def _authorize(self, scope: dict[str, Any], offered: list[str]) -> None:
        keys = [p[len(_KEY_PROTOCOL) :] for p in offered if p.startswith(_KEY_PROTOCOL)]
        if keys and not header(scope, b"authorization"):
            scope = {
                **scope,
                "headers": [*scope["headers"], (b"authorization", f"Bearer {keys[0]}".encode())],
            }
        self.app._authorize(scope)


class Session:
    """One connection: its settings, input buffer, pending input and the active response."""

    def __init__(self, app: GatewayApp, send: Send, session_id: str) -> None:
        self.app, self._send, self.id = app, send, session_id
        self.config = ev.SessionConfig(output_modalities=["audio"])
        self.buffer = bytearray()
        self.limit = app._limit
        self.pending: list[dict[str, Any]] = []  # messages not yet sent to the deployment
        self.media: list[bytes] = []  # the pending messages' audio, in order
        self.started = False  # the deployment's session holds the dialogue
        self.last_item: str | None = None
        self.ids = itertools.count()
        self.turn: Turn | None = None
        self.task: asyncio.Task | None = None
        self.open = True

    def new_id(self, kind: str) -> str:
        return f"{kind}_{self.id[5:]}_{next(self.ids):x}"

    async def send(self, event: dict[str, Any]) -> None:
        if not self.open:
            return
        event = {"event_id": self.new_id("event"), **event}
        try:
            await self._send({"type": "websocket.send", "text": _json.encode(event).decode()})
        except Exception:  # the peer went away: the reader loop sees the disconnect
            self.open = False

    async def error(self, e: ApiError, event_id: str | None) -> None:
        code = _CODES.get(e.status) or ("invalid_request_error" if e.status == 400 else None)
        error = {"type": e.kind, "code": code, "message": e.message, "param": e.param}
        await self.send({"type": "error", "error": {**error, "event_id": event_id}})

    async def run(self, receive: Receive) -> None:
        await self.send({"type": "session.created", "session": self.session_object()})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                self.open = False
                return
            text = message.get("text")
            data = text if text is not None else message.get("bytes") or b""
            event_id = None
            try:
                event = ev.decode_event(data)
                event_id = event.event_id
                await self.handle(event)
            except ApiError as e:
                if event_id is None:
                    given = ev.field_of(data, "event_id")
                    event_id = given if isinstance(given, str) else None
                await self.error(e, event_id)

    async def close(self) -> None:
        self.open = False
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def handle(self, event: Any) -> None:
        if isinstance(event, ev.SessionUpdate):
            await self.update(event.session)
        elif isinstance(event, ev.AudioAppend):
            pcm = b64(event.audio, "audio")
            if len(self.buffer) + len(pcm) > self.limit:
                raise ApiError(
                    400, f"the input audio buffer would exceed {self.limit} bytes", "audio"
                )
            self.buffer += pcm
        elif isinstance(event, ev.AudioCommit):
            await self.commit()
        elif isinstance(event, ev.AudioClear):
            self.buffer.clear()
            await self.send({"type": "input_audio_buffer.cleared"})
        elif isinstance(event, ev.ItemCreate):
            await self.create_item(event)
        elif isinstance(event, ev.ResponseCreate):
            await self.respond(event.response or ev.ResponseConfig())
        elif isinstance(event, ev.ResponseCancel):
            await self.cancel(event.response_id)

    # ------------------------------------------------------------------ session and input

    def session_object(self) -> dict[str, Any]:
        config = self.config
        rate = self.input_rate()
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.app.name,
            "instructions": config.instructions or "",
            "output_modalities": config.output_modalities,
            "max_output_tokens": config.max_output_tokens or "inf",
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": rate}, "turn_detection": None},
                "output": {"format": {"type": "audio/pcm", "rate": ev.PCM_RATE}, "voice": "alloy"},
            },
            "tools": [],
        }

    def input_rate(self) -> int:
        audio = self.config.audio
        if audio is not None and audio.input is not None and audio.input.format is not None:
            return audio.input.format.rate
        return ev.PCM_RATE

    async def update(self, new: ev.SessionConfig) -> None:
        ev.check_session(new)
        self.app._check_model(new.model)
        if self.started and new.instructions not in (None, self.config.instructions):
            raise ApiError(
                400, "instructions are fixed once the first response began", "session.instructions"
            )
        if new.params:
            self.app._check_params(new.params)
        merged = {k: v for k, v in msgspec.structs.asdict(self.config).items()}
        for key, value in msgspec.structs.asdict(new).items():
            if value is not None and key != "type":
                merged[key] = value
        self.config = msgspec.convert(merged, ev.SessionConfig, from_attributes=True)
        await self.send({"type": "session.updated", "session": self.session_object()})

    async def add_item(
        self, role: str, content: list[dict[str, Any]], audio: list[bytes], item_id: str = ""
    ) -> str:
        item_id = item_id or self.new_id("item")
        if self.started and role != "user":
            raise ApiError(
                400,
                f"a {role} item after the first response: only user input follows on",
                "item.role",
            )
        self.pending.append({"role": role, "content": content})
        self.media += audio
        text_type = "output_text" if role == "assistant" else "input_text"
        shown = [
            {"type": text_type, "text": p["text"]}
            if p["type"] == "text"
            else {"type": "input_audio", "transcript": None}
            for p in content
        ]
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": role,
            "status": "completed",
            "content": shown,
        }
        await self.send(
            {"type": "conversation.item.added", "previous_item_id": self.last_item, "item": item}
        )
        await self.send(
            {"type": "conversation.item.done", "previous_item_id": self.last_item, "item": item}
        )
        self.last_item = item_id
        return item_id

    async def commit(self) -> None:
        if not self.buffer:
            raise ApiError(400, "the input audio buffer is empty", "input_audio_buffer")
        audio = wav(bytes(self.buffer), self.input_rate())
        self.buffer.clear()
        previous = self.last_item
        item_id = self.new_id("item")
        await self.send(
            {
                "type": "input_audio_buffer.committed",
                "previous_item_id": previous,
                "item_id": item_id,
            }
        )
        await self.add_item("user", [{"type": "audio"}], [audio], item_id)

    async def create_item(self, event: ev.ItemCreate) -> None:
        if event.item is None:
            raise ApiError(400, "conversation.item.create needs its item", "item")
        content: list[dict[str, Any]] = []
        audio: list[bytes] = []
        for j, part in enumerate(event.item.content):
            if isinstance(part, ev.InputAudio):
                pcm = b64(part.audio, f"item.content[{j}].audio")
                audio.append(wav(pcm, self.input_rate()))
                content.append({"type": "audio"})
            else:
                content.append({"type": "text", "text": part.text})
        if audio and event.item.role != "user":
            raise ApiError(400, "only user items carry audio", "item.content")
        await self.add_item(event.item.role, content, audio)

    # ------------------------------------------------------------------ responses

    async def respond(self, config: ev.ResponseConfig) -> None:
        if self.task is not None and not self.task.done():
            raise ApiError(400, "a response is in progress: cancel it first", "response")
        if config.tools:
            raise ApiError(400, "tools are not supported by this deployment", "response.tools")
        if config.conversation not in (None, "auto"):
            raise ApiError(
                400, "responses join the session's conversation", "response.conversation"
            )
        modalities = config.output_modalities or self.config.output_modalities or ["audio"]
        limit = config.max_output_tokens or self.config.max_output_tokens
        params: dict[str, Any] = dict(self.config.params or {})
        params["want"] = "text,audio" if "audio" in modalities else "text"
        if isinstance(limit, int):
            params["max_tokens"] = limit
        self.app._admit()
        inputs = self.inputs(config.instructions)
        self.app._first_hops_live(inputs, params)
        turn = Turn(self, self.new_id("resp"), list(modalities), config.metadata)
        turn.requeue = (self.pending, self.media, self.started)
        self.pending, self.media = [], []
        self.turn = turn
        self.task = asyncio.ensure_future(turn.run(inputs, params))
        self.started = True

    def requeue(self, turn: Turn) -> None:
        """A turn that did not complete left the deployment's session as it was: its input
        goes again with the next response."""
        pending, media, started = turn.requeue
        self.pending, self.media, self.started = pending + self.pending, media + self.media, started

    def inputs(self, instructions: str | None) -> dict[str, Any]:
        """The request: the dialogue so far on the first turn, the new user input after."""
        messages = list(self.pending)
        inputs: dict[str, Any] = {}
        if len(self.media) == 1:
            inputs["audio"] = self.media[0]
        elif self.media:
            inputs["audios"] = list(self.media)
        if not self.started:
            system = instructions if instructions is not None else self.config.instructions
            if system:
                messages.insert(0, {"role": "system", "content": system})
            if not any(m["role"] == "user" for m in messages):
                messages.append({"role": "user", "content": ""})
            inputs["messages"] = messages
            inputs["text"] = "\n".join(_text(m) for m in messages if _text(m))
            return inputs
        inputs["text"] = " ".join(_text(m) for m in messages if _text(m))
        return inputs

    async def cancel(self, response_id: str | None) -> None:
        turn, task = self.turn, self.task
        if turn is None or task is None or task.done():
            raise ApiError(400, "no response is in progress", "response_id")
        if response_id is not None and response_id != turn.id:
            raise ApiError(400, f"response {response_id!r} is not in progress", "response_id")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _text(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return " ".join(p["text"] for p in content if p.get("type") == "text" and p["text"])
