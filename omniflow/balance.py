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
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

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

    def __init__(self, role: str = "", seed: int | None = None):
        super().__init__(role, seed)
        self._next = 0

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        chosen = replicas[self._next % len(replicas)]
        self._next += 1
        return chosen


class RandomChoice(Policy):
    name = "random"

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        return replicas[self._rng.randrange(len(replicas))]


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        return self._least_loaded(replicas)


class PowerOfTwo(Policy):
    """Two replicas drawn at random; the less loaded wins (no full scan, no herding)."""

    name = "power_of_two"

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

    Replicas publish the block hashes they hold (``publish``; the KV-cache
    layer feeds it). Ties in match length go to the less loaded replica; no
    match anywhere falls back to least-outstanding. With ``max_load_gap``, a
    match whose replica is busier than the least loaded by more than that many
    requests is passed over, so one hot prefix cannot pile everything on one
    replica.
    """

    name = "prefix_aware"

    def __init__(self, role: str = "", seed: int | None = None, max_load_gap: int | None = None):
        super().__init__(role, seed)
        self.max_load_gap = max_load_gap
        self._held: dict[str, Collection[int]] = {}

    def publish(self, actor_id: str, block_hashes: Collection[int]) -> None:
        """Replace what ``actor_id`` is known to hold (a set of block hashes)."""
        self._held[actor_id] = block_hashes

    def forget(self, actor_id: str) -> None:
        self._held.pop(actor_id, None)

    def match_length(self, actor_id: str, chain: Sequence[int]) -> int:
        held = self._held.get(actor_id)
        if not held:
            return 0
        length = 0
        for block_hash in chain:
            if block_hash not in held:
                break
            length += 1
        return length

    def _choose(self, replicas: Sequence[ActorRecord], key: PickKey) -> ActorRecord:
        least = self._least_loaded(replicas)
        if not key.prefix_hashes or not self._held:
            return least
        floor = self.load(least)
        best, best_rank = least, (0, -floor)
        for record in replicas:
            load = self.load(record)
            if self.max_load_gap is not None and load - floor > self.max_load_gap:
                continue
            rank = (self.match_length(record.actor_id, key.prefix_hashes), -load)
            if rank > best_rank:
                best, best_rank = record, rank
        return best


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
]
