"""The page pool across real processes (spawned): refs, reclaim after kill -9, cleanup."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from omniflow.memory import PagePool, StaleLease, unlink_pool
from tests.memory.pool_workers import (
    SPAWN,
    Worker,
    create_and_hold,
    digest,
    start_workers,
    stop_workers,
)


@pytest.fixture(scope="module")
def shared_pool():
    name = f"omniflow-test-procs-{os.getpid()}"
    unlink_pool(name)
    pool = PagePool.create(name, 16 << 20, page_size=64 << 10)
    yield pool
    pool.unlink()
    pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.fixture(scope="module")
def readers(shared_pool: PagePool):
    workers = start_workers(shared_pool.name, 3)
    yield workers
    stop_workers(workers)


def _leftovers(name: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(name)]


def test_block_handed_to_three_readers_is_freed_after_all_released(shared_pool, readers) -> None:
    pool = shared_pool
    t, lease = pool.empty((256, 33), torch.bfloat16)
    t.copy_(torch.randn(256, 33))
    refs = [pool.share(t, w.pid) for w in readers]
    for w, ref in zip(readers, refs, strict=True):
        assert w.call("open", ref) == (digest(t), True)  # same bytes, viewed in the pool
    assert pool.refs(lease.id) == 4
    lease.release()
    for i, (w, ref) in enumerate(zip(readers, refs, strict=True)):
        freed = w.call("release", ref.lease)
        assert freed is (i == 2)
        assert pool.refs(lease.id) == 2 - i
    with pytest.raises(StaleLease):
        pool.open(refs[0])
    assert pool.stats().used_pages == 0


def test_block_made_by_a_worker_is_read_by_the_parent(shared_pool, readers) -> None:
    ref = readers[0].call("fill", os.getpid())
    view = shared_pool.open(ref)
    assert torch.equal(view, torch.arange(1000, dtype=torch.float32))
    assert shared_pool.release(ref.lease) is True


def test_exhaustion_seen_from_another_process_is_quick(shared_pool, readers) -> None:
    pool = shared_pool
    held = pool.alloc((pool.pages - 1) * pool.page_size)
    try:
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match="PoolExhausted: .*no run of 2 free pages"):
            readers[1].call("alloc", 2 * pool.page_size, timeout=5)
        assert time.perf_counter() - start < 2.0
    finally:
        held.release()


def test_concurrent_allocation_never_hands_out_a_page_twice(shared_pool, readers) -> None:
    for i, w in enumerate(readers):
        w.conn.send(("stress", (300, i)))
    for w in readers:
        assert w.conn.poll(60)
        status, value = w.conn.recv()
        assert status == "ok", value
        assert value > 0
    assert shared_pool.stats().used_pages == 0


def test_refs_of_a_reader_killed_with_sigkill_are_reclaimed(shared_pool) -> None:
    pool = shared_pool
    [w] = start_workers(pool.name, 1)
    t, lease = pool.empty((1 << 16,), torch.float32)
    ref = pool.share(t, w.pid)
    own = w.call("alloc", 3 * pool.page_size)[0]  # a block only the worker holds
    w.call("open", ref)
    lease.release()
    assert pool.holders(ref.lease) == {w.pid: 1}
    os.kill(w.pid, signal.SIGKILL)
    w.proc.join(10)
    got = pool.scan()
    assert w.pid in got.dead_pids and got.leases_freed == 2
    assert pool.refs(ref.lease) == 0 and pool.refs(own) == 0
    assert pool.stats().used_pages == 0


def test_sigkill_of_workers_and_creator_then_cleanup_leaves_nothing(pool_name: str) -> None:
    conn, child = SPAWN.Pipe()
    creator = SPAWN.Process(target=create_and_hold, args=(pool_name, child), daemon=True)
    creator.start()
    assert conn.poll(60)
    _, (creator_pid, _) = conn.recv()
    worker = Worker(pool_name).ready()
    worker.call("alloc", 1 << 20)
    for proc in (worker.proc, creator):
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert _leftovers(pool_name) == [pool_name]
    # The supervisor's cleanup: reclaim through a fresh mapping, then unlink by name.
    pool = PagePool.attach(pool_name)
    assert pool.reclaim([creator_pid, worker.pid]).leases_freed == 2
    pool.close()
    assert unlink_pool(pool_name) is True
    assert _leftovers(pool_name) == []


def _alloc_in_forked_child(pool: PagePool, conn) -> None:
    lease = pool.alloc(pool.page_size)  # the child reopens the segment for its own flock
    conn.send((lease.id, os.getpid()))


def test_a_forked_child_locks_on_its_own(shared_pool: PagePool) -> None:
    conn, child_conn = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(
        target=_alloc_in_forked_child, args=(shared_pool, child_conn)
    )
    proc.start()
    assert conn.poll(30)
    lease, pid = conn.recv()
    proc.join(10)
    assert shared_pool.holders(lease) == {pid: 1}
    assert shared_pool.reclaim([pid]).leases_freed == 1
