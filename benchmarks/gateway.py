"""The HTTP gateway's own cost: the echo pipeline through the gateway vs through the
embedded ``Runtime``'s client directly, in the same run.

Latency: one request at a time (p50 of ``--requests``). Throughput: ``--concurrency``
requests kept in flight (requests/s over ``--burst`` requests). Rounds alternate direct and gateway (A B A B); each
figure is the median over rounds. The HTTP side is a minimal keep-alive HTTP/1.1 client on
asyncio streams (one connection per in-flight request), so what is measured is the
gateway, not an HTTP client library. Targets: gateway p50 <= direct p50 + 1 ms, gateway
requests/s >= 0.5 x direct, both judged on each round's paired figures (median).

Then the cost of tracing and metrics: two gateway deployments up at once, one with
``[tracing] enabled`` (every request traced through the OpenTelemetry SDK, spans dropped:
no exporter) and ``/metrics`` scraped every 0.2 s while it is measured, one with neither;
their throughput runs interleave (A B B A) and the cost is the median of each round's
ratio of requests/s; the workers' CPU time per request (from /proc) is reported beside
it, the steadier figure on a shared machine. Target: <= 5%.

    python benchmarks/gateway.py [--requests 400] [--burst 4000] [--concurrency 16] [--rounds 5]
        [--tracing-rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import cpu_name, emit, median, pct, short_run_root  # noqa: E402

import omniflow  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402

TEXT = "hello"


def config(name: str = "gwbench", tracing: bool = False) -> omniflow.Config:
    echo = "omniflow.roles.echo"
    return parse(
        {
            "name": name,
            "tracing": {"enabled": tracing},
            "roles": {
                "upper": {"actor": f"{echo}:Upper"},
                "reverse": {"actor": f"{echo}:Reverse"},
            },
            "graph": {
                "edges": [
                    {"from": "input", "to": "upper"},
                    {"from": "upper", "to": "reverse", "stream": True},
                ]
            },
            # keepalive: a round's connections idle while the other side's round runs
            "gateway": {"port": 0, "max_inflight": 4096, "keepalive_timeout_s": 3600},
        },
        "<bench>",
    )


class Http:
    """One keep-alive connection; ``post`` returns the body of a 200."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> Http:
        return cls(*await asyncio.open_connection(host, port))

    async def post(self, path: str, body: bytes) -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readuntil(b"\r\n")
        headers = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in headers.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        data = await self.reader.readexactly(length)
        if b" 200 " not in status_line:
            raise RuntimeError(f"{status_line!r}: {data[:200]!r}")
        return data

    async def get(self, path: str) -> bytes:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        await self.reader.readuntil(b"\r\n")
        headers = await self.reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line[15:])
            for line in headers.split(b"\r\n")
            if line[:15].lower() == b"content-length:"
        )
        return await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def latency(send, n: int) -> float:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await send()
        samples.append((time.perf_counter() - started) * 1e3)
    return pct(samples, 50)


async def throughput(sends: list, n: int) -> float:
    per_worker = n // len(sends)

    async def worker(send) -> None:
        for _ in range(per_worker):
            await send()

    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in sends))
    return per_worker * len(sends) / (time.perf_counter() - started)


def chat_body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": TEXT}]}).encode()


async def gateway_conns(rt: omniflow.Runtime, n: int) -> list[Http]:
    url = (rt.run_dir / "gateway.url").read_text().strip()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return [await Http.open(host, int(port)) for _ in range(n)]


async def scraping(conn: Http, period: float) -> None:
    """GET /metrics every ``period`` seconds until cancelled (what Prometheus does)."""
    while True:
        text = await conn.get("/metrics")
        assert b"omniflow_replica_served_total" in text
        await asyncio.sleep(period)


def deployment_cpu_s(run_dir: Path) -> float:
    """CPU seconds the worker processes of ``run_dir`` have used, all their threads: a
    cost figure the other load of a shared machine moves far less than requests/s."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"omniflow.runtime.worker" not in cmdline or str(run_dir).encode() not in cmdline:
                continue
            total += process_cpu_s(pid)
        except OSError:
            continue  # gone meanwhile
    return total


_SCHEDSTAT = os.path.exists("/proc/self/schedstat")


def process_cpu_s(pid: str) -> float:
    """Each thread's time on a CPU from its schedstat, in nanoseconds; where the kernel
    keeps none, the process's user + system time in clock ticks (10 ms: several % of a
    worker's time in one round)."""
    if not _SCHEDSTAT:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    ns = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            ns += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return ns / 1e9


