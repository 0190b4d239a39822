"""The radix prefix cache: PageAllocator semantics, media and namespace keys, eviction."""

import random

import pytest

from omniflow.kv import OutOfPages, PrefixMatch, RadixPrefixCache, Residency
from tests.helpers import assert_leaves_queued


def test_match_insert_free_keep_pages_matchable():
    cache = RadixPrefixCache(num_pages=4, page_size=2)
    tokens = [1, 2, 3, 4, 5]
    pages = cache.allocate(3)
    cache.insert(tokens, pages)  # two full pages published; the partial third is not
    assert cache.usage().cached_pages == 2
    match = cache.match_prefix(tokens)
    assert match.page_ids == pages[:2] and match.num_tokens == 4
    assert cache.ref_counts[pages[0]] == 2
    cache.free(pages)
    cache.free(match.page_ids)
    assert cache.usage() == (4, 4, 2)
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4  # still cached after free
    with pytest.raises(RuntimeError, match="freed more often"):
        cache.free([pages[2]])


def test_prefix_is_matched_by_position_and_splits_at_page_boundaries():
    cache = RadixPrefixCache(num_pages=8, page_size=2)
    pages = cache.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6], pages)
    assert cache.match_prefix([9, 9, 3, 4]).num_tokens == 0  # same page, other prefix
    half = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert half.page_ids == pages[:2]
    # The match split the three-page edge: the held prefix is a whole node.
    assert [len(n.page_keys) for n in cache.nodes()] == [2, 1]
    branch = cache.allocate(1)
    cache.insert([1, 2, 3, 4, 7, 7], half.page_ids + branch)
    assert cache.match_prefix([1, 2, 3, 4, 7, 7, 0]).page_ids == pages[:2] + branch
    assert cache.usage().cached_pages == 4


def test_duplicate_pages_keep_the_first_and_stay_uncached():
    cache = RadixPrefixCache(num_pages=4, page_size=2)
    first, second = cache.allocate(1), cache.allocate(1)
    cache.insert([1, 2], first)
    cache.insert([1, 2], second)
    assert cache.match_prefix([1, 2]).page_ids == first
    cache.free(second)
    assert second[0] in cache.blank_pages and cache.usage().cached_pages == 1


def test_image_hash_decides_a_match_not_the_placeholder_id():
    cache = RadixPrefixCache(num_pages=4, page_size=2)
    pages = cache.allocate(2)
    cache.insert([7, 7, 7, 7], pages, extra_keys=["img-a"] * 4)
    assert cache.match_prefix([7, 7, 7, 7], extra_keys=["img-b"] * 4).num_tokens == 0
    assert cache.match_prefix([7, 7, 7, 7]).num_tokens == 0
    assert cache.match_prefix([7, 7, 7, 7], extra_keys=["img-a"] * 4).page_ids == pages
    # None keys mean text: they equal no keys at all, and never match an image.
    assert cache.match_prefix([7, 7, 7, 7], extra_keys=[None] * 4).num_tokens == 0
    text = cache.allocate(1)
    cache.insert([1, 2], text)
    assert cache.match_prefix([1, 2], extra_keys=[None, None]).page_ids == text


def test_namespaces_do_not_mix():
    cache = RadixPrefixCache(num_pages=4, page_size=2, namespace="model-a")
    pages = cache.allocate(1)
    cache.insert([1, 2], pages)
    assert cache.match_prefix([1, 2], namespace="model-b").num_tokens == 0
    assert RadixPrefixCache(4, 2, namespace="model-b").match_prefix([1, 2]).num_tokens == 0
    assert cache.match_prefix([1, 2], namespace="model-a").page_ids == pages
    assert cache.match_prefix([1, 2]).page_ids == pages  # the constructor's namespace


def test_nodes_record_device_residency_with_other_tiers_reserved():
    cache = RadixPrefixCache(num_pages=4, page_size=2)
    pages = cache.allocate(2)
    cache.insert([1, 2, 3, 4], pages)
    [node] = cache.nodes()
    assert node.residency == Residency(tuple(pages), None, None)
    assert node.lock_count == 2
    cache.free(pages)
    assert node.lock_count == 0


def test_eviction_is_leaf_first_least_recently_used():
    cache = RadixPrefixCache(num_pages=6, page_size=2)
    shared, a = cache.allocate(1), cache.allocate(1)
    cache.insert([1, 2, 3, 4], shared + a)
    branch = cache.match_prefix([1, 2]).page_ids + cache.allocate(1)
    b = branch[1:]
    cache.insert([1, 2, 5, 6], branch)
    cache.free(shared + a)
    cache.free(branch)
    cache.free(cache.match_prefix([1, 2, 3, 4]).page_ids)  # a is now more recent than b
    cache.allocate(3)  # the three blank pages
    assert cache.allocate(1) == b
    assert cache.allocate(1) == a
    assert cache.match_prefix([1, 2]).num_tokens == 2  # the shared parent went last
    cache.free(shared)
    assert cache.allocate(1) == shared


