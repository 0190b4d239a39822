"""Pulling a prefix's KV pages from another replica, over ZeroMQ (tcp://, CurveZMQ with keys).

    puller                                   holder (KVPullServer, a ROUTER of its own)
    KvPrepare(token_ids, extra_keys)  ->     pin the longest prefix it holds
                                      <-     KvPrepared(token, num_pages, page layout)
    cost model: pull or recompute?
    KvFetch(token, first_page)        ->     take the token (once), read the pages out,
                                      <-     KvPages ... (last=True): zero-copy frames
                                             unpin
    (or KvDrop(token)                 ->     unpin)

The token is good for one fetch or drop and for ``ttl_s`` seconds; the pin goes when the
pages have been read out (before they finish sending), when the token is dropped, when it
expires, or when the server closes, so a puller that dies at any point costs the holder
nothing past the token's lifetime. A wrong, expired or reused token gets ``KvRefused``
with a code saying which, and the holder goes on serving. The ROUTER is mandatory: pages
for a puller that vanished stop being read at once.

The engine sides are ``PrefixSource`` (the holder's pages) and ``PrefixSink`` (where a pull
writes); engine/kv_transfer.py implements both over an engine's radix tree. RDMA engines
(Mooncake's transfer engine, NIXL) would replace the KvFetch/KvPages leg only: see the
architecture notes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import zmq

from omniflow.kv.pull_cost import Decision, PullCost
from omniflow.kv.pull_tokens import PullRefused, PullTokens
from omniflow.memory.dtypes import dtype_name
from omniflow.messages import (
    Code,
    KvDrop,
    KvFetch,
    KvPages,
    KvPrepare,
    KvPrepared,
    KvPullReply,
    KvPullRequest,
    KvRefused,
)
from omniflow.transport.codec import (
    MAX_HEADER_BYTES,
    BadMessage,
    check_parts,
    decode,
    decoder_for,
    encode,
    export_tensors,
    materialize_tensors,
)
from omniflow.transport.endpoint import MAX_MESSAGE_BYTES, Inbox, fd_of
from omniflow.transport.security import Keys, secure_client

if TYPE_CHECKING:  # torch is imported with the first tensor: workers of model-free roles
    import torch  # import this module (runtime/kv_peers.py) and must not map libtorch

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # pages per KvPages message: about this many bytes
DROP_LINGER_MS = 1000
EXPIRY_SLACK_S = 0.01
_request_decoder = decoder_for(KvPullRequest)
_reply_decoder = decoder_for(KvPullReply)
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

Keys_ = Sequence[Hashable | None] | None


class PrefixSource(Protocol):
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    page_nbytes: int

    async def pin(self, token_ids: list[int], extra_keys: Keys_) -> tuple[list[int], int]:
        """Hold the pages of the longest prefix held: (pages, tokens they cover)."""
        ...

    async def read(self, pages: list[int]) -> torch.Tensor:
        """A CPU copy [len(pages), *page_shape] of held pages."""
        ...

    async def unpin(self, pages: list[int]) -> None: ...


class PrefixSink(Protocol):
    page_shape: tuple[int, ...]
    dtype: torch.dtype

    async def reserve(self, num_pages: int) -> bool:
        """Pages for the pull; False if there is no room."""
        ...

    async def write(self, offset: int, data: torch.Tensor) -> None:
        """Pulled pages [n, *page_shape] into reserved pages offset..offset+n."""
        ...


class KVPullError(RuntimeError):
    """A pull the holder refused or that failed on the way; ``code`` says which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PullResult(NamedTuple):
    pulled_tokens: int  # tokens whose KV arrived (beyond what the puller held)
    remote_tokens: int  # what the holder had of the prefix
    nbytes: int
    seconds: float  # fetch to last page written
    decision: Decision | None  # None: nothing to decide (the holder had no more)


# ------------------------------------------------------------------ the holder


