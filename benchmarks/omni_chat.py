"""A long omni chat through the gateway on the LongCat tiny deployment: per-turn time to
first token for (a) a session, (b) stateless full-history resend, (c) no prefix cache;
and time to first audio chunk at concurrency 1 and 8.

A conversation has ``--turns`` turns (an image every 5, from turn 1), each a streamed
request through the official openai client with the whole history. ``no_cache`` sends the
same dialogue behind a system line that changes every turn, so no prefix of it is ever
cached (the encoders' caches still serve the images). Rounds interleave the modes (A B C,
then B C A, ...), each round with conversations of its own; figures are medians over
rounds. Late = the median of turns 10..20.

First audio: streamed /v1/chat/completions with modalities text+audio (the /v1/realtime
route is not built yet): time to the first text delta and to the first audio delta, one
request at a time (c1) and 8 at once (c8).

Targets: stateless late TTFT <= 1.3x the session's and >= 3x below no_cache; first audio at
c1 <= 2x first text.

    python benchmarks/omni_chat.py [--turns 20] [--rounds 2] [--audio 6]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import openai  # noqa: E402
from _common import cpu_name, emit, median, scratch_dir, short_run_root  # noqa: E402

import omniflow  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402
from tests.roles.media import image_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the quick brown fox jumps over the lazy dog and tells a story about rivers".split()
MODES = ("session", "stateless", "no_cache")


def config(models: Path) -> omniflow.Config:
    raw = tomllib.loads((ROOT / "configs" / "longcat.toml").read_text())
    raw["name"] = "omnichat"
    for role in raw["roles"].values():
        options = role.get("options", {})
        if "model_path" in options:
            options["model_path"] = str(models / Path(options["model_path"]).name)
    raw["roles"]["llm"]["options"]["kv_cache_mb"] = 256
    raw["gateway"] = {"port": 0, "max_inflight": 256}
    return parse(raw, "omni_chat")


def user_turn(turn: int, image: str | None) -> dict:
    text = " ".join(WORDS[(turn + i) % len(WORDS)] for i in range(24)) + f" (turn {turn})"
    parts: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {"role": "user", "content": parts}


async def ttft(client: openai.AsyncOpenAI, messages: list, extra: dict) -> tuple[float, str]:
    started = time.perf_counter()
    first = None
    text = []
    stream = await client.chat.completions.create(
        model="omnichat", messages=messages, stream=True, max_tokens=8, temperature=0, **extra
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
    return (first if first is not None else time.perf_counter() - started) * 1e3, "".join(text)


async def conversation(client, mode: str, tag: str, turns: int, images: list[str]) -> list[float]:
    head = {"role": "system", "content": f"conversation {tag}"}
    history: list[dict] = []
    times = []
    for turn in range(1, turns + 1):
        image = images[(turn - 1) // 5 % len(images)] if (turn - 1) % 5 == 0 else None
        history.append(user_turn(turn, image))
        extra: dict = {}
        first = head
        if mode == "session":
            extra["extra_body"] = {"session": f"s-{tag}"}
        elif mode == "no_cache":
            first = {"role": "system", "content": f"conversation {tag} turn {turn}"}
        ms, reply = await ttft(client, [first, *history], extra)
        times.append(ms)
        history.append({"role": "assistant", "content": reply})
    return times


async def first_audio(client, concurrency: int, n: int) -> tuple[list[float], list[float]]:
    texts, audios = [], []

    async def one(i: int) -> None:
        started = time.perf_counter()
        first_text = first_audio_ = None
        stream = await client.chat.completions.create(
            model="omnichat",
            messages=[{"role": "user", "content": f"say something {i}"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
            stream=True,
            max_tokens=4,
            extra_body={"params": {"audio_chunks": 3, "audio_chunk_tokens": 2}},
        )
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            now = (time.perf_counter() - started) * 1e3
            if delta.content and first_text is None:
                first_text = now
            if getattr(delta, "audio", None) and first_audio_ is None:
                first_audio_ = now
        texts.append(first_text if first_text is not None else float("nan"))
        audios.append(first_audio_ if first_audio_ is not None else float("nan"))

    for start in range(0, n, concurrency):
        await asyncio.gather(*(one(start + i) for i in range(concurrency)))
    return texts, audios


async def main(args: argparse.Namespace) -> dict:
    short_run_root()
    models = scratch_dir("omnichat-models-")
    images = [
        "data:image/png;base64," + base64.b64encode(image_bytes(256, 256, seed=s)).decode()
        for s in range(4)
    ]
    async with omniflow.Runtime(config(models)) as rt:
        url = (rt.run_dir / "gateway.url").read_text().strip()
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
        await conversation(client, "stateless", "warm", 2, images[:1])  # compile, load
        by_mode: dict[str, list[list[float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                times = await conversation(client, mode, f"r{r}{mode}", args.turns, images)
                by_mode[mode].append(times)
                print(f"round {r} {mode}: late {median(times[9:]):.1f} ms", file=sys.stderr)
        text1, audio1 = await first_audio(client, 1, args.audio)
        text8, audio8 = await first_audio(client, 8, 8)
    per_turn = {
        m: [round(median([run[t] for run in runs]), 1) for t in range(args.turns)]
        for m, runs in by_mode.items()
    }
    late = {m: round(median(v[9:]), 1) for m, v in per_turn.items()}
    return {
        "cpu": cpu_name(),
        "turns": args.turns,
        "rounds": args.rounds,
        "ttft_ms_by_turn": per_turn,
        "late_ttft_ms_session": late["session"],
        "late_ttft_ms_stateless": late["stateless"],
        "late_ttft_ms_no_cache": late["no_cache"],
        "first_text_ms_c1": round(median(text1), 1),
        "first_audio_ms_c1": round(median(audio1), 1),
        "first_audio_ms_c8": round(median(audio8), 1),
        "first_audio_route": "/v1/chat/completions (stream, modalities text+audio)",
        "stateless_over_session": round(late["stateless"] / late["session"], 2),
        "no_cache_over_stateless": round(late["no_cache"] / late["stateless"], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--audio", type=int, default=6, help="first-audio requests at c1")
    emit(asyncio.run(main(parser.parse_args())))
