"""Tensor hand-off between real processes through each ref kind, bit-exact."""

from __future__ import annotations

import os
import tempfile
import uuid

import msgspec
import pytest
import torch
import zmq

from omniflow.memory import PagePool, unlink_pool
from omniflow.memory.pool import received
from omniflow.messages import Call, CudaIpc, Emit, Frame, Hello, Shm, Shutdown
from omniflow.transport import tensors as T
from omniflow.transport.tensors import Link, TensorError
from tests.memory.handoff_workers import receive
from tests.memory.pool_workers import SPAWN

_encoder = msgspec.msgpack.Encoder()
_hello = msgspec.msgpack.Decoder(Hello)
_emit = msgspec.msgpack.Decoder(Emit)


def _cuda() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads and all) so only a bit-exact copy compares equal."""
    g = torch.Generator().manual_seed(seed)
    n = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


class Receiver:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.path = os.path.join(tempfile.gettempdir(), f"omniflow-test-{uuid.uuid4().hex}.sock")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.bind(f"ipc://{self.path}")
        self.proc = SPAWN.Process(
            target=receive, args=(pool.name, f"ipc://{self.path}"), daemon=True
        )
        self.proc.start()
        assert self.sock.poll(60_000), "receiver did not start"
        self.pid = _hello.decode(self.sock.recv()).pid

    def send(self, tensors: dict[str, object], link: Link) -> tuple[dict, dict, dict]:
        frames: list[object] = [b""]
        refs = {name: T.export(t, frames, link) for name, t in tensors.items()}
        frames[0] = _encoder.encode(
            Call(request_id="r", role="receiver", reply_to="", tensors=refs)
        )
        self.sock.send_multipart(frames, copy=False)
        assert self.sock.poll(30_000), "receiver did not answer"
        parts = self.sock.recv_multipart(copy=False)
        reply = _emit.decode(parts[0].buffer)
        back = {name: T.materialize(ref, parts) for name, ref in reply.tensors.items()}
        return refs, reply.data["report"], back

    def close(self) -> None:
        self.sock.send(_encoder.encode(Shutdown()))
        self.proc.join(10)
        self.sock.close()
        self.ctx.term()
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture(scope="module")
def pool():
    name = f"omniflow-test-tensors-{os.getpid()}"
    unlink_pool(name)
    p = PagePool.create(name, 32 << 20, page_size=64 << 10)
    T.attach_pool(p, frame_threshold=0)
    yield p
    T.detach_pool()
    p.unlink()
    p.close()
    assert not os.path.exists(p.path)


@pytest.fixture(scope="module")
def receiver(pool: PagePool):
    r = Receiver(pool)
    yield r
    r.close()


def _cases() -> dict[str, torch.Tensor]:
    base = _random((64, 48), torch.float32, seed=5)
    return {
        "bf16": _random((3, 17, 5), torch.bfloat16, 1),
        "f16": _random((1000,), torch.float16, 2),
        "f32": _random((128, 257), torch.float32, 3),
        "i64": _random((9, 9), torch.int64, 4),
        "bool": _random((33,), torch.bool, 6),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "empty": torch.empty((0, 7), dtype=torch.float32),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "scalar_bf16": _random((), torch.bfloat16, 7),
        "from_numpy": _random((40,), torch.int64, 8).numpy(),
    }


@pytest.mark.parametrize("kind", ["frame", "shm"])
def test_handoff_is_bit_exact(pool: PagePool, receiver: Receiver, kind: str) -> None:
    cases = _cases()
    link = Link(same_host=True, pid=receiver.pid) if kind == "shm" else Link()
    refs, report, back = receiver.send(cases, link)
    expect = Shm if kind == "shm" else Frame
    for name, t in cases.items():
        t = torch.as_tensor(t)
        assert isinstance(refs[name], expect), name
        assert "error" not in report[name], report[name]
        assert report[name]["in_pool"] is (kind == "shm"), name
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert _bits(back[name]) == _bits(t), name
    assert pool.stats().used_pages == 0  # the receiver acked every copied-in block


def test_tensor_already_in_the_pool_travels_without_a_copy(pool: PagePool, receiver) -> None:
    t, lease = pool.empty((512, 512), torch.bfloat16)
    t.copy_(_random((512, 512), torch.bfloat16, 9))
    refs, report, back = receiver.send({"x": t}, Link(same_host=True, pid=receiver.pid))
    ref = refs["x"]
    assert ref.offset == t.data_ptr() - pool.base  # the handle names the producer's own bytes
    assert report["x"]["address"] == ref.offset  # ...and the receiver viewed them in place
    assert _bits(back["x"]) == _bits(t)
    assert pool.refs(lease.id) == 1  # the receiver released its ref; ours remains
    lease.release()
    assert pool.stats().used_pages == 0


def test_small_tensors_ride_as_frames_even_on_one_host(pool: PagePool) -> None:
    T.attach_pool(pool, frame_threshold=64 << 10)
    try:
        frames: list[object] = [b""]
        link = Link(same_host=True, pid=os.getpid())
        small = T.export(torch.zeros(100), frames, link)
        big = T.export(torch.zeros(64 << 10), frames, link)
        assert isinstance(small, Frame) and isinstance(big, Shm)
        assert isinstance(T.export(torch.zeros(64 << 10), frames, Link()), Frame)
        T.release(big)
    finally:
        T.attach_pool(pool, frame_threshold=0)
    assert pool.stats().used_pages == 0


def test_forged_and_stale_refs_are_rejected_by_the_receiver(pool: PagePool, receiver) -> None:
    t, lease = pool.empty((16,), torch.float32)
    good = pool.share(t, 0)
    stale = Shm(good.offset, good.nbytes, "float32", (16,), good.lease, pool.name)
    pool.release(good.lease, 0)
    lease.release()
    forged = {
        "outside": Shm(pool.size + 4096, 64, "float32", (16,), good.lease, pool.name),
        "mismatch": Shm(good.offset, 64, "float32", (4, 5), good.lease, pool.name),
        "stale": stale,
        "other_pool": Shm(good.offset, 64, "float32", (16,), good.lease, "elsewhere"),
    }
    frames = [_encoder.encode(Call(request_id="f", role="receiver", reply_to="", tensors=forged))]
    receiver.sock.send_multipart(frames)
    assert receiver.sock.poll(30_000)
    report = _emit.decode(receiver.sock.recv_multipart()[0]).data["report"]
    assert "outside pool" in report["outside"]["error"]
    assert "does not match dtype" in report["mismatch"]["error"]
    assert "not live" in report["stale"]["error"]
    assert "names pool 'elsewhere'" in report["other_pool"]["error"]
    assert all(r["error"].startswith("rejected Shm ref") for r in report.values())


def test_an_unopened_ref_released_leaves_the_opened_count_exact(pool: PagePool) -> None:
    """Two messages name one block for this process; the first is opened, the second is
    dropped unread. Its release must not count as closing the opened one: else a forged
    copy of the opened ref would pass the receiver's check and could free it early."""
    t, lease = pool.empty((16,), torch.float32)
    me = os.getpid()
    first, second = pool.share(t, received(me)), pool.share(t, received(me))
    lease.release()  # as export does: the block lives on the receiver's refs alone
    view = T.materialize(first, [b""])
    assert T.opened_refs(first.lease) == 1
    T.release(second, opened=False)  # the dropped message
    assert T.opened_refs(first.lease) == 1
    assert pool.holders(first.lease)[received(me)] == 1
    forged = Shm(first.offset, first.nbytes, first.dtype, first.shape, first.lease, first.pool)
    with pytest.raises(TensorError, match="rejected Shm ref"):
        T.materialize(forged, [b""])
    assert T.opened_refs(first.lease) == 1
    del view
    T.release(first)
    assert T.opened_refs(first.lease) == 0
    assert pool.stats().used_pages == 0


