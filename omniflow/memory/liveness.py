"""Whether a process is alive, as the pool's holder scan and the supervisor need it.

A zombie counts as dead: it holds no memory and runs no code, and it stays a zombie
until its parent reaps it, which may be never when the parent is the one asking.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    if pid <= 0:  # kill(0) and kill(-1) would signal a group, not one process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state follows the command name, which may itself hold ")" or spaces
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:  # exited between the kill and the open
        return False
    except (OSError, IndexError):  # no /proc: kill's answer stands
        return True
