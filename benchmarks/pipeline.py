"""Orchestration overhead of the five-role LongCat pipeline, against the same roles on Ray.

A request with text + an image in and an image out takes the path
client -> vision_encoder -> llm (joined with the client's text) -> image_decoder -> client:
``hops_per_request`` = 4 sequential hops. Per-request overhead = end-to-end latency minus
the sum of the roles' own compute time (each role's handler wall time, measured the same
way in both systems), at concurrency 1, 8 and 32. ``ray`` chains the same five role
classes as Ray async actors, driven the same way, in the same run; ``hop_p50_us`` is one
direct omniflow hop measured in the same run, back to back. Every hop of a pipeline
follows a role's compute, with the receiver idle meanwhile; ``hop_after_idle_p50_us`` is
the same direct hop after a 5 ms idle gap, the reference for that (on this VM, waking an
idle receiver costs more than the hop). ``zmq_transit_after_idle_p50_us`` is the least a
pipeline transit can cost over ZeroMQ here: one message, sync pyzmq PUSH -> PULL between
two processes, after the same idle gap, timed one way on the host's monotonic clock; the
four transits of a request cost at least ``zmq_floor_after_idle_ms``. Rounds alternate
omniflow and Ray.

    python benchmarks/pipeline.py [--requests 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import multiprocessing
import os
import struct
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import emit, have_ray, pct, scratch_dir, short_run_root  # noqa: E402
from hop import IDLE_GAP_S, PAYLOAD, timed  # noqa: E402
from hop import config as hop_config  # noqa: E402

import omniflow  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402
from tests.roles.media import image_bytes  # noqa: E402

CONCURRENCY = (1, 8, 32)
PARAMS = {"want": "image", "image_grid": [1, 1]}
HOPS = 4


def role_specs(models: Path) -> dict[str, dict]:
    r = "omniflow.roles"
    return {
        "vision_encoder": {
            "actor": f"{r}.vision_encoder:VisionEncoderRole",
            "options": {
                "build_tiny": True,
                "model_path": str(models / "vision"),
                "threads": 1,
                "cache_entries": 0,
            },
        },
        "audio_encoder": {
            "actor": f"{r}.audio_encoder:AudioEncoderRole",
            "options": {"build_tiny": True, "model_path": str(models / "audio"), "threads": 1},
        },
        "llm": {
            "actor": f"{r}.llm:LLMRole",
            "max_concurrency": 64,
            "options": {"build_tiny": True, "model_path": str(models / "llm"), "threads": 1},
        },
        "image_decoder": {
            "actor": f"{r}.image_decoder:ImageDecoderRole",
            "options": {
                "build_tiny": True,
                "model_path": str(models / "next"),
                "steps": 1,
                "threads": 1,
            },
        },
        "audio_decoder": {
            "actor": f"{r}.audio_decoder:AudioDecoderRole",
            "options": {
                "build_tiny": True,
                "model_path": str(models / "next"),
                "threads": 1,
            },
        },
    }


def longcat_config(models: Path):
    return parse(
        {
            "name": "pipebench",
            "roles": role_specs(models),
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
            "runtime": {"start_timeout_s": 180},
        }
    )


# Inputs are made before any timing starts: PNG encoding is not orchestration.
_IMAGES = [image_bytes(64, 64, seed=i) for i in range(64)]


def request(i: int) -> dict:
    return {"text": f"describe {i}", "image": _IMAGES[i % len(_IMAGES)]}


async def omniflow_once(rt, i: int) -> tuple[float, float]:
    inputs = request(i)
    t = time.perf_counter()
    outs, result = await rt.call(inputs, params=PARAMS, timeout=120)
    e2e = time.perf_counter() - t
    assert outs and outs[-1].role == "image_decoder"
    return e2e, sum(x.compute_ms for x in result.timings) / 1e3


class RayChain:
    """The same role classes as Ray async actors, chained by the driver."""

    def __init__(self, models: Path) -> None:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

        @ray.remote
        class RoleActor:
            def __init__(self, path: str, role: str, options: dict) -> None:
                import importlib

                module, _, name = path.partition(":")
                self.actor = getattr(importlib.import_module(module), name)(role, 0, options)

            async def setup(self) -> None:
                await self.actor.setup()

            async def call(self, data: dict, tensors: dict, params: dict):
                from omniflow.runtime.actor import Context, Request

                request = Request("r", data, tensors, params)
                ctx = Context("r", self.actor.role, 0, 0.0, None)
                t = time.perf_counter()
                out = self.actor.handle(request, ctx)
                outputs = [o async for o in out] if inspect.isasyncgen(out) else [await out]
                return outputs, time.perf_counter() - t

        specs = role_specs(models)
        self.actors = {
            name: RoleActor.options(max_concurrency=64).remote(spec["actor"], name, spec["options"])
            for name, spec in specs.items()
        }
        self.ray = ray

    async def setup(self) -> None:
        await asyncio.gather(*(a.setup.remote() for a in self.actors.values()))

    async def once(self, i: int) -> tuple[float, float]:
        inputs = request(i)
        t = time.perf_counter()
        (vision,), vt = await self.actors["vision_encoder"].call.remote(
            {"image": inputs["image"]}, {}, PARAMS
        )
        data = {k: v for k, v in vision.items() if not hasattr(v, "shape")}
        tensors = {k: v for k, v in vision.items() if hasattr(v, "shape")}
        outs, lt = await self.actors["llm"].call.remote(
            {"text": inputs["text"], **data}, tensors, PARAMS
        )
        codes = outs[-1]
        (image,), dt = await self.actors["image_decoder"].call.remote(
            {"image_grid": codes["image_grid"]}, {"image_codes": codes["image_codes"]}, PARAMS
        )
        assert image["image"][:4] == b"\x89PNG"
        return time.perf_counter() - t, vt + lt + dt

    def close(self) -> None:
        self.ray.shutdown()


def _transit_sink(address: str, back: str) -> None:
    """Answers each stamped message with its one-way delay (perf_counter is the host's
    CLOCK_MONOTONIC, the same clock in every process)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(back)
    while (message := pull.recv()) != b"stop":
        arrived = time.perf_counter()
        push.send(struct.pack("d", arrived - struct.unpack_from("d", message)[0]))
    ctx.destroy(linger=0)


