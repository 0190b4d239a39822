"""``cache.ssd_capacity`` is one total per host, shared by the processes that spill there.

Every encoder replica on a host keeps an SSD tier of its own (its slot map lives in its
process), and each preallocates its files up front. Sized alone, each took the whole
capacity: N processes, N times the disk. So a process sizes its tier as its share: under
an exclusive lock on the SSD folder itself (``flock`` on the directory), it adds up the
tier files of the live processes there, and may preallocate what its cache can use, but
never more than the capacity those leave; it preallocates before the lock is let go, so
the next process counts it. A process that finds the capacity spent runs without an SSD
tier (its caller logs it). The files of a dead process no longer count (its successor
removes them).

A tier file is named ``PREFIX-PID.I.pages`` (``SsdStore(name=f"{prefix}-{pid}")``): the
pid says whose it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from omniflow.memory.liveness import pid_alive

_TIER_FILE = re.compile(r"-(\d+)\.\d+\.pages$")


def held_by_live(directory: Path, prefix: str) -> int:
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
def host_share(directory: str, capacity: int, want: int, prefix: str) -> Iterator[int]:
    """Hold ``directory``'s lock and give the bytes this process may preallocate there:
    ``want``, at most what ``capacity`` leaves after the live processes' files (of names
    starting with ``prefix``). Preallocate inside the ``with``; others wait meanwhile."""
    if not os.path.isdir(directory):
        raise ValueError(f"ssd_dir: {directory!r} is not a directory")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield max(0, min(want, capacity - held_by_live(Path(directory), prefix)))
    finally:
        os.close(fd)  # lets the lock go
