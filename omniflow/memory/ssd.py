"""The SSD tier: page slots in preallocated files, written and read by a thread pool.

One ``SsdStore`` belongs to one process (its slot map lives in that process): the
process that runs a tiered cache. Pages move in runs of contiguous slots, cut into
chunks that the I/O threads write (or read) in parallel; a checksum of every page is
computed in the same chunk task, kept in the returned ``SsdBlock`` and checked on
restore, so a corrupt page raises ``SsdCorruption`` instead of returning wrong data.
``spill``/``restore`` block the calling thread; ``aspill``/``arestore`` await the same
chunk tasks and never block the event loop.

The checksum is ``sum_k (2k+1) * S_k`` (wrapping 64-bit) where ``S_k`` sums the int64
words of the page's 512-byte sector k: any bit flip, a lost or torn write, a stale
slot or a misplaced sector changes it. Not ``zlib.crc32``: this one runs as torch SIMD
with the GIL released, several times faster than crc32 on one core, and checksumming
every byte twice must fit inside the SSD tier's I/O budget.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from omniflow.memory.errors import SsdCorruption, SsdError

CHUNK = 8 << 20  # bytes per I/O task: large enough for sequential speed, small enough to overlap


class SsdBlock(NamedTuple):
    """Where a spilled block lives: runs of ``(first_slot, slots)`` and a checksum per page."""

    runs: tuple[tuple[int, int], ...]
    nbytes: int
    sums: tuple[int, ...]


class SsdStore:
    def __init__(
        self,
        directory: str,
        capacity: int,
        page_size: int,
        *,
        name: str = "omniflow-ssd",
        files: int = 1,
        io_threads: int = 2,
        sync: bool = True,
    ) -> None:
        if page_size <= 0 or capacity < page_size * files or capacity % (page_size * files):
            raise ValueError(
                f"ssd_capacity: must be a positive multiple of page_size x files "
                f"({page_size} x {files}), got {capacity}"
            )
        if not os.path.isdir(directory):
            raise ValueError(f"ssd_dir: {directory!r} is not a directory")
        self.page_size = page_size
        self.slots = capacity // page_size
        self._per_file = self.slots // files
        self._sync = sync
        self._used = bytearray(self.slots)
        self._slot_lock = threading.Lock()  # spills may start from the loop and from threads
        self.paths = [os.path.join(directory, f"{name}.{i}.pages") for i in range(files)]
        self._fds: list[int] = []
        try:
            for path in self.paths:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds.append(fd)
                os.posix_fallocate(fd, 0, self._per_file * page_size)  # fail now, not mid-spill
        except OSError as e:
            self.close()
            raise SsdError(
                f"ssd_dir: cannot preallocate {capacity} bytes in {directory}: {e}"
            ) from e
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="omniflow-ssd")

    @property
    def free_slots(self) -> int:
        return self._used.count(0)

    # ------------------------------------------------------------ slots

    def _alloc(self, pages: int) -> tuple[tuple[int, int], ...]:
        with self._slot_lock:
            return self._alloc_locked(pages)

    def _alloc_locked(self, pages: int) -> tuple[tuple[int, int], ...]:
        start = self._used.find(bytes(pages))
        if start >= 0:
            runs = [(start, pages)]
        else:  # no single run: take free slots in order, grouped into runs
            if self.free_slots < pages:
                raise SsdError(f"SSD tier full: {pages} pages asked, {self.free_slots} free")
            runs, at, left = [], 0, pages
            while left:
                first = self._used.find(b"\0", at)
                end = first + 1
                while end < self.slots and end - first < left and not self._used[end]:
                    end += 1
                runs.append((first, end - first))
                left -= end - first
                at = end
        for first, n in runs:
            self._used[first : first + n] = b"\x01" * n
        return tuple(runs)

    def free(self, block: SsdBlock) -> None:
        with self._slot_lock:
            for first, n in block.runs:
                self._used[first : first + n] = bytes(n)

    def _chunks(self, block_runs: tuple[tuple[int, int], ...], nbytes: int):
        """``(fd, file_offset, mem_offset, length, first_page)`` pieces, within one file each."""
        mem = page = 0
        per_chunk = max(1, CHUNK // self.page_size)
        for first, n in block_runs:
            slot = first
            while slot < first + n and mem < nbytes:
                count = min(first + n - slot, per_chunk, self._per_file - slot % self._per_file)
                length = min(count * self.page_size, nbytes - mem)
                fd = self._fds[slot // self._per_file]
                yield fd, (slot % self._per_file) * self.page_size, mem, length, page
                mem += length
                page += count
                slot += count

    # ------------------------------------------------------------ spill / restore

    def _write(self, src: memoryview, fd: int, off: int, mem: int, length: int) -> list[int]:
        view = src[mem : mem + length]
        sums = page_checksums(view, self.page_size)
        done = 0
        while done < length:
            done += os.pwrite(fd, view[done:], off + done)
        if self._sync and _sync_file_range is not None:
            # Start this chunk's writeback now, so the disk works while later chunks are
            # checksummed; the final fdatasync then has little left to wait for.
            _sync_file_range(fd, off, length, _SYNC_FILE_RANGE_WRITE)
        return sums

    def _read(
        self, dst: memoryview, fd: int, off: int, mem: int, length: int, page: int, sums: tuple
    ) -> None:
        view = dst[mem : mem + length]
        done = 0
        while done < length:
            got = os.preadv(fd, [view[done:]], off + done)
            if got == 0:
                raise SsdError(f"short read at offset {off + done} of {self._path(fd)}")
            done += got
        for k, got in enumerate(page_checksums(view, self.page_size)):
            if got != sums[page + k]:
                raise SsdCorruption(
                    f"SSD page {page + k} at offset {off + k * self.page_size} of "
                    f"{self._path(fd)} failed its checksum (stored {sums[page + k]:#x}, "
                    f"read {got:#x})"
                )

    def _path(self, fd: int) -> str:
        return self.paths[self._fds.index(fd)]

    def _submit_spill(self, src: Any) -> tuple[tuple, int, list[Future]]:
        src = _bytes_view(src)
        nbytes = len(src)
        runs = self._alloc(max(1, -(-nbytes // self.page_size)))
        tasks = [
            self._io.submit(self._write, src, fd, off, mem, ln)
            for fd, off, mem, ln, _ in self._chunks(runs, nbytes)
        ]
        return runs, nbytes, tasks

    def _finish_spill(self, runs: tuple, nbytes: int, results: list[list[int]]) -> SsdBlock:
        if self._sync:
            for fd in self._fds:
                os.fdatasync(fd)
        return SsdBlock(runs, nbytes, tuple(c for chunk in results for c in chunk))

    def _submit_restore(self, block: SsdBlock, dst: Any) -> list[Future]:
        dst = _bytes_view(dst)
        if len(dst) < block.nbytes:
            raise ValueError(f"dst: {len(dst)} bytes cannot hold the block's {block.nbytes}")
        return [
            self._io.submit(self._read, dst, fd, off, mem, ln, page, block.sums)
            for fd, off, mem, ln, page in self._chunks(block.runs, block.nbytes)
        ]

    def spill(self, src: Any) -> SsdBlock:
        """Write ``src`` (bytes-like or tensor) to free slots; blocks until written (and synced)."""
        runs, nbytes, tasks = self._submit_spill(src)
        try:
            return self._finish_spill(runs, nbytes, _wait(tasks))
        except BaseException:
            self.free(SsdBlock(runs, nbytes, ()))
            raise

    def restore(self, block: SsdBlock, dst: Any) -> None:
        """Read ``block`` into ``dst`` and check every page; the slots stay allocated."""
        _wait(self._submit_restore(block, dst))

    async def aspill(self, src: Any) -> SsdBlock:
        runs, nbytes, tasks = self._submit_spill(src)
        loop = asyncio.get_running_loop()

        async def finish() -> SsdBlock:
            results = await asyncio.gather(*(asyncio.wrap_future(t) for t in tasks))
            return await loop.run_in_executor(self._io, self._finish_spill, runs, nbytes, results)

        try:
            return await finish()
        except BaseException:
            self.free(SsdBlock(runs, nbytes, ()))
            raise

    async def arestore(self, block: SsdBlock, dst: Any) -> None:
        tasks = self._submit_restore(block, dst)
        await asyncio.gather(*(asyncio.wrap_future(t) for t in tasks))

    def close(self, remove: bool = True) -> None:
        if hasattr(self, "_io"):
            self._io.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if remove:
            for path in self.paths:
                if os.path.exists(path):
                    os.unlink(path)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None
try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux: fdatasync alone
    pass

_SECTOR_WORDS = 64  # 512-byte sectors
_weights: dict[int, torch.Tensor] = {}


def page_checksums(buf: memoryview, page_size: int) -> list[int]:
    """One 64-bit checksum per ``page_size`` bytes of ``buf`` (a short last page is zero-padded)."""
    full, tail = divmod(len(buf), page_size)
    sums = _checksum_rows(_int64_view(buf[: full * page_size]), page_size) if full else []
    if tail:
        pad = torch.zeros(page_size, dtype=torch.uint8)
        pad[:tail] = torch.frombuffer(bytearray(buf[full * page_size :]), dtype=torch.uint8)
        sums += _checksum_rows(pad.view(torch.int64), page_size)
    return sums


def _checksum_rows(words: torch.Tensor, page_size: int) -> list[int]:
    sectors = page_size // (8 * _SECTOR_WORDS)
    weights = _weights.get(sectors)
    if weights is None:
        weights = _weights[sectors] = torch.arange(1, 2 * sectors, 2, dtype=torch.int64)
    per_sector = words.view(-1, sectors, _SECTOR_WORDS).sum(dim=2)
    return (per_sector * weights).sum(dim=1).tolist()


def _int64_view(buf: memoryview) -> torch.Tensor:
    if buf.readonly:  # bytes and the like: torch only wraps writable buffers
        return torch.tensor(np.frombuffer(buf, np.int64))
    return torch.frombuffer(buf, dtype=torch.uint8).view(torch.int64)


def _wait(tasks: list[Future]) -> list[Any]:
    try:
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:  # let the rest finish before the caller reuses the buffers
            t.cancel()
        for t in tasks:
            if not t.cancelled():
                t.exception()
        raise


def _bytes_view(buf: Any) -> memoryview:
    if hasattr(buf, "untyped_storage"):  # a torch tensor: its bytes, no copy
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("a spilled tensor must be a contiguous CPU tensor")
        if buf.numel() == 0:
            return memoryview(b"")
        buf = buf.reshape(-1).view(torch.uint8).numpy()
    view = memoryview(buf)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
