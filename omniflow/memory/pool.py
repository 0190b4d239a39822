"""The host page pool: one shared-memory segment per deployment per host.

The supervisor creates it, every local process maps it once and keeps the mapping;
tensors in it travel between processes as ``Shm`` handles (an offset and a lease),
never as bytes. Usage::

    # supervisor, at `up` (stale segment from a crashed run: unlink_pool(name) first)
    pool = PagePool.create("omniflow-demo", size=parse_size("4GiB"), page_size=64 << 10)
    # or PagePool.from_config(name, config.cache, create=True)
    ...   # spawn workers, tell them pool.name
    pool.reclaim({dead_pid})   # whenever a worker dies (before its pid can be reused)
    pool.unlink(); pool.close()   # at `down`; unlink_pool(name) also works without a mapping

    # worker, at startup (then omniflow.transport.tensors.attach_pool(pool))
    pool = PagePool.attach(name)
    t, lease = pool.empty((3, 224, 224), torch.float32)   # write in place
    ref = pool.share(t, pid=receiver_pid)   # no copy: a ref now held for the receiver
    lease.release()                          # the producer's own ref

    # receiver
    view = pool.open(ref)          # validated, zero-copy
    pool.release(ref.lease)        # the ack: when every holder released, the pages are free

Refs are attributed to pids (``pid=0``: anonymous, never reclaimed), so a reader that
dies with refs outstanding is cleaned up by ``reclaim``/``scan``. Refs a sender shares
with a receiver through the transport are attributed to ``received(pid)``, apart from
the refs that process holds for itself: a forged ref naming one of its own leases can
never release it. A view stays readable
after its lease is released, but the pages may be reused: release only when done.

Trust: handles arriving in messages are checked (pool name, bounds, alignment, live
lease and generation, a ref held for the receiver, dtype/shape against nbytes) before
any view is made. Every local process of the
deployment's user can write the segment, header included; the pool does not defend
against a process that scribbles on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from omniflow.memory.config import CacheConfig
from omniflow.memory.dtypes import ITEMSIZE, dtype_name, nbytes_of, torch_dtype
from omniflow.memory.errors import InvalidHandle, PoolError, StaleLease
from omniflow.memory.lease import Lease, PoolStats, PoolTensor, Reclaimed
from omniflow.memory.liveness import pid_alive
from omniflow.memory.pagetable import PageTable, plan
from omniflow.memory.pinned import cuda_available, register_host, unregister_host
from omniflow.memory.segment import Segment
from omniflow.messages import Shm

if TYPE_CHECKING:
    import torch


class PagePool:
    def __init__(self, segment: Segment, table: PageTable, pin: bool | None) -> None:
        self._seg = segment
        self._table = table
        self.name = segment.name
        self.path = segment.path
        self.page_size = table.page_size
        self.pages = table.n_pages
        self.data_offset = table.layout.data_offset
        self.size = table.layout.total
        self.base = segment.address()
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.pinned = False
        if pin or (pin is None and cuda_available()):
            if pin and not cuda_available():
                raise PoolError(f"pool {self.name!r}: pin=True but no CUDA device is available")
            self.pinned = register_host(self.base + self.data_offset, self.pages * self.page_size)

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        name: str,
        size: int,
        page_size: int = 64 << 10,
        *,
        populate: bool = True,
        pin: bool | None = None,
        tickets: int = 4096,
    ) -> PagePool:
        """Create the segment ``name`` with ``size`` bytes of pages (plus its header)."""
        if page_size < 4096 or page_size & (page_size - 1):
            raise ValueError(f"page_size: must be a power of two >= 4096, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(
                f"size: must be a positive multiple of page_size {page_size}, got {size}"
            )
        layout = plan(page_size, size // page_size, tickets)
        seg = Segment.create(name, layout.total, populate)
        try:
            with seg.lock():
                table = PageTable.format(seg.mm, layout)
            return cls(seg, table, pin)
        except BaseException:
            seg.unlink()
            seg.close()
            raise

    @classmethod
    def from_config(cls, name: str, config: CacheConfig, *, create: bool = False) -> PagePool:
        """``create`` (the supervisor) or ``attach`` (a worker) with a ``[cache]`` table's settings."""
        pin = None if config.pin_memory else False
        if create:
            return cls.create(
                name,
                config.host_pool_bytes,
                config.page_size_bytes,
                populate=config.populate,
                pin=pin,
            )
        return cls.attach(name, populate=config.populate, pin=pin)

    @classmethod
    def attach(cls, name: str, *, populate: bool = True, pin: bool | None = None) -> PagePool:
        """Map the existing pool ``name``; keep the result for the life of the process."""
        seg = Segment.attach(name, populate)
        try:
            with seg.lock():
                table = PageTable.open(seg.mm, name)
            return cls(seg, table, pin)
        except BaseException:
            seg.close()
            raise

    def unlink(self) -> bool:
        """Remove the segment's name; mappings stay valid until each process closes."""
        return self._seg.unlink()

    def close(self) -> None:
        if self.pinned:
            unregister_host(self.base + self.data_offset)
            self.pinned = False
        self._typed.clear()
        self._table.close()
        self._seg.close()

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PagePool({self.name!r}, pages={self.pages}, page_size={self.page_size})"

    # ------------------------------------------------------------ allocation

    def alloc(self, nbytes: int, *, tag: int = 0) -> Lease:
        """A block of at least ``nbytes`` (whole contiguous pages), held by this process.

        ``tag`` (an int64 the caller chooses, read back by ``tag()``) says what the block
        holds, so that a handle found outside a message (a shared weights manifest) can be
        checked against it. Raises ``PoolExhausted`` at once when no run of free pages is
        large enough.
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes: expected an int >= 0, got {nbytes!r}")
        pid = os.getpid()
        with self._seg.lock():
            try:
                lease, page = self._table.alloc(nbytes, pid, aux=tag)
            except PoolError as e:
                raise type(e)(f"pool {self.name!r}: {e}") from None
        return Lease(self, lease, self.data_offset + page * self.page_size, nbytes, pid)

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> PoolTensor:
        """An uninitialised tensor in the pool, for producers to write in place."""
        shape = tuple(shape)
        name = dtype_name(dtype)
        lease = self.alloc(nbytes_of(name, shape))
        return PoolTensor(self._view(lease.offset, dtype, shape), lease)

    def copy_in(self, tensor: torch.Tensor) -> PoolTensor:
        """A contiguous copy of ``tensor`` in the pool (one copy; device tensors by DMA when pinned)."""
        pt = self.empty(tensor.shape, tensor.dtype)
        try:
            pt.tensor.copy_(tensor)
        except BaseException:
            pt.lease.release()
            raise
        return pt

    @property
    def mapping(self) -> Any:
        """This process's mapping of the segment (a buffer: offsets as in ``Shm``)."""
        return self._seg.mm

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s first byte lies in this process's mapping of the pool."""
        if tensor.device.type != "cpu":
            return False
        return self.base + self.data_offset <= _address(tensor) < self.base + self.size

    # ------------------------------------------------------------ handles

    def share(self, tensor: torch.Tensor, pid: int) -> Shm:
        """A handle to ``tensor`` (already in the pool), with a ref taken for ``pid``. No copy."""
        ref = self.try_share(tensor, pid)
        if ref is None:
            if not self.contains(tensor):
                raise ValueError("tensor: not in this pool; use copy_in() first")
            raise ValueError("tensor: a Shm handle needs a contiguous tensor; use copy_in()")
        return ref

    def try_share(self, tensor: torch.Tensor, pid: int) -> Shm | None:
        """``share``, or None when ``tensor`` is not a contiguous CPU tensor in the pool (one
        address read: this runs at every hop that passes a tensor on)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        offset = (tensor.data_ptr() or _address(tensor)) - self.base
        if not self.data_offset <= offset < self.size:
            return None
        name = dtype_name(tensor.dtype)
        nbytes = tensor.numel() * ITEMSIZE[name]
        page = (offset - self.data_offset) // self.page_size
        with self._seg.lock():
            slot = self._table.slot_of_page(page)
            if slot < 0:
                raise PoolError(f"pool {self.name!r}: tensor at offset {offset} is in freed pages")
            lease = self._table.lease_of_slot(slot)
            self._check_within(slot, offset, nbytes, lease)
            self._table.retain(lease, pid)
        return Shm(offset, nbytes, name, tuple(tensor.shape), lease, self.name)

    def open(self, ref: Shm, holder: int | None = None, claimed: int = 0) -> torch.Tensor:
        """The tensor ``ref`` names, as a view of the pool; ``InvalidHandle`` unless it checks out.

        With ``holder`` (the receiver's holder id), the lease must also hold more refs for
        it than the ``claimed`` refs it already opened: a ref that no sender took for this
        process is a forgery, whatever bytes it names.
        """
        if ref.pool != self.name:
            raise InvalidHandle(
                f"handle names pool {ref.pool!r} (another deployment's segment); "
                f"this process maps {self.name!r}"
            )
        try:
            dtype = torch_dtype(ref.dtype)
            expected = nbytes_of(ref.dtype, tuple(ref.shape))
        except ValueError as e:
            raise InvalidHandle(f"handle for lease {ref.lease}: {e}") from None
        if ref.nbytes != expected:
            raise InvalidHandle(
                f"handle for lease {ref.lease}: nbytes {ref.nbytes} does not match dtype "
                f"{ref.dtype} shape {list(ref.shape)} ({expected} bytes)"
            )
        if ref.offset % ITEMSIZE[ref.dtype]:
            raise InvalidHandle(f"handle offset {ref.offset} is not aligned to {ref.dtype}")
        if not self.data_offset <= ref.offset <= self.size - ref.nbytes:
            raise InvalidHandle(
                f"handle offset {ref.offset} + {ref.nbytes} bytes lies outside pool "
                f"{self.name!r} pages [{self.data_offset}, {self.size})"
            )
        with self._seg.lock():
            slot = self._table.check(ref.lease)
            self._check_within(slot, ref.offset, ref.nbytes, ref.lease)
            if holder is not None and self._table.held(ref.lease, holder) <= claimed:
                raise InvalidHandle(
                    f"lease {ref.lease} holds no ref for pid {holder} (holders: "
                    f"{self._table.holders(ref.lease)}, already opened: {claimed}): no "
                    "sender shared it here"
                )
        return self._view(ref.offset, dtype, tuple(ref.shape))

    def _check_within(self, slot: int, offset: int, nbytes: int, lease: int) -> None:
        start, n, _, _ = self._table.block(slot)
        lo = self.data_offset + start * self.page_size
        if n == 0 or not lo <= offset <= lo + n * self.page_size - nbytes:
            raise InvalidHandle(
                f"bytes [{offset}, {offset + nbytes}) are not inside lease {lease}'s block"
            )

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        # Outside inference mode even when called inside it (an engine step demoting KV):
        # a view made there could not be written to later, outside it. Entering the mode
        # costs more than the view, so only when it is on.
        import torch

        if not torch.is_inference_mode_enabled():
            return self._typed_view(offset, dtype, shape)
        with torch.inference_mode(False):
            return self._typed_view(offset, dtype, shape)

    @property
    def _bytes(self) -> torch.Tensor:
        # Made on first use, so that a process that never touches a tensor (the
        # supervisor, a model-free role) never imports torch.
        view = self._typed.get(_uint8())
        if view is None:
            import torch

            view = torch.frombuffer(self._seg.mm, dtype=torch.uint8, count=self.size)
            self._typed[torch.uint8] = view
        return view

    def _typed_view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._bytes.view(dtype)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= max(d, 1)
        return typed.as_strided(shape, tuple(reversed(strides)), offset // typed.element_size())

    def tensor(self, lease: Lease, dtype: torch.dtype, shape: Iterable[int]) -> torch.Tensor:
        """A ``dtype``/``shape`` view at the start of ``lease``'s block (checked to fit)."""
        shape = tuple(shape)
        nbytes = nbytes_of(dtype_name(dtype), shape)
        with self._seg.lock():
            self._check_within(self._table.check(lease.id), lease.offset, nbytes, lease.id)
        return self._view(lease.offset, dtype, shape)

    def block_bytes(self, lease: int) -> torch.Tensor:
        """A uint8 view of a live lease's whole block (every page of it)."""
        with self._seg.lock():
            start, n, _, _ = self._table.block(self._table.check(lease))
        lo = self.data_offset + start * self.page_size
        return self._bytes[lo : lo + n * self.page_size]

    # ------------------------------------------------------------ refs

    def retain(self, lease: int, pid: int | None = None, count: int = 1) -> None:
        with self._seg.lock():
            self._table.retain(lease, os.getpid() if pid is None else pid, count)

    def release(
        self, lease: int, pid: int | None = None, count: int = 1, anonymous: bool = True
    ) -> bool:
        """Drop a ref held by ``pid`` (default: this process), else (``anonymous``) an
        anonymous one; True if the block was freed."""
        with self._seg.lock():
            who = os.getpid() if pid is None else pid
            return self._table.release(lease, who, count, anonymous)

    def tag(self, lease: int) -> tuple[int, int]:
        """``(nbytes, tag)`` of a live page block, as ``alloc`` made it; ``StaleLease`` if freed."""
        with self._seg.lock():
            _, n, nbytes, tag = self._table.block(self._table.check(lease))
        if not n:
            raise InvalidHandle(f"lease {lease} is a ticket, not a page block")
        return int(nbytes), int(tag)

    def swap_tag(self, lease: int, expect: int, new: int) -> bool:
        """Set a live block's tag from ``expect`` to ``new`` in one step under the lock;
        False (nothing changed) when it was not ``expect`` or the block is freed. Of two
        processes racing on one block (a borrower claiming a lease while its lender revokes
        it), exactly one wins."""
        with self._seg.lock():
            try:
                return self._table.swap_aux(lease, expect, new)
            except StaleLease:
                return False

    def refs(self, lease: int) -> int:
        with self._seg.lock():
            return self._table.refs(lease)

    def holders(self, lease: int) -> dict[int, int]:
        with self._seg.lock():
            return self._table.holders(lease)

    def reclaim(self, dead_pids: Iterable[int]) -> Reclaimed:
        """Drop every ref held by ``dead_pids`` (processes the caller knows have exited),
        for themselves and shared to them (``received``)."""
        dead = frozenset(holder_pid(int(p)) for p in dead_pids if p)
        with self._seg.lock():
            dropped, freed = self._table.reclaim({*dead, *(received(p) for p in dead)})
        return Reclaimed(dead, dropped, freed)

    def scan(self) -> Reclaimed:
        """Find holders whose process is gone (or a zombie) and reclaim their refs.

        A pid reused by an unrelated process since its holder died is missed: the
        supervisor, which sees its children die, should call ``reclaim`` instead.
        """
        with self._seg.lock():
            pids = {holder_pid(p) for p in self._table.holder_pids()}
        return self.reclaim(p for p in pids if not pid_alive(p))

    def stats(self) -> PoolStats:
        with self._seg.lock():
            used, live = self._table.usage()
        return PoolStats(self.name, self.page_size, self.pages, used, live)

    def alloc_ticket(self, nbytes: int, aux: int, pid: int) -> int:
        """A page-less lease counting readers of memory kept elsewhere (see cuda_ipc.py)."""
        with self._seg.lock():
            return self._table.alloc(nbytes, pid, pages=False, aux=aux)[0]

    def ticket(self, lease: int) -> tuple[int, int]:
        """``(nbytes, aux)`` of a live ticket; ``StaleLease`` once every reader released it."""
        with self._seg.lock():
            _, n, nbytes, aux = self._table.block(self._table.check(lease))
        if n:
            raise InvalidHandle(f"lease {lease} is a page block, not a ticket")
        return nbytes, aux


def _address(tensor: torch.Tensor) -> int:
    # Not data_ptr(): an empty tensor reports 0 there, wherever its storage lies.
    offset = int(tensor.storage_offset()) * tensor.element_size()
    return int(tensor.untyped_storage().data_ptr()) + offset


def _uint8() -> Any:
    torch = sys.modules.get("torch")
    return torch.uint8 if torch is not None else None


RECEIVED = 1 << 30  # above any pid (pid_max <= 2**22), in a holder slot's int32


def received(pid: int) -> int:
    """The holder id of refs shared *to* ``pid`` by a sender (0: anonymous, as ever)."""
    return pid | RECEIVED if pid else 0


def holder_pid(holder: int) -> int:
    """The process behind a holder id (its own refs or those shared to it)."""
    return holder & (RECEIVED - 1)
