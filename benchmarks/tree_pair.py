"""One benchmark, two source trees, interleaved: is a restructuring free?

Runs ``benchmarks/BENCH.py`` of each tree (each with its own ``omniflow`` on PYTHONPATH) one
round at a time, in the order A B B A A B B A ... so that neither tree always runs first or
last (benchmarks/prefill.py showed a position bias of a few percent on this machine), and
reports each figure's median per tree and the ratio subject / baseline.

    python benchmarks/tree_pair.py --baseline /work/wt/_base --pairs 4 -- --rounds 1
    python benchmarks/tree_pair.py --baseline /work/wt/_base --bench engine_peers -- \
        --engines "" --rounds 1     (omniflow's figures of engine_peers.py, no peer)

Prints a JSON object as its last line: per figure, subject and baseline medians and ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_name  # noqa: E402

FIGURES = ("tokens_per_s", "ttft_cached_ms", "ttft_uncached_ms")


def run_once(tree: Path, bench: str, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / f"{bench}.py"), *extra],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # engine_peers.py reports each engine under "engines": the tree's own is omniflow's
    return result.get("engines", {}).get("omniflow", result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", type=Path, required=True, help="the pre-change checkout")
    parser.add_argument("--subject", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--bench", default="engine")
    parser.add_argument("--pairs", type=int, default=4, help="A B B A counts as two pairs")
    parser.add_argument("extra", nargs="*", help="arguments for the benchmark (after --)")
    args = parser.parse_args()
    trees = {"subject": args.subject, "baseline": args.baseline}
    results: dict[str, list[dict]] = {"subject": [], "baseline": []}
    for i in range(args.pairs):
        order = ["subject", "baseline"] if i % 2 == 0 else ["baseline", "subject"]
        for which in order:
            results[which].append(run_once(trees[which], args.bench, args.extra))
            print(which, json.dumps({f: results[which][-1].get(f) for f in FIGURES}), flush=True)
    summary: dict = {"bench": args.bench, "pairs": args.pairs, "order": "ABBA", "cpu": cpu_name()}
    for figure in FIGURES:
        values = {w: [r[figure] for r in results[w] if r.get(figure) is not None] for w in trees}
        if all(values.values()):
            subject, baseline = (statistics.median(values[w]) for w in ("subject", "baseline"))
            summary[figure] = {
                "subject": subject,
                "baseline": baseline,
                "ratio": round(subject / baseline, 4),
            }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
