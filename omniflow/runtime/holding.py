"""What a worker holds right now, in a file its supervisor reads when it dies.

A heartbeat publishes the requests a replica holds only every ``heartbeat_s``; one
killed in between takes the newer ones with it, and their clients would wait out
their deadlines. So each worker also keeps its in-flight requests in a small shared
file mapping, written as requests arrive and end: plain memory stores, no syscall,
and the kernel keeps the pages when the process is killed. The supervisor reads it
at the death and fails each request there with ``unavailable`` at once.

The file is exact unless a request did not fit (no free slot, or a name too long): the
header counts those held now, and only while that count is above 0 does the supervisor
also use the heartbeat's list (which may name requests that ended since the last beat).

Layout: a 16-byte header (the writer's pid, then the count of held requests that have no
slot), then fixed slots of ``SLOT`` bytes: a 2-byte length (0: free) and
``request_id \\n reply_to \\n token`` in UTF-8 (the request's token in hex: the supervisor's
death notice must show it, or the client drops the notice).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

SLOT = 256
_HEADER = struct.Struct("<qq")  # pid, requests held without a slot
_LENGTH = struct.Struct("<H")


class HoldingFile:
    """The writer's side: ``add`` a request as it arrives, ``remove`` its slot as it ends."""

    def __init__(self, path: Path, slots: int) -> None:
        self.path = Path(path)
        size = _HEADER.size + slots * SLOT
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        self._unlisted = 0
        _HEADER.pack_into(self._map, 0, self._pid, 0)
        self._free = list(range(slots - 1, -1, -1))

    def add(self, request_id: str, reply_to: str, token: bytes = b"") -> int:
        """The slot now naming this request, or -1 when none is free or it does not fit
        (counted in the header: the heartbeat's list still covers it)."""
        payload = f"{request_id}\n{reply_to}\n{token.hex()}".encode()
        if not self._free or len(payload) > SLOT - _LENGTH.size:
            self._count_unlisted(+1)
            return -1
        slot = self._free.pop()
        at = _HEADER.size + slot * SLOT
        self._map[at + 2 : at + 2 + len(payload)] = payload
        _LENGTH.pack_into(self._map, at, len(payload))  # the length last: a slot is whole
        return slot

    def remove(self, slot: int) -> None:
        """The request ``add`` gave ``slot`` ended (-1: one that got none)."""
        if slot < 0:
            self._count_unlisted(-1)
            return
        _LENGTH.pack_into(self._map, _HEADER.size + slot * SLOT, 0)
        self._free.append(slot)

    def _count_unlisted(self, delta: int) -> None:
        self._unlisted = max(0, self._unlisted + delta)
        _HEADER.pack_into(self._map, 0, self._pid, self._unlisted)

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


class Held(NamedTuple):
    """What a holding file says: ``requests`` (request id, reply address), whether that
    is all the writer held (False too when the file is missing or another incarnation's),
    and each request's token (what its death notice must carry)."""

    requests: list[tuple[str, str]]
    complete: bool
    tokens: dict[str, bytes] = {}


def read_held(path: Path, pid: int) -> Held:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return Held([], False)
    if len(data) < _HEADER.size:
        return Held([], False)
    writer, unlisted = _HEADER.unpack_from(data, 0)
    if writer != pid:
        return Held([], False)
    held, tokens = [], {}
    for at in range(_HEADER.size, len(data) - SLOT + 1, SLOT):
        (n,) = _LENGTH.unpack_from(data, at)
        if n:
            request_id, _, rest = data[at + 2 : at + 2 + n].decode().partition("\n")
            reply_to, _, token = rest.rpartition("\n")
            held.append((request_id, reply_to))
            tokens[request_id] = bytes.fromhex(token)
    return Held(held, unlisted == 0, tokens)


def read_holding(path: Path, pid: int) -> list[tuple[str, str]]:
    """(request id, reply address) of every request in the dead ``pid``'s file; [] when the
    file is missing or another incarnation's."""
    return read_held(path, pid).requests


def holding_path(run_dir: Path, role: str, replica: int) -> Path:
    return Path(run_dir) / f"{role}-{replica}.holding"
