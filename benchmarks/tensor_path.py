"""What a tensor costs a pipeline: 5 plain stages in a chain, a small payload against a
1 MiB tensor made in the first stage, at concurrency 1, 8 and 32.

One deployment of five processes: ``stage0`` (``roles/echo.py:MakeTensor``) writes a
``tensor_bytes`` tensor into the page pool when the request asks for one, ``stage1`` ..
``stage4`` (``Noop``) pass everything on; the last stage's output (with the tensor) comes
back to the client. ``small`` requests carry 64 bytes of text and no tensor; ``mib``
requests the same text and ``tensor_bytes = 1 MiB``. Rounds alternate small and mib at
each concurrency (small c1, mib c1, small c8, mib c8, ...), round after round, and
report the median p50 latency and requests/s over rounds; ``rps_min_max`` is the
slowest round's requests/s over the fastest's. ``cpu_us_per_request``: the CPU time
(user + system, from /proc) every process of the run spent per request, and at c32 each
process's share: where a tensor's cost goes, steadier than latency on a shared host.

``first_burst_p99_ms``: the p99 of the first 32 mib requests ever in flight at once (after
one request of each kind, so every process has started and each stage's path is known);
``steady_p99_ms``: the p99 of every later c32 mib round's requests.

    python benchmarks/tensor_path.py [--rounds 5] [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import cpu_name, emit, median, pct, short_run_root, tree_cpu_seconds  # noqa: E402

import omniflow  # noqa: E402
from omniflow.runtime.config import parse  # noqa: E402

CONCURRENCY = (1, 8, 32)
STAGES = 5
MIB = 1 << 20
KINDS = {"small": 0, "mib": MIB}


def config(stages: int = STAGES, **extra):
    names = [f"stage{i}" for i in range(stages)]
    edges = [{"from": "input", "to": names[0]}]
    edges += [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    roles = {n: {"actor": "omniflow.roles.echo:Noop", "max_concurrency": 256} for n in names}
    roles[names[0]]["actor"] = "omniflow.roles.echo:MakeTensor"
    return parse({"name": "tensorpath", "roles": roles, "graph": {"edges": edges}, **extra})


async def once(rt, nbytes: int, i: int) -> float:
    data = {"text": "x" * 64, "tensor_bytes": nbytes, "seed": i}
    t = time.perf_counter()
    outs, _ = await rt.call(data, timeout=60)
    took = time.perf_counter() - t
    got = outs[-1].tensors.get("tensor")
    if nbytes and (got is None or got.numel() != nbytes):
        raise AssertionError(f"request {i}: no {nbytes}-byte tensor came back")
    return took


async def drive(rt, nbytes: int, n: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            latencies.append(await once(rt, nbytes, i))

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, n / (time.perf_counter() - t)


def per_round(concurrency: int, requests: int) -> int:
    return max(concurrency * 4, requests // (4 if concurrency == 1 else 1))


async def main(rounds: int, requests: int) -> dict:
    short_run_root()
    lat = {k: {c: [] for c in CONCURRENCY} for k in KINDS}
    p50s: dict[str, dict[int, list[float]]] = {k: {c: [] for c in CONCURRENCY} for k in KINDS}
    rps: dict[str, dict[int, list[float]]] = {k: {c: [] for c in CONCURRENCY} for k in KINDS}
    cpu: dict[str, dict[int, dict[str, float]]] = {k: {c: {} for c in CONCURRENCY} for k in KINDS}
    async with omniflow.Runtime(config()) as rt:
        for nbytes in KINDS.values():
            await once(rt, nbytes, 0)
        first, _ = await drive(rt, MIB, 32, 32)  # the first burst: 32 in flight at once
        for _ in range(rounds):
            for c in CONCURRENCY:
                for kind, nbytes in KINDS.items():
                    before = tree_cpu_seconds()
                    got, r = await drive(rt, nbytes, per_round(c, requests), c)
                    spent = cpu[kind][c]
                    for name, secs in tree_cpu_seconds().items():
                        spent[name] = spent.get(name, 0.0) + secs - before.get(name, 0.0)
                    lat[kind][c] += got
                    p50s[kind][c].append(pct(got, 50))
                    rps[kind][c].append(r)

    def rounded(xs: list[float], scale: float = 1.0, nd: int = 3) -> list[float]:
        return [round(x * scale, nd) for x in xs]

    out: dict = {"cpu": cpu_name(), "stages": STAGES, "rounds": rounds}
    out["p50_ms"] = {k: rounded([median(p50s[k][c]) for c in CONCURRENCY], 1e3) for k in KINDS}
    out["p99_ms"] = {k: rounded([pct(lat[k][c], 99) for c in CONCURRENCY], 1e3) for k in KINDS}
    out["rps"] = {k: rounded([median(rps[k][c]) for c in CONCURRENCY], 1, 1) for k in KINDS}
    out["rps_min_max"] = {
        k: rounded([min(rps[k][c]) / max(rps[k][c]) for c in CONCURRENCY], 1, 2) for k in KINDS
    }
    out["mib_over_small_p50"] = [
        round(m / s, 2) for m, s in zip(out["p50_ms"]["mib"], out["p50_ms"]["small"], strict=True)
    ]
    # CPU time per request, every process together and (at c32) each: where a tensor's
    # cost goes, read from /proc, steadier than latencies on a noisy host (10 ms ticks,
    # summed over every round's requests)
    done = {c: rounds * per_round(c, requests) for c in CONCURRENCY}
    out["cpu_us_per_request"] = {
        k: [round(sum(cpu[k][c].values()) / done[c] * 1e6) for c in CONCURRENCY] for k in KINDS
    }
    out["cpu_us_per_request_c32"] = {
        k: {n: round(v / done[32] * 1e6) for n, v in sorted(cpu[k][32].items())} for k in KINDS
    }
    out["first_burst_p99_ms"] = round(pct(first, 99) * 1e3, 3)
    out["steady_p99_ms"] = round(pct(lat["mib"][32], 99) * 1e3, 3)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    result = asyncio.run(main(args.rounds, args.requests))
    print(f"cpu: {result['cpu']}", flush=True)
    # The figures, in its order, last.
    keys = ("p50_ms", "rps", "rps_min_max", "first_burst_p99_ms", "steady_p99_ms")
    print({k: v for k, v in result.items() if k not in keys}, flush=True)
    emit({k: result[k] for k in keys})