class ZmqTransit:
    """One-way ZeroMQ transits to another process, each after an idle gap."""

    def __init__(self) -> None:
        base = f"ipc://{os.environ.get('OMNIFLOW_RUN_ROOT', '/tmp')}/transit-{os.getpid()}"
        self.ctx = zmq.Context()
        self.back = self.ctx.socket(zmq.PULL)
        self.back.bind(base + "-back")
        self.sink = multiprocessing.get_context("spawn").Process(
            target=_transit_sink, args=(base, base + "-back"), daemon=True
        )
        self.sink.start()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(base)
        self.pad = b"x" * 320  # with the stamp, the size of a pipeline hop's header

    def once(self, gap: float) -> float:
        time.sleep(gap)  # blocks the loop on purpose: nothing else runs between rounds
        self.push.send(struct.pack("d", time.perf_counter()) + self.pad)
        return struct.unpack("d", self.back.recv())[0]

    def close(self) -> None:
        self.push.send(b"stop")
        self.sink.join(timeout=10)
        self.ctx.destroy(linger=0)


async def drive(once, n: int, concurrency: int) -> tuple[list[float], float]:
    overheads: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            e2e, compute = await once(i)
            overheads.append(e2e - compute)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return overheads, n / (time.perf_counter() - t)


def summary(overheads: list[float], rps: list[float]) -> dict:
    return {
        "overhead_p50_ms": round(pct(overheads, 50) * 1e3, 3),
        "overhead_p99_ms": round(pct(overheads, 99) * 1e3, 3),
        "rps": round(sorted(rps)[len(rps) // 2], 1),
    }


async def main(requests: int, rounds: int) -> dict:
    short_run_root()
    models = scratch_dir("ofb-models-")
    cfg = longcat_config(models)
    results: dict[str, dict[int, tuple[list[float], list[float]]]] = {
        "omniflow": {c: ([], []) for c in CONCURRENCY},
        "ray": {c: ([], []) for c in CONCURRENCY},
    }
    hops: list[float] = []
    idle_hops: list[float] = []
    transits: list[float] = []
    transit = ZmqTransit()
    for _ in range(20):
        transit.once(0.0)  # connected and warm
    async with omniflow.Runtime(cfg) as rt, omniflow.Runtime(hop_config(1)) as hop_rt:
        chain = RayChain(models) if have_ray() else None
        if chain is not None:
            await chain.setup()
        for i in range(8):  # warm up both paths
            await omniflow_once(rt, i)
            if chain is not None:
                await chain.once(i)
        for _ in range(rounds):
            for c in CONCURRENCY:
                systems = [("omniflow", lambda i: omniflow_once(rt, i))]
                if chain is not None:
                    systems.append(("ray", chain.once))
                for name, once in systems:
                    over, rps = await drive(once, max(requests, c), c)
                    results[name][c][0].extend(over)
                    results[name][c][1].append(rps)
            await timed(lambda: hop_rt.call(PAYLOAD), 300, hops)
            for _ in range(30):  # alternated: a hop after idle, a bare transit after idle
                await timed(lambda: hop_rt.call(PAYLOAD), 1, idle_hops, IDLE_GAP_S)
                transits.append(transit.once(IDLE_GAP_S))
        if chain is not None:
            chain.close()
    out: dict = {
        "hop_p50_us": round(pct(hops, 50) * 1e6, 1),
        "hop_after_idle_p50_us": round(pct(idle_hops, 50) * 1e6, 1),
        "zmq_transit_after_idle_p50_us": round(pct(transits, 50) * 1e6, 1),
        "hops_per_request": HOPS,
    }
    transit.close()
    for name in ("omniflow", "ray"):
        if name == "ray" and chain is None:
            continue
        out[name] = {str(c): summary(*results[name][c]) for c in CONCURRENCY}
    budget_ms = 1.5 * HOPS * out["hop_p50_us"] / 1e3
    out["target_overhead_ms"] = round(budget_ms, 3)
    out["target_after_idle_ms"] = round(1.5 * HOPS * out["hop_after_idle_p50_us"] / 1e3, 3)
    out["zmq_floor_after_idle_ms"] = round(HOPS * out["zmq_transit_after_idle_p50_us"] / 1e3, 3)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    emit(asyncio.run(main(args.requests, args.rounds)))
