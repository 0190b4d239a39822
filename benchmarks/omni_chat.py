"""A long omni chat through the gateway on the LongCat tiny deployment: per-turn time to
first token for (a) a session, (b) stateless full-history resend, (c) no prefix cache;
and time to first audio chunk at concurrency 1 and 8.

A conversation has ``--turns`` turns (an image every 5, from turn 1), each a streamed
request through the official openai client with the whole history. ``no_cache`` sends the
same dialogue behind a system line that changes every turn, so no prefix of it is ever
cached (the encoders' caches still serve the images). Rounds interleave the modes (A B C,
then B C A, ...), each round with conversations of its own; figures are medians over
rounds. Late = the median of turns 10..20.

First audio: voice clients on /v1/realtime, each on its own connection (connected and
configured before the clock starts): time from ``response.create`` to the first
``response.output_text.delta`` and to the first ``response.output_audio.delta``, one
client at a time (c1) and 8 at once (c8), with the text made beside the audio in one
decode (``audio_text`` parallel, the default) and, as the baseline, all the text first
(serial), interleaved round by round.

Targets: stateless late TTFT <= 1.3x the session's and >= 3x below no_cache; first audio at
c1 <= 2x first text.

    python benchmarks/omni_chat.py [--turns 20] [--rounds 2] [--audio 6] [--skip-chat]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import openai  # noqa: E402
import websockets  # noqa: E402
from _common import cpu_name, emit, median, scratch_dir, short_run_root  # noqa: E402

import omniflow  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402
from tests.roles.media import image_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the quick brown fox jumps over the lazy dog and tells a story about rivers".split()
MODES = ("session", "stateless", "no_cache")


def config(
    models: Path, decoder_threads: int | None = None, decoder_conv: str | None = None
) -> omniflow.Config:
    raw = tomllib.loads((ROOT / "configs" / "longcat.toml").read_text())
    raw["name"] = "omnichat"
    for role in raw["roles"].values():
        options = role.get("options", {})
        if "model_path" in options:
            options["model_path"] = str(models / Path(options["model_path"]).name)
    raw["roles"]["llm"]["options"]["kv_cache_mb"] = 256
    raw["roles"]["llm"]["options"]["max_model_len"] = 4096  # 20 turns with 4 images
    if decoder_threads is not None:
        raw["roles"]["audio_decoder"]["options"]["threads"] = decoder_threads
    if decoder_conv is not None:
        raw["roles"]["audio_decoder"]["options"]["conv"] = decoder_conv
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


async def realtime_turn(url: str, i: int, session: dict) -> tuple[float, float]:
    """One voice client on /v1/realtime: connected and configured first, then timed from
    its response.create to the first text delta and the first audio delta (ms)."""
    async with websockets.connect(f"{url}/v1/realtime?model=omnichat", max_size=None) as ws:
        events = (json.loads(m) async for m in ws)
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        async for event in events:
            if event["type"] == "session.updated":
                break
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"say something {i}"}],
        }
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        started = time.perf_counter()
        await ws.send(json.dumps({"type": "response.create"}))
        first_text = first_audio_ = float("nan")
        async for event in events:
            now = (time.perf_counter() - started) * 1e3
            if event["type"] == "response.output_text.delta" and first_text != first_text:
                first_text = now
            elif event["type"] == "response.output_audio.delta" and first_audio_ != first_audio_:
                first_audio_ = now
            elif event["type"] in ("response.done", "error"):
                assert event["type"] == "response.done", event
                break
    return first_text, first_audio_


async def first_audio(url: str, concurrency: int, n: int, session: dict) -> tuple[list, list]:
    texts, audios = [], []
    for start in range(0, n, concurrency):
        turns = [realtime_turn(url, start + i, session) for i in range(concurrency)]
        for text, audio in await asyncio.gather(*turns):
            texts.append(text)
            audios.append(audio)
    return texts, audios


async def main(args: argparse.Namespace) -> dict:
    short_run_root()
    models = scratch_dir("omnichat-models-")
    images = [
        "data:image/png;base64," + base64.b64encode(image_bytes(256, 256, seed=s)).decode()
        for s in range(4)
    ]
    async with omniflow.Runtime(config(models, args.decoder_threads, args.decoder_conv)) as rt:
        url = (rt.run_dir / "gateway.url").read_text().strip()
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
        await conversation(client, "stateless", "warm", 2, images[:1])  # compile, load
        by_mode: dict[str, list[list[float]]] = {m: [] for m in MODES}
        for r in range(0 if args.skip_chat else args.rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                times = await conversation(client, mode, f"r{r}{mode}", args.turns, images)
                by_mode[mode].append(times)
                print(f"round {r} {mode}: late {median(times[9:]):.1f} ms", file=sys.stderr)
        ws_url = url.replace("http://", "ws://")
        params = {"audio_chunks": 3, "audio_chunk_tokens": 2}
        if args.first_chunk_tokens is not None:
            params["audio_first_chunk_tokens"] = args.first_chunk_tokens
        # parallel: the text made beside the audio in one decode (the default); serial,
        # the baseline: all the text first, then the audio
        voices = {
            mode: {"params": {**params, "audio_text": mode}, "max_output_tokens": 4}
            for mode in ("parallel", "serial")
        }
        for voice in voices.values():
            await first_audio(ws_url, 1, 1, voice)  # warm
        got: dict[str, list[float]] = {}
        for r in range(args.audio_rounds):  # c1 and c8, parallel and serial, interleaved
            order = ("parallel", "serial") if r % 2 == 0 else ("serial", "parallel")
            for mode in order:
                for c, n in ((1, args.audio), (8, 8)):
                    texts, audios = await first_audio(ws_url, c, n, voices[mode])
                    got.setdefault(f"text{c}_{mode}", []).extend(texts)
                    got.setdefault(f"audio{c}_{mode}", []).extend(audios)
        text1, audio1 = got["text1_parallel"], got["audio1_parallel"]
        text8, audio8 = got["text8_parallel"], got["audio8_parallel"]
        serial = {
            f"serial_first_{kind}_ms_c{c}": round(median(got[f"{kind}{c}_serial"]), 1)
            for kind in ("text", "audio")
            for c in (1, 8)
        }
    per_turn = {
        m: [round(median([run[t] for run in runs]), 1) for t in range(args.turns)]
        for m, runs in by_mode.items()
    }
    late = {m: round(median(v[9:]), 1) if v else float("nan") for m, v in per_turn.items()}
    return {
        "cpu": cpu_name(),
        "turns": args.turns,
        "rounds": args.rounds,
        "decoder_threads": args.decoder_threads,
        "decoder_conv": args.decoder_conv,
        "first_chunk_tokens": args.first_chunk_tokens,
        "ttft_ms_by_turn": per_turn,
        "late_ttft_ms_session": late["session"],
        "late_ttft_ms_stateless": late["stateless"],
        "late_ttft_ms_no_cache": late["no_cache"],
        "first_text_ms_c1": round(median(text1), 1),
        "first_audio_ms_c1": round(median(audio1), 1),
        "first_audio_ms_c8": round(median(audio8), 1),
        "first_text_ms_c8": round(median(text8), 1),
        "first_audio_route": "/v1/realtime (response.create to the first output_audio.delta)",
        "first_audio_over_first_text_c1": round(median(audio1) / median(text1), 2),
        **serial,
        "serial_first_audio_over_first_text_c1": round(
            median(got["audio1_serial"]) / median(got["text1_serial"]), 2
        ),
        "stateless_over_session": round(late["stateless"] / late["session"], 2),
        "no_cache_over_stateless": round(late["no_cache"] / late["stateless"], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--audio", type=int, default=6, help="first-audio requests at c1")
    parser.add_argument("--audio-rounds", type=int, default=2, help="c1/c8 rounds, interleaved")
    parser.add_argument("--skip-chat", action="store_true", help="first audio only")
    parser.add_argument("--decoder-threads", type=int, help="the audio decoder's torch threads")
    parser.add_argument(
        "--decoder-conv", choices=("auto", "mkldnn", "native"), help="the audio decoder's"
    )
    parser.add_argument("--first-chunk-tokens", type=int, help="audio tokens in the first chunk")
    emit(asyncio.run(main(parser.parse_args())))
