"""Receiver processes of the CUDA IPC tests (spawned: a fresh CUDA context each)."""

from __future__ import annotations

import hashlib
import os
import time

import msgspec

_ref = msgspec.msgpack.Decoder()


def _ready(pool_name: str):
    import torch

    from omniflow.memory import PagePool
    from omniflow.messages import CudaIpc
    from omniflow.transport import tensors as T

    T.attach_pool(PagePool.attach(pool_name), frame_threshold=0)
    return torch, T, msgspec.msgpack.Decoder(CudaIpc)


def digest(t) -> str:
    import torch

    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def read_and_release(pool_name: str, conn, sleep_cycles: int) -> None:
    """Per ref: open, queue ``sleep_cycles`` of GPU work before reading, copy it out,
    release (which must wait for that read), report the copy's digest and the mappings."""
    torch, T, dec = _ready(pool_name)
    conn.send(("ready", os.getpid()))
    while True:
        raw = conn.recv()
        if raw is None:
            return
        ref = dec.decode(raw)
        view = T.materialize(ref, [])
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)  # the read below runs after this, on this stream
        copy = view.clone()
        t0 = time.perf_counter()
        T.release(ref)
        waited = time.perf_counter() - t0
        conn.send((digest(copy), T._attached.opener.mapped(), waited))


def open_and_hang(pool_name: str, conn) -> None:
    """Open a ref and keep it, never releasing: the test kills this process."""
    torch, T, dec = _ready(pool_name)
    conn.send(("ready", os.getpid()))
    ref = dec.decode(conn.recv())
    view = T.materialize(ref, [])
    torch.cuda.synchronize()
    conn.send((digest(view), T._attached.opener.mapped(), 0.0))
    time.sleep(600)
