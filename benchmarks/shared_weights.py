"""Two processes holding one model: resident weight memory with shared pool weights
(memory/weights.py) vs each loading its own copy; and the load time of the second process.

Each round runs a private pair then a shared pair (A B A B ...), two spawned processes at
a time. A process's weight memory is the growth of its anonymous memory over the load
(after a warm-up load, so first-use allocations of torch are not counted); the shared
pair adds the pool block once. Both processes of a pair start at once, so the second
role's load time (the one that maps the copy) includes waiting for the first's load.
Prints a JSON object last::

    python benchmarks/shared_weights.py [--model llama-bench-30m] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cpu_name, emit, median, scratch_dir  # noqa: E402


def anonymous_bytes() -> int:
    with open(f"/proc/{os.getpid()}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous: line in smaps_rollup")


def role(pool_name: str, path: str, warm: str, shared: bool, go, conn) -> None:
    import torch

    from omniflow.memory import PagePool, SharedWeights
    from omniflow.models.loader import load_decoder

    torch.set_num_threads(1)
    pool = PagePool.attach(pool_name)
    load_decoder(warm, dtype="float32")  # torch's first-use allocations, not counted
    gc.collect()
    go.wait()
    before, started = anonymous_bytes(), time.perf_counter()
    weights = SharedWeights(pool, path) if shared else None
    model = load_decoder(path, dtype="float32", place=weights.place if weights else None)
    if weights is None:
        model.use_input_major_weights()  # what the engine does to a private model on CPU
    seconds = time.perf_counter() - started
    gc.collect()
    created = weights.created if weights else True
    conn.send((anonymous_bytes() - before, seconds, weights.nbytes if weights else 0, created))
    conn.recv()
    if weights:
        weights.close()


def pair(pool_name: str, path: Path, warm: Path, shared: bool) -> list[tuple]:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    ends, procs = [], []
    for _ in range(2):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=role, args=(pool_name, str(path), str(warm), shared, go, theirs))
        proc.start()
        ends.append(ours)
        procs.append(proc)
    go.set()
    results = [end.recv() for end in ends]
    for end in ends:
        end.send("exit")
    for proc in procs:
        proc.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-bench-30m")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from omniflow.memory import PagePool
    from omniflow.models.tiny.builder import build_tiny_model

    root = scratch_dir("ofb-weights-")
    path = build_tiny_model(root / "model", args.model)
    warm = build_tiny_model(root / "warm", "llama-mha")
    pool = PagePool.create(f"omniflow-bench-weights-{os.getpid()}", 512 << 20, 2 << 20)
    mb = 1 << 20
    two_private, one_private, two_shared, attach_s, private_s = [], [], [], [], []
    try:
        for _ in range(args.rounds):
            private = pair(pool.name, path, warm, shared=False)
            two_private.append(sum(r[0] for r in private) / mb)
            one_private.append(private[0][0] / mb)
            private_s.extend(r[1] for r in private)
            shared = pair(pool.name, path, warm, shared=True)
            two_shared.append((sum(r[0] for r in shared) + shared[0][2]) / mb)
            attach_s.extend(r[1] for r in shared if not r[3])
            if pool.stats().used_pages:
                raise RuntimeError("the shared pair left pages in the pool")
    finally:
        pool.unlink()
        pool.close()
    print(f"cpu: {cpu_name()}; model {args.model}; rounds {args.rounds}")
    emit(
        {
            "weights_mb_two_roles": round(median(two_shared), 1),
            "weights_mb_one_role": round(median(one_private), 1),
            "weights_mb_two_private": round(median(two_private), 1),
            "second_role_load_s": round(median(attach_s), 3),
            "private_load_s": round(median(private_s), 3),
        }
    )


if __name__ == "__main__":
    main()
