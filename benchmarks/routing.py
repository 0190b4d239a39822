"""Per-stage cost of decentralized routing: a 5-stage no-op pipeline vs. one direct hop.

Both deployments run side by side; calls alternate between them in rounds
(A B A B ...). ``overhead_p50_us_per_stage`` is the 5-stage end-to-end p50
divided by 5; with no central router it should stay close to ``hop_p50_us``.

    python benchmarks/routing.py [--calls 3000] [--stages 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import emit, pct, short_run_root  # noqa: E402
from hop import PAYLOAD, config  # noqa: E402

import omniflow  # noqa: E402


async def main(calls: int, stages: int, rounds: int) -> dict:
    short_run_root()
    per_round = max(1, calls // rounds)
    samples: dict[str, list[float]] = {"hop": [], "chain": []}
    async with omniflow.Runtime(config(1)) as one, omniflow.Runtime(config(stages)) as chain:
        for _ in range(200):
            await one.call(PAYLOAD)
            await chain.call(PAYLOAD)
        for _ in range(rounds):
            for name, rt in (("hop", one), ("chain", chain)):
                for _ in range(per_round):
                    t = time.perf_counter()
                    _, result = await rt.call(PAYLOAD)
                    samples[name].append(time.perf_counter() - t)
                assert len(result.timings) == (1 if name == "hop" else stages)
    hop = pct(samples["hop"], 50) * 1e6
    chain_p50 = pct(samples["chain"], 50) * 1e6
    return {
        "stages": stages,
        "calls": len(samples["chain"]),
        "chain_p50_us": round(chain_p50, 1),
        "overhead_p50_us_per_stage": round(chain_p50 / stages, 1),
        "hop_p50_us": round(hop, 1),
        "per_stage_over_hop": round(chain_p50 / stages / hop, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--stages", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    import uvloop

    emit(uvloop.run(main(args.calls, args.stages, args.rounds)))
