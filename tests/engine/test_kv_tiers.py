"""KV tiers below the device: evicted prefix pages go to the host pool, then SSD, and come
back bit-exact; outputs never change; nothing leaks; nothing stale survives a restart."""

import random

import pytest
import torch
from conftest import random_prompts

from omniflow.engine import LLM, SamplingParams
from omniflow.engine.kv_pages import KVCachePages
from omniflow.engine.paged_attention import KVCache
from omniflow.engine.sequence import EmbeddingSpan
from omniflow.kv import OutOfPages, RadixPrefixCache
from omniflow.kv.tiers import HOST, SSD, KVTiers
from omniflow.memory import PagePool
from omniflow.models import DecoderConfig
from tests.helpers import assert_leaves_queued

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PAGE = 4


def tiered_llm(path, tmp_path, host_pages, ssd_pages=0, num_pages=30):
    config = DecoderConfig.from_folder(path)
    page_bytes = KVCache.bytes_per_page(
        config.num_hidden_layers, PAGE, config.num_key_value_heads, config.head_dim, torch.float32
    )
    return LLM(
        path,
        device="cpu",
        page_size=PAGE,
        num_pages=num_pages,
        host_kv_bytes=host_pages * page_bytes,
        ssd_kv_dir=str(tmp_path) if ssd_pages else None,
        ssd_kv_bytes=ssd_pages * max(4096, page_bytes),
    )


def reference_llm(path):
    return LLM(path, device="cpu", num_pages=64, enable_prefix_caching=False)


def prefix_pages(llm, tokens):
    """The KV content of the cached prefix of tokens, and the tier of each of its nodes."""
    allocator = llm.engine.allocator
    tiers = [node.tier for node in _path(allocator, tokens)]
    match = allocator.match_prefix(tokens)
    allocator.cancel_promotion(match.lower)
    content = KVCachePages(llm.engine.cache).read_pages(match.page_ids)
    allocator.free(match.page_ids)
    return content, tiers


def _path(allocator, tokens):
    keys = allocator._page_keys(tokens, None)
    node, index, path = allocator._root(None), 0, []
    while index < len(keys) and keys[index] in node.children:
        node = node.children[keys[index]]
        path.append(node)
        index += len(node.page_keys)
    return path


@pytest.mark.parametrize("tier", [HOST, SSD])
def test_evicted_prefix_comes_back_bit_exact(tiny_models, tmp_path, tier):
    path = tiny_models["llama-mha"]
    prompts = random_prompts((40,) * 6, seed=31)
    expected = [o.token_ids for o in reference_llm(path).generate(prompts, GREEDY)]
    # SSD case: one host page, so everything demoted spills on to SSD.
    llm = tiered_llm(path, tmp_path, host_pages=64 if tier == HOST else 1, ssd_pages=256)
    first = llm.generate([prompts[0]], GREEDY)[0]
    before, tiers = prefix_pages(llm, prompts[0])
    assert set(tiers) == {"device"} and before.shape[0] == 10  # 40 tokens: 10 full pages
    later = [llm.generate([p], GREEDY)[0] for p in prompts[1:]]  # 30 device pages: evicts
    _, tiers = prefix_pages(llm, prompts[0])
    assert tier in tiers and "device" not in tiers[:1], tiers
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.cached_tokens == 36  # promoted back, not recomputed
    after, tiers = prefix_pages(llm, prompts[0])
    assert set(tiers) == {"device"}
    # The 9 promoted pages are bit-exact; the 10th was computed again (another kernel path).
    assert torch.equal(before[:9], after[:9])
    torch.testing.assert_close(before[9], after[9])
    assert [first.token_ids, *[o.token_ids for o in later]] == expected
    assert again.token_ids == expected[0]
    counts = llm.engine.tiers.counts
    assert counts["promoted"] >= 9 and (tier == HOST or counts["spilled"] > 0)
    llm.engine.close()


