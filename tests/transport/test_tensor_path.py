"""A tensor made in a first stage passes through a chain of stages by handle: bit-exact,
never copied by a stage that only passes it on, and every pool block back at the end."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch

import omniflow
from omniflow.memory import PagePool, unlink_pool
from omniflow.messages import Frame, Shm
from omniflow.roles.echo import fill_pattern
from omniflow.runtime.config import parse
from omniflow.transport.links import Link, client_link, pool_client_address
from omniflow.transport.tensors import attach_pool, detach_pool, export, materialize_owned

MIB = 1 << 20


def chain(stages: int, middle: str = "omniflow.roles.echo:Noop"):
    names = [f"s{i}" for i in range(stages)]
    roles = {n: {"actor": middle} for n in names}
    roles["s0"] = {"actor": "omniflow.roles.echo:MakeTensor"}
    edges = [{"from": "input", "to": "s0"}]
    edges += [{"from": a, "to": b} for a, b in zip(names, names[1:], strict=False)]
    return parse(
        {
            "name": f"chain{stages}",
            "roles": roles,
            "graph": {"edges": edges},
            "cache": {"host_pool": "64MiB"},
        }
    )


def expected(n: int, seed: int) -> torch.Tensor:
    return fill_pattern(torch.empty(n, dtype=torch.uint8), seed)


def test_a_tensor_through_five_stages_is_bit_exact_and_its_blocks_come_back(run_root):
    async def main():
        async with omniflow.Runtime(chain(5)) as rt:
            pool = rt.supervisor.pool

            async def one(seed: int) -> tuple[int, bool, bool]:
                outs, _ = await rt.call({"tensor_bytes": MIB + 3, "seed": seed}, timeout=30)
                t = outs[-1].tensors["tensor"]
                return seed, torch.equal(t, expected(MIB + 3, seed)), pool.contains(t)

            results = await asyncio.gather(*(one(seed) for seed in range(24)))
            gc.collect()
            used_after = pool.stats()
            kept, _ = await rt.call({"tensor_bytes": MIB, "seed": 99}, timeout=30)
            held = pool.stats()
            del kept
            gc.collect()
            return results, used_after, held, pool.stats()

    results, used_after, held, released = asyncio.run(main())
    for seed, equal, in_pool in results:
        assert equal, f"seed {seed}: bytes changed on the way"
        assert in_pool  # the client got a view of the pool: no frame, no copy
    assert (used_after.used_pages, used_after.live_leases) == (0, 0)
    assert held.live_leases == 1 and held.used_pages == 16  # a kept output holds its block
    assert (released.used_pages, released.live_leases) == (0, 0)


def test_stages_that_pass_a_tensor_on_never_copy_it(run_root):
    async def main():
        cfg = chain(4, "tests.graph_roles:WhereIsTensor")
        async with omniflow.Runtime(cfg) as rt:
            outs, _ = await rt.call({"tensor_bytes": MIB, "seed": 1, "offsets": []}, timeout=30)
            t = outs[-1].tensors["tensor"]
            pool = rt.supervisor.pool
            mine = t.untyped_storage().data_ptr() - pool.base
            return outs[-1].data["offsets"], mine, torch.equal(t, expected(MIB, 1))

    offsets, mine, equal = asyncio.run(main())
    assert len(offsets) == 3 and len(set(offsets)) == 1  # one block, seen by every stage
    assert mine == offsets[0] and equal


def test_client_link_reads_only_a_pool_clients_address():
    address = pool_client_address("/tmp/of-x/run", 4242, 7)
    assert client_link(address) == Link(same_host=True, pid=4242)
    assert client_link("ipc:///tmp/of-x/run/client-4242-7.sock") == Link()
    assert client_link("tcp://10.0.0.1:5555") == Link()
    assert client_link("ipc:///tmp/x/client-abc-7-pool.sock") == Link()


@pytest.fixture
def pool():
    name = "of-test-owned"
    unlink_pool(name)
    p = PagePool.create(name, 8 * MIB, populate=False)
    attach_pool(p, frame_threshold=0)
    yield p
    detach_pool()
    p.unlink()
    p.close()


def test_owned_outputs_release_their_ref_when_the_last_view_goes(pool):
    src = torch.arange(1000, dtype=torch.bfloat16).reshape(10, 100)
    frames: list = [b""]
    ref = export(src, frames, Link(same_host=True, pid=os.getpid()))
    assert isinstance(ref, Shm)
    got = materialize_owned({"x": ref}, frames)["x"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, src)
    row = got[3]  # a view keeps the storage, and so the ref
    del got
    gc.collect()
    assert pool.stats().live_leases == 1
    assert torch.equal(row, src[3])
    del row
    gc.collect()
    assert pool.stats().live_leases == 0


def test_owned_frames_stay_frames(pool):
    frames: list = [b""]
    ref = export(torch.ones(4), frames, Link())
    assert isinstance(ref, Frame)
    got = materialize_owned({"x": ref}, frames)["x"]
    assert torch.equal(got, torch.ones(4)) and pool.stats().live_leases == 0


def test_two_runtimes_in_one_process_keep_to_their_own_pools(run_root):
    check = parse(
        {
            "name": "checkonly",
            "roles": {"check": {"actor": "tests.graph_roles:CheckTensor"}},
            "graph": {"edges": [{"from": "input", "to": "check"}]},
            "cache": {"host_pool": "64MiB"},
        }
    )
    x = torch.rand(1 << 18)

    async def main():
        async with omniflow.Runtime(chain(2)) as first, omniflow.Runtime(check) as second:
            # the first client maps its pool: the second's input must not name it
            outs, _ = await second.call({"x": x}, timeout=30)
            made, _ = await first.call({"tensor_bytes": MIB, "seed": 3}, timeout=30)
            return outs[0].data, torch.equal(made[-1].tensors["tensor"], expected(MIB, 3))

    data, equal = asyncio.run(main())
    assert data["sum"] == float(x.double().sum()) and equal
