"""Multi-turn multimodal KV reuse: prefix-aware routing vs round robin vs no cache.

A dialogue workload — 8 concurrent sessions x 20 turns of text, with images that recur
across a session's turns (embeddings keyed by content hash, as the vision encoder sends
them) — runs against 2 LLM engine replicas in this process, three ways:
  prefix_aware  caching on; each replica publishes the chained block hashes it holds (any
                tier) and the router sends each turn to the replica holding its longest
                prefix (balance.PrefixAware, load as the tie-break)
  round_robin   caching on; turns alternate between replicas
  no_cache      caching off
Each replica's device KV holds what its own four sessions need at the end, but not all
eight sessions' histories: when turns wander between replicas (round_robin), older turns
move to the host tier and are promoted back. ``--device-pages 200`` makes prefix_aware
promote too (then both cached modes also queue for device pages).

Per mode: prefill_tokens_computed (prompt tokens run through the model), reuse_ratio (cached
tokens / tokens an ideal page-granular cache could have reused: everything the session
computed before, i.e. the previous prompt and reply less the last sampled token, rounded
down to whole pages), ttft_p50_ms_by_turn (median over sessions), total_s. Modes run in
rounds (A B C A B C ...); each figure is the median over rounds. Prints a JSON object last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import emit, median, scratch_dir  # noqa: E402

from omniflow.control.balance import PickKey, make_policy  # noqa: E402
from omniflow.engine import AsyncEngine, LLMEngine, SamplingParams  # noqa: E402
from omniflow.engine.llm_engine import EngineConfig  # noqa: E402
from omniflow.engine.sequence import EmbeddingSpan  # noqa: E402
from omniflow.kv.keys import chain_hashes  # noqa: E402
from omniflow.messages import ActorRecord  # noqa: E402
from omniflow.models import build_tiny_model  # noqa: E402

MODES = ("prefix_aware", "round_robin", "no_cache")
PAGE = 16


@dataclass
class Turn:
    tokens: list[int]
    images: list[tuple[int, str]]  # (offset in the turn, content hash)


@dataclass
class SessionResult:
    ttft_ms: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    ideal: list[int] = field(default_factory=list)


def make_workload(sessions: int, turns: int, image_tokens: int, vocab: int, seed: int):
    """Per session, per turn: [image placeholders] + user text. Images recur: each session
    shows one of its two images every third turn."""
    rng = torch.Generator().manual_seed(seed)
    workload = []
    for s in range(sessions):
        script = []
        for t in range(turns):
            text = torch.randint(3, vocab, (int(torch.randint(20, 41, (1,), generator=rng)),))
            tokens: list[int] = []
            images = []
            if t % 3 == 0:
                images.append((0, f"s{s}-image{(t // 3) % 2}"))
                tokens += [0] * image_tokens
            script.append(Turn(tokens + text.tolist(), images))
        workload.append(script)
    return workload


class Images:
    """Embeddings per content hash, made once (as the vision encoder's cache would)."""

    def __init__(self, hidden: int, tokens: int):
        self.hidden, self.tokens = hidden, tokens
        self.cache: dict[str, torch.Tensor] = {}

    def __call__(self, content_hash: str) -> torch.Tensor:
        if content_hash not in self.cache:
            seed = int.from_bytes(content_hash.encode()[:8].ljust(8, b"\0"), "little") % (1 << 31)
            rng = torch.Generator().manual_seed(seed)
            self.cache[content_hash] = torch.randn(self.tokens, self.hidden, generator=rng) * 0.02
        return self.cache[content_hash]


async def run_mode(mode: str, model_path, workload, images: Images, args) -> dict:
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        page_size=PAGE,
        num_pages=args.device_pages,
        enable_prefix_caching=mode != "no_cache",
        host_kv_bytes=args.host_kv_mb << 20 if mode != "no_cache" else 0,
    )
    engines = [AsyncEngine(LLMEngine(model_path, config)) for _ in range(args.replicas)]
    records = [
        ActorRecord(role="llm", replica=i, pid=0, endpoint="inproc", host="local")
        for i in range(args.replicas)
    ]
    policy = make_policy("prefix_aware" if mode == "prefix_aware" else "round_robin", role="llm")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    results = [SessionResult() for _ in workload]

    async def session(index: int, script: list[Turn]) -> None:
        history: list[int] = []
        spans: list[EmbeddingSpan] = []
        extra: list[str | None] = []
        computed_before = 0  # tokens of this session whose KV was computed in earlier turns
        for turn_index, turn in enumerate(script):
            offset = len(history)
            for at, content_hash in turn.images:
                embeds = images(content_hash)
                spans.append(EmbeddingSpan(offset + at, embeds, ("image", content_hash)))
            turn_extra: list[str | None] = [None] * len(turn.tokens)
            for at, content_hash in turn.images:
                turn_extra[at : at + images.tokens] = [content_hash] * images.tokens
            prompt = history + turn.tokens
            extra += turn_extra
            key = PickKey(f"s{index}-t{turn_index}", f"s{index}")
            if mode == "prefix_aware":
                hashes = chain_hashes(prompt[:-1], _keys(extra[: len(prompt) - 1]), PAGE)
                key = key._replace(prefix_hashes=tuple(hashes))
            record = policy.pick(records, key)
            policy.on_send(record.actor_id)
            engine = engines[record.replica]
            started = time.perf_counter()
            reply: list[int] = []
            first = True
            async for delta in engine.generate(key.request_id, prompt, params, list(spans)):
                if first:
                    results[index].ttft_ms.append((time.perf_counter() - started) * 1000)
                    results[index].cached.append(delta.num_cached_tokens)
                    first = False
                reply += delta.token_ids
            policy.on_done(record.actor_id)
            if mode == "prefix_aware":
                allocator = engine.backend.allocator  # type: ignore[attr-defined]
                held = await engine.call(allocator.block_hashes)
                policy.publish(record.actor_id, held)  # type: ignore[attr-defined]
            ideal = min(computed_before, len(prompt) - 1) // PAGE * PAGE
            results[index].ideal.append(ideal)
            history = prompt + reply
            extra += [None] * len(reply)
            computed_before = len(history) - 1

    computed_at_start = [e.backend.stats["prompt_tokens_computed"] for e in engines]  # type: ignore[attr-defined]
    started = time.perf_counter()
    await asyncio.gather(*(session(i, script) for i, script in enumerate(workload)))
    total_s = time.perf_counter() - started
    computed = sum(
        e.backend.stats["prompt_tokens_computed"] - before  # type: ignore[attr-defined]
        for e, before in zip(engines, computed_at_start, strict=True)
    )
    promoted = sum(
        e.backend.tiers.counts["promoted"]  # type: ignore[attr-defined]
        for e in engines
        if e.backend.tiers is not None  # type: ignore[attr-defined]
    )
    for engine in engines:
        await engine.close()
    turns = len(workload[0])
    cached = sum(sum(r.cached) for r in results)
    ideal = sum(sum(r.ideal) for r in results)
    return {
        "prefill_tokens_computed": computed,
        "reuse_ratio": round(cached / ideal, 4) if ideal else 0.0,
        "ttft_p50_ms_by_turn": [
            round(statistics.median(r.ttft_ms[t] for r in results), 2) for t in range(turns)
        ],
        "total_s": round(total_s, 3),
        "cached_tokens": cached,
        "reusable_tokens": ideal,
        "pages_promoted": promoted,
    }


