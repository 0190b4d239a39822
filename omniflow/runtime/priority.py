"""Model threads give way to their process's event loop.

A role's event loop moves every request: it receives, routes and sends. Its model thread
computes. When a host has fewer cores than busy threads, a message that wakes a loop
thread otherwise waits for the running compute slice to end, which takes milliseconds
under Linux's fair scheduler. With the model threads at a higher nice value, the woken
loop runs first.

It lowers the pipeline's orchestration overhead under load (README, Benchmarks).
Compute threads share the CPU among themselves as before, and the loop threads use
little of it. Torch's intra-op
worker threads (``threads`` > 1) keep the nice value of the thread that first started
them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

# The default for a role's model_nice option. 10 gives a compute thread about a tenth of
# a nice-0 thread's share while both want the CPU.
DEFAULT_MODEL_NICE = 10


def thread_nice() -> int:
    """The calling thread's nice value (Linux keeps one per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_thread_priority(increment: int) -> None:
    """Add ``increment`` to the calling thread's nice value, up to 19.

    Linux only: there a thread id names one thread. Elsewhere the same call would renice
    the whole process (or another one), so it does nothing. Raising a nice value needs no
    privilege, and a refusal (a locked-down container) is logged, not raised.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, thread_nice() + increment))
    except OSError as e:
        log.warning("could not lower the model thread's priority: %s", e)
