"""One hop between two actor processes, against the floor and the alternatives.

Subject: ``hop`` — the client sends a Call to a no-op actor in another process
and waits for its Done (the full omniflow path: codec, routing, credit).
Baselines, measured in the same run and interleaved in rounds (A B C D A B ...):
``floor`` — synchronous pyzmq REQ/REP over ipc:// with the same payload;
``asyncio_floor`` — the least two asyncio peers can do: uvloop on both sides, a
reader on each socket's FD, echo the header (no codec, no routing): what any
event-loop design pays over ``floor`` before doing anything;
``zmq_asyncio`` — the naive design the actor loop must beat: a zmq.asyncio DEALER
awaiting ``send``/``recv`` against a zmq.asyncio ROUTER echo (uvloop, no codec);
``mp_pipe`` — multiprocessing.Pipe with pickle; ``ray`` — a Ray async actor call.
Also ``hop_curve``: the same hop over tcp:// on loopback with CurveZMQ keys
(``[security] keys``; tcp without keys is a config error), interleaved with the rest:
its ratio to ``hop`` (ipc://) is what tcp and encryption cost a hop; ``pipeline_rps``: a two-role pipeline driven by 64
concurrent clients; and ``*_after_idle``: the hop and the floor when each call follows a 5 ms idle gap (as a
pipeline hop follows a role's compute): on a VM, waking idle threads costs more than
the hop itself, and back-to-back calls never see it.

    python benchmarks/hop.py [--calls 5000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

sys.path.insert(0, os.path.dirname(__file__))
from _common import emit, have_ray, pct, scratch_dir, short_run_root  # noqa: E402

import omniflow  # noqa: E402
from omniflow.messages import Call  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402
from omniflow.transport.codec import encode  # noqa: E402
from omniflow.transport.security import generate_keys  # noqa: E402

PAYLOAD = {"text": "x" * 64}
IDLE_GAP_S = 0.005


def _rep_server(address: str, ready) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.bind(address)
    ready.set()
    while True:
        msg = sock.recv()
        if msg == b"stop":
            sock.send(b"")
            break
        sock.send(msg)


def _async_echo_server(address: str, ready) -> None:
    import uvloop

    async def serve() -> None:
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(address)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()

        def drain() -> None:
            while sock.get(zmq.EVENTS) & zmq.POLLIN:  # edge-triggered FD: until empty
                identity, msg = sock.recv_multipart(zmq.NOBLOCK)
                sock.send_multipart([identity, msg], zmq.NOBLOCK)
                if msg == b"stop" and not stop.done():
                    stop.set_result(None)

        loop.add_reader(sock.get(zmq.FD), drain)
        ready.set()
        drain()
        await stop
        loop.remove_reader(sock.get(zmq.FD))

    uvloop.run(serve())


class _AsyncPing:
    """The client half of ``asyncio_floor``: send, then wait on the DEALER's reader."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self.waiter: asyncio.Future | None = None
        asyncio.get_running_loop().add_reader(self.sock.get(zmq.FD), self._drain)

    def _drain(self) -> None:
        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            msg = self.sock.recv(zmq.NOBLOCK)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(msg)

    async def ping(self, payload: bytes) -> bytes:
        self.waiter = asyncio.get_running_loop().create_future()
        self.sock.send(payload, zmq.NOBLOCK)
        self._drain()  # the send may have consumed the FD's edge
        return await self.waiter

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.get(zmq.FD))
        self.sock.close(0)


def _zmq_asyncio_server(address: str, ready) -> None:
    import uvloop

    async def serve() -> None:
        sock = zmq.asyncio.Context().socket(zmq.ROUTER)
        sock.bind(address)
        ready.set()
        while True:
            identity, msg = await sock.recv_multipart()
            await sock.send_multipart([identity, msg])
            if msg == b"stop":
                break

    uvloop.run(serve())