def test_full_tiers_drop_the_oldest_and_outputs_stay_identical(tiny_models, tmp_path):
    path = tiny_models["llama-gqa"]
    prompts = random_prompts((40,) * 8, seed=32)
    expected = [o.token_ids for o in reference_llm(path).generate(prompts, GREEDY)]
    llm = tiered_llm(path, tmp_path, host_pages=4, ssd_pages=12, num_pages=24)
    # There and back: the most recent prompts are still in a lower tier, the oldest are gone.
    order = [*range(8), *reversed(range(8))]
    outputs = [llm.generate([prompts[i]], GREEDY)[0] for i in order]
    assert [o.token_ids for o in outputs] == [expected[i] for i in order]
    assert outputs[8].cached_tokens == 36 and outputs[-1].cached_tokens == 0
    assert llm.engine.tiers.counts["dropped"] > 0 and llm.engine.tiers.counts["promoted"] > 0
    assert llm.engine.tiers.host_used <= 4 and llm.engine.tiers.ssd_free >= 0
    usage = llm.engine.allocator.usage()
    assert usage.free_pages == usage.total_pages  # every page given back
    llm.engine.close()


def test_sessions_share_kv_only_when_their_prefixes_are_equal(tiny_models, tmp_path):
    """Interleaved multi-turn sessions, batched, with small device KV and tiers: each turn's
    output equals the same prompt run alone with caching off. Sessions 0 and 1 share their
    text opening; 2 and 3 carry different images behind identical placeholder ids."""
    path = tiny_models["llama-mha"]
    reference = reference_llm(path)
    llm = tiered_llm(path, tmp_path, host_pages=16, ssd_pages=64, num_pages=40)
    hidden = llm.engine.model.config.hidden_size
    opening = random_prompts((12,), seed=40)[0]
    generator = torch.Generator().manual_seed(41)
    images = [torch.randn(8, hidden, generator=generator) for _ in range(2)]
    histories = [opening[:], opening[:], [0] * 8, [0] * 8]
    spans = [[], [], [EmbeddingSpan(0, images[0], "img-a")], [EmbeddingSpan(0, images[1], "img-b")]]
    cached = []
    for turn in range(4):
        prompts = [
            h + random_prompts((6,), seed=100 * turn + i)[0] for i, h in enumerate(histories)
        ]
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"t{turn}-s{i}", prompt, GREEDY, spans[i] or None)
        got: dict[str, list[int]] = {}
        cached_now: dict[str, int] = {}
        computed = llm.engine.stats["prompt_tokens_computed"]
        for delta in llm.engine.run_to_completion():
            got.setdefault(delta.request_id, []).extend(delta.token_ids)
            cached_now[delta.request_id] = delta.num_cached_tokens
        # Every prompt token was either reported cached or computed (none preempted here).
        computed = llm.engine.stats["prompt_tokens_computed"] - computed
        assert computed + sum(cached_now.values()) == sum(len(p) for p in prompts)
        for i, prompt in enumerate(prompts):
            reference.engine.add_request("ref", prompt, GREEDY, spans[i] or None)
            want = [t for d in reference.engine.run_to_completion() for t in d.token_ids]
            assert got[f"t{turn}-s{i}"] == want, (turn, i)
            histories[i] = prompt + want
        cached.append([cached_now[f"t{turn}-s{i}"] for i in range(4)])
    assert cached[0][2] == 0 and cached[0][3] == 0  # a different image is never a hit
    assert all(c > 0 for c in cached[-1])  # later turns reuse their own history
    assert llm.engine.tiers.counts["demoted"] > 0
    llm.engine.close()


def test_abort_while_promoting_gives_every_page_back(tiny_models, tmp_path):
    path = tiny_models["llama-mha"]
    prompts = random_prompts((40,) * 5, seed=33)
    llm = tiered_llm(path, tmp_path, host_pages=64)
    for prompt in prompts:
        llm.generate([prompt], GREEDY)
    engine = llm.engine
    engine.add_request("again", prompts[0], GREEDY)
    engine.step()
    assert engine.scheduler.promoting  # waiting on its copy
    engine.abort("again")
    engine.run_to_completion()
    assert not engine.scheduler.promoting
    usage = engine.allocator.usage()
    assert usage.free_pages == usage.total_pages
    engine.close()


