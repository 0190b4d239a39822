"""Pulling a prefix's KV pages from another process over tcp: bit-exact, one-time tokens,
pins released whatever the puller does, and the cost model's say."""

import asyncio
import multiprocessing as mp
import time

import pytest
import torch
import zmq
from conftest import random_prompts

from omniflow.engine import AsyncEngine, LLMEngine
from omniflow.engine.kv_transfer import EnginePrefixes, KVTransfer
from omniflow.kv.pull_cost import PullCost
from omniflow.messages import KvDrop, KvFetch, KvPrepare, KvPrepared, KvPullReply, KvRefused
from omniflow.transport.codec import decode, decoder_for, encode
from omniflow.transport.kv_pull import KVPuller, KVPullError
from omniflow.transport.security import generate_keys, load_keys
from tests.engine.kv_pull_peers import die_mid_pull, engine_config, greedy, hold, prefix_pages

SPAWN = mp.get_context("spawn")
PAGE = 4
[PROMPT] = random_prompts([8 * PAGE + 3], seed=7)  # 8 full pages, then a partial one


@pytest.fixture(scope="module")
def holder(llama_path):
    """One holder process for the module, a page per pages message (so fetches are
    multi-part); tests read its counters as differences."""
    parent, child = SPAWN.Pipe()
    options = {"chunk_bytes": 1}
    process = SPAWN.Process(target=hold, args=(str(llama_path), child, options), daemon=True)
    process.start()
    endpoint = parent.recv()

    def ask(command, arg=None):
        parent.send((command, arg))
        return parent.recv()

    ask("prefill", PROMPT)
    yield endpoint, ask
    if process.is_alive():
        ask("exit")
    process.join(10)


def books_settled(ask, before=None):
    """The holder's books once its pins and their page refs have gone (both asynchronous:
    the pin goes first, its pages a moment later on the engine's thread); counters as
    differences from ``before``. A leak still shows: the wait ends after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        books = ask("books")
        settled = books["pinned"] == 0 and books["referenced"] == 0
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if before is not None:
        books = {k: v - before[k] if k in COUNTERS else v for k, v in books.items()}
    return books


COUNTERS = ("prepared", "fetched", "dropped", "expired", "refused")


async def pull_into(engine, endpoint, tokens, cost=None, keys=None, force=True, timeout_s=30.0):
    """Pull tokens' prefix into engine (an AsyncEngine); the result and the pulled pages."""
    prefixes = EnginePrefixes(engine)
    importer = prefixes.importer(tokens)
    ctx = zmq.Context()
    try:
        held = await importer.begin()
        puller = KVPuller(ctx, cost or PullCost(), keys=keys, timeout_s=timeout_s)
        try:
            result = await puller.pull(
                endpoint, "pull-1", tokens, None, importer, held_pages=held, force=force
            )
        except BaseException:
            await importer.abandon()
            raise
        if result.pulled_tokens:
            await importer.publish()
        else:
            await importer.abandon()
        return result
    finally:
        ctx.term()


def test_pulled_pages_are_bit_exact_and_continue_like_a_local_prefill(holder, llama_path):
    endpoint, ask = holder
    before = ask("books")
    prefix = PROMPT[:-1]  # what admission matches: every token but the last
    puller = AsyncEngine(LLMEngine(llama_path, engine_config()))
    try:
        result = asyncio.run(pull_into(puller, endpoint, prefix))
    finally:
        asyncio.run(puller.close())
    assert result.pulled_tokens == result.remote_tokens == 8 * PAGE
    assert result.nbytes == 8 * KVTransfer(puller.backend).page_nbytes

    local = LLMEngine(llama_path, engine_config())
    expected_tokens, _ = greedy(local, "local", PROMPT)
    expected, _ = prefix_pages(local, prefix)
    pulled, num_tokens = prefix_pages(puller.backend, prefix)
    assert num_tokens == 8 * PAGE
    assert pulled.dtype == expected.dtype
    assert torch.equal(pulled.view(torch.uint8), expected.view(torch.uint8))

    tokens, cached = greedy(puller.backend, "continued", PROMPT)
    assert cached == 8 * PAGE  # the pulled pages served the prompt, not a recompute
    assert tokens == expected_tokens
    books = books_settled(ask, before)
    assert books["fetched"] == 1 and books["referenced"] == 0


