"""A role that can stall its replica's event loop; workers import tests.runtime.stall_role:Stall."""

from __future__ import annotations

import time

from omniflow.runtime.actor import Actor


class Stall(Actor):
    """Echoes ``text``; ``params["block_ms"]`` blocks the whole event loop that long (not
    an await): whatever reaches the replica meanwhile sits unread in its socket queue."""

    async def handle(self, request, ctx):
        block_ms = request.params.get("block_ms", 0)
        if block_ms:
            time.sleep(block_ms / 1e3)
        return {"text": request.data["text"], "replica": self.replica}
