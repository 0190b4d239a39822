"""Soak: mixed LongCat traffic at fixed concurrency while a random replica is kill -9'd.

A bounded run (``--seconds``, default 120) of the five-role LongCat pipeline (tiny random
models, two ``llm`` replicas) under ``--concurrency`` client loops, each looping over a
mix: text in/out, image in, image out, audio in, audio out. Some loops hold one client,
the others connect a new one per request (``omniflow.connect``: a client that comes and
goes). Every ``--kill-every`` seconds a ready replica of a random role gets SIGKILL; the
supervisor restarts it. Every request must end exactly once, as a result or a failure.

The last line is a JSON object:
  requests, ok, failed_by_code   every request sent, and how each ended
  lost                           requests without exactly one terminal outcome (target 0)
  migrated                       requests that went on, on another replica, after theirs died
  p50_ms, p99_ms                 latency of the requests that succeeded
  rss_growth_mb                  RSS growth of every process alive from warm-up to the end
                                 (the supervisor and clients here, replicas never killed)
  max_fd_growth                  the most open FDs any process gained over its first count
  leaked_shm_segments            /dev/shm entries of the deployment left after it stopped
  pool_bytes_in_use_after        the host page pool's bytes in use once traffic ended
                                 (encoder caches and the host KV tier are off, so any
                                 byte still in use is a leak)
The baseline measured in the same run is the same traffic before the first kill
(``baseline_*``): the warm-up period, ``--baseline`` seconds, nothing killed.

    python benchmarks/soak.py [--seconds 120] [--concurrency 6] [--kill-every 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import cpu_name, emit, pct, scratch_dir, short_run_root  # noqa: E402

import omniflow  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402
from tests.roles.media import image_bytes, wav_bytes  # noqa: E402

REQUEST_TIMEOUT_S = 60.0


def soak_config(name: str, models: Path, llm_replicas: int):
    r = "omniflow.roles"

    def opts(sub: str, **more):
        return {"build_tiny": True, "model_path": str(models / sub), "threads": 1, **more}

    return parse(
        {
            "name": name,
            "roles": {
                "vision_encoder": {
                    "actor": f"{r}.vision_encoder:VisionEncoderRole",
                    "idempotent": True,
                    "options": opts("vision", cache_entries=0),
                },
                "audio_encoder": {
                    "actor": f"{r}.audio_encoder:AudioEncoderRole",
                    "idempotent": True,
                    "options": opts("audio", cache_entries=0),
                },
                "llm": {
                    "actor": f"{r}.llm:LLMRole",
                    "replicas": llm_replicas,
                    "policy": "prefix_aware",
                    "options": opts("llm", kv_cache_mb=16, host_kv_mb=0, max_tokens=64),
                },
                "image_decoder": {
                    "actor": f"{r}.image_decoder:ImageDecoderRole",
                    "options": opts("next", steps=1),
                },
                "audio_decoder": {
                    "actor": f"{r}.audio_decoder:AudioDecoderRole",
                    "options": opts("next"),
                },
            },
            "graph": {
                "edges": [
                    {"from": "input", "to": "vision_encoder", "when": "has_image"},
                    {"from": "input", "to": "audio_encoder", "when": "has_audio"},
                    {"from": "input", "to": "llm"},
                    {"from": "vision_encoder", "to": "llm"},
                    {"from": "audio_encoder", "to": "llm"},
                    {"from": "llm", "to": "image_decoder", "when": "has:image_codes"},
                    {
                        "from": "llm",
                        "to": "audio_decoder",
                        "when": "has:audio_codes",
                        "stream": True,
                    },
                ]
            },
            "runtime": {
                "heartbeat_s": 0.25,
                "ttl_s": 1.5,
                "start_timeout_s": 300,
                "restart_backoff_s": 0.2,
                "restart_backoff_max_s": 1.0,
                "request_timeout_s": REQUEST_TIMEOUT_S,
            },
        },
        "<soak>",
    )


_IMAGES = [image_bytes(32, 32, seed=i) for i in range(8)]
_AUDIO = [wav_bytes(0.25, freq=220.0 + 40 * i) for i in range(4)]


def mixed_request(i: int) -> tuple[str, dict, dict]:
    """(kind, inputs, params) of the i-th request of a loop: the five kinds in turn."""
    kind = ("text", "image_in", "image_out", "audio_in", "audio_out")[i % 5]
    text = {"text": f"soak request {i}: say something"}
    greedy = {"max_tokens": 8, "temperature": 0.0}
    if kind == "text":
        return kind, text, {"want": "text", **greedy}
    if kind == "image_in":
        return kind, {**text, "image": _IMAGES[i % len(_IMAGES)]}, {"want": "text", **greedy}
    if kind == "image_out":
        return kind, text, {"want": "text,image", "image_grid": [2, 2], **greedy}
    if kind == "audio_in":
        return kind, {**text, "audio": _AUDIO[i % len(_AUDIO)]}, {"want": "text", **greedy}
    params = {"want": "text,audio", "audio_chunks": 2, "audio_chunk_tokens": 2, **greedy}
    return kind, text, params


def check_outputs(kind: str, outputs: list) -> str | None:
    """Why a successful request's outputs are wrong, or None."""
    roles = {o.role for o in outputs}
    if "llm" not in roles:
        return "no text"
    if kind == "image_out" and "image_decoder" not in roles:
        return "no image"
    if kind == "audio_out" and "audio_decoder" not in roles:
        return "no audio"
    for role in roles:  # each role's chunks once, in order (after a migration too)
        seqs = [o.seq for o in outputs if o.role == role]
        if seqs != list(range(len(seqs))):
            return f"{role} chunks out of order or repeated: {seqs}"
    return None


