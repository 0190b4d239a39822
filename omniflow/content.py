"""Content keys: how media and sessions are named wherever something is cached or routed.

``content_hash`` names a piece of media by its bytes (the encoder-output cache key, the
LLM's prefix-key span for that media, and what a producer hashes to route by prefix).
``summary_key`` folds a kind and a name into the 64-bit ints that replicas publish as a
summary of what they hold and that a ``PickKey``'s prefix chain is made of: producers
and replicas must compute it the same way, so it lives here, below both.
"""

from __future__ import annotations

import hashlib

# The ``ActorRecord.meta`` field where an LLM replica publishes its summary: a list of
# ``summary_key`` ints for the sessions and leading media whose KV it holds.
SUMMARY_META = "prefix_summary"


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """blake2b-128 hex digest of ``data``."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def summary_key(kind: str, name: str) -> int:
    """A 63-bit int naming ``name`` of ``kind`` (``"session"``, ``"image"``, ``"audio"``)."""
    digest = hashlib.blake2b(f"{kind}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits a signed int64 on every wire
