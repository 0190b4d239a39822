"""Errors of the cache layer; every message names the pool, lease or field at fault."""

from __future__ import annotations


class PoolError(RuntimeError):
    """Misuse of a page pool (wrong process, table full, unknown segment)."""


class PoolExhausted(PoolError, MemoryError):
    """No run of free pages (or no free lease slot) large enough; raised at once, never waited on."""


class InvalidHandle(PoolError, ValueError):
    """A handle that names bytes this process must not read: forged, stale or inconsistent."""


class StaleLease(InvalidHandle):
    """The lease a handle names was freed (or never existed)."""


class SsdError(RuntimeError):
    """The SSD tier cannot spill or restore (full, closed, I/O error)."""


class SsdCorruption(SsdError):
    """A page read back from the SSD tier does not match the checksum written with it."""
