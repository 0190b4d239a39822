"""Processes for the KV pull tests: a holder (an engine behind a KVPullServer, driven over a
pipe) and a puller that dies mid-transfer."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import torch
import zmq

from omniflow.engine import AsyncEngine, LLMEngine, SamplingParams
from omniflow.engine.kv_transfer import EnginePrefixes, KVTransfer
from omniflow.engine.llm_engine import EngineConfig
from omniflow.messages import KvFetch, KvPrepare, KvPrepared
from omniflow.transport.codec import decode, decoder_for, encode
from omniflow.transport.kv_pull import KVPullServer
from omniflow.transport.security import load_keys


def engine_config(page_size: int = 4, num_pages: int = 64) -> EngineConfig:
    return EngineConfig(device="cpu", page_size=page_size, num_pages=num_pages)


def hold(model: str, conn: Any, options: dict[str, Any]) -> None:
    """The holder: prefill prompts on command, serve their KV, report its books."""
    torch.set_num_threads(1)
    asyncio.run(_hold(model, conn, options))


async def _hold(model: str, conn: Any, options: dict[str, Any]) -> None:
    engine = AsyncEngine(LLMEngine(model, engine_config(**options.get("engine", {}))))
    keys = load_keys(options["keys"]) if options.get("keys") else None
    ctx = zmq.Context()
    server = KVPullServer(
        ctx,
        "tcp://127.0.0.1:*",
        EnginePrefixes(engine),
        keys=keys,
        ttl_s=options.get("ttl_s", 10.0),
        chunk_bytes=options.get("chunk_bytes", 8 << 20),
    )
    server.start()
    conn.send(server.endpoint)
    backend: Any = engine.backend
    try:
        while True:
            command, arg = await asyncio.to_thread(conn.recv)
            if command == "prefill":
                params = SamplingParams(temperature=0.0, max_tokens=1)
                async for _ in engine.generate(f"fill-{len(arg)}-{arg[0]}", arg, params):
                    pass
                conn.send(None)
            elif command == "ttl":  # later tokens live this long; answers the books
                server.tokens.ttl_s = arg
                conn.send({"pinned": server.pinned, **server.counts})
            elif command == "books":  # what is pinned and referenced once pulls are over
                refs = await engine.call(lambda: sum(backend.allocator.ref_counts))
                conn.send({"pinned": server.pinned, "referenced": refs, **server.counts})
            else:
                conn.send(None)
                return
    finally:
        await server.close()
        await engine.close()
        ctx.term()


def die_mid_pull(endpoint: str, tokens: list[int], conn: Any) -> None:
    """Prepare and fetch a prefix, take the first pages message, then SIGKILL itself."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(encode(KvPrepare("doomed", tokens)))
    prepared = decode(sock.recv(), decoder_for(KvPrepared))
    sock.send(encode(KvFetch("doomed", prepared.token)))
    sock.recv_multipart()
    conn.send(prepared.num_pages)
    os.kill(os.getpid(), signal.SIGKILL)


def prefix_pages(engine: LLMEngine, tokens):
    """The K/V of the pages holding ``tokens``' prefix, read out, and that prefix's length."""
    transfer = KVTransfer(engine)
    pages, num_tokens = transfer.pin(tokens)
    data = transfer.read(pages)
    transfer.unpin(pages)
    return data, num_tokens


def greedy(engine: LLMEngine, request_id, prompt):
    """8 greedy tokens of ``prompt``, and how many of its tokens were found cached."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    deltas = engine.run_to_completion()
    return [t for d in deltas for t in d.token_ids], deltas[-1].num_cached_tokens
