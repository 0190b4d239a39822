"""Ref-counted KV pages with a hash-chained prefix index (nano-vllm style).

A full page is keyed by hash(previous page's key, its token ids, its extra keys), so a key
names a whole prefix, not just one page. Unreferenced pages keep their key and stay
matchable until the allocator needs them back (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from omniflow.engine.page_allocator import ExtraKeys, OutOfPages, PageUsage, PrefixMatch


def page_key(
    previous: bytes, token_ids: Sequence[int], extra_keys: Sequence[object] | None
) -> bytes:
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys is not None and any(key is not None for key in extra_keys):
        digest.update(repr(list(extra_keys)).encode())
    return digest.digest()


class HashPrefixPageCache:
    def __init__(self, num_pages: int, page_size: int, namespace: bytes = b"omniflow"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.root_key = hashlib.blake2b(namespace, digest_size=16).digest()
        self.ref_counts = [0] * num_pages
        self.key_of_page: dict[int, bytes] = {}
        self.page_of_key: dict[bytes, int] = {}
        self.blank_pages: deque[int] = deque(range(num_pages))
        self.evictable_pages: OrderedDict[int, None] = OrderedDict()

    def usage(self) -> PageUsage:
        free = len(self.blank_pages) + len(self.evictable_pages)
        return PageUsage(self.num_pages, free, len(self.page_of_key))

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self.blank_pages) + len(self.evictable_pages):
            raise OutOfPages(f"{num_pages} pages wanted, {self.usage().free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self.blank_pages:
                page = self.blank_pages.popleft()
            else:
                page, _ = self.evictable_pages.popitem(last=False)
                del self.page_of_key[self.key_of_page.pop(page)]
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, page_ids: Sequence[int]) -> None:
        # Free the tail first so the deepest (least shareable) pages are evicted first.
        for page in reversed(page_ids):
            if self.ref_counts[page] <= 0:
                raise RuntimeError(f"page {page} freed more often than it was taken")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if page in self.key_of_page:
                    self.evictable_pages[page] = None
                else:
                    self.blank_pages.append(page)

    def match_prefix(
        self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> PrefixMatch:
        pages: list[int] = []
        key = self.root_key
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            end = start + self.page_size
            extra = None if extra_keys is None else extra_keys[start:end]
            key = page_key(key, token_ids[start:end], extra)
            page = self.page_of_key.get(key)
            if page is None:
                break
            if self.ref_counts[page] == 0:
                del self.evictable_pages[page]
            self.ref_counts[page] += 1
            pages.append(page)
        return PrefixMatch(pages, len(pages) * self.page_size)

    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> None:
        key = self.root_key
        for index in range(len(token_ids) // self.page_size):
            page = page_ids[index]
            known = self.key_of_page.get(page)
            if known is not None:
                key = known  # full pages never change, so their key is still valid
                continue
            start, end = index * self.page_size, (index + 1) * self.page_size
            extra = None if extra_keys is None else extra_keys[start:end]
            key = page_key(key, token_ids[start:end], extra)
            if key in self.page_of_key:
                continue  # another page already holds this prefix; keep the first
            self.key_of_page[page] = key
            self.page_of_key[key] = page
