"""pid_alive: gone and zombie processes are dead; a group id never counts as one."""

import os
import subprocess
import sys
import time

from omniflow.memory import pid_alive


def test_running_zombie_and_reaped():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    assert pid_alive(proc.pid)
    assert proc.stdin is not None
    proc.stdin.close()  # it exits; unreaped, it stays a zombie
    deadline = time.monotonic() + 10
    while pid_alive(proc.pid):
        assert time.monotonic() < deadline, "a zombie still counts as alive"
        time.sleep(0.01)
    assert os.waitpid(proc.pid, os.WNOHANG)[0] == proc.pid  # it was a zombie, not reaped
    proc.returncode = 0
    assert not pid_alive(proc.pid)


def test_self_alive_and_non_pids_dead():
    assert pid_alive(os.getpid())
    assert not pid_alive(0) and not pid_alive(-1)
