"""Read-only KV leases to another process: full pages by reference, the tail copied."""

import multiprocessing as mp
import os
import signal
import uuid

import msgspec
import pytest
import torch
from conftest import random_prompts

from omniflow.cache import PagePool
from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.llm_engine import EngineConfig
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
