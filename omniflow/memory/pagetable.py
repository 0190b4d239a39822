"""The pool's allocator and lease table, kept in the segment's header so every process shares it.

Layout (all offsets from the segment start, each region 64-byte aligned)::

    superblock   32 int64: magic, version, geometry, lease generation, usage
    page_used    1 byte per page: 0 free, 1 used (searched with mmap.find: C speed)
    slot_used    1 byte per lease slot
    page_slot    int32 per page: the slot of the block that owns it
    slots        8 int64 per slot: lease id, first page, pages, bytes, refs, anon refs, aux, pid
    holders      16 (pid, count) int32 pairs per slot
    data         pages, from data_offset

A lease id is ``generation << 24 | slot``: a handle naming a slot that was freed and
reused carries the old generation and is rejected. A block is freed when its refs reach
zero; refs are attributed to the pid that holds them so ``reclaim(dead_pids)`` can drop
what a dead process held. Refs given with pid 0 are anonymous: counted, never reclaimed.

Every method here must run under the segment lock. Writes are ordered so that a holder
killed mid-update can leak a block but never hand one block out twice.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import numpy as np

from omniflow.memory.errors import PoolError, PoolExhausted, StaleLease

MAGIC = 0x776F6C66696E6D6F  # b"omniflow" little-endian
VERSION = 1
HOLDERS = 16
SLOT_BITS = 24
SLOT_MASK = (1 << SLOT_BITS) - 1
SUPER_QWORDS = 32
SLOT_QWORDS = 8
# superblock fields
_MAGIC, _VERSION, _PAGE_SIZE, _N_PAGES, _N_SLOTS, _DATA_OFFSET, _TOTAL, _GEN, _USED, _LIVE = range(
    10
)
# slot fields
_LEASE, _START, _NPAGES, _NBYTES, _REFS, _ANON, _AUX, _PID = range(SLOT_QWORDS)


class Layout(NamedTuple):
    page_size: int
    n_pages: int
    n_slots: int
    page_used: int
    slot_used: int
    page_slot: int
    slots: int
    holders: int
    data_offset: int
    total: int


def plan(page_size: int, n_pages: int, n_tickets: int = 4096) -> Layout:
    """Where everything goes for ``n_pages`` pages plus ``n_tickets`` page-less leases."""
    n_slots = n_pages + n_tickets
    if n_slots > SLOT_MASK:
        raise ValueError(f"{n_pages} pages need {n_slots} lease slots, more than {SLOT_MASK}")
    at = SUPER_QWORDS * 8
    offsets: list[int] = []
    for nbytes in (n_pages, n_slots, 4 * n_pages, 8 * SLOT_QWORDS * n_slots, 8 * HOLDERS * n_slots):
        offsets.append(at)
        at = _align(at + nbytes, 64)
    data_offset = _align(at, max(4096, min(page_size, 1 << 21)))
    page_used, slot_used, page_slot, slots, holders = offsets
    total = data_offset + n_pages * page_size
    return Layout(
        page_size,
        n_pages,
        n_slots,
        page_used,
        slot_used,
        page_slot,
        slots,
        holders,
        data_offset,
        total,
    )


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class PageTable:
    def __init__(self, buf: mmap.mmap, layout: Layout) -> None:
        self.buf = buf
        self.layout = lay = layout
        self.page_size = lay.page_size
        self.n_pages = lay.n_pages
        self.n_slots = lay.n_slots
        # Memoryviews give fast scalar access (Python ints); numpy views serve bulk work.
        self._super = memoryview(buf)[: SUPER_QWORDS * 8].cast("q")
        self._slots = memoryview(buf)[lay.slots : lay.slots + 8 * SLOT_QWORDS * lay.n_slots].cast(
            "q"
        )
        self._holders = memoryview(buf)[lay.holders : lay.holders + 8 * HOLDERS * lay.n_slots].cast(
            "i"
        )
        self._page_used = np.frombuffer(buf, np.uint8, lay.n_pages, lay.page_used)
        self._slot_used = np.frombuffer(buf, np.uint8, lay.n_slots, lay.slot_used)
        self._page_slot = np.frombuffer(buf, np.int32, lay.n_pages, lay.page_slot)
        self._holder_arr = np.frombuffer(buf, np.int32, 2 * HOLDERS * lay.n_slots, lay.holders)

    @classmethod
    def format(cls, buf: mmap.mmap, layout: Layout) -> PageTable:
        """Write a fresh superblock; the file is zero-filled, so every page and slot is free."""
        t = cls(buf, layout)
        s = t._super
        s[_VERSION], s[_PAGE_SIZE], s[_N_PAGES], s[_N_SLOTS] = VERSION, *layout[:3]
        s[_DATA_OFFSET], s[_TOTAL] = layout.data_offset, layout.total
        s[_MAGIC] = MAGIC  # last: an attach that races creation sees no magic, not half a header
        return t

    @classmethod
    def open(cls, buf: mmap.mmap, name: str) -> PageTable:
        s = memoryview(buf)[: SUPER_QWORDS * 8].cast("q")
        try:
            if s[_MAGIC] != MAGIC or s[_VERSION] != VERSION:
                raise PoolError(
                    f"pool {name!r}: segment is not an omniflow pool of version {VERSION} "
                    f"(magic {s[_MAGIC]:#x}, version {s[_VERSION]})"
                )
            layout = plan(s[_PAGE_SIZE], s[_N_PAGES], s[_N_SLOTS] - s[_N_PAGES])
            if layout.data_offset != s[_DATA_OFFSET] or layout.total > len(buf):
                raise PoolError(f"pool {name!r}: header geometry does not match the segment")
        finally:
            s.release()
        return cls(buf, layout)

    def close(self) -> None:
        for view in (self._super, self._slots, self._holders):
            view.release()
        del self._page_used, self._slot_used, self._page_slot, self._holder_arr

    # ------------------------------------------------------------ allocation

    def alloc(self, nbytes: int, pid: int, pages: bool = True, aux: int = 0) -> tuple[int, int]:
        """A new lease holding one ref for ``pid``; returns ``(lease, first_page)``.

        ``pages=False`` makes a ticket: a lease with no pages, used as a cross-process
        reader count for memory kept elsewhere (CUDA IPC chunks); ``aux`` is its offset.
        """
        n = max(1, -(-nbytes // self.page_size)) if pages else 0
        start = -1
        if n:
            at = self.layout.page_used
            start = self.buf.find(bytes(n), at, at + self.n_pages)
            if start < 0:
                raise PoolExhausted(self._exhausted_message(nbytes, n))
            start -= at
        at = self.layout.slot_used
        slot = self.buf.find(b"\0", at, at + self.n_slots)
        if slot < 0:
            raise PoolExhausted(f"all {self.n_slots} lease slots are in use")
        slot -= at
        gen = self._super[_GEN] + 1
        self._super[_GEN] = gen
        lease = gen << SLOT_BITS | slot
        if n:
            self._page_used[start : start + n] = 1
            self._page_slot[start : start + n] = slot
        self._slot_used[slot] = 1
        q = slot * SLOT_QWORDS
        sl = self._slots
        sl[q + _START], sl[q + _NPAGES], sl[q + _NBYTES] = start, n, nbytes
        sl[q + _REFS], sl[q + _ANON], sl[q + _AUX], sl[q + _PID] = 0, 0, aux, pid
        self._super[_USED] += n
        self._super[_LIVE] += 1
        sl[q + _LEASE] = lease  # publish last
        self.retain(lease, pid)
        return lease, start

    def _exhausted_message(self, nbytes: int, n: int) -> str:
        used = self._super[_USED]
        return (
            f"no run of {n} free pages for {nbytes} bytes: {used}/{self.n_pages} pages of "
            f"{self.page_size} bytes in use, largest free run {self.largest_free_run()} pages"
        )

    def largest_free_run(self) -> int:
        free = np.concatenate(([0], (self._page_used == 0).view(np.int8), [0]))
        edges = np.diff(free)
        runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
        return int(runs.max()) if len(runs) else 0

    # ------------------------------------------------------------ leases

    def check(self, lease: int) -> int:
        """The slot of a live ``lease``; ``StaleLease`` otherwise."""
        slot = lease & SLOT_MASK if isinstance(lease, int) and lease > 0 else -1
        if not 0 <= slot < self.n_slots or self._slots[slot * SLOT_QWORDS + _LEASE] != lease:
            raise StaleLease(f"lease {lease} is not live (already freed, or forged)")
        return slot

    def block(self, slot: int) -> tuple[int, int, int, int]:
        """``(first_page, pages, nbytes, aux)`` of the live block in ``slot``."""
        q = slot * SLOT_QWORDS
        s = self._slots
        return s[q + _START], s[q + _NPAGES], s[q + _NBYTES], s[q + _AUX]

    def swap_aux(self, lease: int, expect: int, new: int) -> bool:
        """Set a live block's aux from ``expect`` to ``new``; False (unchanged) otherwise."""
        q = self.check(lease) * SLOT_QWORDS
        if self._slots[q + _AUX] != expect:
            return False
        self._slots[q + _AUX] = new
        return True

    def refs(self, lease: int) -> int:
        """Refs on ``lease``; 0 once freed."""
        try:
            slot = self.check(lease)
        except StaleLease:
            return 0
        return self._slots[slot * SLOT_QWORDS + _REFS]

    def holders(self, lease: int) -> dict[int, int]:
        slot = self.check(lease)
        h = self._holders
        out = {
            h[i]: h[i + 1] for i in range(slot * 2 * HOLDERS, (slot + 1) * 2 * HOLDERS, 2) if h[i]
        }
        anon = self._slots[slot * SLOT_QWORDS + _ANON]
        if anon:
            out[0] = anon
        return out

    def held(self, lease: int, holder: int) -> int:
        """Refs on a live ``lease`` held by ``holder`` (0: the anonymous ones)."""
        slot = self.check(lease)
        if not holder:
            return self._slots[slot * SLOT_QWORDS + _ANON]
        h = self._holders
        base = slot * 2 * HOLDERS
        for i in range(base, base + 2 * HOLDERS, 2):
            if h[i] == holder:
                return h[i + 1]
        return 0

    def slot_of_page(self, page: int) -> int:
        """The slot owning ``page`` if it is in use, else -1."""
        if not 0 <= page < self.n_pages or not self._page_used[page]:
            return -1
        return int(self._page_slot[page])

    def lease_of_slot(self, slot: int) -> int:
        return self._slots[slot * SLOT_QWORDS + _LEASE]

    def retain(self, lease: int, pid: int, count: int = 1) -> None:
        slot = self.check(lease)
        q = slot * SLOT_QWORDS
        if pid:
            h = self._holders
            base = slot * 2 * HOLDERS
            free = -1
            for i in range(base, base + 2 * HOLDERS, 2):
                if h[i] == pid:
                    h[i + 1] += count
                    break
                if free < 0 and h[i] == 0:
                    free = i
            else:
                if free < 0:
                    raise PoolError(
                        f"lease {lease} is already held by {HOLDERS} processes; pid {pid} "
                        "cannot take another ref"
                    )
                h[free + 1] = count
                h[free] = pid
        else:
            self._slots[q + _ANON] += count
        self._slots[q + _REFS] += count

    def release(self, lease: int, pid: int, count: int = 1, anonymous: bool = True) -> bool:
        """Drop ``count`` refs held by ``pid`` (else, with ``anonymous``, anonymous ones);
        True if that freed the block."""
        slot = self.check(lease)
        q = slot * SLOT_QWORDS
        h = self._holders
        base = slot * 2 * HOLDERS
        for i in range(base, base + 2 * HOLDERS, 2):
            if pid and h[i] == pid and h[i + 1] >= count:
                h[i + 1] -= count
                if h[i + 1] == 0:
                    h[i] = 0
                break
        else:
            if not anonymous or self._slots[q + _ANON] < count:
                raise PoolError(
                    f"pid {pid} holds no ref on lease {lease} (holders: {self.holders(lease)})"
                )
            self._slots[q + _ANON] -= count
        refs = self._slots[q + _REFS] - count
        self._slots[q + _REFS] = refs
        if refs <= 0:
            self._free(slot)
            return True
        return False

    def _free(self, slot: int) -> None:
        q = slot * SLOT_QWORDS
        self._slots[q + _LEASE] = 0  # first: from here on, handles naming it are rejected
        start, n = self._slots[q + _START], self._slots[q + _NPAGES]
        self._holder_arr[slot * 2 * HOLDERS : (slot + 1) * 2 * HOLDERS] = 0
        self._slot_used[slot] = 0
        if n:
            self._page_used[start : start + n] = 0
        self._super[_USED] -= n
        self._super[_LIVE] -= 1

    # ------------------------------------------------------------ dead processes

    def holder_pids(self) -> set[int]:
        pids = self._holder_arr[0::2]
        return {int(p) for p in np.unique(pids[pids != 0])}

    def reclaim(self, dead: set[int]) -> tuple[int, int]:
        """Drop every ref held by a pid in ``dead``; returns ``(refs_dropped, leases_freed)``."""
        if not dead:
            return 0, 0
        pids = self._holder_arr[0::2]
        hits = np.flatnonzero(np.isin(pids, np.fromiter(dead, np.int64)) & (pids != 0))
        dropped = freed = 0
        for k in hits.tolist():
            slot = k // HOLDERS
            lease = self._slots[slot * SLOT_QWORDS + _LEASE]
            pid, count = int(pids[k]), int(self._holder_arr[2 * k + 1])
            if lease == 0 or pid == 0 or count == 0:
                continue
            dropped += count
            freed += self.release(lease, pid, count)
        return dropped, freed

    def usage(self) -> tuple[int, int]:
        """``(used_pages, live_leases)``."""
        return self._super[_USED], self._super[_LIVE]
