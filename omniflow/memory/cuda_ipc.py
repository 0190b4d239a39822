"""CUDA IPC: GPU tensors to other processes on this host through a device-side pool.

Sender side, ``DevicePool``: one ``cudaMalloc``'d chunk per process per GPU whose IPC
handle is taken once; tensors are copied into (or allocated in) page-aligned blocks of
it. Every hand-off gets a *ticket* in the host page pool: a page-less lease whose refs
are the readers, attributed to their pids. A block is recycled once the sender dropped
it and every ticket on it is gone: each reader acknowledged (``release``) or died and
was reclaimed. Per-tensor ``_share_cuda_`` is avoided on purpose: it keeps each tensor's
memory alive until the sender exits and costs a mapping per tensor per reader.

Ordering, without blocking either side's host thread:

- the sender records the block's interprocess event on its current stream (the stream
  that produced the tensor, or copied it into the block) and the ref carries the event's
  handle; ``share`` returns while the producer's kernels may still be running;
- the receiver makes its current stream wait on that event (``cudaStreamWaitEvent``)
  before it returns the view, so every kernel it queues on the view runs after the writes;
- ``IpcOpener.release`` waits for the receiver's own queued work on its stream before
  the ticket goes back, so a block is never recycled while a reader's kernel still reads it.

GPUs are named by PCI bus id (``CudaIpc.bus_id``): the two processes may see the same GPU
under different ordinals (``CUDA_VISIBLE_DEVICES`` per replica). The receiver opens a
sender chunk once per hand-off it holds and closes the mapping when it released the last
of them (``cudaIpcCloseMemHandle``); a receiver that dies loses its mappings with its
process and the host pool reclaims its tickets. A hop inside one process never opens
its own handle: the ref resolves to the process's own chunk.

Needs cupy (the ``gpu`` extra) and a CUDA device; without them every entry point raises
``NotImplementedError``. Tests are marked ``gpu`` (tests/transport/test_cuda_ipc.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
_IPC_EVENT = 2 | 4  # cudaEventDisableTiming | cudaEventInterprocess


def _require_cuda() -> None:
    if cupy is None:
        raise NotImplementedError("CUDA IPC needs cupy (pip install 'omniflow[gpu]')")
    try:
        available = cupy.cuda.is_available()
    except Exception:  # noqa: BLE001 - a driver too old for the runtime, and the like
        available = False
    if not available:
        raise NotImplementedError("CUDA IPC needs a CUDA device; none is visible")


def bus_id(ordinal: int) -> str:
    """The PCI bus id of this process's ``cuda:ordinal``: a GPU's name across processes."""
    _require_cuda()
    return str(cupy.cuda.runtime.deviceGetPCIBusId(ordinal)).lower()


def visible_bus_ids() -> list[str]:
    """PCI bus ids of every GPU this process sees, by ordinal."""
    _require_cuda()
    return [bus_id(i) for i in range(cupy.cuda.runtime.getDeviceCount())]


class _Raw:
    """``__cuda_array_interface__`` (v2: no stream, so torch adds no sync) over raw bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def _device_view(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    """A uint8 torch tensor over raw device memory, without copying or owning it."""
    return torch.as_tensor(_Raw(ptr, nbytes), device=torch.device("cuda", device))


def _stream(device: int, stream: torch.cuda.Stream | None = None) -> int:
    return int((stream or torch.cuda.current_stream(device)).cuda_stream)


class _Block:
    __slots__ = ("start", "pages", "local", "tickets", "event")

    def __init__(self, start: int, pages: int, local: int, event: int) -> None:
        self.start, self.pages, self.local, self.event = start, pages, local, event
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
        self.bus_id = bus_id(device)
        with cupy.cuda.Device(device):
            self._ptr = cupy.cuda.runtime.malloc(size)
            self.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
        self._chunk: torch.Tensor | None = _device_view(self._ptr, size, device)
        self._used = bytearray(size // page_size)
        self._blocks: dict[int, _Block] = {}
        self._free_events: list[int] = []
        self._event_handles: dict[int, bytes] = {}  # event ptr -> its IPC handle
        self.local_events: dict[bytes, int] = {}  # and back, for a hop inside this process

    def _event(self) -> int:
        if self._free_events:
            return self._free_events.pop()
        with cupy.cuda.Device(self.device):
            event = cupy.cuda.runtime.eventCreateWithFlags(_IPC_EVENT)
            handle = bytes(cupy.cuda.runtime.ipcGetEventHandle(event))
        self._event_handles[event], self.local_events[handle] = handle, event
        return event

    def _alloc(self, nbytes: int, local: int) -> _Block:
        n = max(1, -(-nbytes // self.page_size))
        start = self._used.find(bytes(n))
        if start < 0 and self.collect():
            start = self._used.find(bytes(n))
        if start < 0:
            raise PoolExhausted(
                f"device pool on cuda:{self.device} ({self.bus_id}): no run of {n} free "
                f"pages for {nbytes} bytes"
            )
        self._used[start : start + n] = b"\x01" * n
        block = self._blocks[start] = _Block(start, n, local, self._event())
        return block

    def _tensor(self, block: _Block, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        assert self._chunk is not None, "device pool is closed"
        lo = block.start * self.page_size
        raw = self._chunk[lo : lo + nbytes_of(dtype_name(dtype), shape)]
        return raw.view(dtype).view(shape)

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> tuple[torch.Tensor, DeviceLease]:
        """A tensor in the chunk for a producer to write (then ``share`` sends it uncopied)."""
        shape = tuple(shape)
        block = self._alloc(nbytes_of(dtype_name(dtype), shape), local=1)
        return self._tensor(block, dtype, shape), DeviceLease(self, block)

    def share(
        self, tensor: torch.Tensor, pid: int, stream: torch.cuda.Stream | None = None
    ) -> CudaIpc:
        """A ref to ``tensor`` for reader ``pid``; copied into the chunk unless already in it.

        ``stream`` (default: the current one) is where ``tensor`` was produced: the event
        the ref carries is recorded there, so this returns without waiting for the kernels.
        The sender must not write ``tensor`` again once it is shared.
        """
        name = dtype_name(tensor.dtype)
        nbytes = tensor.numel() * ITEMSIZE[name]
        block = self._block_of(tensor) if tensor.is_contiguous() else None
        with torch.cuda.device(self.device):
            if block is None:
                block = self._alloc(nbytes, local=0)
                target = self._tensor(block, tensor.dtype, tuple(tensor.shape))
                with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
                    target.copy_(tensor)  # queued after the producer's kernels, same stream
                offset = block.start * self.page_size
            else:
                offset = tensor.data_ptr() - self._ptr
            cupy.cuda.runtime.eventRecord(block.event, _stream(self.device, stream))
        ticket = self.host_pool.alloc_ticket(nbytes, aux=offset, pid=pid)
        block.tickets.add(ticket)
        return CudaIpc(
            self.handle,
            offset,
            nbytes,
            name,
            tuple(tensor.shape),
            self.device,
            ticket,
            bus_id=self.bus_id,
            event=self._event_handles[block.event],
        )

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

    def view(self, ref: CudaIpc) -> torch.Tensor:
        """``ref``'s bytes in this process's own chunk (a hop inside the sender's process)."""
        assert self._chunk is not None, "device pool is closed"
        raw = self._chunk[ref.offset : ref.offset + ref.nbytes]
        return raw.view(torch_dtype(ref.dtype)).view(tuple(ref.shape))

    def collect(self) -> int:
        """Recycle blocks the sender dropped and every reader acknowledged; returns pages freed."""
        freed = 0
        for start, block in list(self._blocks.items()):
            block.tickets = {t for t in block.tickets if self._live(t)}
            if block.local <= 0 and not block.tickets:
                del self._blocks[start]
                self._used[start : start + block.pages] = bytes(block.pages)
                self._free_events.append(block.event)
                freed += block.pages
        return freed

    def _live(self, ticket: int) -> bool:
        try:
            return self.host_pool.refs(ticket) > 0
        except Exception:  # noqa: BLE001 - a stale ticket: every reader is gone
            return False

    def in_use(self) -> int:
        """Pages held by blocks not recycled yet (after a ``collect``)."""
        self.collect()
        return sum(b.pages for b in self._blocks.values())

    def close(self) -> None:
        """Free the chunk; readers' mappings of it become invalid, so close after they released."""
        self._chunk = None
        with cupy.cuda.Device(self.device):
            for event in self._event_handles:
                cupy.cuda.runtime.eventDestroy(event)
            cupy.cuda.runtime.free(self._ptr)
        self._event_handles.clear()
        self.local_events.clear()
        self._free_events.clear()


class _Mapping:
    __slots__ = ("base", "device", "refs", "events")

    def __init__(self, base: int, device: int) -> None:
        self.base, self.device, self.refs = base, device, 0
        self.events: dict[bytes, int] = {}  # opened IPC event handles of this sender chunk


class IpcOpener:
    """Receiver side: a sender chunk stays mapped while this process holds refs into it.

    ``local`` maps this process's own chunk handles to their ``DevicePool`` (a hop inside
    one process resolves there, without opening a handle).
    """

    def __init__(self, host_pool: PagePool, local: dict[bytes, Any] | None = None) -> None:
        _require_cuda()
        self.host_pool = host_pool
        self.local = local if local is not None else {}
        self._maps: dict[tuple[bytes, int], _Mapping] = {}
        self._ordinals: dict[str, int] = {}

    def ordinal(self, ref: CudaIpc) -> int:
        """This process's ordinal of the GPU ``ref`` lives on (by PCI bus id)."""
        if not ref.bus_id:
            return ref.device
        found = self._ordinals.get(ref.bus_id)
        if found is None:
            try:
                found = int(cupy.cuda.runtime.deviceGetByPCIBusId(ref.bus_id))
            except Exception:  # noqa: BLE001 - a CUDARuntimeError: not visible here
                raise InvalidHandle(
                    f"CUDA IPC handle for lease {ref.lease}: GPU {ref.bus_id} is not visible "
                    "in this process (CUDA_VISIBLE_DEVICES)"
                ) from None
            self._ordinals[ref.bus_id] = found
        return found

    def _check(self, ref: CudaIpc) -> torch.dtype:
        try:
            dtype = torch_dtype(ref.dtype)
            expected = nbytes_of(ref.dtype, tuple(ref.shape))
        except ValueError as e:
            raise InvalidHandle(f"CUDA IPC handle for lease {ref.lease}: {e}") from None
        if ref.nbytes != expected or len(ref.handle) != 64 or len(ref.event) not in (0, 64):
            raise InvalidHandle(
                f"CUDA IPC handle for lease {ref.lease}: nbytes {ref.nbytes} vs dtype/shape "
                f"{expected}, handle of {len(ref.handle)} bytes and event of {len(ref.event)} "
                "(64 each expected)"
            )
        nbytes, offset = self.host_pool.ticket(ref.lease)  # StaleLease once acknowledged
        if offset != ref.offset or ref.nbytes > nbytes:
            raise InvalidHandle(f"CUDA IPC handle does not match ticket {ref.lease}")
        return dtype

    def open(self, ref: CudaIpc) -> torch.Tensor:
        """A view of ``ref``'s tensor, ordered after the sender's writes on this process's
        current stream. Counts as held until ``release(ref)``."""
        dtype = self._check(ref)
        own = self.local.get(ref.handle)
        if own is not None:  # a hop inside this process: its own chunk, its own event
            event = own.local_events.get(ref.event)
            if event is not None:
                cupy.cuda.runtime.streamWaitEvent(_stream(own.device), event, 0)
            return own.view(ref)
        device = self.ordinal(ref)
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype, device=torch.device("cuda", device))
        mapping = self._map(ref, device)
        mapping.refs += 1
        try:
            if ref.event:
                event = mapping.events.get(ref.event)
                with cupy.cuda.Device(device):
                    if event is None:
                        event = cupy.cuda.runtime.ipcOpenEventHandle(ref.event)
                        mapping.events[ref.event] = event
                    cupy.cuda.runtime.streamWaitEvent(_stream(device), event, 0)
            raw = _device_view(mapping.base + ref.offset, ref.nbytes, device)
        except BaseException:
            self.forget(ref)
            raise
        return raw.view(dtype).view(ref.shape)

    def _map(self, ref: CudaIpc, device: int) -> _Mapping:
        key = (ref.handle, device)
        mapping = self._maps.get(key)
        if mapping is None:
            with cupy.cuda.Device(device):
                base = cupy.cuda.runtime.ipcOpenMemHandle(ref.handle, _LAZY_PEER_ACCESS)
            mapping = self._maps[key] = _Mapping(base, device)
        return mapping

    def release(self, ref: CudaIpc) -> None:
        """After the last use of ``ref``'s view: wait for the kernels this process queued on
        it, then forget it (closing the mapping with its last ref). The caller then gives
        the ticket back."""
        if ref.handle in self.local:
            own = self.local[ref.handle]
            torch.cuda.current_stream(own.device).synchronize()
            return
        mapping = self._maps.get((ref.handle, self.ordinal(ref)))
        if mapping is not None:
            torch.cuda.current_stream(mapping.device).synchronize()
        self.forget(ref)

    def forget(self, ref: CudaIpc) -> None:
        """Drop this process's hold on ``ref`` without waiting (never used, or used up)."""
        if ref.handle in self.local or ref.nbytes == 0:
            return
        key = (ref.handle, self.ordinal(ref))
        mapping = self._maps.get(key)
        if mapping is None:
            return
        mapping.refs -= 1
        if mapping.refs <= 0:
            del self._maps[key]
            self._close(mapping)

    def mapped(self) -> int:
        """Sender chunks this process has open now."""
        return len(self._maps)

    @staticmethod
    def _close(mapping: _Mapping) -> None:
        with cupy.cuda.Device(mapping.device):
            for event in mapping.events.values():
                cupy.cuda.runtime.eventDestroy(event)
            cupy.cuda.runtime.ipcCloseMemHandle(mapping.base)

    def close(self) -> None:
        for mapping in self._maps.values():
            self._close(mapping)
        self._maps.clear()
