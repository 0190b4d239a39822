"""A page-granular radix tree over paged KV: the engine's PageAllocator, shareable by prefix.

Each token position is keyed by (token_id, extra_key): extra_key is the content hash of the
image or audio span the position belongs to (None for text), so equal placeholder ids of
different media never match. Each namespace (model id, adapter) has its own root. An edge
holds a run of whole pages and splits only at page boundaries; its node records where those
pages reside: device pages, host-pool blocks or SSD blocks (one tier per node). Pages are
ref-counted one by one, as the protocol frees them; unreferenced cached pages stay matchable
until allocate() needs them back.

Eviction is leaf-first LRU, one tier at a time: device → host pool → SSD → dropped (with no
``KVTiers``, device pages are dropped at once). So along any path from a root, device nodes
come first, then host nodes, then SSD nodes. A match that runs into lower-tier nodes returns
them locked (``promoting``); the caller either promotes them into device pages it allocated
(``start_promotion``/``finish_promotion``: the copy runs on the tiers' worker thread while
the request waits for admission) or gives them back (``cancel_promotion``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from omniflow.kv.keys import (
    PageKey,
    _chain,
    _common_length,
    _namespace_hash,
    page_keys,
)
from omniflow.kv.leaf_queue import LeafQueue
from omniflow.kv.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch
from omniflow.kv.tiers import HOST, SSD, KVTiers, Promotion

DEVICE = "device"


class Residency(NamedTuple):
    device: tuple[int, ...]  # device page ids, one per page of the edge (empty below device)
    host: tuple[Any, ...] | None = None  # host-pool blocks (Lease), one per page
    ssd: tuple[Any, ...] | None = None  # SSD blocks (SsdBlock), one per page

    @property
    def tier(self) -> str:
        return HOST if self.host is not None else SSD if self.ssd is not None else DEVICE

    def handles(self) -> tuple[Any, ...]:
        return self.host or self.ssd or ()

    def split(self, at: int) -> tuple[Residency, Residency]:
        host, ssd = self.host, self.ssd  # None stays None
        head = Residency(self.device[:at], host and host[:at], ssd and ssd[:at])
        tail = Residency(self.device[at:], host and host[at:], ssd and ssd[at:])
        return head, tail


def _tiers(children: dict[PageKey, RadixNode]) -> set[str]:
    return {child.tier for child in children.values()}


class RadixNode:
    __slots__ = (
        "page_keys",
        "parent",
        "children",
        "residency",
        "lock_count",
        "last_access",
        "promoting",
    )

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
        self.lock_count = 0  # references held on this node's device pages; > 0 means in use
        self.last_access = last_access
        self.promoting = False  # a lower-tier node on its way back to device pages

    @property
    def tier(self) -> str:
        return self.residency.tier


class PendingPromotion(NamedTuple):
    nodes: list[RadixNode]
    job: Promotion
    future: Future[None]

    @property
    def num_pages(self) -> int:
        return len(self.job.device_pages)


class RadixPrefixCache:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        namespace: Hashable = "omniflow",
        tiers: KVTiers | None = None,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.namespace = namespace
        self.tiers = tiers
        self.roots: dict[Hashable, RadixNode] = {}
        self.ref_counts = [0] * num_pages
        self.node_of_page: dict[int, RadixNode] = {}
        self.blank_pages: deque[int] = deque(range(num_pages))
        self.num_unreferenced_cached = 0
        self._clock = itertools.count(1)
        # Each tier's evictable leaves, LRU first (kv/leaf_queue.py).
        self.leaves: dict[str, LeafQueue[RadixNode]] = {t: LeafQueue() for t in (DEVICE, HOST, SSD)}

    def usage(self) -> PageUsage:
        free = len(self.blank_pages) + self.num_unreferenced_cached
        return PageUsage(self.num_pages, free, len(self.node_of_page))

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self.blank_pages) + self.num_unreferenced_cached:
            raise OutOfPages(f"{num_pages} pages wanted, {self.usage().free_pages} free")
        missing = num_pages - len(self.blank_pages)
        if missing > 0:
            missing = self._evict_device(missing)
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
                self._touch(node)
            elif self.ref_counts[page] == 0:
                self.blank_pages.append(page)

    def match_prefix(
        self,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
        *,
        namespace: Hashable | None = None,
    ) -> PrefixMatch:
        """Acquire the device pages of the longest cached prefix; lower-tier nodes that
        continue it come back locked in ``lower`` (promote or cancel them)."""
        keys = self._page_keys(token_ids, extra_keys)
        now = next(self._clock)
        node, index = self._root(namespace), 0
        pages: list[int] = []
        lower: list[RadixNode] = []
        while index < len(keys) and keys[index] in node.children:
            child = node.children[keys[index]]
            if child.promoting:
                break  # another request is bringing it back; compute past this point
            shared = _common_length(child.page_keys, keys, index)
            if shared < len(child.page_keys):
                child = self._split(child, shared)  # the matched prefix becomes a whole node
            child.last_access = now
            if child.tier == DEVICE:
                pages += child.residency.device
            else:
                child.promoting = True
                lower.append(child)
            node, index = child, index + shared
        for page in pages:
            self._acquire(page)
        return PrefixMatch(pages, len(pages) * self.page_size, lower)

    def insert(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
        *,
        namespace: Hashable | None = None,
    ) -> None:
        """Publish the full pages of token_ids (stored in page_ids). A sequence inserts again
        each time a page fills: the walk starts at the node holding the last of its pages
        already in the tree, and only the pages after it are keyed."""
        size = self.page_size
        full = len(token_ids) // size
        node, done = self._inserted(page_ids, full, namespace)
        begin, end = done * size, full * size
        keys = self._page_keys(
            token_ids[begin:end], None if extra_keys is None else extra_keys[begin:end]
        )
        page_ids = page_ids[done:]
        now = next(self._clock)
        index = 0
        while index < len(keys) and keys[index] in node.children:
            # Device pages already in the tree win; the caller's duplicates stay uncached.
            child = node.children[keys[index]]
            if child.promoting:
                return
            shared = _common_length(child.page_keys, keys, index)
            if shared < len(child.page_keys):
                child = self._split(child, shared)
            if child.tier != DEVICE and not self._adopt(child, page_ids[index : index + shared]):
                return
            child.last_access = now
            self._touch(child)
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
        self._own(leaf)

    def _inserted(
        self, page_ids: Sequence[int], full: int, namespace: Hashable | None
    ) -> tuple[RadixNode, int]:
        """(node, k): the first k of page_ids are the tree's pages on the path to node, found
        from the caller's last page in the tree (node_of_page holds attached nodes only).
        Probes only the pages not in the tree yet; (root, 0) when it cannot tell."""
        root = self._root(namespace)
        if namespace is not None and namespace != self.namespace:
            return root, 0
        for k in range(min(full, len(page_ids)), 0, -1):
            node = self.node_of_page.get(page_ids[k - 1])
            if node is None:
                continue
            device = node.residency.device
            if device and device[-1] == page_ids[k - 1]:
                return node, k
            return root, 0  # mid-edge: the tree holds other pages after it
        return root, 0

    def block_hashes(self) -> set[int]:
        """The chained hash of every cached page (any tier), as ``chain_hashes`` computes it
        for a prompt: what a replica publishes for prefix-aware routing."""
        held: set[int] = set()
        stack = [(root, _namespace_hash(ns)) for ns, root in self.roots.items()]
        while stack:
            node, chained = stack.pop()
            for child in node.children.values():
                running = chained
                for page_key in child.page_keys:
                    running = _chain(running, page_key)
                    held.add(int.from_bytes(running[:8], "little"))
                stack.append((child, running))
        return held

    def nodes(self) -> Iterator[RadixNode]:
        """Every node below the roots, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------ promotion

    def start_promotion(self, nodes: list[RadixNode], device_pages: list[int]) -> PendingPromotion:
        """Copy ``nodes`` (from match_prefix's ``lower``) into ``device_pages`` (allocated by
        the caller, who keeps holding them) on the tiers' worker thread."""
        assert self.tiers is not None
        sources = [(n.tier, h) for n in nodes for h in n.residency.handles()]
        if len(sources) != len(device_pages):
            raise ValueError(f"{len(sources)} pages to promote into {len(device_pages)} pages")
        job = Promotion(sources, list(device_pages))
        return PendingPromotion(nodes, job, self.tiers.promote(job))

    def finish_promotion(self, pending: PendingPromotion) -> bool:
        """After the copy: the nodes hold the device pages now. False if the copy failed
        (e.g. an SSD page failed its checksum): the nodes are dropped and the caller's pages
        hold nothing valid."""
        assert self.tiers is not None
        try:
            pending.future.result()
        except Exception:
            for node in pending.nodes:
                node.promoting = False
            if pending.nodes[0].parent is not None:
                self._drop_subtree(pending.nodes[0])
            return False
        self.tiers.finish(pending.job)
        now, at = next(self._clock), 0
        for node in pending.nodes:
            count = len(node.page_keys)
            node.residency = Residency(tuple(pending.job.device_pages[at : at + count]))
            node.promoting = False
            node.last_access = now
            at += count
            self._own(node)
        return True

    def cancel_promotion(self, nodes: Sequence[RadixNode]) -> None:
        for node in nodes:
            node.promoting = False
            self._touch(node)

    # ------------------------------------------------------------ internals

    def _root(self, namespace: Hashable | None) -> RadixNode:
        key = self.namespace if namespace is None else namespace
        root = self.roots.get(key)
        if root is None:
            root = self.roots[key] = RadixNode([], None, Residency(()), 0)
        return root

    def _page_keys(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> list[PageKey]:
        return page_keys(token_ids, extra_keys, self.page_size)

    def _acquire(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            self.num_unreferenced_cached -= 1
        self.ref_counts[page] += 1
        self.node_of_page[page].lock_count += 1

    def _own(self, node: RadixNode) -> None:
        """Index a node's (new) device pages, counting the references already on them."""
        for page in node.residency.device:
            self.node_of_page[page] = node
            node.lock_count += self.ref_counts[page]
            if self.ref_counts[page] == 0:
                self.num_unreferenced_cached += 1
        self._touch(node)

    def _adopt(self, node: RadixNode, page_ids: Sequence[int]) -> bool:
        """A lower-tier node whose tokens the caller just computed: take the caller's device
        pages instead and drop the lower-tier copy. False if they cannot be used."""
        if len(page_ids) < len(node.page_keys) or any(p in self.node_of_page for p in page_ids):
            return False
        assert self.tiers is not None
        self.tiers.drop(node.tier, node.residency.handles())
        node.residency = Residency(tuple(page_ids[: len(node.page_keys)]))
        self._own(node)
        return True

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
        self._touch(head)  # a device head over a lower-tier tail is a device leaf
        return head

    def _touch(self, node: RadixNode) -> None:
        """After node's tier, pages, children, refs or last access change: queue it. O(log n)"""
        queue = self.leaves[node.tier]
        if not queue.queued(node, node.last_access) and self._evictable(node, node.tier):
            queue.push(node, node.last_access)

    def _evictable(self, node: RadixNode, tier: str) -> bool:
        """Device: an unreferenced tail, no device child; host: SSD children only; SSD: none."""
        if node.tier != tier or node.parent is None:
            return False
        if tier == DEVICE:
            return self._unreferenced_tail(node) > 0
        return not node.promoting and _tiers(node.children) <= ({SSD} if tier == HOST else set())

    def _pop_leaf(self, tier: str) -> RadixNode | None:
        """The least recently used evictable leaf of ``tier``, off its queue; None if none."""
        while (entry := self.leaves[tier].pop()) is not None:
            node, last_access = entry
            if node.last_access != last_access:
                self._touch(node)  # used since it was queued: back in at its last access
            elif self._evictable(node, tier):
                return node
        return None

    def _unreferenced_tail(self, node: RadixNode) -> int:
        """How many of a device leaf's last pages nobody references (0: not evictable)."""
        if node.parent is None or node.tier != DEVICE or DEVICE in _tiers(node.children):
            return 0  # not a leaf of the device tier
        run = 0
        for page in reversed(node.residency.device):
            if self.ref_counts[page]:
                break
            run += 1
        return run

    def _evict_device(self, count: int) -> int:
        """Leaf-first LRU over the device tier: demote (or drop) unreferenced tail pages,
        taking leaves off the evictable-leaf queue (no walk over the tree)."""
        while count > 0 and (leaf := self._pop_leaf(DEVICE)) is not None:
            run = self._unreferenced_tail(leaf)
            # Never more than the host tier holds at once: bigger pieces could only drop.
            take = min(count, run, self.tiers.host_capacity if self.tiers else run)
            if take < len(leaf.page_keys):
                self._split(leaf, len(leaf.page_keys) - take)  # leaf keeps the last `take`
            parent = leaf.parent
            self._demote(leaf)
            count -= take
            if parent is not None:  # it may be a device leaf now
                self._touch(parent)
        return count

    def _demote(self, node: RadixNode) -> None:
        """Move a device node's (unreferenced) pages to the host tier, or drop the node."""
        device = node.residency.device
        leases = None
        if self.tiers is not None and self._make_room(HOST, len(device)):
            leases = self.tiers.to_host(device)
        if leases is None:
            self._drop_subtree(node)
            return
        for page in device:
            self._uncache(page)
        node.residency = Residency((), host=tuple(leases))
        self.leaves[DEVICE].discard(node)
        self._touch(node)

    def _make_room(self, tier: str, pages: int) -> bool:
        """Free ``pages`` slots in a lower tier by pushing its LRU leaves one tier down."""
        tiers = self.tiers
        assert tiers is not None
        while (tiers.host_free if tier == HOST else tiers.ssd_free) < pages:
            victim = self._pop_leaf(tier)
            if victim is None:
                return False
            if tier == HOST and self._make_room(SSD, len(victim.page_keys)):
                blocks = tiers.to_ssd(victim.residency.host or ())
                if blocks is not None:
                    victim.residency = Residency((), ssd=tuple(blocks))
                    self._touch(victim)
                    if victim.parent is not None:
                        self._touch(victim.parent)  # a host parent may be a host leaf now
                    continue
            self._drop_subtree(victim)
        return True

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
        before = len(self.blank_pages)
        self._drop_subtree(node)
        return count - (len(self.blank_pages) - before)

    def _drop_subtree(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.page_keys[0]]
        node.parent = None
        stack = [node]
        while stack:
            dropped = stack.pop()
            for queue in self.leaves.values():
                queue.discard(dropped)
            stack.extend(dropped.children.values())
            for page in dropped.residency.device:
                self._uncache(page)
            if dropped.tier != DEVICE and self.tiers is not None:
                self.tiers.drop(dropped.tier, dropped.residency.handles())
        self._touch(parent)  # it may be a device leaf now

    def _uncache(self, page: int) -> None:
        del self.node_of_page[page]
        if self.ref_counts[page] == 0:
            self.num_unreferenced_cached -= 1
            self.blank_pages.append(page)
