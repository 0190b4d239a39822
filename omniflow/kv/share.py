"""Read-only leases of a prefix's KV pages to another role on the same host.

An engine whose KV tensors live in the deployment's page pool can lend the KV of a finished
request's tokens (prompt and reply) to another process — say a diffusion role attending to
the LLM's prompt — without copying the full pages:

- ``keys``/``values`` name the lender's whole K and V tensors in the pool
  ([layers, kv_heads, pages, page_size, head_dim]); ``page_ids`` lists the prefix's full
  pages. The lender keeps those pages referenced in its radix tree while the lease lives,
  so they are never evicted, demoted or reused under the borrower; full pages never change.
- ``tail`` is copy-on-write: the rows past the last full page were in a page the lender goes
  on writing (or reuses), so they are copied once into a block of their own,
  [2, layers, kv_heads, rows, head_dim].

Each of the three handles holds one pool ref for the borrower's pid. The borrower drops them
when done (``KVLeaseView.close``, or the end of a ``with`` block); if it dies, the
supervisor reclaims them. The lender sees the tail block's ref count fall back to its own
and unlocks the pages (``LeaseBook.reap``). Nothing is written through a lease: it is
read-only by contract (the views are plain tensors over shared memory).

A lease must be claimed: the borrower's ``KVLeaseView`` flips the tail block's tag from
lent to claimed. One lost on its way (the message never delivered, the request dropped
where nothing gives it back) while the borrower lives on would otherwise hold the pages
until that process exits, so the lender revokes a lease still unclaimed after
``claim_s`` (``LeaseBook.reap``), or at once when it knows the lease will never arrive
(``revoke``): it flips the tag to revoked and drops the borrower's refs itself. The flip
is one compare-and-swap under the pool's lock, so a claim and a revocation racing on one
lease never both win; a borrower that comes too late gets ``StaleLease``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, NamedTuple

import msgspec
import torch

from omniflow.memory.errors import PoolError, StaleLease
from omniflow.memory.pool import PagePool
from omniflow.messages import Shm

# The tail block's tag: a lease's state, read and changed only by PagePool.swap_tag.
LENT, CLAIMED, REVOKED = 0x4B564C01, 0x4B564C02, 0x4B564C03


class KVLease(msgspec.Struct, frozen=True, omit_defaults=True):
    keys: Shm
    values: Shm
    tail: Shm
    page_ids: list[int]
    page_size: int
    num_tokens: int  # full pages * page_size + tail rows


class KVLeaseView:
    """The borrower's side: per-layer K/V of the leased prefix, gathered from the pages."""

    def __init__(self, pool: PagePool, lease: KVLease | dict[str, Any]):
        if not isinstance(lease, KVLease):
            lease = msgspec.convert(lease, KVLease)
        self.pool, self.lease = pool, lease
        if not pool.swap_tag(lease.tail.lease, LENT, CLAIMED):
            raise StaleLease(
                f"KV lease {lease.tail.lease}: revoked by its lender (not claimed in time, "
                "or its request ended there) or already claimed"
            )
        self._open = True
        try:
            self.keys = pool.open(lease.keys)
            self.values = pool.open(lease.values)
            self.tail = pool.open(lease.tail)
        except BaseException:
            self.close()  # claimed: the refs are this process's to drop
            raise
        self.num_layers = self.keys.shape[0]
        self._pages = torch.tensor(lease.page_ids, dtype=torch.long)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer: [kv_heads, num_tokens, head_dim] each (a gather)."""
        if not self._open:
            raise RuntimeError("KV lease already closed")
        out = []
        for which, table in ((0, self.keys), (1, self.values)):
            pages = table[index].index_select(1, self._pages)  # [heads, n, size, dim]
            heads, _, _, dim = pages.shape
            out.append(torch.cat((pages.reshape(heads, -1, dim), self.tail[which, index]), dim=1))
        return out[0], out[1]

    def close(self) -> None:
        """Drop the borrower's refs: the lender may unlock the pages."""
        if self._open:
            self._open = False
            pid = os.getpid()
            for ref in (self.lease.keys, self.lease.values, self.lease.tail):
                self.pool.release(ref.lease, pid)

    def __enter__(self) -> KVLeaseView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def revoke(pool: PagePool, lease: KVLease, borrower_pid: int) -> bool:
    """The lender takes back a lease the borrower has not claimed: the borrower's refs are
    dropped here (the lender's ``reap`` then unlocks the pages). False when it was claimed
    (the borrower hands it back itself) or is gone."""
    if not pool.swap_tag(lease.tail.lease, LENT, REVOKED):
        return False
    for ref in (lease.keys, lease.values, lease.tail):
        # A borrower that died was reclaimed: its refs are gone already.
        with contextlib.suppress(PoolError):
            if pool.holders(ref.lease).get(borrower_pid, 0):
                pool.release(ref.lease, borrower_pid)
    return True


class _Lent(NamedTuple):
    tail: Any  # the tail block's Lease (the lender's own ref): the lease's liveness
    pages: list[int]  # page ids held for it
    lease: KVLease
    borrower: int
    claim_by: float  # time.monotonic() after which an unclaimed lease is revoked


class LeaseBook:
    """The lender's side: open leases, each a tail block (its liveness) and locked pages."""

    def __init__(self, pool: PagePool, claim_s: float = 60.0):
        if not claim_s > 0:
            raise ValueError(f"claim_s: expected seconds > 0, got {claim_s!r}")
        self.pool, self.claim_s = pool, claim_s
        self.open: list[_Lent] = []
        self.revoked = 0  # leases taken back unclaimed (by reap; revoke() callers count theirs)

    def lend(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        page_ids: list[int],
        page_size: int,
        tail_rows: torch.Tensor,
        borrower_pid: int,
    ) -> KVLease:
        """A lease for ``borrower_pid``: ``page_ids`` must already be held for it (the caller
        referenced them); ``tail_rows`` [2, layers, kv_heads, rows, dim] is copied."""
        rows = tail_rows.contiguous()
        block = self.pool.alloc(rows.numel() * rows.element_size(), tag=LENT)
        try:
            tail = self.pool.tensor(block, rows.dtype, rows.shape)
            tail.copy_(rows)
        except BaseException:
            block.release()
            raise
        lease = KVLease(
            self.pool.share(keys, borrower_pid),
            self.pool.share(values, borrower_pid),
            self.pool.share(tail, borrower_pid),
            list(page_ids),
            page_size,
            len(page_ids) * page_size + tail_rows.shape[3],
        )
        claim_by = time.monotonic() + self.claim_s
        self.open.append(_Lent(block, list(page_ids), lease, borrower_pid, claim_by))
        return lease

    def reap(self) -> list[list[int]]:
        """Leases whose borrower let go (or died and was reclaimed), and leases revoked
        now because nobody claimed them in time: their pages, to free."""
        done, still = [], []
        now = time.monotonic()
        for lent in self.open:
            if now >= lent.claim_by and revoke(self.pool, lent.lease, lent.borrower):
                self.revoked += 1
            if self.pool.refs(lent.tail.id) <= 1:
                lent.tail.release()
                done.append(lent.pages)
            else:
                still.append(lent)
        self.open = still
        return done

    def close(self) -> None:
        """The lender is done: unclaimed leases are revoked, and its own refs on the tails
        go (a claimed lease stays readable: the borrower's refs keep its blocks)."""
        for lent in self.open:
            if revoke(self.pool, lent.lease, lent.borrower):
                self.revoked += 1
            lent.tail.release()
        self.open = []
