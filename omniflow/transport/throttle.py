"""Warnings about what strangers send, at most one per ``every_s`` seconds.

A flood of garbage (malformed headers, refused handshakes, forged refs) must not flood
the log: the first one of a window is logged, the rest are counted, and the next report
says how many it folded.
"""

from __future__ import annotations

import logging
import time

LOG_EVERY_S = 10.0


class Throttled:
    """``note(what)`` logs ``template % what`` on ``logger`` at most once per ``every_s``."""

    def __init__(self, logger: logging.Logger, template: str, every_s: float = LOG_EVERY_S) -> None:
        self._log = logger
        self._template = template
        self._every = every_s
        self._folded = 0
        self._logged_at = -every_s - 1.0
        self.total = 0

    def note(self, *args: object, exc_info: bool = False) -> None:
        """Log this one (``exc_info``: with the exception being handled) or count it."""
        self.total += 1
        now = time.monotonic()
        if now - self._logged_at < self._every:
            self._folded += 1
            return
        folded, self._folded, self._logged_at = self._folded, 0, now
        more = f" ({folded} more like it since the last report)" if folded else ""
        self._log.warning(self._template + "%s", *args, more, exc_info=exc_info)