def test_a_message_with_a_refused_ref_counts_none_opened(pool: PagePool) -> None:
    t, lease = pool.empty((16,), torch.float32)
    good = pool.share(t, received(os.getpid()))
    bad = Shm(pool.size + 4096, 64, "float32", (16,), good.lease, pool.name)
    with pytest.raises(TensorError, match="outside pool"):
        T.materialize_all({"good": good, "bad": bad}, [b""])
    assert T.opened_refs(good.lease) == 0  # the caller releases the message as unopened
    T.release(good, opened=False)
    assert T.opened_refs(good.lease) == 0
    lease.release()
    assert pool.stats().used_pages == 0


def test_shm_ref_without_a_pool_is_a_clear_error(pool: PagePool) -> None:
    T.detach_pool()
    try:
        with pytest.raises(TensorError, match="no page pool attached"):
            T.materialize(Shm(pool.data_offset, 4, "float32", (), 1 << 24, pool.name), [b""])
    finally:
        T.attach_pool(pool, frame_threshold=0)


def test_frame_refs_are_checked_too() -> None:
    with pytest.raises(TensorError, match="holds 3 bytes"):
        T.materialize(Frame(index=1, dtype="float32", shape=(1,)), [b"", b"abc"])
    with pytest.raises(TensorError, match="unknown dtype"):
        T.materialize(Frame(index=1, dtype="complex64", shape=(1,)), [b"", b"abcdefgh"])
    with pytest.raises(TensorError, match="outside the message"):
        T.materialize(Frame(index=3, dtype="float32", shape=(1,)), [b""])


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA and cupy")
def test_cuda_ipc_handoff_is_bit_exact_and_acknowledged(pool: PagePool, receiver) -> None:
    from omniflow.memory.cuda_ipc import DevicePool

    device_pool = DevicePool(pool, device=0, size=64 << 20)
    T.attach_device_pool(device_pool)
    try:
        cases = {k: torch.as_tensor(v).cuda() for k, v in _cases().items()}
        link = Link(same_host=True, gpus=(device_pool.bus_id,), pid=receiver.pid)
        refs, report, back = receiver.send(cases, link)
        for name, t in cases.items():
            assert isinstance(refs[name], CudaIpc), name
            assert "error" not in report[name], report[name]
            assert _bits(back[name]) == _bits(t), name
        assert all(pool.refs(r.lease) == 0 for r in refs.values())  # every reader acked
        assert device_pool.collect() > 0 and not device_pool._blocks
    finally:
        T.detach_pool()
        T.attach_pool(pool, frame_threshold=0)
        device_pool.close()
