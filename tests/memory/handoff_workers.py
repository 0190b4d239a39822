"""A receiver process for the tensor hand-off tests: real ZeroMQ, real wire types.

It attaches the pool, materializes every ref of each ``Call``, reports what it got,
sends the bytes back as frames, and releases (acks) its refs before replying.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch
import zmq

from omniflow.memory import PagePool
from omniflow.messages import Call, Emit, Frame, Hello, Shutdown
from omniflow.transport.tensors import (
    Link,
    TensorError,
    attach_pool,
    export,
    materialize,
    release_all,
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Call | Shutdown)


def receive(pool_name: str, endpoint: str) -> None:
    torch.set_num_threads(1)
    pool = PagePool.attach(pool_name)
    attach_pool(pool, frame_threshold=0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    sock.connect(endpoint)
    sock.send(_encoder.encode(Hello(role="receiver", replica=0, pid=os.getpid())))
    try:
        while True:
            parts = sock.recv_multipart(copy=False)
            msg = _decoder.decode(parts[0].buffer)
            if isinstance(msg, Shutdown):
                return
            sock.send_multipart(_answer(pool, msg, parts))
    finally:
        sock.close()
        ctx.term()


def _answer(pool: PagePool, msg: Call, parts: list[Any]) -> list[Any]:
    report: dict[str, Any] = {}
    copies: dict[str, torch.Tensor] = {}
    opened = []
    for name, ref in msg.tensors.items():
        try:
            t = materialize(ref, parts)
        except TensorError as e:
            report[name] = {"error": str(e)}
            continue
        opened.append(ref)
        report[name] = {
            "kind": type(ref).__name__,
            "in_pool": pool.contains(t),
            "address": t.untyped_storage().data_ptr()
            + t.storage_offset() * t.element_size()
            - pool.base,
        }
        copies[name] = t.clone()  # our own bytes: the refs are released before replying
    release_all(opened)
    frames: list[Any] = [b""]
    refs = {name: export(t, frames, Link()) for name, t in copies.items()}
    assert all(isinstance(r, Frame) for r in refs.values())
    frames[0] = _encoder.encode(
        Emit(
            request_id=msg.request_id, role="receiver", seq=0, data={"report": report}, tensors=refs
        )
    )
    return frames
