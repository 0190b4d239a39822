"""What the pool hands out: leases on blocks, and the small records its methods return."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from omniflow.memory.pool import PagePool


class PoolTensor(NamedTuple):
    tensor: torch.Tensor
    lease: Lease


class PoolStats(NamedTuple):
    name: str
    page_size: int
    pages: int
    used_pages: int
    live_leases: int

    @property
    def usage(self) -> float:
        return self.used_pages / self.pages


class Reclaimed(NamedTuple):
    dead_pids: frozenset[int]
    refs_dropped: int
    leases_freed: int


class Lease:
    """One ref on a block, held by the process that made it; ``release()`` once."""

    __slots__ = ("pool", "id", "offset", "nbytes", "pid", "_held")

    def __init__(self, pool: PagePool, lease: int, offset: int, nbytes: int, pid: int) -> None:
        self.pool, self.id, self.offset, self.nbytes, self.pid = pool, lease, offset, nbytes, pid
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            self.pool.release(self.id, self.pid)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({self.id}, offset={self.offset}, nbytes={self.nbytes}, held={self._held})"
