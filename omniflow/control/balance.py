"""Load-balancing policies: which live replica of a role gets the next request.

The producer of a hop owns one policy per downstream role. It calls
``pick(replicas, key)`` over the registry's live records of that role, then
``on_send(actor_id)`` when it sends and ``on_done(actor_id)`` when the
terminal reply comes back, so policies see the producer's own outstanding
requests; records also carry ``inflight`` from the replica's heartbeats.
Policies are pure and synchronous: a pick costs microseconds, not a hop.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from omniflow.content import SUMMARY_META, content_hash, summary_key
from omniflow.messages import ActorRecord, Code


class PickKey(NamedTuple):
    """What a policy may key on: the request, its session, its prefix block-hash chain."""

    request_id: str = ""
    session: str = ""
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks


class NoReplicaError(LookupError):
    """No live replica of ``role`` to send to."""

    code = Code.UNAVAILABLE

    def __init__(self, role: str):
        self.role = role
        super().__init__(f"no live replica of role {role!r} in the registry")


class Policy:
    """Base policy: tracks this producer's outstanding requests per replica."""

    name = ""
    uses_prefix = False  # whether picks need PickKey.prefix_hashes (producers skip hashing)
    uses_key = True  # whether picks read the PickKey at all (producers skip building it)

    def __init__(self, role: str = "", seed: int | None = None):
        self.role = role
        self._outstanding: dict[str, int] = {}
        self._rng = random.Random(seed)

    def pick(self, replicas: Sequence[ActorRecord], key: PickKey = PickKey()) -> ActorRecord:
        if not replicas:
            raise NoReplicaError(self.role)
        return self._choose(replicas, key)

    def on_send(self, actor_id: str) -> None:
        self._outstanding[actor_id] = self._outstanding.get(actor_id, 0) + 1

    def on_done(self, actor_id: str) -> None:
        left = self._outstanding.get(actor_id, 0) - 1
        if left > 0:
            self._outstanding[actor_id] = left
        else:
            self._outstanding.pop(actor_id, None)

    def load(self, record: ActorRecord) -> int:
        # Our own count is exact but sees only our requests; the heartbeat's
        # count sees every producer's but lags. Take the larger.
        return max(self._outstanding.get(record.actor_id, 0), record.inflight)

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        raise NotImplementedError

    def _least_loaded(self, replicas: Sequence[ActorRecord]) -> ActorRecord:
        # Start the scan at a random offset so equal loads spread evenly.
        start = self._rng.randrange(len(replicas))
        best = replicas[start]
        best_load = self.load(best)
        for offset in range(1, len(replicas)):
            candidate = replicas[(start + offset) % len(replicas)]
            load = self.load(candidate)
            if load < best_load:
                best, best_load = candidate, load
        return best


class RoundRobin(Policy):
    name = "round_robin"
    uses_key = False

    def __init__(self, role: str = "", seed: int | None = None):
        super().__init__(role, seed)
        self._next = 0

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        chosen = replicas[self._next % len(replicas)]
        self._next += 1
        return chosen


class RandomChoice(Policy):
    name = "random"
    uses_key = False

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        return replicas[self._rng.randrange(len(replicas))]


class LeastOutstanding(Policy):
    name = "least_outstanding"
    uses_key = False

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        return self._least_loaded(replicas)


class PowerOfTwo(Policy):
    """Two replicas drawn at random; the less loaded wins (no full scan, no herding)."""

    name = "power_of_two"
    uses_key = False

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        if len(replicas) == 1:
            return replicas[0]
        first, second = self._rng.sample(range(len(replicas)), 2)
        a, b = replicas[first], replicas[second]
        return b if self.load(b) < self.load(a) else a


class ConsistentHash(Policy):
    """Rendezvous (highest-random-weight) hashing on the session id.

    A session stays on its replica while that replica lives; adding or
    removing a replica moves only the sessions that it wins or held. A
    request without a session hashes on its request id (spread, no affinity).
    """

    name = "consistent_hash"

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        token = (key.session or key.request_id).encode()
        return max(replicas, key=lambda record: _weight(token, record.actor_id))


