"""CUDA IPC hand-off between real processes (marked ``gpu``: run by scripts/gpu_check.sh).

Bit-exact with the producer's kernel still running when the ref leaves; a receiver still
reading keeps the block from being reused; a killed receiver's refs are reclaimed and the
block recycled; a hop inside one process uses its own chunk.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal

import msgspec
import pytest
import torch

from omniflow.memory import PagePool, unlink_pool
from omniflow.messages import CudaIpc
from omniflow.transport import tensors as T
from omniflow.transport.tensors import Link
from tests.transport import cuda_ipc_workers as W

pytestmark = pytest.mark.gpu
SPAWN = multiprocessing.get_context("spawn")
SLEEP = 200_000_000  # GPU cycles of torch.cuda._sleep: ~0.1 s on any current GPU
_enc = msgspec.msgpack.Encoder()


@pytest.fixture
def pools():
    from omniflow.memory.cuda_ipc import DevicePool

    name = f"omniflow-test-ipc-{os.getpid()}"
    unlink_pool(name)
    host = PagePool.create(name, 16 << 20, page_size=64 << 10)
    T.attach_pool(host, frame_threshold=0)
    device = DevicePool(host, device=0, size=64 << 20)
    T.attach_device_pool(device)
    yield host, device
    T.detach_pool()
    device.close()
    host.unlink()
    host.close()


def _start(target, host: PagePool, *args):
    ours, theirs = SPAWN.Pipe()
    proc = SPAWN.Process(target=target, args=(host.name, theirs, *args), daemon=True)
    proc.start()
    assert ours.poll(120), "receiver did not start"
    tag, pid = ours.recv()
    assert tag == "ready"
    return proc, ours, pid


def _share(tensor: torch.Tensor, pid: int, device) -> CudaIpc:
    ref = T.export(tensor, [b""], Link(same_host=True, gpus=(device.bus_id,), pid=pid))
    assert isinstance(ref, CudaIpc) and ref.bus_id == device.bus_id and len(ref.event) == 64
    return ref


def _expected(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def test_handoff_is_bit_exact_while_the_producer_kernel_still_runs(pools) -> None:
    host, device = pools
    proc, conn, pid = _start(W.read_and_release, host, 0)
    try:
        for dtype in (torch.bfloat16, torch.float32, torch.int64):
            src = torch.randint(-(2**14), 2**14, (257, 1031), device="cuda").to(dtype)
            want = _expected(src)
            out, lease = device.empty(src.shape, dtype)
            torch.cuda._sleep(5 * SLEEP)  # the producer's stream is busy for a while ...
            out.copy_(src * 1)  # ... and this write lands only after it
            ref = _share(out, pid, device)
            assert not torch.cuda.current_stream().query(), "the producer already finished"
            conn.send(_enc.encode(ref))
            assert conn.poll(60)
            got, mapped, _ = conn.recv()
            assert got == want, dtype
            assert mapped == 0  # the mapping closed with the last ref
            lease.release()
        assert device.in_use() == 0
    finally:
        conn.send(None)
        proc.join(30)


def test_a_receiver_still_reading_keeps_the_block(pools) -> None:
    host, device = pools
    proc, conn, pid = _start(W.read_and_release, host, 5 * SLEEP)
    try:
        src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        want = _expected(src)
        ref = _share(src, pid, device)  # copied into a block of the chunk
        assert device.in_use() > 0
        conn.send(_enc.encode(ref))
        assert device.in_use() > 0, "recycled while the receiver may still read"
        assert conn.poll(60)
        got, mapped, waited = conn.recv()
        assert got == want and mapped == 0
        assert waited > 0.01, "release returned before the receiver's queued read ran"
        assert host.refs(ref.lease) == 0 and device.in_use() == 0
        again = _share(torch.zeros_like(src), pid, device)  # the block is reused ...
        assert again.offset == ref.offset
        host.release(again.lease, pid)
    finally:
        conn.send(None)
        proc.join(30)


def test_a_killed_receivers_refs_are_reclaimed(pools) -> None:
    host, device = pools
    proc, conn, pid = _start(W.open_and_hang, host)
    src = torch.randn(3, 1 << 18, device="cuda")
    ref = _share(src, pid, device)
    conn.send(_enc.encode(ref))
    assert conn.poll(60)
    got, mapped, _ = conn.recv()
    assert got == _expected(src) and mapped == 1
    assert device.in_use() > 0
    os.kill(pid, signal.SIGKILL)
    proc.join(30)
    reclaimed = host.reclaim([pid])
    assert reclaimed.refs_dropped >= 1
    assert device.in_use() == 0  # its ticket is gone: the block is free again


def test_a_hop_inside_one_process_opens_no_handle(pools) -> None:
    host, device = pools
    src = torch.randn(1000, device="cuda")
    ref = _share(src, os.getpid(), device)
    view = T.materialize(ref, [])
    assert torch.equal(view, src)
    assert T._attached.opener.mapped() == 0  # resolved to this process's own chunk
    T.release(ref)
    assert device.in_use() == 0
