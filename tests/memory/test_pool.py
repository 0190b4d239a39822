"""The page pool within one process: allocation, leases, handle checks, cleanup."""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch

from omniflow.memory import InvalidHandle, PagePool, PoolError, PoolExhausted, StaleLease
from omniflow.messages import Shm


def test_segment_is_owner_only_and_unlink_leaves_nothing(pool_name: str) -> None:
    p = PagePool.create(pool_name, 1 << 20, page_size=64 << 10)
    assert stat.S_IMODE(os.stat(p.path).st_mode) == 0o600
    assert p.path == f"/dev/shm/{pool_name}"
    p.unlink()
    p.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(pool_name)]


def test_create_refuses_an_existing_name_and_attach_a_missing_one(pool: PagePool) -> None:
    with pytest.raises(PoolError, match="already exists"):
        PagePool.create(pool.name, 1 << 20)
    with pytest.raises(PoolError, match="no segment"):
        PagePool.attach(pool.name + "-missing")
    with pytest.raises(ValueError, match="pool name"):
        PagePool.create("../etc/passwd", 1 << 20)


def test_multi_page_blocks_are_contiguous_and_freed_on_last_release(pool: PagePool) -> None:
    a = pool.alloc(3 * pool.page_size + 1)  # 4 pages
    b = pool.alloc(10)
    assert b.offset == a.offset + 4 * pool.page_size
    assert pool.stats().used_pages == 5
    t = pool.block_bytes(a.id)
    assert t.numel() == 4 * pool.page_size
    a.release()
    assert pool.stats().used_pages == 1
    c = pool.alloc(2 * pool.page_size)  # first fit reuses the freed run
    assert c.offset == a.offset
    b.release()
    c.release()
    assert pool.stats().used_pages == 0 and pool.stats().live_leases == 0


def test_refs_are_counted_per_pid(pool: PagePool) -> None:
    t, lease = pool.empty((4, 4), torch.float32)
    refs = [pool.share(t, pid) for pid in (101, 102, 103)]
    assert pool.holders(lease.id) == {os.getpid(): 1, 101: 1, 102: 1, 103: 1}
    lease.release()
    for pid, expect in ((101, 2), (102, 1)):
        pool.release(refs[0].lease, pid)
        assert pool.refs(lease.id) == expect
    with pytest.raises(PoolError, match="holds no ref"):
        pool.release(lease.id, 999)
    assert pool.release(lease.id, 103) is True
    assert pool.refs(lease.id) == 0


def test_reclaim_drops_only_the_dead_pids_refs(pool: PagePool) -> None:
    t, lease = pool.empty((10,), torch.int64)
    pool.share(t, 201)
    pool.share(t, 202)
    got = pool.reclaim([201])
    assert (got.refs_dropped, got.leases_freed) == (1, 0)
    assert pool.holders(lease.id) == {os.getpid(): 1, 202: 1}
    got = pool.reclaim([os.getpid(), 202])
    assert (got.refs_dropped, got.leases_freed) == (2, 1)
    assert pool.stats().used_pages == 0


def test_exhaustion_is_a_quick_clear_error(pool: PagePool) -> None:
    held = pool.alloc(pool.pages * pool.page_size - pool.page_size)
    start = time.perf_counter()
    with pytest.raises(PoolExhausted, match="no run of 2 free pages") as info:
        pool.alloc(2 * pool.page_size)
    assert time.perf_counter() - start < 1.0  # refused at once, not after a wait
    assert pool.name in str(info.value) and isinstance(info.value, MemoryError)
    held.release()
    pool.alloc(2 * pool.page_size).release()


def test_empty_and_scalar_tensors_get_a_block(pool: PagePool) -> None:
    for shape in ((), (0,), (3, 0, 2)):
        t, lease = pool.empty(shape, torch.bfloat16)
        ref = pool.share(t, 0)
        assert pool.open(ref).shape == torch.Size(shape)
        pool.release(ref.lease, 0)
        lease.release()


def test_open_is_a_zero_copy_view(pool: PagePool) -> None:
    t, lease = pool.empty((8, 3), torch.float16)
    t.copy_(torch.randn(8, 3))
    ref = pool.share(t, 0)
    view = pool.open(ref)
    assert view.data_ptr() == t.data_ptr() and torch.equal(view, t)
    t[0, 0] = 7.0
    assert view[0, 0] == 7.0


