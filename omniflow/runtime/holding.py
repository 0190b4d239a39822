"""What a worker holds right now, in a file its supervisor reads when it dies.

A heartbeat publishes the requests a replica holds only every ``heartbeat_s``; one
killed in between takes the newer ones with it, and their clients would wait out
their deadlines. So each worker also keeps its in-flight requests in a small shared
file mapping, written as requests arrive and end: plain memory stores, no syscall,
and the kernel keeps the pages when the process is killed. The supervisor reads it
at the death and fails each request there with ``unavailable`` at once, with the
request's token (a client drops a notice without it).

The file names every request held: an actor refuses a Call whose request id or reply
address is past ``MAX_ID_BYTES``/``MAX_ADDRESS_BYTES``, so each fits a slot, and the
file doubles its slots when they run out (a syscall, only then). Only a file that could
not grow misses one (logged); its client still moves it on once the dead replica leaves
its view (``migration.py``).

Layout: an 8-byte header (the writer's pid), then fixed slots of ``SLOT`` bytes:
a 2-byte length (0: free) and ``request_id \\n reply_to \\n token`` in UTF-8 (the token
in hex).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

from omniflow.messages import MAX_ADDRESS_BYTES, MAX_ID_BYTES, TOKEN_BYTES

log = logging.getLogger("omniflow.runtime.holding")

_HEADER = struct.Struct("<q")  # the writer's pid
_LENGTH = struct.Struct("<H")
SLOT = _LENGTH.size + MAX_ID_BYTES + 1 + MAX_ADDRESS_BYTES + 1 + 2 * TOKEN_BYTES


class HoldingFile:
    """The writer's side: ``add`` a request as it arrives, ``remove`` its slot as it ends."""

    def __init__(self, path: Path, slots: int) -> None:
        self.path = Path(path)
        self._slots = max(1, slots)
        size = _HEADER.size + self._slots * SLOT
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, os.getpid())
        self._free = list(range(self._slots - 1, -1, -1))

    @property
    def slots(self) -> int:
        return self._slots

    def add(self, request_id: str, reply_to: str, token: bytes = b"") -> int:
        """The slot now naming this request; -1 only when it is longer than a slot (an
        actor refuses such a Call first) or the file could not grow."""
        payload = f"{request_id}\n{reply_to}\n{token.hex()}".encode()
        if len(payload) > SLOT - _LENGTH.size:
            log.warning("holding file %s: request %.64r does not fit a slot", self.path, request_id)
            return -1
        if not self._free and not self._grow():
            return -1
        slot = self._free.pop()
        at = _HEADER.size + slot * SLOT
        self._map[at + 2 : at + 2 + len(payload)] = payload
        _LENGTH.pack_into(self._map, at, len(payload))  # the length last: a slot is whole
        return slot

    def _grow(self) -> bool:
        """Twice the slots (the new ones zero: free); False where the file cannot grow."""
        slots = 2 * self._slots
        try:
            self._map.resize(_HEADER.size + slots * SLOT)
        except (OSError, ValueError, SystemError) as e:
            log.warning("holding file %s: cannot grow to %d slots: %s", self.path, slots, e)
            return False
        self._free.extend(range(slots - 1, self._slots - 1, -1))
        self._slots = slots
        return True

    def remove(self, slot: int) -> None:
        """The request ``add`` gave ``slot`` ended (-1: one that got none)."""
        if slot < 0:
            return
        _LENGTH.pack_into(self._map, _HEADER.size + slot * SLOT, 0)
        self._free.append(slot)

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


class Held(NamedTuple):
    """What a holding file says: ``requests`` (request id, reply address), and each
    request's token (what its death notice must carry); both empty when the file is
    missing or another incarnation's."""

    requests: list[tuple[str, str]]
    tokens: dict[str, bytes] = {}


def read_held(path: Path, pid: int) -> Held:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return Held([])
    if len(data) < _HEADER.size:
        return Held([])
    (writer,) = _HEADER.unpack_from(data, 0)
    if writer != pid:
        return Held([])
    held, tokens = [], {}
    for at in range(_HEADER.size, len(data) - SLOT + 1, SLOT):
        (n,) = _LENGTH.unpack_from(data, at)
        if n:
            request_id, _, rest = data[at + 2 : at + 2 + n].decode().partition("\n")
            reply_to, _, token = rest.rpartition("\n")
            held.append((request_id, reply_to))
            tokens[request_id] = bytes.fromhex(token)
    return Held(held, tokens)


def read_holding(path: Path, pid: int) -> list[tuple[str, str]]:
    """(request id, reply address) of every request in the dead ``pid``'s file; [] when the
    file is missing or another incarnation's."""
    return read_held(path, pid).requests


def holding_path(run_dir: Path, role: str, replica: int) -> Path:
    return Path(run_dir) / f"{role}-{replica}.holding"
