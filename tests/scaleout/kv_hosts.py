"""The two ends of a KV pull between network-namespace hosts, each run as
``python -m tests.scaleout.kv_hosts hold|pull ...`` inside its namespace.

hold MODEL BIND KEYS PROMPT_JSON   prefill the prompt, serve its pages at BIND (CurveZMQ),
                                   print "ENDPOINT <endpoint>", serve until stdin closes
pull MODEL ENDPOINT KEYS PROMPT_JSON
                                   pull the prompt's prefix from ENDPOINT, then print one JSON
                                   line: tokens pulled, the pages' sha256, the greedy
                                   continuation and how many prompt tokens it found cached
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import torch
import zmq

from omniflow.engine import AsyncEngine, LLMEngine, SamplingParams
from omniflow.engine.kv_transfer import EnginePrefixes
from omniflow.kv.pull_cost import PullCost
from omniflow.transport.kv_pull import KVPuller, KVPullServer
from omniflow.transport.security import load_keys
from tests.engine.kv_pull_peers import engine_config, greedy, prefix_pages

PAGE = 4  # engine_config's page size


def pages_digest(engine: LLMEngine, tokens: list[int]) -> tuple[str, int]:
    """sha256 of the K/V bytes of the pages holding ``tokens``' prefix, and its length."""
    data, num_tokens = prefix_pages(engine, tokens)
    return hashlib.sha256(data.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(), (
        num_tokens
    )


async def hold(model: str, bind: str, keys: str, prompt: list[int]) -> None:
    engine = AsyncEngine(LLMEngine(model, engine_config()))
    async for _ in engine.generate("fill", prompt, SamplingParams(temperature=0.0, max_tokens=1)):
        pass
    ctx = zmq.Context()
    server = KVPullServer(ctx, bind, EnginePrefixes(engine), keys=load_keys(keys))
    server.start()
    print(f"ENDPOINT {server.endpoint}", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.close()
    await engine.close()
    ctx.term()


async def pull(model: str, endpoint: str, keys: str, prompt: list[int]) -> dict:
    engine = AsyncEngine(LLMEngine(model, engine_config()))
    prefix = prompt[:-1]
    ctx = zmq.Context()
    try:
        importer = EnginePrefixes(engine).importer(prefix)
        held = await importer.begin()
        puller = KVPuller(ctx, PullCost(), keys=load_keys(keys), timeout_s=60.0)
        result = await puller.pull(endpoint, "across", prefix, None, importer, held, force=True)
        await importer.publish()
        digest, num_tokens = await engine.call(lambda: pages_digest(engine.backend, prefix))
    finally:
        await engine.close()
        ctx.term()
    tokens, cached = greedy(engine.backend, "continued", prompt)
    return {
        "pulled_tokens": result.pulled_tokens,
        "digest": digest,
        "num_tokens": num_tokens,
        "tokens": tokens,
        "cached": cached,
    }


def main() -> None:
    torch.set_num_threads(1)
    mode, model, where, keys, prompt_json = sys.argv[1:6]
    prompt = json.loads(prompt_json)
    if mode == "hold":
        asyncio.run(hold(model, where, keys, prompt))
    else:
        print(json.dumps(asyncio.run(pull(model, where, keys, prompt))), flush=True)


if __name__ == "__main__":
    main()