def test_share_refuses_what_is_not_a_pool_block_and_try_share_says_none(
    pool: PagePool,
) -> None:
    outside = torch.zeros(64, dtype=torch.uint8)
    t, lease = pool.empty((4, 4), torch.float32)
    strided = t.t()  # in the pool, not contiguous
    for tensor, message in ((outside, "not in this pool"), (strided, "contiguous")):
        assert pool.try_share(tensor, 0) is None
        with pytest.raises(ValueError, match=message):
            pool.share(tensor, 0)
    ref = pool.try_share(t[1], 0)  # a contiguous row inside the block: no copy
    assert ref is not None and ref.lease == lease.id and ref.nbytes == 16
    assert pool.open(ref).data_ptr() == t[1].data_ptr()
    pool.release(ref.lease, 0)
    lease.release()


def test_open_counts_only_the_refs_held_for_that_holder(pool: PagePool) -> None:
    t, lease = pool.empty((16,), torch.float32)
    ref = pool.share(t, 4242)  # one ref, held for holder 4242
    assert pool.open(ref, holder=4242).data_ptr() == t.data_ptr()
    with pytest.raises(InvalidHandle, match="holds no ref for pid 4242"):
        pool.open(ref, holder=4242, claimed=1)  # that one ref is already opened
    with pytest.raises(InvalidHandle, match="holds no ref for pid 4343"):
        pool.open(ref, holder=4343)
    pool.retain(ref.lease, 0, 2)  # anonymous refs count for holder 0 only
    assert pool.open(ref, holder=0, claimed=1).shape == (16,)
    with pytest.raises(InvalidHandle, match="holds no ref for pid 0"):
        pool.open(ref, holder=0, claimed=2)
    pool.release(ref.lease, 0, 2)
    pool.release(ref.lease, 4242)
    lease.release()


def _good_ref(pool: PagePool) -> tuple[Shm, object]:
    t, lease = pool.empty((16,), torch.float32)
    return pool.share(t, 0), lease


@pytest.mark.parametrize(
    "change, message",
    [
        ({"offset": 1 << 40}, "outside pool"),
        ({"offset": -4}, "outside pool"),
        ({"offset": 4}, "outside pool"),  # the header is no tensor's memory
        ({"offset": 2}, "not aligned"),
        ({"nbytes": 128}, "does not match dtype"),
        ({"shape": (17,)}, "does not match dtype"),
        ({"dtype": "complex32"}, "unknown dtype"),
        ({"shape": (-16,)}, "non-negative"),
        ({"lease": 12345}, "not live"),
        ({"lease": -1}, "not live"),
        ({"pool": "someone-else"}, "names pool"),
    ],
)
def test_forged_handles_are_rejected(pool: PagePool, change: dict, message: str) -> None:
    ref, _ = _good_ref(pool)
    fields = {f: getattr(ref, f) for f in ref.__struct_fields__} | change
    with pytest.raises(InvalidHandle, match=message):
        pool.open(Shm(**fields))


def test_handle_past_its_block_is_rejected(pool: PagePool) -> None:
    ref, _ = _good_ref(pool)  # a one-page block
    other, _ = _good_ref(pool)  # the next page, a different lease
    forged = Shm(other.offset, 64, "float32", (16,), ref.lease, pool.name)
    with pytest.raises(InvalidHandle, match="not inside lease"):
        pool.open(forged)


def test_stale_handle_after_free_and_reuse_is_rejected(pool: PagePool) -> None:
    ref, lease = _good_ref(pool)
    pool.release(ref.lease, 0)
    lease.release()
    with pytest.raises(StaleLease):
        pool.open(ref)
    again, _ = _good_ref(pool)  # same slot and offset, new generation
    assert again.offset == ref.offset and again.lease != ref.lease
    with pytest.raises(StaleLease):
        pool.open(ref)


def test_attach_sees_the_creators_blocks(pool: PagePool) -> None:
    t, lease = pool.empty((5,), torch.int64)
    t.copy_(torch.arange(5))
    ref = pool.share(t, 0)
    other = PagePool.attach(pool.name)
    try:
        assert other.base != pool.base  # a second mapping of the same pages
        assert other.open(ref).tolist() == [0, 1, 2, 3, 4]
    finally:
        other.close()