def _pipe_server(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(msg)


async def timed(call, count: int, into: list[float], gap: float = 0.0) -> None:
    """Time ``count`` calls of ``call`` (a plain function, or one returning an awaitable),
    each after ``gap`` seconds idle."""
    for _ in range(count):
        if gap:
            await asyncio.sleep(gap)
        t = time.perf_counter()
        pending = call()
        if pending is not None:
            await pending
        into.append(time.perf_counter() - t)


def config(roles: int, name: str = "", **extra: Any):
    names = [f"noop{i}" for i in range(roles)]
    edges = [{"from": "input", "to": names[0]}]
    edges += [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    return parse(
        {
            "name": name or f"hop{roles}",
            "roles": {
                n: {"actor": "omniflow.roles.echo:Noop", "max_concurrency": 256} for n in names
            },
            "graph": {"edges": edges},
            **extra,
        }
    )


def curve_config(folder: Path) -> Any:
    """The one-hop deployment over tcp:// on loopback, with CurveZMQ keys."""
    generate_keys(folder)
    tcp = {"transport": "tcp", "bind_host": "127.0.0.1"}
    return config(1, "hopcurve", runtime=tcp, security={"keys": str(folder)})


async def main(calls: int, rounds: int, clients: int) -> dict:
    short_run_root()
    per_round = max(1, calls // rounds)
    header = encode(Call("0" * 32, "noop0", "ipc:///tmp/x", data=PAYLOAD))

    # floor: sync REQ/REP with a payload of the same size as omniflow's header
    spawn = mp.get_context("spawn")
    address = f"ipc:///tmp/ofb-floor-{os.getpid()}.sock"
    ready = spawn.Event()
    rep = spawn.Process(target=_rep_server, args=(address, ready), daemon=True)
    rep.start()
    ready.wait(30)
    zctx = zmq.Context()
    req = zctx.socket(zmq.REQ)
    req.connect(address)

    async_address = f"ipc:///tmp/ofb-async-{os.getpid()}.sock"
    async_ready = spawn.Event()
    echo = spawn.Process(target=_async_echo_server, args=(async_address, async_ready), daemon=True)
    echo.start()
    async_ready.wait(30)
    aping = _AsyncPing(zctx, async_address)

    naive_address = f"ipc:///tmp/ofb-naive-{os.getpid()}.sock"
    naive_ready = spawn.Event()
    naive = spawn.Process(
        target=_zmq_asyncio_server, args=(naive_address, naive_ready), daemon=True
    )
    naive.start()
    naive_ready.wait(30)

    naive_sock = zmq.asyncio.Context().socket(zmq.DEALER)
    naive_sock.connect(naive_address)

    parent, child = spawn.Pipe()
    piper = spawn.Process(target=_pipe_server, args=(child,), daemon=True)
    piper.start()

    ray_actor = None
    if have_ray():
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

        @ray.remote
        class Echo:
            async def call(self, payload):
                return payload

        ray_actor = Echo.remote()
        await ray_actor.call.remote(PAYLOAD)

    samples: dict[str, list[float]] = {
        "hop": [],
        "hop_curve": [],
        "floor": [],
        "asyncio_floor": [],
        "zmq_asyncio": [],
        "mp_pipe": [],
        "ray": [],
        "hop_after_idle": [],
        "floor_after_idle": [],
    }
    idle_calls = max(1, per_round // 20)

    def floor_call() -> None:
        req.send(header)
        req.recv()

    async def zmq_asyncio_call() -> None:
        await naive_sock.send(header)
        await naive_sock.recv()

    def pipe_call() -> None:
        parent.send(PAYLOAD)
        parent.recv()

    async with (
        omniflow.Runtime(config(1)) as rt,
        omniflow.Runtime(curve_config(scratch_dir("ofk-") / "keys")) as rt_curve,
    ):
        subjects = {  # (call, calls per round); interleaved in this order every round
            "hop": (lambda: rt.call(PAYLOAD), per_round),
            "hop_curve": (lambda: rt_curve.call(PAYLOAD), per_round),
            "floor": (floor_call, per_round),
            "asyncio_floor": (lambda: aping.ping(header), per_round),
            "zmq_asyncio": (zmq_asyncio_call, per_round),
            "mp_pipe": (pipe_call, per_round),
        }
        if ray_actor is not None:
            subjects["ray"] = (lambda: ray_actor.call.remote(PAYLOAD), max(1, per_round // 5))
        for name, (call, _) in subjects.items():  # warm up every path
            if name != "ray":
                await timed(call, 200, [])
        for _ in range(rounds):
            for name, (call, count) in subjects.items():
                await timed(call, count, samples[name])
            await timed(subjects["hop"][0], idle_calls, samples["hop_after_idle"], IDLE_GAP_S)
            await timed(floor_call, idle_calls, samples["floor_after_idle"], IDLE_GAP_S)

    async with omniflow.Runtime(config(2)) as rt:
        await asyncio.gather(*(rt.call(PAYLOAD) for _ in range(clients)))
        done = 0
        stop_at = time.perf_counter() + 5.0
        started = time.perf_counter()

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await rt.call(PAYLOAD)
                done += 1

        await asyncio.gather(*(client() for _ in range(clients)))
        rps = done / (time.perf_counter() - started)

    req.send(b"stop")
    req.recv()
    await aping.ping(b"stop")
    aping.close()
    echo.join(5)
    await naive_sock.send(b"stop")
    await naive_sock.recv()
    naive_sock.close(0)
    naive.join(5)
    parent.send(None)
    rep.join(5)
    piper.join(5)
    if ray_actor is not None:
        import ray

        ray.shutdown()

    us = {k: [s * 1e6 for s in v] for k, v in samples.items()}
    result = {
        "calls": len(us["hop"]),
        "hop_p50_us": round(pct(us["hop"], 50), 1),
        "hop_p99_us": round(pct(us["hop"], 99), 1),
        "hop_curve_p50_us": round(pct(us["hop_curve"], 50), 1),
        "pipeline_rps": round(rps, 1),
        "floor_p50_us": round(pct(us["floor"], 50), 1),
        "asyncio_floor_p50_us": round(pct(us["asyncio_floor"], 50), 1),
        "zmq_asyncio_p50_us": round(pct(us["zmq_asyncio"], 50), 1),
        "hop_after_idle_p50_us": round(pct(us["hop_after_idle"], 50), 1),
        "floor_after_idle_p50_us": round(pct(us["floor_after_idle"], 50), 1),
        "mp_pipe_p50_us": round(pct(us["mp_pipe"], 50), 1),
        "ray_p50_us": round(pct(us["ray"], 50), 1) if us["ray"] else None,
    }
    result["hop_over_floor"] = round(result["hop_p50_us"] / result["floor_p50_us"], 2)
    # The cost of tcp:// with CurveZMQ on a hop, against the same hop over ipc://.
    result["hop_curve_over_ipc"] = round(result["hop_curve_p50_us"] / result["hop_p50_us"], 2)
    result["asyncio_floor_over_floor"] = round(
        result["asyncio_floor_p50_us"] / result["floor_p50_us"], 2
    )
    result["hop_over_zmq_asyncio"] = round(result["hop_p50_us"] / result["zmq_asyncio_p50_us"], 2)
    result["hop_after_idle_over_floor_after_idle"] = round(
        result["hop_after_idle_p50_us"] / result["floor_after_idle_p50_us"], 2
    )
    if result["ray_p50_us"]:
        result["ray_over_hop"] = round(result["ray_p50_us"] / result["hop_p50_us"], 2)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()
    import uvloop

    emit(uvloop.run(main(args.calls, args.rounds, args.clients)))
