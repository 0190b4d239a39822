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

from omniflow.control.discovery import Registry, decode_record
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
        # At its last death: the requests already failed from its holding file, and whether
        # that file named all it held (then the heartbeat's list adds nothing).
        self.failed_at_death: set[str] = set()
        self.holding_complete = False

    @property
    def actor_id(self) -> str:
        return f"{self.role}/{self.index}"

    def fail_what_it_was_holding(self, run_dir: Path, outbox: Outbox) -> None:
        """Fail at once every request the dead replica held when it died (its holding
        file: the heartbeat's list misses those taken since the last beat)."""
        assert self.proc is not None
        path = holding_path(run_dir, self.role, self.index)
        try:
            held, complete, tokens = read_held(path, self.proc.pid)
        except (OSError, ValueError) as e:
            log.warning("could not read what %s held: %s", self.actor_id, e)
            held, complete, tokens = [], False, {}
        self.failed_at_death = set()
        self.holding_complete = complete
        for request_id, reply_to in held:
            self.post_unavailable(outbox, request_id, reply_to, tokens.get(request_id, b""))
        path.unlink(missing_ok=True)

    def post_unavailable(
        self, outbox: Outbox, request_id: str, reply_to: str, token: bytes = b""
    ) -> None:
        """One terminal Fail per request and death, whichever list names it (``token``: the
        request's; a heartbeat's list has none, and the client drops such a notice, moving
        the request on itself once the replica leaves its view)."""
        if request_id in self.failed_at_death:
            return
        self.failed_at_death.add(request_id)
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

    async def fail_what_it_held(self, registry: Registry, key: str, outbox: Outbox) -> None:
        """Fail the requests a dead replica held at its last heartbeat, at once, when its
        holding file did not name them all (those that did not fit there).

        Their branch is lost; without this the clients would wait out their deadlines.
        A request it finished after the beat may be failed too: the price of not waiting.
        """
        if self.holding_complete:
            return  # the file named exactly what it held; the beat may name ended ones
        for found, value in await registry.list(key):
            if found != key:
                continue  # "reverse/1" is a prefix of "reverse/10"
            record = decode_record(value)
            if record.pid != (self.proc.pid if self.proc else -1):
                continue  # a record of an earlier incarnation
            for request_id, reply_to in record.holding:
                self.post_unavailable(outbox, request_id, reply_to)


def retrieve(future: asyncio.Future) -> None:
    """A done callback: the future's exception counts as retrieved."""
    if not future.cancelled():
        future.exception()
