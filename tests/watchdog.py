"""A watchdog for the suite: a test still running well past pytest-timeout's limit is
stuck where that limit cannot reach it (a C call that swallows the alarm, a teardown
after the timeout fired). It prints every thread's stack and the test's name on the real
stderr, then ends the run, instead of letting CI spend its whole budget on one hang."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

import pytest

GRACE_S = float(
    os.environ.get("OMNIFLOW_WATCHDOG_GRACE_S", "180")
)  # on top of the test's own timeout


class Watchdog:
    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._timer: threading.Timer | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0]) if marker and marker.args else 0.0
        limit = limit or float(self._config.getini("timeout") or 0) or 120.0
        self._timer = threading.Timer(limit + GRACE_S, self._bite, args=(item.nodeid,))
        self._timer.daemon = True
        self._timer.start()
        try:
            yield
        finally:
            self._timer.cancel()

    def _bite(self, nodeid: str) -> None:
        capman = self._config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            try:
                capman.suspend_global_capture(in_=True)
            except Exception:  # a race with the test's own capture: print anyway
                pass
        sys.stderr.write(f"\n\nWATCHDOG: {nodeid} is stuck past its timeout; stacks:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os.system("ps -eo pid,ppid,stat,etime,args --forest | cut -c1-200 >&2")  # the children
        os._exit(3)
