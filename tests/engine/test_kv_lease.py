"""Read-only KV leases to another process: full pages by reference, the tail copied."""

import multiprocessing as mp
import os
import signal
import time
import uuid

import msgspec
import pytest
import torch
from conftest import random_prompts

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.llm_engine import EngineConfig
from omniflow.kv.share import revoke
from omniflow.memory import PagePool
from tests.engine.lease_borrower import serve

SPAWN = mp.get_context("spawn")
PAGE = 4


@pytest.fixture
def pool():
    pool = PagePool.create(f"omniflow-lease-{uuid.uuid4().hex[:8]}", 256 << 12, 4096)
    yield pool
    pool.unlink()
    pool.close()


@pytest.fixture
def borrower(pool):
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(target=serve, args=(pool.name, child), daemon=True)
    process.start()
    pid = parent.recv()
    yield parent, pid, process
    if process.is_alive():
        parent.send(("exit", 0, None))
        process.join(10)


def engine_in(pool, path, num_pages=12):
    config = EngineConfig(device="cpu", page_size=PAGE, num_pages=num_pages, share_kv=True)
    return LLMEngine(path, config, kv_pool=pool)


def lend(engine, request_id, prompt, borrower_pid, max_tokens=6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, params, lend_kv_to=borrower_pid)
    deltas = engine.run_to_completion()
    [last] = [d for d in deltas if d.finish_reason is not None]
    return last.kv_lease, [t for d in deltas for t in d.token_ids]


def lender_view(engine, lease):
    """The lender's own reading of the leased tokens, at lease time."""
    size = engine.cache.page_size
    pages = torch.tensor(lease.page_ids)
    out = []
    for layer in range(engine.cache.keys.shape[0]):
        pair = []
        for table in (engine.cache.keys, engine.cache.values):
            full = table[layer].index_select(1, pages)
            heads, _, _, dim = full.shape
            pair.append(full.reshape(heads, -1, dim).clone())
        out.append(pair)
    return out, size


def test_borrower_reads_the_kv_bit_exact_and_pages_stay_locked(tiny_models, pool, borrower):
    conn, pid, _ = borrower
    engine = engine_in(pool, tiny_models["llama-gqa"])
    [prompt] = random_prompts((18,), seed=51)
    lease, reply = lend(engine, "a", prompt, pid)
    # 18 prompt + 5 computed reply tokens (the last sampled one never ran): 5 pages + 3 rows.
    assert lease.num_tokens == 23 and len(lease.page_ids) == 5
    full, _ = lender_view(engine, lease)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(lease))  # as it rides in a message
    conn.send(("open", 1, wire))
    assert conn.recv() == 23
    conn.send(("read", 1, None))
    first = conn.recv()
    for layer, (keys, values) in enumerate(first):
        assert keys.shape[1] == 23
        assert torch.equal(keys[:, :20], full[layer][0]) and torch.equal(
            values[:, :20], full[layer][1]
        )
    # The same 23 tokens prefilled afresh give the same K/V (up to the kernels' rounding).
    fresh = LLMEngine(tiny_models["llama-gqa"], EngineConfig(device="cpu", page_size=32))
    fresh.add_request("f", prompt + reply[:5], SamplingParams(max_tokens=1))
    fresh.run_to_completion()
    for layer, (keys, values) in enumerate(first):
        torch.testing.assert_close(keys, fresh.cache.keys[layer, :, 0, :23])
        torch.testing.assert_close(values, fresh.cache.values[layer, :, 0, :23])
    # Pressure: other requests take every free page, overwriting the lender's old tail page.
    for index, other in enumerate(random_prompts((20, 20, 20), seed=52)):
        engine.add_request(f"other{index}", other, SamplingParams(temperature=0.0, max_tokens=4))
        engine.run_to_completion()
    assert all(engine.allocator.ref_counts[p] >= 1 for p in lease.page_ids)
    conn.send(("read", 1, None))
    again = conn.recv()
    for (k1, v1), (k2, v2) in zip(first, again, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)  # full pages and the COW tail
    conn.send(("close", 1, None))
    conn.recv()
    engine.step()  # reaps the lease
    usage = engine.allocator.usage()
    assert usage.free_pages == usage.total_pages
    assert pool.stats().live_leases == 2  # only the engine's K and V tensors


def test_a_dead_borrower_releases_its_lease_when_reclaimed(tiny_models, pool, borrower):
    conn, pid, process = borrower
    engine = engine_in(pool, tiny_models["llama-mha"])
    [prompt] = random_prompts((13,), seed=53)
    lease, _ = lend(engine, "a", prompt, pid)
    conn.send(("open", 1, lease))
    conn.recv()
    engine.step()
    assert engine.allocator.usage().free_pages < engine.allocator.usage().total_pages
    os.kill(pid, signal.SIGKILL)
    process.join(10)
    pool.reclaim([pid])  # what the supervisor does for a dead child
    engine.step()
    usage = engine.allocator.usage()
    assert usage.free_pages == usage.total_pages
    assert pool.stats().live_leases == 2