def _weight(token: bytes, actor_id: str) -> int:
    digest = hashlib.blake2b(token + b"\0" + actor_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class PrefixAware(Policy):
    """The replica holding the longest prefix of the request's block-hash chain.

    What a replica holds comes from two places: the summary it publishes in its
    registry record (``meta[SUMMARY_META]``, a list of ints; read from the records
    handed to ``pick``, replaced whenever a newer record arrives, so a restarted
    replica's empty summary replaces its old one at once) and this producer's own
    memory of where it sent each chain (valid only while that replica keeps the
    ``started`` time it had then: a restart forgets it). The second covers the gap
    until the replica's next heartbeat. ``publish`` sets a summary directly.

    Ties in match length go to the less loaded replica, then to the one this
    producer gave fewer new chains (so new sessions spread evenly), then at random.
    With ``max_load_gap``, a match whose replica is busier than the least loaded by
    more than that many requests is passed over, so one hot prefix cannot pile
    everything on one replica.
    """

    name = "prefix_aware"
    uses_prefix = True
    memory = 1 << 16  # chain hashes remembered from this producer's own picks

    def __init__(self, role: str = "", seed: int | None = None, max_load_gap: int | None = None):
        super().__init__(role, seed)
        self.max_load_gap = max_load_gap
        self._held: dict[str, Collection[int]] = {}
        self._seen: dict[str, ActorRecord] = {}  # the record each summary came from
        self._sent: OrderedDict[int, tuple[str, float]] = OrderedDict()  # hash -> (id, started)
        self._assigned: dict[str, int] = {}  # chains this producer placed without a match

    def publish(self, actor_id: str, block_hashes: Collection[int]) -> None:
        """Replace what ``actor_id`` is known to hold (a set of block hashes)."""
        self._held[actor_id] = block_hashes

    def forget(self, actor_id: str) -> None:
        self._held.pop(actor_id, None)
        self._seen.pop(actor_id, None)

    def match_length(self, actor_id: str, chain: Sequence[int], started: float = 0.0) -> int:
        held = self._held.get(actor_id, ())
        length = 0
        for block_hash in chain:
            if block_hash not in held and self._sent.get(block_hash) != (actor_id, started):
                break
            length += 1
        return length

    def _sync(self, replicas: Sequence[ActorRecord]) -> None:
        """Take the summaries of records newer than the ones last read."""
        for record in replicas:
            summary = record.meta.get(SUMMARY_META)
            if summary is None or self._seen.get(record.actor_id) is record:
                continue
            self._seen[record.actor_id] = record
            self._held[record.actor_id] = frozenset(summary)

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        self._sync(replicas)
        chain = key.prefix_hashes
        loads = [self.load(r) for r in replicas]
        floor = min(loads)
        start = self._rng.randrange(len(replicas))  # equal ranks: the first from here wins
        best, best_rank, best_match = replicas[start], None, 0
        for offset in range(len(replicas)):
            i = (start + offset) % len(replicas)
            record, load = replicas[i], loads[i]
            if self.max_load_gap is not None and load - floor > self.max_load_gap:
                continue
            match = self.match_length(record.actor_id, chain, record.started) if chain else 0
            rank = (match, -load, -self._assigned.get(record.actor_id, 0))
            if best_rank is None or rank > best_rank:
                best, best_rank, best_match = record, rank, match
        if chain:
            self._remember(best, chain, best_match)
        return best

    def _remember(self, record: ActorRecord, chain: Sequence[int], match: int) -> None:
        if not match:
            self._assigned[record.actor_id] = self._assigned.get(record.actor_id, 0) + 1
        for block_hash in chain:
            self._sent[block_hash] = (record.actor_id, record.started)
            self._sent.move_to_end(block_hash)
        while len(self._sent) > self.memory:
            self._sent.popitem(last=False)


def prefix_chain(session: str, data: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """The prefix chain a producer can compute for a request it routes to an LLM.

    The session comes first (its history, kept by the replica that served it, is the
    prompt's prefix), then the content hash of each image and audio clip in ``data``:
    raw bytes as the client sends them (``image``, ``images``, ``audio``) or the hashes
    an encoder put in its output (``image_hash``, ``image_spans``, ...). Each element
    is a ``summary_key``, the same ints an LLM replica publishes for what it holds.
    """
    chain = [summary_key("session", session)] if session else []
    for kind in ("image", "audio"):
        for name in _media_hashes(kind, data or {}):
            chain.append(summary_key(kind, name))
    return tuple(chain)


def _media_hashes(kind: str, data: Mapping[str, Any]) -> list[str]:
    raw = data.get(kind)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return [content_hash(raw)]
    items = data.get(f"{kind}s")
    if isinstance(items, list):
        return [content_hash(x) for x in items if isinstance(x, (bytes, bytearray, memoryview))]
    spans = data.get(f"{kind}_spans")
    if isinstance(spans, list):
        return [str(span[0]) for span in spans if isinstance(span, (list, tuple)) and span]
    name = data.get(f"{kind}_hash")
    return [name] if isinstance(name, str) else []


POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomChoice, LeastOutstanding, PowerOfTwo, ConsistentHash, PrefixAware)
}


def make_policy(name: str, role: str = "", **options: object) -> Policy:
    """The policy called ``name`` for ``role``; options go to its constructor."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown balance policy {name!r} for role {role!r}; valid: {', '.join(sorted(POLICIES))}"
        )
    try:
        return factory(role=role, **options)
    except TypeError as error:
        raise ValueError(f"balance policy {name!r} for role {role!r}: {error}") from None


__all__ = [
    "POLICIES",
    "ConsistentHash",
    "LeastOutstanding",
    "NoReplicaError",
    "PickKey",
    "Policy",
    "PowerOfTwo",
    "PrefixAware",
    "RandomChoice",
    "RoundRobin",
    "make_policy",
    "prefix_chain",
]
