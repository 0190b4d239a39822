"""One supervised replica: the process the supervisor spawns for it and its state, and
what its death leaves to do: fail at once every request it held, so no client waits out
its deadline for a reply that cannot come."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from omniflow.messages import Code, Fail
from omniflow.runtime.holding import holding_path, read_held
from omniflow.transport.codec import encode

if TYPE_CHECKING:
    from omniflow.transport.endpoint import Outbox

log = logging.getLogger("omniflow.runtime.supervisor")


class StartError(RuntimeError):
    """The deployment could not start; the message names the replica and why."""


class Replica:
    def __init__(self, role: str, index: int) -> None:
        self.role = role
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.state = "stopped"  # spawned -> setup -> ready; restarting; failed
        self.restarts = 0
        self.backoff_step = 0  # restarts since it last served for a while (the backoff's)
        self.ready_at = 0.0  # time.monotonic() it last became ready
        self.ready: asyncio.Future | None = None
        self.exited: asyncio.Future | None = None
        self.endpoint = ""

    @property
    def actor_id(self) -> str:
        return f"{self.role}/{self.index}"

    def fail_what_it_was_holding(self, run_dir: Path, outbox: Outbox) -> None:
        """Fail at once every request the dead replica held when it died: its holding file
        names each with its token (the heartbeat's list misses those taken since the last
        beat, and has no tokens: a client drops a notice without one)."""
        assert self.proc is not None
        path = holding_path(run_dir, self.role, self.index)
        try:
            held, tokens = read_held(path, self.proc.pid)
        except (OSError, ValueError) as e:
            log.warning("could not read what %s held: %s", self.actor_id, e)
            held, tokens = [], {}
        for request_id, reply_to in held:
            self.post_unavailable(outbox, request_id, reply_to, tokens.get(request_id, b""))
        path.unlink(missing_ok=True)

    def post_unavailable(
        self, outbox: Outbox, request_id: str, reply_to: str, token: bytes
    ) -> None:
        """The terminal Fail of a request it held (``token``: the request's); the file
        names each request once."""
        fail = Fail(
            Code.UNAVAILABLE.value,
            f"{self.actor_id} died while handling it",
            self.role,
            request_id,
            self.actor_id,
            token,
        )
        with contextlib.suppress(Exception):
            outbox.post(reply_to, [encode(fail)])


def retrieve(future: asyncio.Future) -> None:
    """A done callback: the future's exception counts as retrieved."""
    if not future.cancelled():
        future.exception()
