"""What a role's author writes: an ``Actor`` subclass.

    class Upper(Actor):
        async def handle(self, request, ctx):
            for word in request.data["text"].split(" "):
                yield {"text": word.upper()}

``handle`` is a coroutine (returns one output, or None) or an async generator
(yields outputs as they are produced). An output is a dict: tensors (torch or
numpy) travel out of band, everything else as plain data. An exception fails
this request alone; ``BadRequest`` names the field that was wrong.

An actor class may set ``eager = True`` (the pass-through roles in ``roles/echo.py`` do):
then a single-chunk request's ``handle`` starts inside the socket reader, before any Task
exists, and moves into a Task only at its first real suspension, saving a Task per hop.
Until then ``asyncio.current_task()`` is None and context variables set by the handler
land in the reader's context, so only handlers that use neither should opt in.

An actor class may set ``Options`` to a msgspec Struct: its config's ``options`` table is
then checked against it when the config loads (unknown keys, types, ``Meta`` ranges) and
``self.options`` is that Struct; without one, ``self.options`` is the table as a dict.
``Params`` likewise declares the request parameters it reads: clients refuse a key that no
role of the deployment declares (None: the role reads any).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from omniflow.runtime.tables import decode

if TYPE_CHECKING:
    import torch

    from omniflow.runtime.kv_peers import KVPeers


class BadRequest(ValueError):
    """The request's input is wrong; ``field`` names what."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Request:
    """One input of one request, as a role sees it."""

    __slots__ = ("request_id", "data", "tensors", "params", "session", "seq", "last")

    def __init__(
        self,
        request_id: str,
        data: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        params: dict[str, Any],
        session: str = "",
        seq: int = 0,
        last: bool = True,
    ) -> None:
        self.request_id = request_id
        self.data = data
        self.tensors = tensors
        self.params = params
        self.session = session
        self.seq = seq
        self.last = last

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.data:
            return self.data[key]
        return self.tensors.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.data or key in self.tensors


class Context:
    """Per-request handle: identity, deadline, cancellation, and ``emit``."""

    def __init__(
        self, request_id: str, role: str, replica: int, deadline: float, sink: Any
    ) -> None:
        self.request_id = request_id
        self.role = role
        self.replica = replica
        self.deadline = deadline
        self._sink = sink
        self._cancelled: asyncio.Event | None = None
        self.usage: dict[str, int] = {}
        self.held: list[Any] = []
        self._peer: Any = None  # role -> the ActorRecord its outputs go to (the host's Fanout)

    @property
    def cancelled(self) -> asyncio.Event:
        """Set when the request is cancelled (made on first use: most handlers never ask)."""
        if self._cancelled is None:
            self._cancelled = asyncio.Event()
        return self._cancelled

    def remaining(self) -> float:
        """Seconds left before the deadline (inf without one)."""
        return self.deadline - time.time() if self.deadline else float("inf")

    async def emit(self, output: Mapping[str, Any]) -> None:
        """Send one output onward now, as a yield from an async-generator handler would."""
        await self._sink(output)

    def peer_pid(self, role: str) -> int:
        """The pid of the ``role`` replica this request's outputs will go to, chosen now:
        what a lease for that process (``lend_kv_to``) names as its borrower."""
        if self._peer is None:
            raise RuntimeError(f"request {self.request_id}: no route to {role!r} from here")
        return int(self._peer(role).pid)

    def hold(self, lease: Any) -> None:
        """Keep a page-pool lease (from ``pool.empty``) until this request's outputs are sent.

        A tensor written into the pool travels onward by handle with no copy; the
        receiver takes its own reference, and this one is released when the request
        ends here.
        """
        self.held.append(lease)

    def add_usage(self, **counts: int) -> None:
        for key, n in counts.items():
            self.usage[key] = self.usage.get(key, 0) + int(n)


class MemoryBudget(NamedTuple):
    """What a co-located role may take: ``fraction`` of ``free_bytes`` on ``device``."""

    device: str
    free_bytes: int
    fraction: float

    @property
    def bytes(self) -> int:
        return int(self.free_bytes * self.fraction)


class Actor:
    """Base class of every role. Subclasses override ``handle``; others are optional."""

    eager = False  # start single-chunk handlers in the socket reader (see the module doc)
    Options: ClassVar[Any] = None  # a msgspec Struct type for the options table; None: any
    Params: ClassVar[Any] = None  # a msgspec Struct of the request params it reads; None: any
    # The outputs it makes ("text", "image", "audio"): the gateway serves those modalities
    # (and /v1/images/generations) only where a role of the deployment makes them (a
    # deployment where no role says: text alone).
    Makes: ClassVar[tuple[str, ...]] = ()
    # Serves and pulls prefix KV pages across replicas (the llm role): the worker then gives
    # it a KVPeers (`use_kv_peers`) before it registers.
    uses_kv_peers: ClassVar[bool] = False
    # A streamed request's closing marker (last, no data, no tensors) reaches ``handle``
    # too, so what the stream held back can go out (the audio decoder's cross-fade tail).
    handles_stream_end: ClassVar[bool] = False

    def __init__(self, role: str, replica: int, options: Mapping[str, Any] | None = None) -> None:
        self.role = role
        self.replica = replica
        raw = dict(options or {})
        table = ("roles", role, "options")
        self.options: Any = (
            raw if self.Options is None else decode(raw, self.Options, table, "option")
        )

    async def setup(self) -> None:
        """Load weights and warm up; the actor registers only after this returns."""

    async def use_kv_peers(self, peers: KVPeers) -> None:
        """With ``uses_kv_peers``: the replica's KV page server and puller, after setup."""

    async def reserve(self, budget: MemoryBudget) -> None:
        """Size memory pools (KV) from ``budget``; called after every co-located role
        finished ``setup()``, so weights of its neighbours are already counted."""

    async def handle(self, request: Request, ctx: Context) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.handle is not written")

    def discard(self, data: Mapping[str, Any]) -> None:
        """A request that will never reach ``handle`` (refused, expired or cancelled while
        queued): give back what its ``data`` holds for this process (a KV lease lent to it).
        Runs on the event loop; must not block."""

    async def close(self) -> None:
        """Release what ``setup`` took; called after in-flight requests drained."""

    def meta(self) -> dict[str, Any]:
        """Extra fields published in this replica's registry record.

        ``{RESUMABLE_META: True}`` says the role takes ``params["resume"]`` (the text tokens
        a dead replica streamed) and goes on from there: a request on a replica of it that
        dies moves to another one (runtime/client.py), as for an idempotent role.
        """
        return {}

    def figures(self) -> dict[str, float]:
        """Engine figures for /metrics, read on the event loop at each heartbeat (cheap
        reads, no locks): names as roles/gateway/role_metrics.py maps them (``kv_pages_used_device``,
        ``running``, ``preemptions_total``...); a role without an engine has none."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What it loaded, for the start-up log line (model, dtype, KV size, threads)."""
        return {}


RESUMABLE_META = "resumable"
