"""A page-granular radix tree over paged KV: the engine's PageAllocator, shareable by prefix.

Each token position is keyed by (token_id, extra_key): extra_key is the content hash of the
image or audio span the position belongs to (None for text), so equal placeholder ids of
different media never match. Each namespace (model id, adapter) has its own root. An edge
holds a run of whole pages and splits only at page boundaries; its node records where those
pages reside in every tier. Pages are ref-counted one by one, as the protocol frees them;
unreferenced cached pages stay matchable until allocate() needs them back, least recently
used leaves first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple

from omniflow.cache.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch

TokenKey = tuple[int, Hashable | None]  # (token id, content hash of its media span or None)
PageKey = tuple[TokenKey, ...]  # page_size token keys


class Residency(NamedTuple):
    device: tuple[int, ...]  # device page ids, one per page of the edge
    host: tuple[int, ...] | None = None  # host-pool pages: reserved for the tiering step
    ssd: tuple[int, ...] | None = None  # SSD blocks: reserved for the tiering step

    def split(self, at: int) -> tuple[Residency, Residency]:
        head = Residency(self.device[:at], _head(self.host, at), _head(self.ssd, at))
        tail = Residency(self.device[at:], _tail(self.host, at), _tail(self.ssd, at))
        return head, tail


def _head(tier: tuple[int, ...] | None, at: int) -> tuple[int, ...] | None:
    return None if tier is None else tier[:at]


def _tail(tier: tuple[int, ...] | None, at: int) -> tuple[int, ...] | None:
    return None if tier is None else tier[at:]


class RadixNode:
    __slots__ = ("page_keys", "parent", "children", "residency", "lock_count", "last_access")

    def __init__(
        self,
        page_keys: list[PageKey],
        parent: RadixNode | None,
        residency: Residency,
        last_access: int,
    ):
        self.page_keys = page_keys  # the edge from parent: len(page_keys) whole pages
        self.parent = parent
        self.children: dict[PageKey, RadixNode] = {}  # by the child's first page key
        self.residency = residency
        self.lock_count = 0  # references held on this node's pages; > 0 means in use
        self.last_access = last_access


class RadixPrefixCache:
    def __init__(self, num_pages: int, page_size: int, namespace: Hashable = "omniflow"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.namespace = namespace
        self.roots: dict[Hashable, RadixNode] = {}
        self.ref_counts = [0] * num_pages
        self.node_of_page: dict[int, RadixNode] = {}
        self.blank_pages: deque[int] = deque(range(num_pages))
        self.num_unreferenced_cached = 0
        self._clock = itertools.count(1)

    def usage(self) -> PageUsage:
        free = len(self.blank_pages) + self.num_unreferenced_cached
        return PageUsage(self.num_pages, free, len(self.node_of_page))

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self.blank_pages) + self.num_unreferenced_cached:
            raise OutOfPages(f"{num_pages} pages wanted, {self.usage().free_pages} free")
        missing = num_pages - len(self.blank_pages)
        if missing > 0:
            missing = self._evict_leaves(missing)
        while missing > 0:
            missing = self._drop_orphaning_page(missing)
        pages = [self.blank_pages.popleft() for _ in range(num_pages)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def free(self, page_ids: Sequence[int]) -> None:
        now = next(self._clock)
        for page in reversed(page_ids):
            if self.ref_counts[page] <= 0:
                raise RuntimeError(f"page {page} freed more often than it was taken")
            self.ref_counts[page] -= 1
            node = self.node_of_page.get(page)
            if node is not None:
                node.lock_count -= 1
                node.last_access = now
                if self.ref_counts[page] == 0:
                    self.num_unreferenced_cached += 1
            elif self.ref_counts[page] == 0:
                self.blank_pages.append(page)

    def match_prefix(
        self,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
        *,
        namespace: Hashable | None = None,
    ) -> PrefixMatch:
        keys = self._page_keys(token_ids, extra_keys)
        now = next(self._clock)
        node, index = self._root(namespace), 0
        pages: list[int] = []
        while index < len(keys) and keys[index] in node.children:
            child = node.children[keys[index]]
            shared = _common_length(child.page_keys, keys, index)
            if shared < len(child.page_keys):
                child = self._split(child, shared)  # the matched prefix becomes a whole node
            child.last_access = now
            pages += child.residency.device
            node, index = child, index + shared
        for page in pages:
            self._acquire(page)
        return PrefixMatch(pages, len(pages) * self.page_size)

    def insert(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
        *,
        namespace: Hashable | None = None,
    ) -> None:
        keys = self._page_keys(token_ids, extra_keys)
        now = next(self._clock)
        node, index = self._root(namespace), 0
        while index < len(keys) and keys[index] in node.children:
            # Pages already in the tree win; the caller's duplicates stay uncached.
            child = node.children[keys[index]]
            shared = _common_length(child.page_keys, keys, index)
            if shared < len(child.page_keys):
                child = self._split(child, shared)
            child.last_access = now
            node, index = child, index + shared
        new_pages: list[int] = []
        for page in page_ids[index : len(keys)]:
            if page in self.node_of_page:
                break  # a page lives at one place in the tree; never alias it elsewhere
            new_pages.append(page)
        if not new_pages:
            return
        leaf = RadixNode(
            keys[index : index + len(new_pages)], node, Residency(tuple(new_pages)), now
        )
        node.children[leaf.page_keys[0]] = leaf
        for page in new_pages:
            self.node_of_page[page] = leaf
            leaf.lock_count += self.ref_counts[page]
            if self.ref_counts[page] == 0:
                self.num_unreferenced_cached += 1

    def nodes(self) -> Iterator[RadixNode]:
        """Every node below the roots, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _root(self, namespace: Hashable | None) -> RadixNode:
        key = self.namespace if namespace is None else namespace
        root = self.roots.get(key)
        if root is None:
            root = self.roots[key] = RadixNode([], None, Residency(()), 0)
        return root

    def _page_keys(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> list[PageKey]:
        num_tokens = len(token_ids) // self.page_size * self.page_size
        if extra_keys is not None and len(extra_keys) < num_tokens:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {num_tokens} tokens")
        extras = itertools.repeat(None) if extra_keys is None else extra_keys
        flat = list(zip((int(t) for t in token_ids[:num_tokens]), extras, strict=False))
        return [
            tuple(flat[start : start + self.page_size])
            for start in range(0, num_tokens, self.page_size)
        ]

    def _acquire(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            self.num_unreferenced_cached -= 1
        self.ref_counts[page] += 1
        self.node_of_page[page].lock_count += 1

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge after `at` pages; return the new parent holding the head."""
        assert node.parent is not None and 0 < at < len(node.page_keys)
        head_residency, tail_residency = node.residency.split(at)
        head = RadixNode(node.page_keys[:at], node.parent, head_residency, node.last_access)
        node.parent.children[head.page_keys[0]] = head
        node.page_keys, node.residency, node.parent = node.page_keys[at:], tail_residency, head
        head.children[node.page_keys[0]] = node
        for page in head.residency.device:
            self.node_of_page[page] = head
        head.lock_count = sum(self.ref_counts[page] for page in head.residency.device)
        node.lock_count -= head.lock_count
        return head

    def _evictable_tail(self, node: RadixNode) -> bool:
        device = node.residency.device
        return not node.children and bool(device) and self.ref_counts[device[-1]] == 0

    def _evict_leaves(self, count: int) -> int:
        """Leaf-first LRU: trim unreferenced pages off the least recently used leaves."""
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self.nodes() if self._evictable_tail(n)]
        heapq.heapify(heap)
        while count > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            first_key = leaf.page_keys[0]
            while count > 0 and self._evictable_tail(leaf):
                page = leaf.residency.device[-1]
                leaf.page_keys.pop()
                leaf.residency = leaf.residency.split(len(leaf.page_keys))[0]
                self._uncache(page)
                count -= 1
            parent = leaf.parent
            if not leaf.page_keys and parent is not None:
                del parent.children[first_key]
                if parent.parent is not None and self._evictable_tail(parent):
                    heapq.heappush(heap, (parent.last_access, next(order), parent))
        return count

    def _drop_orphaning_page(self, count: int) -> int:
        """Reclaim an unreferenced page that has referenced pages below it.

        It happens when a caller's page duplicated one already in the tree: insert() keeps the
        tree's page, so the caller's later pages hang below a page it does not hold. Dropping
        the subtree from that page down keeps usage().free_pages honest; held pages in it stay
        valid for their holders and return to the blank list when freed.
        """
        orphaning = next(p for p in self.node_of_page if self.ref_counts[p] == 0)
        node = self.node_of_page[orphaning]
        at = node.residency.device.index(orphaning)
        if at > 0:
            self._split(node, at)
        assert node.parent is not None
        del node.parent.children[node.page_keys[0]]
        stack = [node]
        while stack:
            dropped = stack.pop()
            stack.extend(dropped.children.values())
            for page in dropped.residency.device:
                if self.ref_counts[page] == 0:
                    count -= 1
                self._uncache(page)
        return count

    def _uncache(self, page: int) -> None:
        del self.node_of_page[page]
        if self.ref_counts[page] == 0:
            self.num_unreferenced_cached -= 1
            self.blank_pages.append(page)


def _common_length(page_keys: list[PageKey], keys: list[PageKey], start: int) -> int:
    shared = 0
    for edge_key, key in zip(page_keys, keys[start:], strict=False):
        if edge_key != key:
            break
        shared += 1
    return shared
