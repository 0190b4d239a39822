"""Two tiny roles that exercise the whole path before any model exists.

``upper`` streams the words of ``text`` upper-cased, one chunk per word;
``reverse`` reverses each chunk it receives. Options make them useful in
tests: ``delay_ms`` (a slow replica), ``fail_on`` (raise for that text),
``crash_on`` (kill the process for that text); a request's ``delay_ms``
parameter slows that request alone.
"""

from __future__ import annotations

import asyncio
import os
import re

from omniflow.roles.options import EchoOptions, EchoParams, read_params
from omniflow.runtime.actor import Actor, BadRequest, Context, Request


def _text(request: Request) -> str:
    text = request.data.get("text")
    if not isinstance(text, str):
        raise BadRequest("text", f"expected a string, got {type(text).__name__}")
    return text


class _Echo(Actor):
    Options = EchoOptions
    Params = EchoParams
    options: EchoOptions

    async def _maybe_misbehave(self, text: str, request: Request) -> None:
        if text and text == self.options.fail_on:
            raise RuntimeError(f"asked to fail on {text!r}")
        if text and text == self.options.crash_on:
            os._exit(17)
        delay = self.options.delay_ms + read_params(EchoParams, request.params).delay_ms
        if delay:
            await asyncio.sleep(delay / 1e3)

    def meta(self) -> dict:
        return {"delay_ms": self.options.delay_ms}


class Upper(_Echo):
    async def handle(self, request: Request, ctx: Context):
        text = _text(request)
        await self._maybe_misbehave(text, request)
        for word in re.findall(r"\S+\s*", text) or [text]:
            yield {"text": word.upper(), "replica": self.replica}


class Reverse(_Echo):
    async def handle(self, request: Request, ctx: Context):
        text = _text(request)
        await self._maybe_misbehave(text, request)
        return {"text": text[::-1], "replica": self.replica}


class Noop(Actor):
    """Passes its input through unchanged: for measuring the runtime itself."""

    eager = True  # never suspends, uses no Task: the reader callback answers it

    async def handle(self, request: Request, ctx: Context):
        return {**request.data, **request.tensors}
