"""``build_tiny`` folders, built atomically and never inside an existing folder.

A role with ``build_tiny = true`` builds its random-weight model only where ``model_path``
names no folder yet (or an empty one): everything is written into a sibling temporary
folder, renamed into place once complete. An existing folder is never written into, so a
user's checkpoint stays byte-for-byte as it was, and a build killed half way (a full disk,
Ctrl-C) leaves only a temporary folder, removed by the next start, which builds again.
Replicas building the same folder at once take turns on a lock file next to it.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_STAGING = ".{name}.building-"


def needs_build(folder: Path) -> bool:
    """True when ``folder`` does not exist or is an empty directory."""
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def build_atomically(folder: str | Path, build: Callable[[Path], object]) -> bool:
    """Run ``build(staging)`` and rename ``staging`` to ``folder``, unless ``folder`` holds
    something already. Returns whether it built."""
    folder = Path(folder)
    if not needs_build(folder):
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the kernel drops it if the builder dies
        if not needs_build(folder):  # another replica built it while this one waited
            return False
        prefix = _STAGING.format(name=folder.name)
        for stale in folder.parent.glob(prefix + "*"):  # an interrupted build's, under the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
        try:
            build(staging)
            if folder.is_dir():
                folder.rmdir()  # empty (checked above)
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True
