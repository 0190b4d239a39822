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
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from omniflow.cache.pool import PagePool
from omniflow.messages import Shm


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
        self._open = True
        self.keys = pool.open(lease.keys)
        self.values = pool.open(lease.values)
        self.tail = pool.open(lease.tail)
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


class LeaseBook:
    """The lender's side: open leases, each a tail block (its liveness) and locked pages."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.open: list[tuple[Any, list[int]]] = []  # (tail block Lease, page ids held)

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
        tail = self.pool.copy_in(tail_rows.contiguous())
        lease = KVLease(
            self.pool.share(keys, borrower_pid),
            self.pool.share(values, borrower_pid),
            self.pool.share(tail.tensor, borrower_pid),
            list(page_ids),
            page_size,
            len(page_ids) * page_size + tail_rows.shape[3],
        )
        self.open.append((tail.lease, list(page_ids)))
        return lease

    def reap(self) -> list[list[int]]:
        """Leases whose borrower let go (or died and was reclaimed): their pages, to free."""
        done, still = [], []
        for tail, pages in self.open:
            if self.pool.refs(tail.id) <= 1:
                tail.release()
                done.append(pages)
            else:
                still.append((tail, pages))
        self.open = still
        return done
