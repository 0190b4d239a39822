"""A role that can stall its replica's event loop; workers import tests.runtime.stall_role:Stall."""

from __future__ import annotations

import os
import time

from omniflow.runtime.actor import Actor


class Stall(Actor):
    """Echoes ``text``; ``params["block_ms"]`` blocks the whole event loop that long (not
    an await), and ``params["until"]`` (a path) blocks it until that file exists: whatever
    reaches the replica meanwhile sits unread in its socket queue."""

    async def handle(self, request, ctx):
        block_ms = request.params.get("block_ms", 0)
        if block_ms:
            time.sleep(block_ms / 1e3)
        until = request.params.get("until")
        if until:
            while not os.path.exists(until):
                time.sleep(0.01)
        return {"text": request.data["text"], "replica": self.replica}
