"""The gateway's ASGI app: OpenAI's chat and image routes onto a deployment's ``Client``.

A raw ASGI callable, not a framework: six routes need no router, and each framework layer
is time on every request (the gateway's overhead is the point of benchmarks/gateway.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from omniflow.roles.gateway.calls import (
    api_error,
    check_param_names,
    check_sizes,
    choice,
    declared_params,
    gather,
    seed_of,
    session_of,
)
from omniflow.roles.gateway.cors import Cors
from omniflow.roles.gateway.http import (
    Disconnected,
    Receive,
    Send,
    answer,
    event,
    header,
    open_sse,
    read_body,
    until_disconnect,
)
from omniflow.roles.gateway.metrics import Metrics
from omniflow.roles.gateway.multipart import form_fields, text_field
from omniflow.roles.gateway.realtime import Realtime
from omniflow.roles.gateway.replies import (
    AUDIO_RATE,
    ChatChunks,
    TextChunks,
    Transcripts,
    chat_message,
    completion_logprobs,
    finish_reason,
    text_of,
    token_logprobs,
    usage,
)
from omniflow.roles.gateway.schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    ImageRequest,
    SpeechRequest,
    chat_inputs,
    chat_params,
    completion_params,
    decode_body,
    image_params,
    refuse_unsupported,
)
from omniflow.roles.gateway.speech import stream_speech
from omniflow.runtime.client import Client, Output, RequestFailed, Result
from omniflow.runtime.config import Config, GatewayConfig
from omniflow.runtime.loading import makes_of

log = logging.getLogger("omniflow.gateway")
_INPUT = "input"  # the graph's source: where a client's request enters
_RETRY = [(b"retry-after", b"1")]


class GatewayApp:
    def __init__(self, client: Client, config: Config, options: GatewayConfig) -> None:
        self.client, self.config, self.options, self.name = client, config, options, config.name
        self.metrics = Metrics(config.name)
        self.started = int(time.time())
        self.inflight = 0
        self.metrics.inflight.set_function(lambda: self.inflight)  # read at scrape time
        self._key = options.api_key.encode()
        self._limit = int(options.max_body_mb * 2**20)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self.transcripts = Transcripts()  # of the audio answered: a resent turn's audio.id
        self.makes = {kind for role in config.roles.values() for kind in makes_of(role.actor)}
        if not self.makes:  # no role says what it makes (custom roles): text, as ever
            self.makes = {"text"}
        self._first_roles = {e.dst for e in client.router.plan.edges if e.src == _INPUT}
        self._params = declared_params(config)
        self._routes = {
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/audio/speech"): self.speech,
            ("POST", "/v1/images/generations"): self.images,
            ("POST", "/v1/images/edits"): self.edits,
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.prometheus,
            ("GET", "/"): self.playground,
        }
        self._realtime = Realtime(self)
        self._cors = Cors(self._route, options.cors_origins) if options.cors_origins else None
        page = (Path(__file__).parent / "playground.html").read_text()
        self._page = page.replace("__MODEL__", json.dumps(self.name)).encode()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._realtime(scope, receive, send)
        elif self._cors is not None:
            await self._cors(scope, receive, send)
        else:
            await self._route(scope, receive, send)

    async def _route(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        handler = self._routes.get((scope["method"], path))
        status = 200
        try:
            if handler is None:
                known = any(p == path for _, p in self._routes)
                raise ApiError(405 if known else 404, f"no route {scope['method']} {path}")
            if path.startswith("/v1/") or path == "/metrics":  # /health and / stay open
                self._authorize(scope)
            status = await handler(scope, receive, send)
        except ApiError as e:
            status = e.status
            await answer(send, e.status, e.body(), extra=_RETRY if e.status in (429, 503) else None)
        except Disconnected:
            status = 499  # nginx's "client closed request": counted, never sent
        except Exception:
            log.exception("gateway: %s %s failed", scope["method"], path)
            status = 500
            with contextlib.suppress(Exception):  # unless the response had begun
                await answer(send, 500, ApiError(500, "internal error").body())
        self.metrics.answered(path if handler is not None else "other", status)

    def _authorize(self, scope: dict[str, Any]) -> None:
        if not self._key:
            return
        given = header(scope, b"authorization") or b""
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(token, self._key):
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)")

    # ------------------------------------------------------------------ simple routes

    async def models(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        model: dict[str, Any] = {"id": self.name, "object": "model", "owned_by": "omniflow"}
        model["created"] = self.started
        await answer(send, 200, {"object": "list", "data": [model]})
        return 200

    async def health(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        missing = [role for role in self.config.roles if not self.client.view.replicas(role)]
        status = 503 if missing else 200
        await answer(
            send, status, {"status": "unavailable" if missing else "ok", "missing": missing}
        )
        return status

    async def playground(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        await answer(send, 200, self._page, b"text/html; charset=utf-8")
        return 200

    async def prometheus(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        await answer(send, 200, self.metrics.text(), CONTENT_TYPE_LATEST.encode())
        return 200

    # ------------------------------------------------------------------ model routes

    def _admit(self) -> None:
        if self.inflight >= self.options.max_inflight:
            raise ApiError(429, f"{self.inflight} requests in flight; try again later")

    def _first_hops_live(self, inputs: dict[str, Any], params: dict[str, Any]) -> None:
        """503 at once when a role this request goes to first lost its last replica.

        The router would wait a grace period for one to come back; an HTTP client is
        better served by a 503 it can retry (``Retry-After``) than by a stalled request.
        A role this view has not seen yet (right after a start) keeps the grace.
        """
        check_sizes(inputs, params, self.config.runtime.max_prompt_chars)  # before any work
        view = self.client.view
        if not any(view.lost(role) for role in self._first_roles):
            return  # the common case, without routing the request twice
        for route in self.client.router.plan.route(_INPUT, params, inputs):
            role = route.edge.dst
            if view.lost(role):
                raise ApiError(503, f"no ready replica of role {role!r}", None)

    def _timeout(self, asked: float | None) -> float | None:
        limit = self.options.timeout_s or None
        if asked is None:
            return limit
        return min(asked, limit) if limit else asked

    def _check_params(self, given: dict[str, Any]) -> None:
        check_param_names(given, self._params, self.name)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(
                400, f"unknown model {model!r}; this deployment is {self.name!r}", "model"
            )

    async def chat(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        req = decode_body(await read_body(scope, receive, self._limit), ChatRequest)
        self._check_model(req.model)
        refuse_unsupported(req)
        session = session_of(req, header(scope, b"x-session-id"), self.options.max_id_chars)
        if req.n > 1 and (req.stream or session):
            field = "stream" if req.stream else "session"
            raise ApiError(400, f"n > 1 is served without {field}", "n")
        inputs, want = chat_inputs(req, self.options.allow_local_paths, self.transcripts)
        for kind in want:
            if kind not in self.makes:
                raise ApiError(400, f"this deployment makes no {kind}", "modalities")
        self._check_params(req.params)
        params = chat_params(req, want)
        request_id = f"chatcmpl-{self._prefix}{next(self._ids):x}"
        kwargs = {"session": session, "timeout": self._timeout(req.timeout)}
        audio_format = req.audio.format if req.audio is not None else "wav"
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        def reply(results: list[tuple[list[Output], Result]]) -> dict[str, Any]:
            choices = [
                {"index": i, **chat_message(request_id, outputs, audio_format, req.logprobs)}
                for i, (outputs, _) in enumerate(results)
            ]
            self.transcripts.note_choices(choices)
            return {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": choices,
                "usage": usage([result.usage for _, result in results]),
            }

        chunks = ChatChunks(request_id, self.name, req.logprobs, include_usage, self.transcripts)
        return await self._serve(
            receive, send, inputs, params, kwargs, request_id, req.n, reply,
            chunks if req.stream else None,
        )  # fmt: skip

    async def completions(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        """/v1/completions: the prompt as it is (no chat template), text out."""
        req = decode_body(await read_body(scope, receive, self._limit), CompletionRequest)
        self._check_model(req.model)
        for field in ("suffix", "best_of"):
            if getattr(req, field) not in (None, 1):
                raise ApiError(400, f"{field} is not supported", field)
        if req.n > 1 and req.stream:
            raise ApiError(400, "n > 1 is served without stream", "n")
        self._check_params(req.params)
        prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        inputs = {"text": prompt, "prompt": prompt}
        params = completion_params(req)
        request_id = f"cmpl-{self._prefix}{next(self._ids):x}"
        kwargs = {"session": "", "timeout": self._timeout(req.timeout)}
        echo = prompt if req.echo else ""

        def reply(results: list[tuple[list[Output], Result]]) -> dict[str, Any]:
            choices = []
            for i, (outputs, _) in enumerate(results):
                entries = token_logprobs(outputs)
                logprobs = (
                    completion_logprobs(entries, len(echo)) if req.logprobs is not None else None
                )
                choices.append(
                    {
                        "index": i,
                        "text": echo + text_of(outputs),
                        "logprobs": logprobs,
                        "finish_reason": finish_reason(outputs),
                    }
                )
            return {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": choices,
                "usage": usage([result.usage for _, result in results]),
            }

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = TextChunks(request_id, self.name, req.logprobs is not None, include_usage, echo)
        return await self._serve(
            receive, send, inputs, params, kwargs, request_id, req.n, reply,
            chunks if req.stream else None,
        )  # fmt: skip

    async def speech(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        """/v1/audio/speech: the input spoken by the llm's audio tokens, streamed."""
        req = decode_body(await read_body(scope, receive, self._limit), SpeechRequest)
        self._check_model(req.model)
        req.check()
        if "audio" not in self.makes:
            raise ApiError(400, f"{self.name} makes no audio", "model")
        self._check_params(req.params)
        inputs = {"text": req.input, "messages": [{"role": "user", "content": req.input}]}
        params = {**req.params, "want": "audio"}
        self._admit()
        self._first_hops_live(inputs, params)
        rid = f"speech-{self._prefix}{next(self._ids):x}"
        timeout = self._timeout(req.timeout)
        stream = self.client.stream(inputs, params=params, timeout=timeout, request_id=rid)
        self.inflight += 1
        started = time.perf_counter()
        clock = self.metrics.audio_clock("speech", started)
        try:
            sse = req.stream_format == "sse"
            work = stream_speech(send, cast(Any, stream), req.response_format, sse, clock)
            status, result = await until_disconnect(receive, work)
        except RequestFailed as e:
            raise api_error(e) from None
        finally:
            self.inflight -= 1
        if result is not None:
            self.metrics.usage(result.usage)
        self.metrics.latency.labels("speech").observe(time.perf_counter() - started)
        return status

    async def _serve(
        self,
        receive: Receive,
        send: Send,
        inputs: dict[str, Any],
        params: dict[str, Any],
        kwargs: dict[str, Any],
        request_id: str,
        n: int,
        reply: Any,
        chunks: Any,
    ) -> int:
        """Admit a model request, run it (n times, seeds apart) or stream it, and answer."""
        self._admit()
        self._first_hops_live(inputs, params)
        kwargs = {**kwargs, "request_id": request_id}
        self.inflight += 1
        started = time.perf_counter()
        try:
            if chunks is not None:
                work = self._stream(send, inputs, {**kwargs, "params": params}, started, chunks)
                status = await until_disconnect(receive, work)
            else:
                calls = [
                    self._call(inputs, {**kwargs, **choice(params, i, n, request_id)}, started)
                    for i in range(n)
                ]
                results = await until_disconnect(receive, gather(calls))
                await answer(send, 200, reply(results))
                status = 200
        finally:
            self.inflight -= 1
        self.metrics.chat_latency.observe(time.perf_counter() - started)
        return status

    async def _call(
        self, inputs: dict[str, Any], kwargs: dict[str, Any], started: float
    ) -> tuple[list[Output], Result]:
        try:
            outputs, result = await self.client.call(inputs, **kwargs)
        except RequestFailed as e:
            raise api_error(e) from None
        self.metrics.chat_ttft.observe(time.perf_counter() - started)
        self.metrics.usage(result.usage)
        return outputs, result

    async def _stream(
        self, send: Send, inputs: dict[str, Any], kwargs: dict[str, Any], started: float, chunks
    ) -> int:
        """Server-sent events, one per output. The headers wait for the first event, so a
        request that fails before any output still gets its own status."""
        opened = False
        clock = self.metrics.audio_clock("chat", started)
        # aclosing: a disconnect's cancel ends the stream now, which sends the Cancel.
        generator = cast(
            AsyncGenerator[Output | Result, None], self.client.stream(inputs, **kwargs)
        )
        try:
            async with contextlib.aclosing(generator) as stream:
                async for item in stream:
                    if isinstance(item, Result):
                        self.metrics.usage(item.usage)
                        clock.done(item)
                        if not opened:
                            await open_sse(send)
                        body = chunks.last(item) + b"data: [DONE]\n\n"
                        await send({"type": "http.response.body", "body": body})
                        return 200
                    clock.chunk(item.role, item.data, AUDIO_RATE)
                    body = chunks.of(item)
                    if body is None:
                        continue
                    if not opened:
                        self.metrics.chat_ttft.observe(time.perf_counter() - started)
                        await open_sse(send)
                        opened = True
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        except RequestFailed as e:
            error = api_error(e)
            if not opened:
                raise error from None
            await send({"type": "http.response.body", "body": event(error.body())})
            return error.status
        raise AssertionError("a stream ended without its Result")

    async def images(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        req = decode_body(await read_body(scope, receive, self._limit), ImageRequest)
        return await self._images(req, {"text": req.prompt}, receive, send)

    async def edits(self, scope: dict[str, Any], receive: Receive, send: Send) -> int:
        """/v1/images/edits: a multipart ``image`` and ``prompt``; the image conditions the
        pipeline (longcat: through the vision encoder; HunyuanImage-3: ti2i)."""
        body = await read_body(scope, receive, self._limit)
        fields = form_fields(header(scope, b"content-type"), body)
        if "mask" in fields:
            raise ApiError(400, "masks are not supported: the whole image is edited", "mask")
        images = fields.get("image") or fields.get("image[]") or []
        if len(images) != 1 or not images[0]:
            raise ApiError(400, "expected one image file", "image")
        values = {k: text_field(fields, k) for k in fields if k not in ("image", "image[]")}
        try:
            req = msgspec.convert(values, ImageRequest, strict=False)
        except msgspec.ValidationError as e:
            where = str(e).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(e) else None
            raise ApiError(400, str(e).replace("`$.", "`"), where) from None
        content = [{"type": "image"}, {"type": "text", "text": req.prompt}]
        inputs = {
            "text": req.prompt,
            "image": images[0],
            "messages": [{"role": "user", "content": content}],
        }
        return await self._images(req, inputs, receive, send)

    async def _images(
        self, req: ImageRequest, inputs: dict[str, Any], receive: Receive, send: Send
    ) -> int:
        self._check_model(req.model)
        if "image" not in self.makes:
            raise ApiError(400, f"{self.name} makes no images", "model")
        # A pipeline whose roles read `size` takes it as given ("WxH" or "auto"; they check
        # it); others get it as longcat's token grid.
        params = image_params(req, sized=self._params is not None and "size" in self._params)
        self._admit()
        self._first_hops_live(inputs, params)
        started = time.perf_counter()
        self.inflight += 1
        timeout = self._timeout(req.timeout)

        async def all_of() -> list[tuple[list[Output], Result]]:
            tasks = [asyncio.ensure_future(one(i)) for i in range(req.n)]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:  # one failed (or the client left): the others stop too
                for task in tasks:
                    task.cancel()
                raise

        async def one(i: int) -> tuple[list[Output], Result]:
            seed = {"seed": seed_of(params.get("seed", 0), i)} if req.n > 1 else {}
            try:
                return await self.client.call(
                    inputs, params={**params, **seed}, session="", timeout=timeout
                )
            except RequestFailed as e:
                raise api_error(e) from None

        try:
            results = await until_disconnect(receive, all_of())
        finally:
            self.inflight -= 1
        data = [
            {"b64_json": base64.b64encode(o.data["image"]).decode(), "revised_prompt": req.prompt}
            for outputs, _ in results
            for o in outputs
            if "image" in o.data
        ]
        for _, result in results:
            self.metrics.usage(result.usage)
        await answer(send, 200, {"created": int(time.time()), "data": data})
        self.metrics.latency.labels("images").observe(time.perf_counter() - started)
        return 200
