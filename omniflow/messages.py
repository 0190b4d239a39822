"""Every wire type of omniflow, and nothing else.

A ZeroMQ message is ``[header, *buffers]``: the header is one msgspec-encoded
``Message`` (a tagged union); tensors travel as ``TensorRef``s in the header and,
for ``Frame`` refs, as the raw bytes of a later frame. No pickle anywhere.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

# Fields a message does not declare are refused, not skipped: a peer on another
# version (or a stranger) gets a clear error instead of a silently partial message.
_WIRE = {"array_like": True, "omit_defaults": True, "gc": False, "forbid_unknown_fields": True}
_REF = {"omit_defaults": True, "gc": False, "forbid_unknown_fields": True}

# Bounds every tensor ref must meet before any buffer is looked at (see codec.py for
# the per-message limits: frames, header bytes, tensor bytes).
MAX_DIMS = 16
MAX_DIM = 1 << 40
_Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Shape = Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=MAX_DIMS)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]

# A request's token: random bytes the client draws for it (``secrets.token_bytes``) and
# sends in its Call. Every hop carries it on; an Emit, Done, Fail or Cancel of that
# request counts only with the same token, so a peer that never saw the Call cannot
# answer it in the client's stead nor cancel it (a wrong or missing one is dropped).
TOKEN_BYTES = 16
Token = Annotated[bytes, msgspec.Meta(max_length=TOKEN_BYTES)]

# The longest request id and reply address a Call may carry, in UTF-8 bytes: an actor
# refuses longer ones by name, so each fits a slot of its holding file (what the
# supervisor fails at once when it dies). A caller's own id leaves room for the "~N"
# a migration's attempt adds.
MAX_ID_BYTES = 256
MAX_CALLER_ID_BYTES = MAX_ID_BYTES - 16
MAX_ADDRESS_BYTES = 256


class Code(enum.StrEnum):
    """Failure codes carried by ``Fail.code``."""

    ERROR = "error"  # the handler raised
    BAD_REQUEST = "bad_request"  # the input was malformed; names the field
    DEADLINE = "deadline"
    OVERLOADED = "overloaded"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"  # no live replica of a role / replica died
    SHUTTING_DOWN = "shutting_down"


# ---------------------------------------------------------------- tensor refs
# Tensor refs are dict-shaped (not array_like) so they can sit in a union with
# each other inside a header.


class Frame(msgspec.Struct, tag="frame", **_REF):
    """The bytes travel as frame ``index`` after the header (other hosts, small tensors)."""

    index: Annotated[int, msgspec.Meta(ge=1)]
    dtype: str
    shape: Shape


class Shm(msgspec.Struct, tag="shm", **_REF):
    """Bytes at ``offset`` in the host page pool that every local process maps."""

    offset: _NonNeg
    nbytes: _NonNeg
    dtype: str
    shape: Shape
    lease: int = 0
    pool: str = ""


class CudaIpc(msgspec.Struct, tag="cuda", **_REF):
    """Bytes at ``offset`` in a device pool chunk shared through a CUDA IPC handle."""

    handle: bytes
    offset: _NonNeg
    nbytes: _NonNeg
    dtype: str
    shape: Shape
    device: int = 0  # the sender's ordinal: only for a receiver that cannot resolve bus_id
    lease: int = 0
    bus_id: str = ""  # the GPU's PCI bus id, the same in every process
    event: bytes = b""  # cudaIpcEventHandle of the event recorded after the producer's writes


TensorRef = Frame | Shm | CudaIpc


class Timing(msgspec.Struct, **_WIRE):
    """Time one role spent computing for one request (milliseconds), and when.

    ``arrived`` and ``left`` are wall-clock (time.time()) instants: the first input
    chunk reached the actor, and its outputs were about to be sent onward.
    """

    role: str
    replica: int
    compute_ms: float
    arrived: float = 0.0
    left: float = 0.0
    # A traced request's only (runtime/tracing.py): this role's span id, the span it hangs
    # under, and the milliseconds it waited for a slot. Defaults: untraced, nothing sent.
    span: str = ""
    parent: str = ""
    queued_ms: float = 0.0


class Join(msgspec.Struct, **_WIRE):
    """Fan-in bookkeeping: the branch ``part`` of ``parts`` that meet at ``role``."""

    role: str
    replica: str  # actor id of the join's replica, chosen once where the branches split
    parts: int
    part: int


# ---------------------------------------------------------------- data messages


class Call(msgspec.Struct, tag="call", **_WIRE):
    """Work for one role: one chunk (``seq``) of one request's input stream.

    ``credit`` is the share of the request's completion credit this branch holds;
    it rides only on the last chunk. The client finishes a request when every
    share has come back in a ``Done``.
    """

    request_id: str
    role: str
    reply_to: str  # the client's endpoint: terminal messages and Emits go there
    data: dict[str, Any] = {}
    tensors: dict[str, TensorRef] = {}
    params: dict[str, Any] = {}  # request-level parameters, carried unchanged along the path
    seq: int = 0
    last: bool = True
    credit: int = 0
    deadline: float = 0.0  # absolute, time.time() seconds; 0 = none
    session: str = ""
    origin: str = ""  # the actor id (or client) that sent this chunk
    join: Join | None = None
    timings: list[Timing] = []
    usage: dict[str, int] = {}
    hops: int = 0  # roles this branch went through
    loops: dict[str, int] = {}  # times each loop edge ("src>dst") was taken on this path
    trace: str = ""  # a W3C traceparent: the span this hop hangs under ("": untraced)
    token: Token = b""  # the request's (TOKEN_BYTES); an actor refuses a Call without one


class Emit(msgspec.Struct, tag="emit", **_WIRE):
    """A chunk of output streamed to the client."""

    request_id: str
    role: str
    seq: int
    data: dict[str, Any] = {}
    tensors: dict[str, TensorRef] = {}
    token: Token = b""  # the request's: the client drops an Emit without it


class Done(msgspec.Struct, tag="done", **_WIRE):
    """A branch of a request finished; returns its ``credit`` to the client.

    A role whose last output goes to the client sends it inside its Done
    (``seq`` >= 0) rather than as a separate Emit: one message instead of two.
    """

    request_id: str
    role: str
    credit: int
    timings: list[Timing] = []
    usage: dict[str, int] = {}
    seq: int = -1  # >= 0: this Done carries the output chunk ``seq``
    data: dict[str, Any] = {}
    tensors: dict[str, TensorRef] = {}
    token: Token = b""  # the request's: the client drops a Done without it


class Fail(msgspec.Struct, tag="fail", **_WIRE):
    """The request failed; terminal for the whole request."""

    code: str
    message: str
    role: str
    request_id: str
    # The actor id of a replica that died holding it (a death notice), or that did not
    # take its next hop (most likely dead): the client may move the request on.
    replica: str = ""
    token: Token = b""  # the request's: the client drops a Fail without it


class Cancel(msgspec.Struct, tag="cancel", **_WIRE):
    """Stop work on a request; propagates along the path the request took."""

    request_id: str
    reason: str = Code.CANCELLED.value
    token: Token = b""  # the request's: an actor ignores a Cancel without it


# ---------------------------------------------------------------- KV pull
# A replica pulls a prefix's KV pages from another that holds them (transport/kv_pull.py):
# prepare (the holder pins the pages, answers a one-time token and their layout), then
# fetch (the pages come back as frames) or drop (the puller recomputes instead).


class KvPrepare(msgspec.Struct, tag="kv_prepare", **_WIRE):
    """Pin the longest prefix of ``token_ids`` held as KV pages (``extra_keys``: one prefix
    key per token, None for text; empty: all text)."""

    request_id: str
    token_ids: list[int]
    extra_keys: list[Any] = []


class KvPrepared(msgspec.Struct, tag="kv_prepared", **_WIRE):
    """Pages pinned for one fetch: ``token`` is good once, for ``ttl_s`` seconds."""

    request_id: str
    token: str
    num_tokens: int  # whole pages matched, times the page size
    num_pages: int
    page_shape: list[int]  # one page: K and V of every layer
    dtype: str
    ttl_s: float


class KvFetch(msgspec.Struct, tag="kv_fetch", **_WIRE):
    """Send the pinned pages from page ``first_page`` on (the puller holds those before)."""

    request_id: str
    token: str
    first_page: int = 0


class KvDrop(msgspec.Struct, tag="kv_drop", **_WIRE):
    """The puller will not fetch: unpin now."""

    request_id: str
    token: str


class KvPages(msgspec.Struct, tag="kv_pages", **_WIRE):
    """Pages ``first_page``.. of a fetch, as one frame ``tensors["pages"]`` [n, *page_shape]."""

    request_id: str
    first_page: int
    last: bool
    tensors: dict[str, TensorRef] = {}


class KvRefused(msgspec.Struct, tag="kv_refused", **_WIRE):
    """A prepare or fetch the holder would not serve; ``code`` says why."""

    request_id: str
    code: str
    message: str


KvPullRequest = KvPrepare | KvFetch | KvDrop
KvPullReply = KvPrepared | KvPages | KvRefused


# ---------------------------------------------------------------- actor records


LEAVING = "leaving"  # ActorRecord.state of a replica draining before it deregisters


class ActorRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """What the registry knows of one actor replica."""

    role: str
    replica: int
    pid: int
    endpoint: str
    host: str
    gpus: list[int] = []  # the config's GPU ids of its role
    state: str = "ready"
    inflight: int = 0
    served: int = 0
    started: float = 0.0
    meta: dict[str, Any] = {}
    # (request id, reply address) of what it held at its last heartbeat: if it dies,
    # the supervisor fails those requests at once instead of leaving them to time out.
    holding: list[tuple[str, str]] = []
    # PCI bus ids of the GPUs it computes on (empty: a CPU process): what CUDA IPC
    # matches on, since ordinals differ between processes with their own placement.
    devices: list[str] = []
    # Engine and queue figures at its last heartbeat (ActorHost.queued, Actor.figures): what
    # the gateway's /metrics serves for every replica (roles/gateway/role_metrics.py).
    stats: dict[str, float] = {}

    @property
    def actor_id(self) -> str:
        return f"{self.role}/{self.replica}"


# ---------------------------------------------------------------- control messages
# Supervisor <-> worker handshake.


class Hello(msgspec.Struct, tag="hello", **_WIRE):
    role: str
    replica: int
    pid: int


class Ready(msgspec.Struct, tag="ready", **_WIRE):
    role: str
    replica: int
    pid: int
    endpoint: str


class SetupFailed(msgspec.Struct, tag="setup_failed", **_WIRE):
    role: str
    replica: int
    pid: int
    message: str


class Shutdown(msgspec.Struct, tag="shutdown", **_WIRE):
    reason: str = ""
    timeout: float = 0.0  # to the supervisor: seconds to drain in-flight requests (0: config's)


# Registry protocol (embedded registry, over ZeroMQ). Every request carries an
# ``rid`` that its reply echoes.


class RegPut(msgspec.Struct, tag="reg_put", **_WIRE):
    rid: int
    key: str
    value: bytes
    ttl: float = 0.0  # 0 = no lease


class RegKeepalive(msgspec.Struct, tag="reg_keepalive", **_WIRE):
    rid: int
    keys: list[str]


class RegDelete(msgspec.Struct, tag="reg_delete", **_WIRE):
    rid: int
    key: str


class RegList(msgspec.Struct, tag="reg_list", **_WIRE):
    rid: int
    prefix: str


class RegWatch(msgspec.Struct, tag="reg_watch", **_WIRE):
    rid: int
    prefix: str


class RegBarrier(msgspec.Struct, tag="reg_barrier", **_WIRE):
    rid: int
    name: str
    n: int
    member: str


class RegReply(msgspec.Struct, tag="reg_reply", **_WIRE):
    rid: int
    ok: bool = True
    error: str = ""
    items: list[tuple[str, bytes]] = []


class RegEvent(msgspec.Struct, tag="reg_event", **_WIRE):
    """A watched key changed: ``kind`` is "put" or "delete"."""

    rid: int  # the watch's rid
    kind: str
    key: str
    value: bytes = b""


Message = (
    Call
    | Emit
    | Done
    | Fail
    | Cancel
    | Hello
    | Ready
    | SetupFailed
    | Shutdown
    | RegPut
    | RegKeepalive
    | RegDelete
    | RegList
    | RegWatch
    | RegBarrier
    | RegReply
    | RegEvent
)

DataMessage = Call | Emit | Done | Fail | Cancel
RegistryRequest = RegPut | RegKeepalive | RegDelete | RegList | RegWatch | RegBarrier
RegistryMessage = RegReply | RegEvent


def add_usage(into: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    """Add usage counters (``Call.usage``, ``Done.usage``) into ``into``; returns it."""
    for key, n in counts.items():
        into[key] = into.get(key, 0) + n
    return into
