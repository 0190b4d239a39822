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
from typing import Any

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


class MakeTensor(Actor):
    """A ``Noop`` that, for data with ``tensor_bytes`` = n > 0, adds ``tensor``: n uint8
    bytes written in the page pool (``fill_pattern``, ``seed`` from the data), as a
    producing stage would. For measuring what a tensor costs the runtime."""

    eager = True

    async def handle(self, request: Request, ctx: Context):
        n = request.data.get("tensor_bytes", 0)
        if not n:
            return {**request.data, **request.tensors}
        if not isinstance(n, int) or n < 0:
            raise BadRequest("tensor_bytes", f"expected an int >= 0, got {n!r}")
        seed = request.data.get("seed", 0)
        if not isinstance(seed, int):
            raise BadRequest("seed", f"expected an int, got {type(seed).__name__}")
        import torch

        from omniflow.transport.links import attached_pool

        pool = attached_pool()
        if pool is None:
            t = torch.empty(n, dtype=torch.uint8)
        else:
            t, lease = pool.empty((n,), torch.uint8)
            ctx.hold(lease)  # sent onward by handle; this ref goes when the request ends
        fill_pattern(t, seed)
        return {**request.data, **request.tensors, "tensor": t}


_PATTERNS: dict[int, Any] = {}


def fill_pattern(t: Any, seed: int) -> Any:
    """Write into the uint8 tensor ``t`` bytes that differ from byte to byte and from seed
    to seed (the first 8 are ``seed``, little-endian); returns ``t``.

    One memcpy on this thread (numpy's): torch's ``copy_`` splits 1 MiB over its OpenMP
    threads, which on a host whose cores every stage shares doubled the fill's CPU time
    (profiled in benchmarks/tensor_path.py) for no gain in latency.
    """
    import numpy as np
    import torch

    n = t.numel()
    base = _PATTERNS.get(n)
    if base is None:
        i = torch.arange(n, dtype=torch.int64)
        base = _PATTERNS[n] = ((i * 2654435761) >> 13).to(torch.uint8).numpy()
        while len(_PATTERNS) > 8:
            _PATTERNS.pop(next(iter(_PATTERNS)))
    if t.is_contiguous():
        np.copyto(t.numpy(), base)
    else:
        t.copy_(torch.from_numpy(base))
    head = seed.to_bytes(8, "little", signed=True)[:n]
    if head:
        t[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return t
