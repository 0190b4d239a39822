"""CUDA IPC: GPU tensors to other processes on this host through a device-side pool.

Sender side, ``DevicePool``: one ``cudaMalloc``'d chunk per process per GPU whose IPC
handle is taken once; tensors are copied into (or allocated in) page-aligned blocks of
it. Every hand-off gets a *ticket* in the host page pool: a page-less lease whose refs
are the readers, attributed to their pids. A block is recycled once the sender dropped
it and every ticket on it is gone: each reader acknowledged (``release``) or died and
was reclaimed. Per-tensor ``_share_cuda_`` is avoided on purpose: it keeps each tensor's
memory alive until the sender exits and costs a mapping per tensor per reader.

Receiver side, ``IpcOpener``: opens each chunk handle once (``cudaIpcOpenMemHandle``)
and keeps it open; a ref is checked against its ticket before any view is made.

Hazards: ``CudaIpc.device`` is a CUDA ordinal of the sender's process, so sender and
receivers need the same ``CUDA_VISIBLE_DEVICES`` ordering. The sender synchronizes its
current stream before a ref leaves, so readers see finished writes. Needs cupy (the
``gpu`` extra) and a CUDA device; without them every entry point raises
``NotImplementedError``. Untested on CPU-only machines; tests are marked ``gpu``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from omniflow.memory.dtypes import ITEMSIZE, dtype_name, nbytes_of, torch_dtype
from omniflow.memory.errors import InvalidHandle, PoolExhausted
from omniflow.memory.pool import PagePool
from omniflow.messages import CudaIpc

try:  # optional: the "gpu" extra
    import cupy
except Exception:  # noqa: BLE001 - a broken CUDA install must not break CPU-only use
    cupy = None

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def _require_cuda() -> None:
    if cupy is None:
        raise NotImplementedError("CUDA IPC needs cupy (pip install 'omniflow[gpu]')")
    if not cupy.cuda.is_available():
        raise NotImplementedError("CUDA IPC needs a CUDA device; none is visible")


def _device_view(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    """A uint8 torch tensor over raw device memory, without copying or owning it."""
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=torch.device("cuda", device))


class _Block:
    __slots__ = ("start", "pages", "local", "tickets")

    def __init__(self, start: int, pages: int, local: int) -> None:
        self.start, self.pages, self.local = start, pages, local
        self.tickets: set[int] = set()


class DeviceLease:
    """The producer's hold on a block from ``DevicePool.empty``; ``release()`` once."""

    def __init__(self, pool: DevicePool, block: _Block) -> None:
        self._pool = pool
        self._block: _Block | None = block

    def release(self) -> None:
        if self._block is not None:
            self._block.local -= 1
            self._block = None
            self._pool.collect()