def _keys(extra: list[str | None]) -> list[tuple[str, str] | None] | None:
    if not any(extra):
        return None
    return [None if key is None else ("image", key) for key in extra]


def combine(rounds: list[dict]) -> dict:
    """Median over rounds of every figure (element-wise for the per-turn list)."""
    out = {}
    for key, value in rounds[0].items():
        if isinstance(value, list):
            out[key] = [round(median([r[key][i] for r in rounds]), 2) for i in range(len(value))]
        else:
            out[key] = round(median([r[key] for r in rounds]), 4)
    return out


async def main_async(args) -> dict:
    torch.set_num_threads(args.threads)
    # Both replicas' engine threads share this process's GIL (deployed, each is a process
    # of its own): hand it over more often than every 5 ms, so one replica's Python does
    # not stall the other's step.
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    folder = build_tiny_model(
        scratch_dir("omniflow-multiturn-"),
        "llama-mha",
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=args.hidden // 64,
        vocab_size=2048,
        max_position_embeddings=4096,
    )
    workload = make_workload(args.sessions, args.turns, args.image_tokens, 2048, seed=1)
    images = Images(args.hidden, args.image_tokens)
    by_mode: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES:
            result = await run_mode(mode, folder, workload, images, args)
            by_mode[mode].append(result)
            print(
                f"round {round_index} {mode}: reuse {result['reuse_ratio']}, prefill "
                f"{result['prefill_tokens_computed']} tokens, {result['total_s']} s",
                flush=True,
            )
    modes = {mode: combine(rounds) for mode, rounds in by_mode.items()}
    late = slice(min(4, args.turns - 1), args.turns)  # turns 5..20

    def late_ttft(mode: str) -> float:
        return statistics.median(modes[mode]["ttft_p50_ms_by_turn"][late])

    return {
        "modes": modes,
        "ttft_late_p50_ms": {mode: round(late_ttft(mode), 2) for mode in MODES},
        "ttft_late_speedup_vs_no_cache": round(
            late_ttft("no_cache") / late_ttft("prefix_aware"), 2
        ),
        "sessions": args.sessions,
        "turns": args.turns,
        "replicas": args.replicas,
        "rounds": args.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--image-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device-pages", type=int, default=320)
    parser.add_argument("--host-kv-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (per engine)")
    parser.add_argument("--switch-interval-ms", type=float, default=0.5)
    args = parser.parse_args()
    emit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