class Ledger:
    """Every request sent and each terminal outcome it got."""

    def __init__(self) -> None:
        self.outcomes: dict[int, list[str]] = {}
        self.latency_ms: list[tuple[float, float]] = []  # (ended at, ms) of the ok ones
        self.migrated = 0
        self.bad_outputs: Counter[str] = Counter()
        self.failed_at: Counter[str] = Counter()  # "role:code" of each failure
        self.examples: dict[str, str] = {}  # "role:code" -> one failure's message
        self._ids = 0

    def open(self) -> int:
        self._ids += 1
        self.outcomes[self._ids] = []
        return self._ids

    def end(self, rid: int, outcome: str) -> None:
        self.outcomes[rid].append(outcome)


async def one_request(client, ledger: Ledger, i: int, streamed: bool) -> None:
    kind, inputs, params = mixed_request(i)
    rid = ledger.open()
    started = time.perf_counter()
    try:
        if streamed:
            outputs, result = [], None
            async for item in client.stream(inputs, params=params, timeout=REQUEST_TIMEOUT_S):
                if isinstance(item, omniflow.Result):
                    result = item
                else:
                    outputs.append(item)
            assert result is not None
        else:
            outputs, result = await client.call(inputs, params=params, timeout=REQUEST_TIMEOUT_S)
    except omniflow.RequestFailed as e:
        ledger.end(rid, e.code)
        ledger.failed_at[f"{e.role}:{e.code}"] += 1
        ledger.examples.setdefault(f"{e.role}:{e.code}", e.detail[:160])
        return
    except Exception as e:  # noqa: BLE001 - counted, by type: the soak must see every end
        ledger.end(rid, f"exception:{type(e).__name__}")
        return
    why = check_outputs(kind, outputs)
    if why is not None:
        ledger.bad_outputs[why] += 1
        ledger.end(rid, "bad_output")
        return
    ledger.end(rid, "ok")
    ledger.migrated += bool(getattr(result, "migrations", 0))
    ledger.latency_ms.append((time.monotonic(), (time.perf_counter() - started) * 1e3))


