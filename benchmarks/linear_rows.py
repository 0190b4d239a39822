"""omniflow's AMX projection kernel against oneDNN's packed bf16 linear, by row count.

The projections of the engine benchmark's model (build_tiny_model "llama-bench-30m"): qkv,
o, gate/up with silu * up (the kernel fuses it; oneDNN's side runs its linear, then the
kernels' silu_mul), down, and the tied output projection. For each shape and row count
(--rows), the two run interleaved (A B A B ...) for --rounds rounds; each round's figure is
the fastest of --calls calls (on a shared 2-core VM a call that loses a core for one time
slice takes milliseconds more, which would swamp sub-millisecond calls), and the reported
one the median over rounds.

oneDNN's weight is re-laid once (torch.ops.mkldnn._reorder_linear_weight) for --hint rows,
as PackedLinear does; the kernel's once by CpuKernels.pack_linear, as KernelLinear does.

Prints a JSON object as its last line: "cpu", "threads", and per shape a list of
{"rows", "amx_ms", "onednn_ms", "onednn_over_amx"} (amx_ms / onednn_ms: above 1, oneDNN is
faster); "totals": the same summed over one layer's four projections; "onednn_wins_from":
the smallest row count from which oneDNN is faster on the layer total at every larger count
measured (null if it never is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_name  # noqa: E402

from omniflow.kernels import cpu_kernels  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 512, 1408, 8, 4, 8192  # llama-bench-30m
HEAD_DIM = HIDDEN // HEADS
# name: (out_features, in_features, gate_up rows or 0)
SHAPES = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 0),
    "o": (HIDDEN, HEADS * HEAD_DIM, 0),
    "gate_up_silu": (2 * INTER, HIDDEN, INTER),
    "down": (HIDDEN, INTER, 0),
    "lm_head": (VOCAB, HIDDEN, 0),
}
LAYER = ("qkv", "o", "gate_up_silu", "down")


def timed(fn, calls: int) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return min(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32,64,128,256,512,768,1024,1040,1536,2048,3072,4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--hint", type=int, default=2048, help="oneDNN's rows hint")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.amx:
        raise SystemExit("linear_rows: needs the CPU kernels with AMX on this CPU")
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = args.shapes.split(",")
    results: dict[str, list[dict]] = {}
    with torch.inference_mode():
        for name in shapes:
            out_features, in_features, gate_up = SHAPES[name]
            weight = (torch.randn(out_features, in_features) * 0.02).bfloat16()
            packed = kernels.pack_linear(weight, gate_up)
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, args.hint)
            results[name] = []
            for rows in rows_list:
                x = torch.randn(rows, in_features).bfloat16()

                def amx(x=x, packed=packed, out_features=out_features, gate_up=gate_up):
                    return kernels.linear(x, packed, out_features, None, gate_up, bool(gate_up))

                def dnn(x=x, onednn=onednn, gate_up=gate_up):
                    out = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
                    return kernels.silu_mul(out) if gate_up else out

                torch.testing.assert_close(amx(), dnn(), atol=2e-2, rtol=2e-2)
                amx_rounds, dnn_rounds = [], []
                for _ in range(args.rounds):
                    amx_rounds.append(timed(amx, args.calls))
                    dnn_rounds.append(timed(dnn, args.calls))
                a, d = statistics.median(amx_rounds), statistics.median(dnn_rounds)
                row = {"rows": rows, "amx_ms": round(a, 4), "onednn_ms": round(d, 4)}
                row["onednn_over_amx"] = round(a / d, 3)
                results[name].append(row)
                print(name, row, flush=True)
    totals = []
    if all(name in results for name in LAYER):
        for index, rows in enumerate(rows_list):
            a = sum(results[name][index]["amx_ms"] for name in LAYER)
            d = sum(results[name][index]["onednn_ms"] for name in LAYER)
            totals.append(
                {
                    "rows": rows,
                    "amx_ms": round(a, 4),
                    "onednn_ms": round(d, 4),
                    "onednn_over_amx": round(a / d, 3),
                }
            )
    wins_from = None
    for row in reversed(totals):
        if row["onednn_over_amx"] <= 1.0:
            break
        wins_from = row["rows"]
    print(
        json.dumps(
            {
                "cpu": cpu_name(),
                "threads": torch.get_num_threads(),
                "hint": args.hint,
                "shapes": results,
                "totals": totals,
                "onednn_wins_from": wins_from,
            }
        )
    )


if __name__ == "__main__":
    main()