class KVPullServer:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        source: PrefixSource,
        keys: Keys | None = None,
        ttl_s: float = 10.0,
        chunk_bytes: int = CHUNK_BYTES,
        advertise: str = "",
    ) -> None:
        self.source = source
        self.tokens = PullTokens(ttl_s)
        self.chunk_pages = max(1, chunk_bytes // source.page_nbytes)
        self.counts = dict.fromkeys(("prepared", "fetched", "dropped", "expired", "refused"), 0)
        self.pinned = 0  # grants whose pages are still pinned
        self._tasks: set[asyncio.Task] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._inbox = Inbox(  # requests are one header: nothing bigger is read
            ctx,
            endpoint,
            self._on_message,
            mandatory=True,
            keys=keys,
            advertise=advertise,
            max_message=MAX_HEADER_BYTES,
        )
        self.endpoint = self._inbox.endpoint

    def start(self) -> None:
        self._inbox.start()

    async def close(self) -> None:
        """Stop serving; every pin still held goes."""
        self._inbox.close()
        for timer in self._timers:
            timer.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # fetches unpin as they end
        for grant in self.tokens.drain():
            await self._unpin(grant.pages)

    def _on_message(self, identity: bytes, parts: list[Any]) -> None:
        try:
            if len(parts) != 1:
                raise BadMessage(f"a KV pull request carries no frames, got {len(parts) - 1}")
            msg = decode(parts[0], _request_decoder)
        except BadMessage as e:
            self._refuse(identity, "?", Code.BAD_REQUEST, str(e))
            return
        task = asyncio.get_running_loop().create_task(self._serve(identity, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, identity: bytes, msg: Any) -> None:
        try:
            if isinstance(msg, KvPrepare):
                await self._prepare(identity, msg)
            elif isinstance(msg, KvFetch):
                await self._fetch(identity, self.tokens.take(msg.token), msg)
            else:
                await self._unpin(self.tokens.take(msg.token).pages)
                self.counts["dropped"] += 1
        except PullRefused as e:
            self._refuse(identity, msg.request_id, e.code, str(e))
        except ValueError as e:
            self._refuse(identity, msg.request_id, Code.BAD_REQUEST, str(e))
        except Exception as e:  # noqa: BLE001 - one pull's failure, told to its puller
            log.exception("KV pull %s failed", msg.request_id)
            self._refuse(identity, msg.request_id, Code.ERROR, f"{type(e).__name__}: {e}")

    async def _prepare(self, identity: bytes, msg: KvPrepare) -> None:
        keys = wire_keys_in(msg.extra_keys, len(msg.token_ids), msg.request_id)
        pages, num_tokens = await self.source.pin(msg.token_ids, keys)
        token = ""
        if pages:
            grant = self.tokens.grant(pages, num_tokens)
            token = grant.token
            self.pinned += 1
            self.counts["prepared"] += 1
            loop = asyncio.get_running_loop()  # the sweep runs just after the deadline
            timer = loop.call_later(self.tokens.ttl_s + EXPIRY_SLACK_S, self._expire)
            self._timers.add(timer)
        reply = KvPrepared(
            msg.request_id,
            token,
            num_tokens,
            len(pages),
            list(self.source.page_shape),
            dtype_name(self.source.dtype),
            self.tokens.ttl_s,
        )
        self._inbox.reply(identity, [encode(reply)])  # a puller gone: the token expires

    async def _fetch(self, identity: bytes, grant: Any, msg: KvFetch) -> None:
        try:
            pages = grant.pages
            if not 0 <= msg.first_page <= len(pages):
                raise ValueError(f"first_page: {msg.first_page} outside 0..{len(pages)}")
            starts = range(msg.first_page, len(pages), self.chunk_pages)
            for start in starts or [len(pages)]:
                data = await self.source.read(pages[start : start + self.chunk_pages])
                frames: list[Any] = [b""]
                refs = export_tensors({"pages": data}, frames)
                last = start + self.chunk_pages >= len(pages)
                frames[0] = encode(KvPages(msg.request_id, start, last, refs))
                if not self._inbox.reply(identity, frames, copy=False):
                    log.warning("KV pull %s: the puller went away mid-transfer", msg.request_id)
                    return
            self.counts["fetched"] += 1
        finally:
            await self._unpin(grant.pages)

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        self._timers = {t for t in self._timers if t.when() > now}  # drop the fired ones
        for grant in self.tokens.expired():
            self.counts["expired"] += 1
            task = asyncio.get_running_loop().create_task(self._unpin(grant.pages))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _unpin(self, pages: list[int]) -> None:
        self.pinned -= 1
        await self.source.unpin(pages)

    def _refuse(self, identity: bytes, request_id: str, code: str, message: str) -> None:
        self.counts["refused"] += 1
        self._inbox.reply(identity, [encode(KvRefused(request_id, str(code), message))])


# ------------------------------------------------------------------ the puller


class KVPuller:
    """Pulls prefixes for one replica; ``cost`` decides and learns the link's rate."""

    def __init__(
        self,
        ctx: zmq.Context,
        cost: PullCost,
        keys: Keys | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.ctx, self.cost, self.keys, self.timeout_s = ctx, cost, keys, timeout_s

    async def pull(
        self,
        endpoint: str,
        request_id: str,
        token_ids: Sequence[int],
        extra_keys: Keys_,
        sink: PrefixSink,
        held_pages: int = 0,
        force: bool = False,
    ) -> PullResult:
        """Pull the pages of token_ids's prefix past the first ``held_pages`` (which the
        sink's engine holds already) from the holder at ``endpoint``, if the cost model
        says it beats recomputing (``force``: always). Raises ``KVPullError``."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a holder's chunk is ~CHUNK_BYTES
        if self.keys is not None and endpoint.startswith("tcp://"):
            secure_client(sock, self.keys)
        sock.connect(endpoint)
        try:
            return await self._pull(
                sock, request_id, token_ids, extra_keys, sink, held_pages, force
            )
        finally:
            sock.close(DROP_LINGER_MS)  # a KvDrop just sent must still leave

    async def _pull(self, sock, request_id, token_ids, extra_keys, sink, held, force):
        deadline = time.monotonic() + self.timeout_s
        keys = wire_keys_out(extra_keys, len(token_ids), request_id)
        started = time.perf_counter()
        sock.send(encode(KvPrepare(request_id, list(token_ids), keys)))
        prepared, _ = await _receive(sock, deadline, request_id)
        self.cost.add_round_trip(time.perf_counter() - started)
        if not isinstance(prepared, KvPrepared):
            raise KVPullError("protocol", f"KV pull {request_id}: expected kv_prepared")
        todo = prepared.num_pages - held
        if todo <= 0:
            _drop(sock, request_id, prepared.token)
            return PullResult(0, prepared.num_tokens, 0, 0.0, None)
        layout = (tuple(sink.page_shape), dtype_name(sink.dtype))
        if (tuple(prepared.page_shape), prepared.dtype) != layout:
            _drop(sock, request_id, prepared.token)
            raise KVPullError(
                "layout",
                f"KV pull {request_id}: the holder's pages {prepared.page_shape} "
                f"{prepared.dtype} differ from this replica's {list(layout[0])} {layout[1]}",
            )
        page_tokens = prepared.num_tokens // prepared.num_pages
        nbytes = todo * math.prod(prepared.page_shape) * sink.dtype.itemsize
        decision = self.cost.decide(nbytes, todo * page_tokens)
        if not (decision.pull or force) or not await sink.reserve(todo):
            _drop(sock, request_id, prepared.token)
            return PullResult(0, prepared.num_tokens, 0, 0.0, decision)
        started = time.perf_counter()
        sock.send(encode(KvFetch(request_id, prepared.token, held)))
        expected = held
        while True:
            msg, parts = await _receive(sock, deadline, request_id)
            if not isinstance(msg, KvPages) or msg.first_page != expected:
                raise KVPullError("protocol", f"KV pull {request_id}: pages out of order")
            data = materialize_tensors(msg.tensors, parts).get("pages")
            if data is None or tuple(data.shape[1:]) != layout[0]:
                raise KVPullError("protocol", f"KV pull {request_id}: pages of the wrong shape")
            if len(data):
                await sink.write(expected - held, data)
            expected += len(data)
            if msg.last:
                break
        if expected != prepared.num_pages:
            raise KVPullError(
                "protocol", f"KV pull {request_id}: {expected - held} of {todo} pages"
            )
        seconds = time.perf_counter() - started
        self.cost.link.add(nbytes, seconds)
        return PullResult(todo * page_tokens, prepared.num_tokens, nbytes, seconds, decision)


def _drop(sock: zmq.Socket, request_id: str, token: str) -> None:
    if token:
        sock.send(encode(KvDrop(request_id, token)), _NOBLOCK)


async def _receive(sock: zmq.Socket, deadline: float, request_id: str) -> tuple[Any, list[Any]]:
    """The next reply (and its parts, header as bytes); ``KvRefused`` raised as KVPullError."""
    loop = asyncio.get_running_loop()
    fd = fd_of(sock)
    while not int(sock.get(_EVENTS)) & _POLLIN:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KVPullError(Code.DEADLINE, f"KV pull {request_id}: the holder did not answer")
        ready = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        try:
            await asyncio.wait_for(ready, min(remaining, 0.05))
        except TimeoutError:
            pass  # re-check: the FD is edge-triggered
        finally:
            loop.remove_reader(fd)
    frames = sock.recv_multipart(_NOBLOCK, copy=False)
    parts: list[Any] = [frames[0].bytes, *frames[1:]]
    try:
        msg = decode(parts[0], _reply_decoder)
        check_parts(msg, parts)
    except BadMessage as e:
        raise KVPullError("protocol", f"KV pull {request_id}: {e}") from None
    if isinstance(msg, KvRefused):
        raise KVPullError(msg.code, f"KV pull {request_id} refused: {msg.message}")
    return msg, parts


def _wake(ready: asyncio.Future) -> None:
    if not ready.done():
        ready.set_result(None)


# ------------------------------------------------------------------ prefix keys on the wire


def wire_keys_out(extra_keys: Keys_, num_tokens: int, request_id: str) -> list[Any]:
    """Prefix keys as plain data ([] when all text); tuples travel as arrays."""
    if extra_keys is None or all(key is None for key in extra_keys):
        return []
    if len(extra_keys) < num_tokens:
        raise ValueError(f"request {request_id}: {len(extra_keys)} extra keys, {num_tokens} tokens")
    return list(extra_keys[:num_tokens])


def wire_keys_in(keys: list[Any], num_tokens: int, request_id: str) -> list[Any] | None:
    """Back to the hashable keys the radix tree compares (arrays become tuples)."""
    if not keys:
        return None
    if len(keys) != num_tokens:
        raise ValueError(
            f"request {request_id}: extra_keys has {len(keys)} entries for {num_tokens} tokens"
        )
    return [_hashable(key) for key in keys]


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