async def client_loop(rt, name: str, ledger: Ledger, n: int, until: float) -> None:
    """Loop ``n``: even ones share the runtime's client, odd ones reconnect per request."""
    i = n
    while time.monotonic() < until:
        streamed = (i // 5) % 2 == 0
        if n % 2 == 0:
            await one_request(rt.client, ledger, i, streamed)
        else:
            try:
                conn = await omniflow.connect(name)
            except Exception as e:  # noqa: BLE001
                rid = ledger.open()
                ledger.end(rid, f"connect:{type(e).__name__}")
                await asyncio.sleep(0.2)
                continue
            try:
                await one_request(conn, ledger, i, streamed)
            finally:
                await conn.close()
        i += 1


def proc_stats(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open FDs) of a live process, or None."""
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), fds


class Sampler:
    """RSS and FDs of the supervisor (this process) and every replica, once a second."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self.first: dict[int, tuple[int, int]] = {}
        self.last: dict[int, tuple[int, int]] = {}
        self.max_fds: dict[int, int] = {}
        self.names: dict[int, str] = {os.getpid(): "supervisor+clients"}

    def pids(self) -> list[int]:
        replicas = self.rt.supervisor.replicas
        live = [r for r in replicas if r.proc is not None and r.state == "ready"]
        for r in live:
            self.names[r.proc.pid] = r.actor_id
        return [os.getpid(), *(r.proc.pid for r in live)]

    def sample(self) -> None:
        for pid in self.pids():
            stats = proc_stats(pid)
            if stats is None:
                continue
            self.first.setdefault(pid, stats)
            self.last[pid] = stats
            self.max_fds[pid] = max(self.max_fds.get(pid, 0), stats[1])

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            self.sample()
            await asyncio.sleep(1.0)

    def rss_growth_mb(self) -> float:
        alive = set(self.pids())
        grown = [self.last[p][0] - self.first[p][0] for p in self.first if p in alive]
        return sum(grown) / 2**20

    def max_fd_growth(self) -> tuple[int, str]:
        """The most FDs one process gained, and which process that was."""
        grown = [(self.max_fds[p] - self.first[p][1], self.names[p]) for p in self.first]
        return max(grown, default=(0, ""))


async def killer(rt, every: float, until: float, rng: random.Random, kills: Counter) -> None:
    while time.monotonic() < until:
        ready = [r for r in rt.supervisor.replicas if r.state == "ready" and r.proc is not None]
        roles = sorted({r.role for r in ready})
        if not roles:
            await asyncio.sleep(0.5)
            continue
        role = rng.choice(roles)
        victim = rng.choice([r for r in ready if r.role == role])
        try:
            os.kill(victim.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills[victim.actor_id] += 1
        await asyncio.sleep(every)


async def wait_all_ready(rt, timeout: float) -> bool:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if all(r.state == "ready" for r in rt.supervisor.replicas):
            return True
        await asyncio.sleep(0.2)
    return False


async def pool_bytes_settled(rt, timeout: float) -> int:
    """Bytes in use in the page pool once it stops falling (a dying request releases late)."""
    pool = rt.supervisor.pool
    until = time.monotonic() + timeout
    while True:
        stats = pool.stats()
        used = stats.used_pages * stats.page_size
        if used == 0 or time.monotonic() >= until:
            return used
        await asyncio.sleep(0.25)


def shm_entries(name: str) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if f"-{name}-" in e or e.endswith(name))


async def main(args: argparse.Namespace) -> dict:
    short_run_root()
    models = scratch_dir("soak-models-")
    name = f"soak{os.getpid()}"
    rng = random.Random(args.seed)
    ledger = Ledger()
    kills: Counter[str] = Counter()
    rt = omniflow.Runtime(soak_config(name, models, args.llm_replicas))
    await rt.start()
    pool_name = rt.supervisor.pool_name
    try:
        for i in range(5):  # every kind once: models loaded, nothing measured
            await one_request(rt.client, Ledger(), i, streamed=False)
        sampler = Sampler(rt)
        sampler.sample()
        started = time.monotonic()
        until = started + args.seconds
        baseline_until = started + min(args.baseline, args.seconds)
        loops = [
            asyncio.create_task(client_loop(rt, name, ledger, n, until))
            for n in range(args.concurrency)
        ]
        watch = asyncio.create_task(sampler.run(until))
        await asyncio.sleep(baseline_until - time.monotonic())
        kill = asyncio.create_task(killer(rt, args.kill_every, until, rng, kills))
        await asyncio.gather(*loops)
        kill.cancel()
        await watch
        sampler.sample()
        all_ready = await wait_all_ready(rt, 60.0)
        pool_after = await pool_bytes_settled(rt, 15.0)
        rss_growth, (fd_growth, fd_process) = sampler.rss_growth_mb(), sampler.max_fd_growth()
    finally:
        await rt.close()
    leaked = [e for e in os.listdir("/dev/shm") if e == pool_name] + shm_entries(name)
    outcomes = ledger.outcomes
    ends = Counter(o[0] for o in outcomes.values() if len(o) == 1)
    failed = {code: n for code, n in sorted(ends.items()) if code != "ok"}
    ok_ms = [ms for _, ms in ledger.latency_ms]
    base_ms = [ms for at, ms in ledger.latency_ms if at < baseline_until]
    return {
        "cpu": cpu_name(),
        "seconds": args.seconds,
        "concurrency": args.concurrency,
        "llm_replicas": args.llm_replicas,
        "kills": dict(sorted(kills.items())),
        "replicas_ready_after": all_ready,
        "bad_outputs": dict(ledger.bad_outputs),
        "failed_at": dict(sorted(ledger.failed_at.items())),
        "failure_examples": ledger.examples,
        "max_fd_growth_in": fd_process,
        "baseline_requests": len(base_ms),
        "baseline_p50_ms": round(pct(base_ms, 50), 1),
        "requests": len(outcomes),
        "ok": ends.get("ok", 0),
        "failed_by_code": failed,
        "lost": sum(1 for o in outcomes.values() if len(o) != 1),
        "migrated": ledger.migrated,
        "p50_ms": round(pct(ok_ms, 50), 1),
        "p99_ms": round(pct(ok_ms, 99), 1),
        "rss_growth_mb": round(rss_growth, 1),
        "max_fd_growth": fd_growth,
        "leaked_shm_segments": len(leaked),
        "pool_bytes_in_use_after": pool_after,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--llm-replicas", type=int, default=2)
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds before any kill")
    parser.add_argument("--seed", type=int, default=0)
    emit(asyncio.run(main(parser.parse_args())))