def test_lending_needs_the_kv_in_a_pool(tiny_models):
    engine = LLMEngine(tiny_models["llama-mha"], EngineConfig(device="cpu", num_pages=8))
    with pytest.raises(NotImplementedError, match="lend_kv_to needs the engine's KV in a host"):
        engine.add_request("a", [5, 6, 7], lend_kv_to=os.getpid())


def reap_until_free(engine, seconds=10.0):
    """Engine steps (each reaps the lease book) until every lent page is back."""
    until = time.monotonic() + seconds
    while engine.leases.open and time.monotonic() < until:
        engine.step()
        time.sleep(0.02)
    usage = engine.allocator.usage()
    return usage.free_pages == usage.total_pages


def test_an_unclaimed_lease_is_revoked_while_the_borrower_lives(tiny_models, pool, borrower):
    """The lease message is lost: the borrower lives on and never claims it. The lender takes
    it back after the bound; the pool is then empty though the borrower process still runs."""
    conn, pid, process = borrower
    config = EngineConfig(
        device="cpu", page_size=PAGE, num_pages=12, share_kv=True, lease_claim_s=0.3
    )
    engine = LLMEngine(tiny_models["llama-gqa"], config, kv_pool=pool)
    [prompt] = random_prompts((18,), seed=54)
    lease, _ = lend(engine, "lost", prompt, pid)
    assert engine.allocator.usage().free_pages < engine.allocator.usage().total_pages
    assert pool.holders(lease.tail.lease).get(pid) == 1  # the borrower's ref, unclaimed
    assert reap_until_free(engine)
    assert engine.leases.revoked == 1
    assert pid not in pool.holders(lease.keys.lease)  # its refs dropped by the lender
    conn.send(("open", 1, lease))  # the lost message turns up after all: too late
    assert "revoked by its lender" in conn.recv()
    engine.close()
    assert process.is_alive()
    stats = pool.stats()
    assert (stats.used_pages, stats.live_leases) == (0, 0)


def test_a_claimed_lease_is_not_revoked_after_the_bound(tiny_models, pool, borrower):
    conn, pid, _ = borrower
    config = EngineConfig(
        device="cpu", page_size=PAGE, num_pages=12, share_kv=True, lease_claim_s=0.2
    )
    engine = LLMEngine(tiny_models["llama-mha"], config, kv_pool=pool)
    [prompt] = random_prompts((13,), seed=55)
    lease, _ = lend(engine, "kept", prompt, pid)
    conn.send(("open", 1, lease))
    assert conn.recv() == lease.num_tokens
    assert not revoke(pool, lease, pid)  # claimed: the lender cannot take it back
    time.sleep(0.3)
    engine.step()
    assert engine.leases.revoked == 0 and len(engine.leases.open) == 1
    conn.send(("read", 1, None))
    assert conn.recv()[0][0].shape[1] == lease.num_tokens
    conn.send(("close", 1, None))
    conn.recv()
    assert reap_until_free(engine)
    engine.close()
    assert pool.stats().live_leases == 0


def test_a_lease_revoked_at_once_cannot_be_claimed(tiny_models, pool, borrower):
    """The lender learns the lease will never arrive (its send failed): revoke() takes it
    back before the bound, and a claim racing it loses cleanly."""
    conn, pid, _ = borrower
    engine = engine_in(pool, tiny_models["llama-mha"])
    [prompt] = random_prompts((9,), seed=56)
    lease, _ = lend(engine, "failed", prompt, pid)
    assert revoke(pool, lease, pid)
    assert not revoke(pool, lease, pid)  # once
    conn.send(("open", 1, lease))
    assert "revoked by its lender" in conn.recv()
    engine.step()
    usage = engine.allocator.usage()
    assert usage.free_pages == usage.total_pages and engine.leases.revoked == 0


def test_an_unclaimed_lease_of_a_dead_borrower_is_reaped_past_the_bound(
    tiny_models, pool, borrower
):
    """The borrower dies before claiming and is reclaimed; the bound passes before the
    lender's next reap: the revocation finds no ref of it to drop, and the pages go back."""
    _, pid, process = borrower
    config = EngineConfig(
        device="cpu", page_size=PAGE, num_pages=12, share_kv=True, lease_claim_s=0.2
    )
    engine = LLMEngine(tiny_models["llama-mha"], config, kv_pool=pool)
    [prompt] = random_prompts((11,), seed=57)
    lend(engine, "orphan", prompt, pid)
    os.kill(pid, signal.SIGKILL)
    process.join(10)
    pool.reclaim([pid])
    time.sleep(0.3)
    assert reap_until_free(engine)
    engine.close()
    stats = pool.stats()
    assert (stats.used_pages, stats.live_leases) == (0, 0)