async def tracing_cost(args: argparse.Namespace) -> dict:
    """requests/s through a gateway with tracing (no exporter) and scrapes vs without."""
    expected = TEXT.upper()[::-1].encode()
    async with (
        omniflow.Runtime(config("gwplain")) as plain,
        omniflow.Runtime(config("gwtraced", tracing=True)) as traced,
    ):
        conns = {
            "off": await gateway_conns(plain, args.concurrency),
            "on": await gateway_conns(traced, args.concurrency + 1),
        }
        bodies = {"off": chat_body("gwplain"), "on": chat_body("gwtraced")}
        run_dirs = {"off": plain.run_dir, "on": traced.run_dir}

        def sends(name: str) -> list:
            def via(conn: Http):
                async def send() -> None:
                    assert expected in await conn.post("/v1/chat/completions", bodies[name])

                return send

            return [via(c) for c in conns[name][: args.concurrency]]

        for name in ("off", "on"):  # warm both
            await throughput(sends(name), 20 * args.concurrency)
        rps: dict[str, list[float]] = {"off": [], "on": []}
        cpu_ms: dict[str, list[float]] = {"off": [], "on": []}  # per request
        for i in range(args.tracing_rounds):
            for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                scraper = None
                if name == "on":
                    scraper = asyncio.create_task(scraping(conns["on"][-1], 0.2))
                try:
                    cpu = deployment_cpu_s(run_dirs[name])
                    rps[name].append(await throughput(sends(name), args.burst))
                    cpu = deployment_cpu_s(run_dirs[name]) - cpu
                    cpu_ms[name].append(cpu * 1e3 / args.burst)
                finally:
                    if scraper is not None:
                        scraper.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await scraper
        for conn in [*conns["off"], *conns["on"]]:
            conn.close()
    costs = [1 - on / off for on, off in zip(rps["on"], rps["off"], strict=True)]
    cpu_costs = [on / off - 1 for on, off in zip(cpu_ms["on"], cpu_ms["off"], strict=True)]
    return {
        "rps_tracing_off": round(median(rps["off"]), 1),
        "rps_tracing_on": round(median(rps["on"]), 1),
        "cost": round(median(costs), 4),
        "cost_rounds": [round(c, 4) for c in costs],
        # The deployment's CPU time per request, on over off, minus one.
        "cpu_ms_per_request_off": round(median(cpu_ms["off"]), 4),
        "cpu_ms_per_request_on": round(median(cpu_ms["on"]), 4),
        "cpu_cost": round(median(cpu_costs), 4),
        "cpu_cost_rounds": [round(c, 4) for c in cpu_costs],
        "rounds": args.tracing_rounds,
        "cost_at_most_5pct": median(costs) <= 0.05,
        "cpu_cost_at_most_5pct": median(cpu_costs) <= 0.05,
    }


async def main(args: argparse.Namespace) -> dict:
    short_run_root()
    async with omniflow.Runtime(config()) as rt:
        url = (rt.run_dir / "gateway.url").read_text().strip()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps(
            {"model": "gwbench", "messages": [{"role": "user", "content": TEXT}]}
        ).encode()
        expected = TEXT.upper()[::-1]

        async def direct() -> None:
            outputs, _ = await rt.call({"text": TEXT})
            assert outputs[0].data["text"] == expected

        conns = [await Http.open(host, int(port)) for _ in range(args.concurrency)]

        def via(conn: Http):
            async def send() -> None:
                reply = await conn.post("/v1/chat/completions", body)
                assert expected.encode() in reply

            return send

        for _ in range(50):  # warm both paths
            await direct()
            await via(conns[0])()
        results: dict[str, dict[str, list[float]]] = {
            "direct": {"p50_ms": [], "rps": []},
            "gateway": {"p50_ms": [], "rps": []},
        }
        for i in range(args.rounds):
            # A B, then B A: a load that drifts during a round favours neither side.
            for name in ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct"):
                one = direct if name == "direct" else via(conns[0])
                many = [direct] * args.concurrency if name == "direct" else [via(c) for c in conns]
                results[name]["p50_ms"].append(await latency(one, args.requests))
                results[name]["rps"].append(await throughput(many, args.burst))
        for conn in conns:
            conn.close()
    tracing = await tracing_cost(args) if args.tracing_rounds else None
    figures = {
        name: {key: round(median(values), 3) for key, values in r.items()}
        for name, r in results.items()
    }
    d, g = figures["direct"], figures["gateway"]
    # Each round's own ratio (its two runs measured back to back, under the same load),
    # then the median: on a shared machine the load moves more between rounds than within.
    ratios = [
        gr / dr for gr, dr in zip(results["gateway"]["rps"], results["direct"]["rps"], strict=True)
    ]
    overheads = [
        gp - dp
        for gp, dp in zip(results["gateway"]["p50_ms"], results["direct"]["p50_ms"], strict=True)
    ]
    return {
        "benchmark": "gateway",
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "pipeline": "echo (upper -> reverse), one word",
        "requests": args.requests,
        "burst": args.burst,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "direct": d,
        "gateway": g,
        "gateway_overhead_p50_ms": round(median(overheads), 3),
        "gateway_rps_ratio": round(median(ratios), 3),
        "gateway_rps_ratio_rounds": [round(r, 3) for r in ratios],
        "targets_met": {
            "p50_within_1ms": median(overheads) <= 1.0,
            "rps_at_least_half": median(ratios) >= 0.5,
            **({"tracing_cost_at_most_5pct": tracing["cost_at_most_5pct"]} if tracing else {}),
        },
        **({"tracing_and_metrics": tracing} if tracing else {}),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    # Requests per throughput run: a second or two, so one stall of a shared CPU is a
    # small part of it.
    parser.add_argument("--burst", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    # Rounds of the tracing-and-metrics cost (0: skip it).
    parser.add_argument("--tracing-rounds", type=int, default=6)
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(main(args))
    print(f"cpu: {result['cpu']} ({result['cpus']} cpus)", flush=True)
    emit(result)
