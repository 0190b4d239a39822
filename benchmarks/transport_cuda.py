"""CUDA IPC hand-off vs a device->host->device copy between two processes on one GPU.

Subject: the sender exports a CUDA tensor as a ``CudaIpc`` ref (event-ordered, no copy
when it already lives in the device pool; here it is copied in once, as a producer's
output would be); the receiver opens it, reads every byte on the GPU (a sum), releases.
Baseline: the same tensor as a ``Shm`` ref (device -> pinned host pool by DMA), which the
receiver copies back to its GPU and reads. Rounds interleave A B A B; medians of the
round trip (send to the receiver's ack) per size. Run by scripts/gpu_check.sh, or
``python benchmarks/transport.py --device cuda``. Needs a CUDA GPU and cupy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import msgspec
import torch

from benchmarks._common import cpu_name, emit, median
from omniflow.memory import PagePool, unlink_pool
from omniflow.messages import CudaIpc, Shm
from omniflow.transport import tensors as T
from omniflow.transport.tensors import Link

MiB = 1 << 20
_enc = msgspec.msgpack.Encoder()


def _receiver(pool_name: str, conn) -> None:
    T.attach_pool(PagePool.attach(pool_name), frame_threshold=0)
    dec = msgspec.msgpack.Decoder(CudaIpc | Shm)
    conn.send(os.getpid())
    while (raw := conn.recv()) is not None:
        ref = dec.decode(raw)
        t = T.materialize(ref, [])
        if not t.is_cuda:
            t = t.to("cuda", non_blocking=True)
        total = int(t.view(torch.uint8).sum(dtype=torch.int64))  # every byte read on the GPU
        T.release(ref)
        conn.send(total)


def run(sizes: list[int], rounds: int) -> dict:
    from omniflow.memory.cuda_ipc import DevicePool

    name = f"omniflow-bench-cuda-{os.getpid()}"
    unlink_pool(name)
    big = max(sizes) * MiB
    host = PagePool.create(name, big + 64 * MiB, page_size=64 << 10, pin=True)
    T.attach_pool(host, frame_threshold=0)
    device = DevicePool(host, 0, -(-(big + 2 * MiB) // (2 * MiB)) * 2 * MiB)
    T.attach_device_pool(device)
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(name, theirs), daemon=True)
    proc.start()
    pid = ours.recv()
    links = {"cuda_ipc": Link(True, (device.bus_id,), pid), "d2h2d": Link(True, (), pid)}
    out: dict = {}
    try:
        for size in sizes:
            src = torch.randint(0, 255, (size * MiB,), dtype=torch.uint8, device="cuda")
            want = int(src.sum(dtype=torch.int64))
            times: dict[str, list[float]] = {k: [] for k in links}
            for _ in range(rounds + 1):  # the first round warms up, unreported
                for method, link in links.items():  # A B A B
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ref = T.export(src, [b""], link)
                    ours.send(_enc.encode(ref))
                    got = ours.recv()
                    times[method].append(time.perf_counter() - t0)
                    assert got == want, (method, size)
            out[f"{size}MiB"] = {
                f"{m}_ms": round(median(v[1:]) * 1e3, 3) for m, v in times.items()
            } | {f"{m}_gbps": round(size * MiB / median(v[1:]) / 1e9, 2) for m, v in times.items()}
    finally:
        ours.send(None)
        proc.join(30)
        T.detach_pool()
        device.close()
        host.unlink()
        host.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,8,64,512", help="MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args, _ = ap.parse_known_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("transport --device cuda: no CUDA device visible")
    sizes = [int(s) for s in args.sizes.split(",")]
    result = run(sizes, args.rounds)
    emit(
        {
            "bench": "transport_cuda",
            "cpu": cpu_name(),
            "gpu": torch.cuda.get_device_name(0),
            "rounds": args.rounds,
            "sizes": result,
        }
    )


if __name__ == "__main__":
    main()