def test_a_restarted_engine_serves_no_stale_pages(tiny_models, tmp_path):
    path = tiny_models["llama-mha"]
    [prompt] = random_prompts((40,), seed=34)
    first = tiered_llm(path, tmp_path, host_pages=1, ssd_pages=64, num_pages=12)
    first.generate([prompt], GREEDY)
    first.generate(random_prompts((40,), seed=35), GREEDY)  # pushes the prompt to SSD
    assert first.engine.tiers.counts["spilled"] > 0
    first.engine.close()
    restarted = tiered_llm(path, tmp_path, host_pages=1, ssd_pages=64, num_pages=12)
    [again] = restarted.generate([prompt], GREEDY)
    assert again.cached_tokens == 0
    restarted.engine.close()


def test_random_workload_keeps_tiers_consistent(tmp_path):
    """The radix tree with real tiers under a random workload: the books balance, tiers are
    ordered device > host > SSD along every path, and promoted pages hold what was demoted."""
    cache = KVCache(2, 10, 2, 1, 4, torch.float32, torch.device("cpu"))
    device = KVCachePages(cache)
    pool = PagePool.create(f"omniflow-test-tiers-{random.randrange(1 << 30)}", 16 * 4096, 4096)
    pool.unlink()
    from omniflow.memory.ssd import SsdStore

    tiers = KVTiers(device, pool, host_pages=5, ssd=SsdStore(str(tmp_path), 6 * 4096, 4096))
    tree = RadixPrefixCache(10, 2, tiers=tiers)
    rng = random.Random(7)
    held: list[list[int]] = []

    def content(tokens):  # what a page of these tokens holds, so restores can be checked
        return torch.tensor(tokens, dtype=torch.float32).repeat_interleave(16)

    for _ in range(1500):
        if held and rng.random() < 0.45:
            tree.free(held.pop(rng.randrange(len(held))))
            continue
        tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 8))]
        match = tree.match_prefix(tokens)
        pages = list(match.page_ids)
        if match.lower:
            wanted = sum(len(n.page_keys) for n in match.lower)
            try:
                fresh = tree.allocate(wanted)
            except OutOfPages:
                tree.cancel_promotion(match.lower)
            else:
                pending = tree.start_promotion(list(match.lower), fresh)
                assert tree.finish_promotion(pending)
                pages += fresh
        for index, page in enumerate(pages):
            expected = content(tokens[index * 2 : index * 2 + 2])
            assert torch.equal(device.read_pages([page]).flatten(), expected)
        needed = -(-len(tokens) // 2) - len(pages)
        try:
            new = tree.allocate(needed)
        except OutOfPages:
            tree.free(pages)
            continue
        for index, page in enumerate(new, start=len(pages)):
            chunk = tokens[index * 2 : index * 2 + 2]
            if len(chunk) == 2:
                device.write_pages([page], content(chunk).view(1, *device.page_shape))
        tree.insert(tokens, pages + new)
        held.append(pages + new)
        _check_books(tree, tiers, held)
    for pages in held:
        tree.free(pages)
    assert tree.usage().free_pages == 10
    tiers.close()
    pool.close()


def _check_books(tree, tiers, held):
    in_use = {page for pages in held for page in pages}
    assert tree.usage().free_pages == 10 - len(in_use)
    host = ssd = 0
    for node in tree.nodes():
        if node.parent is not None and node.parent.parent is not None:
            order = ["device", HOST, SSD]
            assert order.index(node.parent.tier) <= order.index(node.tier)
        host += len(node.residency.host or ())
        ssd += len(node.residency.ssd or ())
    assert host == tiers.host_used <= tiers.host_capacity
    assert ssd == tiers.ssd.slots - tiers.ssd_free
    assert_leaves_queued(tree)  # the host and SSD tiers' eviction queues too
