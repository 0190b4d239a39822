"""The decode mirror is a cache of the pages: it always serves what the pages hold, and
decoding through it gives the same tokens as gathering the pages."""

import random

import pytest
import torch
from conftest import random_prompts

from omniflow.engine import LLMEngine, SamplingParams
from omniflow.engine.decode_mirror import DecodeMirror
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.paged_attention import KVCache
from omniflow.engine.sequence import Sequence

LAYERS, KV_HEADS, PAGE, DIM = 2, 2, 4, 8


@pytest.fixture
def cache():
    cache = KVCache(LAYERS, 32, PAGE, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    return cache


def decoding(page_ids: list[int], length: int) -> Sequence:
    sequence = Sequence("s", list(range(length)), SamplingParams())
    sequence.page_ids = list(page_ids)
    return sequence


def context(cache: KVCache, sequence: Sequence, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = torch.tensor(sequence.page_ids)
    keys = cache.keys[:, :, pages].reshape(LAYERS, KV_HEADS, -1, DIM)[:, :, :length]
    values = cache.values[:, :, pages].reshape(LAYERS, KV_HEADS, -1, DIM)[:, :, :length]
    return keys, values


def assert_mirrors(mirror: DecodeMirror, cache: KVCache, decodes):
    for slot, (sequence, position) in enumerate(decodes):
        keys, values = context(cache, sequence, position)
        assert torch.equal(mirror.keys[:, slot, :, :position], keys)
        assert torch.equal(mirror.values[:, slot, :, :position], values)


def step(mirror: DecodeMirror, decodes):
    """One model step: prepare, then write the new tokens' K/V as the attention would."""
    prepared = mirror.prepare(decodes)
    assert prepared is not None
    ordered = [decodes[i] for i in prepared.order]
    assert_mirrors(mirror, mirror.cache, ordered)
    for slot, (sequence, position) in enumerate(ordered):
        page = sequence.page_ids[position // PAGE]
        for source, target in (
            (mirror.cache.keys, mirror.keys),
            (mirror.cache.values, mirror.values),
        ):
            target[:, slot, :, position] = source[:, :, page, position % PAGE]
    mirror.commit()
    return ordered


def test_slots_fill_from_pages_and_follow_the_batch(cache):
    mirror = DecodeMirror(cache)
    a, b, c = decoding([3, 1], 6), decoding([7, 2, 9], 10), decoding([5], 2)
    step(mirror, [(a, 5), (b, 9), (c, 1)])
    step(mirror, [(a, 6), (b, 10), (c, 2)])
    # b finishes: c moves into its slot, a keeps slot 0, a newcomer d gets a fresh slot.
    d = decoding([11, 12], 5)
    ordered = step(mirror, [(d, 4), (c, 3), (a, 7)])
    assert [s for s, _ in ordered] == [a, c, d]


def test_written_pages_and_replaced_page_tables_are_refilled(cache):
    mirror = DecodeMirror(cache)
    a, b = decoding([3, 1, 4], 10), decoding([6, 8], 7)
    step(mirror, [(a, 9), (b, 6)])
    # A tier promotion rewrites page 1 (a's second page): a is refilled from it.
    fresh = torch.randn(LAYERS, KV_HEADS, PAGE, DIM)
    cache.keys[:, :, 1], cache.values[:, :, 1] = fresh, -fresh
    cache.note_written([1])
    step(mirror, [(a, 10), (b, 7)])
    # b is preempted and recomputed into the same page ids (the prefill rewrote them).
    b.num_preemptions += 1
    cache.keys[:, :, [6, 8]] += 1.0
    step(mirror, [(a, 11), (b, 7)])
    # b is preempted again and comes back on other pages.
    b.num_preemptions += 1
    b.page_ids = [20, 21]
    step(mirror, [(a, 11), (b, 7)])
    # a's page table changes under it without a preemption count (defensive).
    a.page_ids = [13, 14, 15]
    step(mirror, [(a, 11), (b, 7)])


def test_capacity_grows_and_keeps_contents(cache):
    mirror = DecodeMirror(cache)
    a, b = decoding(list(range(8)), 30), decoding([30, 31], 6)
    step(mirror, [(a, 3), (b, 5)])
    capacity = mirror.keys.shape[3]
    mirror.max_bytes = 10**9
    long_pages = list(range(8)) * (capacity // PAGE // 8 + 2)
    a.page_ids = long_pages[: -(-(capacity + 5) // PAGE)]
    # Same sequence, same first page, a longer context: the slot grows and keeps its tokens.
    step(mirror, [(a, capacity + 4), (b, 6)])
    assert mirror.keys.shape[3] > capacity


def test_over_budget_returns_none(cache):
    mirror = DecodeMirror(cache, max_bytes=100)
    assert mirror.prepare([(decoding([1, 2], 6), 5)]) is None


def run(engine: LLMEngine, prompts, params, abort_at=None):
    produced = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    rng = random.Random(3)
    steps = 0
    while pending or engine.has_unfinished_requests():
        steps += 1
        for _ in range(rng.randint(0, 2)):  # staggered arrivals: mixed prefill + decode steps
            if pending:
                index = pending.pop(0)
                engine.add_request(f"r{index}", prompts[index], params)
        if abort_at is not None and steps == abort_at and "r1" in engine.sequences:
            engine.abort("r1")
        for delta in engine.step():
            produced[int(delta.request_id[1:])] += delta.token_ids
    return produced


@pytest.mark.parametrize(
    "num_pages,dtype", [(None, "float32"), (14, "float32"), (None, "bfloat16")]
)
def test_mirrored_decode_equals_paged_decode(tiny_models, num_pages, dtype):
    # bfloat16: the mirror holds bf16 copies of the pages, and both paths run decode
    # attention as SDPA over bf16 K/V, so both still give the same tokens.
    path = tiny_models["qwen2-tied-odd-heads"]
    prompts = random_prompts((30, 12, 25, 7, 18, 22, 3), seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(
        device="cpu", dtype=dtype, page_size=4, num_pages=num_pages, max_num_batched_tokens=32
    )
    paged = LLMEngine(path, config)
    paged.runner.mirror.max_bytes = 0
    mirrored = LLMEngine(path, config)
    expected = run(paged, prompts, params, abort_at=9)
    assert run(mirrored, prompts, params, abort_at=9) == expected
    assert len(expected[1]) < params.max_tokens  # aborted mid-decode
    assert mirrored.runner.mirror.keys.shape[1] > 0  # the mirror did serve the decodes
    assert mirrored.runner.mirror.keys.dtype == getattr(torch, dtype)
    assert paged.runner.mirror.keys.shape[1] == 0
