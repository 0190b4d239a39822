"""One /v1/realtime response: a streamed request whose outputs become Realtime events.

``response.created``, the assistant item, ``response.output_text.delta`` per text piece and
``response.output_audio.delta`` per decoded audio chunk (base64 PCM16 at 24 kHz) as they
come, then their ``done`` events and ``response.done`` with the status (``completed``,
``incomplete`` when max_output_tokens cut it, ``cancelled``, ``failed``) and usage. A
cancel closes the stream, which cancels the request in every role it reached.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

from omniflow.roles.gateway.calls import api_error
from omniflow.roles.gateway.realtime_events import PCM_RATE
from omniflow.roles.gateway.schema import ApiError
from omniflow.runtime.client import Output, RequestFailed, Result

if TYPE_CHECKING:
    from omniflow.roles.gateway.realtime import Session

log = logging.getLogger("omniflow.gateway")


class Turn:
    def __init__(
        self, session: Session, response_id: str, modalities: list[str], metadata: Any
    ) -> None:
        self.session, self.id, self.modalities, self.metadata = (
            session,
            response_id,
            modalities,
            metadata,
        )
        self.item_id = session.new_id("item")
        self.text: list[str] = []
        self.audio_chunks = 0
        self.status = "in_progress"
        self.reason: str | None = None
        self.usage: dict[str, int] = {}
        self.requeue: tuple[list, list, bool] = ([], [], False)

    def resource(self, with_output: bool = False) -> dict[str, Any]:
        response: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "conversation_id": self.session.id,
            "output_modalities": self.modalities,
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": PCM_RATE}}},
            "metadata": self.metadata,
            "output": [self.item(True)] if with_output else [],
        }
        if self.status == "incomplete":
            response["status_details"] = {"type": "incomplete", "reason": "max_output_tokens"}
        elif self.status == "cancelled":
            response["status_details"] = {"type": "cancelled", "reason": "client_cancelled"}
        elif self.status == "failed" and self.reason:
            response["status_details"] = {"type": "failed", "error": {"message": self.reason}}
        if self.usage:
            prompt = self.usage.get("prompt_tokens", 0)
            output = self.usage.get("completion_tokens", 0)
            response["usage"] = {
                "input_tokens": prompt,
                "output_tokens": output,
                "total_tokens": prompt + output,
                "input_token_details": {"cached_tokens": self.usage.get("cached_tokens", 0)},
            }
        return response

    def item(self, done: bool) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if done and self.text:
            content.append({"type": "output_text", "text": "".join(self.text)})
        if done and self.audio_chunks:
            content.append({"type": "output_audio", "transcript": "".join(self.text)})
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": content,
        }

    def _where(self, content_index: int) -> dict[str, Any]:
        return {
            "response_id": self.id,
            "item_id": self.item_id,
            "output_index": 0,
            "content_index": content_index,
        }

    async def run(self, inputs: dict[str, Any], params: dict[str, Any]) -> None:
        session, app = self.session, self.session.app
        send = session.send
        await send({"type": "response.created", "response": self.resource()})
        added = {"response_id": self.id, "output_index": 0, "item": self.item(False)}
        await send({"type": "response.output_item.added", **added})
        app.inflight += 1
        started = time.perf_counter()
        clock = app.metrics.audio_clock("realtime", started)
        try:
            await self._stream(inputs, params, clock, started)
        except asyncio.CancelledError:
            self.status = "cancelled"
        except RequestFailed as e:
            await self._fail(api_error(e))
        except Exception:  # a bug: the session goes on, the turn fails
            log.exception("realtime: response %s failed", self.id)
            await self._fail(ApiError(500, "internal error"))
        finally:
            app.inflight -= 1
        if self.status != "completed" and self.status != "incomplete":
            session.requeue(self)
        await self._finish()
        app.metrics.latency.labels("realtime").observe(time.perf_counter() - started)

    async def _fail(self, error: ApiError) -> None:
        self.status, self.reason = "failed", error.message
        await self.session.error(error, None)

    async def _stream(
        self, inputs: dict[str, Any], params: dict[str, Any], clock: Any, started: float
    ) -> None:
        session, app = self.session, self.session.app
        stream = app.client.stream(
            inputs,
            params=params,
            session=session.id,
            timeout=app._timeout(None),
            request_id=f"rt-{self.id}",
        )
        length = False
        first = True
        async with contextlib.aclosing(
            cast(AsyncGenerator[Output | Result, None], stream)
        ) as items:
            async for item in items:
                if isinstance(item, Result):
                    clock.done(item)
                    self.usage = item.usage
                    app.metrics.usage(item.usage)
                    self.status = "incomplete" if length else "completed"
                    return
                data = item.data
                if data.get("finish_reason") == "length" and "audio" not in self.modalities:
                    length = True
                text = data.get("text")
                pcm = data.get("audio_chunk")
                if first and (text or pcm):
                    app.metrics.ttft.labels("realtime").observe(time.perf_counter() - started)
                    first = False
                if isinstance(text, str) and text:
                    self.text.append(text)
                    await session.send(
                        {"type": "response.output_text.delta", **self._where(0), "delta": text}
                    )
                elif isinstance(pcm, (bytes, bytearray)):
                    clock.chunk(item.role, data, PCM_RATE)
                    self.audio_chunks += 1
                    delta = base64.b64encode(pcm).decode()
                    await session.send(
                        {"type": "response.output_audio.delta", **self._where(1), "delta": delta}
                    )
        raise AssertionError("a stream ended without its Result")

    async def _finish(self) -> None:
        send = self.session.send
        if self.text:
            await send(
                {"type": "response.output_text.done", **self._where(0), "text": "".join(self.text)}
            )
        if self.audio_chunks:
            await send({"type": "response.output_audio.done", **self._where(1)})
        done = {"response_id": self.id, "output_index": 0, "item": self.item(True)}
        await send({"type": "response.output_item.done", **done})
        await send({"type": "response.done", "response": self.resource(with_output=True)})