def test_a_puller_holding_part_of_the_prefix_fetches_only_the_rest(holder, llama_path):
    endpoint, ask = holder
    engine = LLMEngine(llama_path, engine_config())
    greedy(engine, "part", PROMPT[: 3 * PAGE + 1])  # 3 pages of the prefix, computed here
    puller = AsyncEngine(engine)
    try:
        result = asyncio.run(pull_into(puller, endpoint, PROMPT[:-1]))
    finally:
        asyncio.run(puller.close())
    assert result.pulled_tokens == 5 * PAGE
    local = LLMEngine(llama_path, engine_config())
    greedy(local, "local", PROMPT)
    expected, _ = prefix_pages(local, PROMPT[:-1])
    pulled, _ = prefix_pages(engine, PROMPT[:-1])
    # Pages 3.. came from the holder's prefill of the whole prompt, as the local one's did
    # (the first three were computed here over a shorter prompt: other float rounding).
    assert torch.equal(pulled[3:].view(torch.uint8), expected[3:].view(torch.uint8))


def raw_request(endpoint, *messages):
    """Send requests on one DEALER, one at a time; each reply's header (frames dropped)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.connect(endpoint)
    decoder = decoder_for(KvPullReply)
    replies = []
    try:
        for message in messages:
            if callable(message):
                message = message(replies)
            sock.send(encode(message))
            if isinstance(message, KvDrop):  # answered by nothing
                continue
            reply = decode(sock.recv_multipart()[0], decoder)
            while not isinstance(reply, KvPrepared | KvRefused) and not reply.last:
                reply = decode(sock.recv_multipart()[0], decoder)
            replies.append(reply)
    finally:
        sock.close(1000)  # a KvDrop just sent still leaves
        ctx.term()
    return replies


def test_a_token_opens_one_fetch_and_wrong_ones_are_refused_by_name(holder):
    endpoint, ask = holder
    prepare = KvPrepare("r1", PROMPT[:-1])
    prepared, fetched, again, wrong = raw_request(
        endpoint,
        prepare,
        lambda replies: KvFetch("r1", replies[0].token),
        lambda replies: KvFetch("r1", replies[0].token),
        KvFetch("r2", "0" * 32),
    )
    assert isinstance(prepared, KvPrepared) and prepared.num_pages == 8
    assert fetched.last
    assert isinstance(again, KvRefused) and again.code == "token_used"
    assert "already used" in again.message and again.request_id == "r1"
    assert isinstance(wrong, KvRefused) and wrong.code == "token_unknown"
    [bad] = raw_request(endpoint, KvPrepare("r3", PROMPT[:8], extra_keys=[None] * 3))
    assert isinstance(bad, KvRefused) and bad.code == "bad_request" and "extra_keys" in bad.message
    books = books_settled(ask)
    assert books["pinned"] == 0 and books["referenced"] == 0
    before = ask("books")
    [served] = raw_request(  # and it goes on serving
        endpoint, prepare, lambda replies: KvDrop("r1", replies[0].token)
    )
    assert isinstance(served, KvPrepared) and served.num_pages == 8
    books = books_settled(ask, before)
    assert books["dropped"] == 1 and books["referenced"] == 0


def test_an_expired_token_is_refused_and_its_pin_released(holder):
    endpoint, ask = holder
    before = ask("ttl", 2.0)
    try:
        [prepared] = raw_request(endpoint, KvPrepare("late", PROMPT[:-1]))
        assert ask("books")["pinned"] == 1
        books = books_settled(ask, before)  # the token's lifetime passes
    finally:
        ask("ttl", 10.0)
    assert books["expired"] == 1 and books["referenced"] == 0
    [refused] = raw_request(endpoint, KvFetch("late", prepared.token))
    assert isinstance(refused, KvRefused) and refused.code == "token_expired"


def test_the_holder_survives_a_puller_killed_mid_transfer(holder, llama_path):
    endpoint, ask = holder
    parent, child = SPAWN.Pipe()
    doomed = SPAWN.Process(target=die_mid_pull, args=(endpoint, PROMPT[:-1], child))
    doomed.start()
    assert parent.recv() == 8
    doomed.join(10)
    assert doomed.exitcode == -9
    books = books_settled(ask)
    assert books["pinned"] == 0 and books["referenced"] == 0  # pin released, nothing leaked
    puller = AsyncEngine(LLMEngine(llama_path, engine_config()))
    try:
        result = asyncio.run(pull_into(puller, endpoint, PROMPT[:-1]))
    finally:
        asyncio.run(puller.close())
    assert result.pulled_tokens == 8 * PAGE


def test_a_slow_link_makes_the_puller_recompute(holder, llama_path):
    endpoint, ask = holder
    before = ask("books")
    cost = PullCost()
    cost.prefill.add(2_000, 1.0)  # 2,000 prefill tokens/s measured here
    cost.link.add(1_000, 1.0)  # and a 1 kB/s link: 32 tokens of KV take minutes
    engine = LLMEngine(llama_path, engine_config())
    puller = AsyncEngine(engine)
    try:
        result = asyncio.run(pull_into(puller, endpoint, PROMPT[:-1], cost=cost, force=False))
    finally:
        asyncio.run(puller.close())
    assert result.pulled_tokens == 0 and not result.decision.pull
    assert result.decision.pull_s > result.decision.recompute_s
    assert KVTransfer(engine).cached_tokens(PROMPT[:-1]) == 0  # nothing half-imported
    assert engine.allocator.usage().free_pages == engine.allocator.num_pages
    books = books_settled(ask, before)
    assert books["dropped"] == 1 and books["fetched"] == 0 and books["referenced"] == 0


def test_a_fast_link_against_a_slow_prefill_makes_it_pull(holder, llama_path):
    endpoint, _ = holder
    engine = LLMEngine(llama_path, engine_config())
    greedy(engine, "warm", random_prompts([40], seed=3)[0])
    assert engine.prefill_rate.samples >= 1  # the engine measures its prefill steps
    cost = PullCost()
    cost.prefill.add(10, 1.0)  # a replica that prefills 10 tokens/s (a big model, say)
    cost.link.add(1 << 30, 1.0)  # and a 1 GiB/s link
    puller = AsyncEngine(engine)
    try:
        result = asyncio.run(pull_into(puller, endpoint, PROMPT[:-1], cost=cost, force=False))
    finally:
        asyncio.run(puller.close())
    assert result.decision.pull and result.pulled_tokens == 8 * PAGE
    assert cost.link.samples == 2  # the pull measured the link


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-keys") / "keys"
    generate_keys(folder)
    return folder


@pytest.fixture
def curve_holder(keys_dir, llama_path):
    parent, child = SPAWN.Pipe()
    options = {"keys": str(keys_dir)}
    process = SPAWN.Process(target=hold, args=(str(llama_path), child, options), daemon=True)
    process.start()
    endpoint = parent.recv()
    parent.send(("prefill", PROMPT))
    parent.recv()
    yield endpoint
    parent.send(("exit", None))
    parent.recv()
    process.join(10)


def test_curve_pulls_need_the_deployments_keys(curve_holder, keys_dir, llama_path):
    puller = AsyncEngine(LLMEngine(llama_path, engine_config()))
    try:
        result = asyncio.run(pull_into(puller, curve_holder, PROMPT[:-1], keys=load_keys(keys_dir)))
        assert result.pulled_tokens == 8 * PAGE
        with pytest.raises(KVPullError, match="did not answer") as keyless:
            asyncio.run(pull_into(puller, curve_holder, PROMPT[:-1], timeout_s=1.0))
        assert keyless.value.code == "deadline"
    finally:
        asyncio.run(puller.close())
