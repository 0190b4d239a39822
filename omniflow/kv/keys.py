"""How the radix tree keys KV pages: per position (token id, media content hash), per page a
tuple of those, and the chained page hashes a prompt is routed by (chain_hashes)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Hashable, Sequence

from omniflow.kv.pages import ExtraKeys

TokenKey = tuple[int, Hashable | None]  # (token id, content hash of its media span or None)
PageKey = tuple[TokenKey, ...]  # page_size token keys


def page_keys(
    token_ids: Sequence[int], extra_keys: ExtraKeys | None, page_size: int
) -> list[PageKey]:
    """The keys of the full pages of token_ids: one (token id, extra key) per position."""
    num_tokens = len(token_ids) // page_size * page_size
    if extra_keys is not None and len(extra_keys) < num_tokens:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {num_tokens} tokens")
    extras = itertools.repeat(None) if extra_keys is None else extra_keys
    flat = list(zip((int(t) for t in token_ids[:num_tokens]), extras, strict=False))
    return [tuple(flat[start : start + page_size]) for start in range(0, num_tokens, page_size)]


def chain_hashes(
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None,
    page_size: int,
    namespace: Hashable = "omniflow",
) -> list[int]:
    """The chained hashes of a prompt's full pages: hash i names pages 0..i together."""
    running, hashes = _namespace_hash(namespace), []
    for page_key in page_keys(token_ids, extra_keys, page_size):
        running = _chain(running, page_key)
        hashes.append(int.from_bytes(running[:8], "little"))
    return hashes


def _namespace_hash(namespace: Hashable) -> bytes:
    return hashlib.blake2b(repr(namespace).encode(), digest_size=16).digest()


def _chain(previous: bytes, page_key: PageKey) -> bytes:
    return hashlib.blake2b(previous + repr(page_key).encode(), digest_size=16).digest()


def _common_length(page_keys: list[PageKey], keys: list[PageKey], start: int) -> int:
    shared = 0
    for edge_key, key in zip(page_keys, keys[start:], strict=False):
        if edge_key != key:
            break
        shared += 1
    return shared
