"""The SSD tier: bit-exact spill/restore, checksums, slot runs, async without blocking."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from omniflow.memory import SsdCorruption, SsdError, SsdStore

PAGE = 64 << 10


@pytest.fixture
def store(tmp_path):
    s = SsdStore(str(tmp_path), 64 * PAGE, PAGE, files=2)
    yield s
    s.close()
    assert os.listdir(tmp_path) == []


def _data(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("n", [0, 1, PAGE - 1, PAGE, 3 * PAGE + 17, 40 * PAGE])
def test_spill_restore_is_bit_exact(store: SsdStore, n: int) -> None:
    src = _data(n, n)
    block = store.spill(src)
    dst = torch.zeros(n, dtype=torch.uint8)
    store.restore(block, dst)
    assert torch.equal(src, dst)
    assert len(block.sums) == -(-n // PAGE)
    store.free(block)
    assert store.free_slots == 64


def test_fragmented_slots_and_file_boundaries(store: SsdStore) -> None:
    a = store.spill(_data(30 * PAGE, 1))  # slots 0-29
    b = store.spill(_data(4 * PAGE, 2))  # 30-33: straddles the two files (32 slots each)
    c = store.spill(_data(20 * PAGE, 3))
    store.free(a)
    big = _data(35 * PAGE, 4)  # no run of 35 free slots: split across the holes
    d = store.spill(big)
    assert len(d.runs) > 1
    out = torch.zeros_like(big)
    store.restore(d, out)
    assert torch.equal(out, big)
    for blk, seed, n in ((b, 2, 4), (c, 3, 20)):
        got = torch.zeros(n * PAGE, dtype=torch.uint8)
        store.restore(blk, got)
        assert torch.equal(got, _data(n * PAGE, seed))
    with pytest.raises(SsdError, match="SSD tier full"):
        store.spill(_data(10 * PAGE))


def test_a_corrupt_page_is_an_error_not_data(store: SsdStore) -> None:
    block = store.spill(_data(4 * PAGE, 5))
    first, _ = block.runs[0]
    fd = os.open(store.paths[0], os.O_RDWR)
    os.pwrite(fd, b"\xff\x00\xff", (first + 2) * PAGE + 100)  # page 2 of the block
    os.close(fd)
    with pytest.raises(SsdCorruption, match=r"SSD page 2 .* failed its checksum"):
        store.restore(block, torch.zeros(4 * PAGE, dtype=torch.uint8))


def test_async_spill_restore_keeps_the_loop_running(tmp_path) -> None:
    store = SsdStore(str(tmp_path), 64 << 20, PAGE)
    src = _data(48 << 20, 6)
    dst = torch.zeros_like(src)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def main() -> None:
        beat = asyncio.create_task(heartbeat())
        block = await store.aspill(src)
        during_spill = ticks
        await store.arestore(block, dst)
        beat.cancel()
        assert during_spill > 1 and ticks > during_spill

    try:
        asyncio.run(main())
        assert torch.equal(src, dst)
    finally:
        store.close()


def test_bad_configuration_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="ssd_capacity"):
        SsdStore(str(tmp_path), PAGE + 1, PAGE)
    with pytest.raises(ValueError, match="ssd_dir"):
        SsdStore(str(tmp_path / "missing"), PAGE, PAGE)
