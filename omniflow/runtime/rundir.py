"""Trust checks for run dirs: whose they are, and which process holds one.

A run dir holds the deployment's sockets, its state and its config: another local user
who can write any folder on the way to it (a run root they made first in a shared
/tmp) could plant a ``deployment.json`` a respawned worker runs, or a ``state.json``
that makes ``down`` signal a process of their choosing. So every folder from the run
root down must be ours and writable by no one else, and a ``state.json`` names a live
supervisor only while that pid holds the run dir's lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from omniflow.transport.security import UntrustedPath, check_private

__all__ = [
    "UntrustedPath",
    "check_private",
    "default_run_root",
    "holds_run_dir",
    "lock_holders",
    "run_root",
    "run_root_of",
]


def default_run_root() -> Path:
    """omniflow's own run root, ``/tmp/omniflow-$UID``."""
    return Path(f"/tmp/omniflow-{os.getuid()}")


def run_root() -> Path:
    """Where default run dirs live: ``$OMNIFLOW_RUN_ROOT``, else ``default_run_root()``."""
    return Path(os.environ.get("OMNIFLOW_RUN_ROOT") or default_run_root())


def run_root_of(run_dir: str | os.PathLike[str]) -> Path:
    """The folder from which ``run_dir`` must be ours: the run root for a default run
    dir (RUN_ROOT/NAME), else the run dir itself (one the config names)."""
    run_dir = Path(run_dir)
    return run_dir.parent if run_dir.parent == run_root() else run_dir


def lock_holders(lock: str | os.PathLike[str]) -> set[int] | None:
    """The pids holding a flock on ``lock`` (from /proc/locks); None where unknown."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    try:
        st = os.stat(lock)
    except OSError:
        return set()  # no lock file: no supervisor ever held this run dir
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    pids = set()
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            pid = int(fields[4])
            major_minor, inode = fields[5].rsplit(":", 1)
        except (ValueError, IndexError):
            continue
        if int(inode) == st.st_ino and major_minor == dev:
            pids.add(pid)
    return pids


def holds_run_dir(pid: int, run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``pid`` is the supervisor holding ``run_dir``'s lock (True where the
    system cannot say: no /proc/locks)."""
    holders = lock_holders(Path(run_dir) / "lock")
    return holders is None or pid in holders