def test_held_pages_are_never_evicted_and_out_of_pages_only_when_all_held():
    cache = RadixPrefixCache(num_pages=3, page_size=2)
    held = cache.allocate(2)
    cache.insert([1, 2, 3, 4], held)
    loose = cache.allocate(1)
    cache.insert([8, 9], loose)
    cache.free(loose)
    assert cache.usage().free_pages == 1
    assert cache.allocate(1) == loose  # evicts the unreferenced page, not the held ones
    assert cache.match_prefix([8, 9]).num_tokens == 0
    with pytest.raises(OutOfPages):
        cache.allocate(1)
    assert cache.match_prefix([1, 2, 3, 4]).page_ids == held


def test_pages_below_a_duplicate_are_reclaimed_when_needed():
    # B computed the same first page as A; B's second page hangs below A's first page, which
    # nobody holds once A is freed. It still counts as free and allocate() can take it.
    cache = RadixPrefixCache(num_pages=4, page_size=2)
    a, b = cache.allocate(1), cache.allocate(2)
    cache.insert([1, 2], a)
    cache.insert([1, 2, 3, 4], b)
    cache.free(a)
    assert cache.usage().free_pages == 2
    assert cache.allocate(2) == [3, a[0]]  # the blank page, then A's orphaning page
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    cache.free(b)
    assert cache.usage().free_pages == 2 and cache.usage().cached_pages == 0


def test_random_workload_keeps_the_books_balanced():
    rng = random.Random(3)
    cache = RadixPrefixCache(num_pages=12, page_size=2)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            cache.free(held.pop(rng.randrange(len(held))))
        else:
            tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 8))]
            # Skipping the match sometimes makes duplicate pages, as two requests racing do.
            match = cache.match_prefix(tokens) if rng.random() < 0.7 else PrefixMatch([], 0)
            needed = -(-len(tokens) // 2) - len(match.page_ids)
            try:
                pages = match.page_ids + cache.allocate(needed)
            except OutOfPages:
                assert cache.usage().free_pages < needed
                cache.free(match.page_ids)
                continue
            cache.insert(tokens, pages)
            held.append(pages)
        in_use = {page for pages in held for page in pages}
        usage = cache.usage()
        assert usage.free_pages == 12 - len(in_use)
        assert not in_use & set(cache.blank_pages)  # a held page is never handed out again
        assert sum(n.lock_count for n in cache.nodes()) == sum(
            cache.ref_counts[p] for p in cache.node_of_page
        )
        assert_leaves_queued(cache)
    for pages in held:
        cache.free(pages)
    assert cache.usage().free_pages == 12


def test_a_growing_sequence_keys_only_its_new_pages(monkeypatch):
    """Inserting after every filled page walks on from the sequence's last page in the tree:
    each page is keyed once, not the whole prompt again each time (quadratic)."""
    from omniflow.kv import radix as prefix

    keyed = []
    real = prefix.page_keys

    def counting(token_ids, extra_keys, page_size):
        keys = real(token_ids, extra_keys, page_size)
        keyed.append(len(keys))
        return keys

    monkeypatch.setattr(prefix, "page_keys", counting)
    cache = RadixPrefixCache(num_pages=64, page_size=2)
    tokens = list(range(100, 160))
    extra = [None] * 10 + [("image", i) for i in range(10)] + [None] * 40
    pages = cache.allocate(30)
    for length in range(2, 61, 2):
        cache.insert(tokens[:length], pages, extra[:length])
    assert sum(keyed) == 30
    match = cache.match_prefix(tokens, extra)
    assert match.page_ids == pages and match.num_tokens == 60
    # Another sequence sharing 10 pages then diverging: its walk starts at its own pages.
    cache.free(match.page_ids)
    other = cache.match_prefix(tokens[:20] + [1, 2, 3], extra[:20] + [None] * 3)
    assert other.num_tokens == 20
    own = other.page_ids + cache.allocate(2)
    keyed.clear()
    cache.insert(tokens[:20] + [1, 2, 3, 4], own, extra[:20] + [None] * 4)
    assert keyed == [2]
    assert (
        cache.match_prefix(tokens[:20] + [1, 2, 3, 4, 5], extra[:20] + [None] * 5).num_tokens == 24
    )


def test_eviction_from_a_large_tree_takes_lru_leaves_without_a_walk():
    n = 20_000
    cache = RadixPrefixCache(num_pages=n + 3, page_size=1)
    chain = cache.allocate(3)  # one three-page path, the oldest of all
    cache.insert([-1, -2, -3], chain)
    cache.free(chain)
    for i in range(n):  # 20k one-page leaves, each less recently used than the next
        page = cache.allocate(1)
        cache.insert([i], page)
        cache.free(page)
    assert sum(1 for _ in cache.nodes()) == n + 1  # the path is one three-page edge
    probes = cache.leaves["device"].probes
    taken = cache.allocate(13)  # the oldest: the path, then leaves 0..9
    assert sorted(taken) == sorted(chain + list(range(3, 13)))
    assert cache.match_prefix([-1]).num_tokens == 0
    assert [cache.match_prefix([i]).num_tokens for i in (0, 9, 10, n - 1)] == [0, 0, 1, 1]
    # Popped heap entries, not nodes walked: about one per page evicted, not one per node.
    assert cache.leaves["device"].probes - probes <= 2 * 13
