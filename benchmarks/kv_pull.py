"""Pulling a 2,048-token prefix's KV from another process over tcp, against prefilling it.

    kv_pull_ms_2048     prepare, fetch, write into this engine's pages and publish them in
                        its prefix tree (transport/kv_pull.py), from a holder process that
                        prefilled the prefix
    recompute_ms_2048   prefilling the same prefix here (one more token, sampled)

Both run in the puller's process on the same engine, alternating (A B A B) after a warm-up
round; the puller's prefix cache is emptied after each so every round starts cold. Medians.
The model is the 30M-parameter benchmark llama (8 layers, 4 KV heads of 64: 16 KiB of KV
per token in float32, 32 MiB for the prefix).

benchmarks/scaleout.py calls ``start_holder`` (with a command prefix such as
``ip netns exec h1`` and a bind address inside that namespace) and ``measure`` (from another
namespace) with the endpoint it returns. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cpu_name, emit, median, scratch_dir  # noqa: E402
from omniflow.engine import AsyncEngine, LLMEngine, SamplingParams  # noqa: E402
from omniflow.engine.kv_transfer import EnginePrefixes  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.kv.pull_cost import PullCost  # noqa: E402
from omniflow.models import build_tiny_model  # noqa: E402
from omniflow.transport.kv_pull import KVPuller, KVPullServer  # noqa: E402
from omniflow.transport.security import load_keys  # noqa: E402

PRESET = "llama-bench-30m"
TOKENS = 2048


def build_model(folder: str | os.PathLike[str] | None = None) -> Path:
    folder = Path(folder) if folder else scratch_dir("omniflow-kvpull-") / "model"
    if not (folder / "config.json").is_file():
        build_tiny_model(folder, PRESET, seed=0, max_position_embeddings=4096)
    return folder


def prefix_tokens(tokens: int, vocab: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (tokens,), generator=generator).tolist()


def engine_config() -> EngineConfig:
    return EngineConfig(device="cpu", max_model_len=4096, kv_cache_bytes=256 << 20)


# ------------------------------------------------------------------ the holder


def start_holder(
    model: Path,
    bind: str = "tcp://127.0.0.1:*",
    tokens: int = TOKENS,
    keys: str | None = None,
    command_prefix: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """A holder process (behind ``command_prefix``, e.g. ``ip netns exec h1``) that prefilled
    the prefix and serves its pages at ``bind``; (process, endpoint). Close its stdin (or
    terminate it) to stop it."""
    command = [sys.executable, __file__, "--serve", bind, "--model", str(model)]
    command += ["--tokens", str(tokens)] + (["--keys", keys] if keys else [])
    process = subprocess.Popen(
        [*(command_prefix or []), *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("ENDPOINT "):
        process.kill()
        raise RuntimeError(f"the KV holder did not start: {line!r}")
    return process, line.split(" ", 1)[1]


async def _serve(model: Path, bind: str, tokens: int, keys: str | None) -> None:
    engine = AsyncEngine(LLMEngine(model, engine_config()))
    prompt = prefix_tokens(tokens + 1, engine.backend.vocab_size)  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    async for _ in engine.generate("prefill", prompt, params):
        pass
    ctx = zmq.Context()
    server = KVPullServer(ctx, bind, EnginePrefixes(engine), load_keys(keys) if keys else None)
    server.start()
    print(f"ENDPOINT {server.endpoint}", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    await server.close()
    await engine.close()
    ctx.term()


# ------------------------------------------------------------------ the puller


def _clear(engine: LLMEngine) -> None:
    """Empty the prefix cache: take every free page (evicting cached ones), give them back."""
    allocator: Any = engine.allocator
    allocator.free(allocator.allocate(allocator.usage().free_pages))


async def _measure(endpoint: str, model: Path, tokens: int, rounds: int, keys: str | None):
    engine = AsyncEngine(LLMEngine(model, engine_config()))
    backend: Any = engine.backend
    prompt = prefix_tokens(tokens + 1, backend.vocab_size)
    prefix = prompt[:-1]
    prefixes = EnginePrefixes(engine)
    ctx = zmq.Context()
    puller = KVPuller(
        ctx, PullCost(prefill=backend.prefill_rate), load_keys(keys) if keys else None
    )
    pulls: list[float] = []
    recomputes: list[float] = []
    nbytes = 0
    try:
        for round_ in range(rounds + 1):  # round 0 warms both paths up
            started = time.perf_counter()
            importer = prefixes.importer(prefix)
            held = await importer.begin()
            result = await puller.pull(
                endpoint, f"bench-{round_}", prefix, None, importer, held, force=True
            )
            await importer.publish()
            pull_s = time.perf_counter() - started
            if result.pulled_tokens != tokens:
                raise RuntimeError(f"pulled {result.pulled_tokens} tokens of {tokens}")
            nbytes = result.nbytes
            await engine.call(lambda: _clear(backend))

            started = time.perf_counter()
            params = SamplingParams(temperature=0.0, max_tokens=1)
            async for _ in engine.generate(f"recompute-{round_}", prompt, params):
                pass
            recompute_s = time.perf_counter() - started
            await engine.call(lambda: _clear(backend))
            if round_:
                pulls.append(pull_s * 1000)
                recomputes.append(recompute_s * 1000)
    finally:
        await engine.close()
        ctx.term()
    figures = puller.cost.figures()
    return {
        f"kv_pull_ms_{tokens}": median(pulls),
        f"recompute_ms_{tokens}": median(recomputes),
        "pull_bytes": nbytes,
        "link_gbps": figures["link_bytes_per_s"] * 8 / 1e9,
        "prefill_tokens_per_s": figures["prefill_tokens_per_s"],
        "pull_beats_recompute": median(pulls) < median(recomputes),
        "rounds": rounds,
    }


def measure(
    endpoint: str, model: Path, tokens: int = TOKENS, rounds: int = 5, keys: str | None = None
) -> dict[str, Any]:
    """Pull vs recompute of the holder's prefix at ``endpoint``, from this process: medians
    of ``rounds`` interleaved rounds, and the CPU this ran on."""
    print(f"cpu: {cpu_name()}, threads={torch.get_num_threads()}", flush=True)
    figures = asyncio.run(_measure(endpoint, model, tokens, rounds, keys))
    return {**figures, "cpu": cpu_name()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", metavar="BIND", help="run as the holder, bound at BIND")
    parser.add_argument("--pull", metavar="ENDPOINT", help="measure against a holder there")
    parser.add_argument("--model", help="model folder (default: built in a scratch folder)")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", help="CurveZMQ keys folder (omniflow keys DIR)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        asyncio.run(_serve(Path(args.model), args.serve, args.tokens, args.keys))
        return
    model = build_model(args.model)
    if args.pull:  # the puller alone (scaleout.py runs it in another network namespace)
        emit(measure(args.pull, model, args.tokens, args.rounds, args.keys))
        return
    holder, endpoint = start_holder(model, tokens=args.tokens, keys=args.keys)
    try:
        result = measure(endpoint, model, args.tokens, args.rounds, args.keys)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    emit(result)


if __name__ == "__main__":
    main()