class DevicePool:
    def __init__(self, host_pool: PagePool, device: int, size: int, page_size: int = 2 << 20):
        _require_cuda()
        if size < page_size or size % page_size:
            raise ValueError(f"size: must be a positive multiple of page_size {page_size}")
        self.host_pool, self.device, self.size, self.page_size = host_pool, device, size, page_size
        with cupy.cuda.Device(device):
            self._ptr = cupy.cuda.runtime.malloc(size)
            self.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
        self._chunk: torch.Tensor | None = _device_view(self._ptr, size, device)
        self._used = bytearray(size // page_size)
        self._blocks: dict[int, _Block] = {}

    def _alloc(self, nbytes: int, local: int) -> _Block:
        n = max(1, -(-nbytes // self.page_size))
        start = self._used.find(bytes(n))
        if start < 0 and self.collect():
            start = self._used.find(bytes(n))
        if start < 0:
            raise PoolExhausted(
                f"device pool on cuda:{self.device}: no run of {n} free pages for {nbytes} bytes"
            )
        self._used[start : start + n] = b"\x01" * n
        block = self._blocks[start] = _Block(start, n, local)
        return block

    def _tensor(self, block: _Block, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        assert self._chunk is not None, "device pool is closed"
        lo = block.start * self.page_size
        raw = self._chunk[lo : lo + nbytes_of(dtype_name(dtype), shape)]
        return raw.view(dtype).view(shape)

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> tuple[torch.Tensor, DeviceLease]:
        shape = tuple(shape)
        block = self._alloc(nbytes_of(dtype_name(dtype), shape), local=1)
        return self._tensor(block, dtype, shape), DeviceLease(self, block)

    def share(self, tensor: torch.Tensor, pid: int) -> CudaIpc:
        """A ref to ``tensor`` for reader ``pid``; copied into the chunk unless already in it."""
        name = dtype_name(tensor.dtype)
        nbytes = tensor.numel() * ITEMSIZE[name]
        block = self._block_of(tensor) if tensor.is_contiguous() else None
        if block is None:
            block = self._alloc(nbytes, local=0)
            self._tensor(block, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
            offset = block.start * self.page_size
        else:
            offset = tensor.data_ptr() - self._ptr
        torch.cuda.current_stream(self.device).synchronize()  # readers must see the writes
        ticket = self.host_pool.alloc_ticket(nbytes, aux=offset, pid=pid)
        block.tickets.add(ticket)
        return CudaIpc(self.handle, offset, nbytes, name, tuple(tensor.shape), self.device, ticket)

    def _block_of(self, tensor: torch.Tensor) -> _Block | None:
        if tensor.device != torch.device("cuda", self.device):
            return None
        offset = tensor.data_ptr() - self._ptr
        if not 0 <= offset < self.size:
            return None
        page = offset // self.page_size
        for block in self._blocks.values():
            if block.start <= page < block.start + block.pages:
                return block
        return None

    def collect(self) -> int:
        """Recycle blocks the sender dropped and every reader acknowledged; returns pages freed."""
        freed = 0
        for start, block in list(self._blocks.items()):
            block.tickets = {t for t in block.tickets if self.host_pool.refs(t) > 0}
            if block.local <= 0 and not block.tickets:
                del self._blocks[start]
                self._used[start : start + block.pages] = bytes(block.pages)
                freed += block.pages
        return freed

    def close(self) -> None:
        """Free the chunk; readers' mappings of it become invalid, so close after they released."""
        self._chunk = None
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.free(self._ptr)


class IpcOpener:
    """Receiver side: one open mapping per sender chunk, kept for the life of the process."""

    def __init__(self, host_pool: PagePool) -> None:
        _require_cuda()
        self.host_pool = host_pool
        self._opened: dict[tuple[bytes, int], int] = {}

    def open(self, ref: CudaIpc) -> torch.Tensor:
        try:
            dtype = torch_dtype(ref.dtype)
            expected = nbytes_of(ref.dtype, tuple(ref.shape))
        except ValueError as e:
            raise InvalidHandle(f"CUDA IPC handle for lease {ref.lease}: {e}") from None
        if ref.nbytes != expected or len(ref.handle) != 64:
            raise InvalidHandle(
                f"CUDA IPC handle for lease {ref.lease}: nbytes {ref.nbytes} vs dtype/shape "
                f"{expected}, handle of {len(ref.handle)} bytes (64 expected)"
            )
        nbytes, offset = self.host_pool.ticket(ref.lease)  # StaleLease once acknowledged
        if offset != ref.offset or ref.nbytes > nbytes:
            raise InvalidHandle(f"CUDA IPC handle does not match ticket {ref.lease}")
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype, device=torch.device("cuda", ref.device))
        key = (ref.handle, ref.device)
        base = self._opened.get(key)
        if base is None:
            with cupy.cuda.Device(ref.device):
                base = cupy.cuda.runtime.ipcOpenMemHandle(ref.handle, _LAZY_PEER_ACCESS)
            self._opened[key] = base
        return _device_view(base + ref.offset, ref.nbytes, ref.device).view(dtype).view(ref.shape)

    def close(self) -> None:
        for (_, device), base in self._opened.items():
            with cupy.cuda.Device(device):
                cupy.cuda.runtime.ipcCloseMemHandle(base)
        self._opened.clear()
