"""``cache.ssd_capacity`` is one total per host, shared by the processes that spill there.

Every process with an SSD tier on a host (each encoder replica's cache, each llm replica's
KV pages below its host tier) keeps a tier of its own (its slot map lives in its process),
and each preallocates its files up front. Sized alone, each took the whole capacity: N
processes, N times the disk. So a process sizes its tier as its share (``SsdShare``):
under an exclusive lock on the SSD folder itself (``flock`` on the directory), it adds up
the tier files of the live processes there, and may preallocate what it can use, but never
more than its fair part (``capacity // sharers``, the sharers being the processes of the
deployment on this host with an SSD tier) nor more than the capacity the others leave; it
preallocates before the lock is let go, so the next process counts it. The fair part keeps
the first process from taking it all: each of N gets its part whatever order they start in.
A process that finds the capacity spent runs without an SSD tier (its caller logs it). The
files of a dead process no longer count (its successor removes them).

A tier file is named ``SHARE_PREFIX + NAME-PID.I.pages`` (NAME says which role replica,
e.g. ``encoder-vision-0`` or ``kv-llm-0``; the pid says which process).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from omniflow.memory.liveness import pid_alive
from omniflow.memory.ssd import SsdStore

# Every shared tier file starts so: the files that count against cache.ssd_capacity.
SHARE_PREFIX = "share-"
_TIER_FILE = re.compile(r"-(\d+)\.\d+\.pages$")


def held_by_live(directory: Path, prefix: str = SHARE_PREFIX) -> int:
    """Bytes the tier files ``prefix*-PID.I.pages`` of live processes take in ``directory``."""
    total = 0
    for path in directory.glob(f"{prefix}*.pages"):
        found = _TIER_FILE.search(path.name)
        if found is None or not pid_alive(int(found.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):  # it closed meanwhile
            total += path.stat().st_size
    return total


@contextlib.contextmanager
def host_share(
    directory: str, capacity: int, want: int, prefix: str = SHARE_PREFIX, sharers: int = 1
) -> Iterator[int]:
    """Hold ``directory``'s lock and give the bytes this process may preallocate there:
    ``want``, at most its fair part ``capacity // sharers``, and at most what ``capacity``
    leaves after the live processes' files (of names starting with ``prefix``).
    Preallocate inside the ``with``; others wait meanwhile."""
    if not os.path.isdir(directory):
        raise ValueError(f"ssd_dir: {directory!r} is not a directory")
    fair = capacity // max(1, sharers)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield max(0, min(want, fair, capacity - held_by_live(Path(directory), prefix)))
    finally:
        os.close(fd)  # lets the lock go


@dataclass(frozen=True)
class SsdShare:
    """How one role replica's SSD tier takes part in the per-host ``cache.ssd_capacity``."""

    capacity: int  # cache.ssd_capacity in bytes: the host's total
    name: str  # which role replica: its files are SHARE_PREFIX + name + -PID.I.pages
    sharers: int = 1  # processes on this host with an SSD tier there: each takes <= 1/sharers

    def preallocate(
        self, directory: str, want: int, page_size: int, *, sync: bool = True
    ) -> SsdStore | None:
        """A store of this process's share of ``want`` bytes in ``directory`` (whole pages),
        preallocated under the folder's lock; None when the share is under one page."""
        remove_orphans(Path(directory), self.name)
        with host_share(directory, self.capacity, want, SHARE_PREFIX, self.sharers) as share:
            slots = share // page_size
            if slots < 1:
                return None
            name = f"{SHARE_PREFIX}{self.name}-{os.getpid()}"
            return SsdStore(directory, slots * page_size, page_size, name=name, sync=sync)


def remove_orphans(directory: Path, name: str) -> None:
    """Delete the tier files of ``name``'s earlier processes that are gone (kill -9 leaves
    them: only a clean close removes its own), those named before the share prefix too
    (``NAME-PID.I.pages``: never counted, they would take the disk for good)."""
    for stem in (f"{SHARE_PREFIX}{name}-", f"{name}-"):
        for path in directory.glob(f"{stem}*.pages"):
            pid = path.name[len(stem) :].split(".", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                path.unlink(missing_ok=True)
