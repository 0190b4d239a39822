"""AsyncEngine streams tokens from a worker thread, aborts on early exit, keeps the loop free."""

import asyncio
import threading

import pytest
from conftest import random_prompts

from omniflow.engine import LLM, SamplingParams
from omniflow.engine.async_engine import AsyncEngine
from omniflow.engine.llm_engine import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


async def collect(engine, request_id, prompt, params=GREEDY):
    tokens, last = [], None
    async for delta in engine.generate(request_id, prompt, params):
        tokens += delta.token_ids
        last = delta
    return tokens, last


def test_concurrent_streams_match_offline(llama_path):
    prompts = random_prompts((5, 21, 13), seed=31)
    expected = [o.token_ids for o in LLM(llama_path, device="cpu").generate(prompts, GREEDY)]

    async def main():
        engine = AsyncEngine.from_path(llama_path, EngineConfig(device="cpu"))
        try:
            results = await asyncio.gather(
                *(collect(engine, f"r{i}", p) for i, p in enumerate(prompts))
            )
        finally:
            await engine.close()
        return results

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(last.finish_reason == "length" for _, last in results)


def test_bad_request_raises_in_its_stream_only(llama_path):
    async def main():
        engine = AsyncEngine.from_path(llama_path, EngineConfig(device="cpu"))
        try:
            with pytest.raises(ValueError, match="bad.*prompt_token_ids"):
                await collect(engine, "bad", [10**7])
            tokens, _ = await collect(engine, "good", [3, 4, 5])
        finally:
            await engine.close()
        return tokens

    assert len(asyncio.run(main())) == GREEDY.max_tokens


def test_leaving_the_stream_aborts_and_frees_pages(llama_path):
    async def main():
        engine = AsyncEngine.from_path(llama_path, EngineConfig(device="cpu"))
        long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        try:
            async for delta in engine.generate("long", [3, 4, 5], long):
                if len(delta.token_ids):
                    break
            for _ in range(200):
                if not engine.backend.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            usage = engine.backend.allocator.usage()
        finally:
            await engine.close()
        return usage

    usage = asyncio.run(main())
    assert usage.free_pages == usage.total_pages


def test_event_loop_stays_responsive_while_generating(tiny_models):
    """Engine steps run beside the event loop, not on it: a ticker on the loop runs while a
    step is in progress (an engine stepping on the loop would hold it for the whole step).
    Counted, not timed, so a loaded machine changes how often, not whether."""

    async def main():
        engine = AsyncEngine.from_path(tiny_models["llama-gqa"], EngineConfig(device="cpu"))
        backend = engine.backend
        step = backend.step
        in_step = [0]  # steps in progress
        stepped_on = []  # the threads steps ran on

        def watched_step():
            stepped_on.append(threading.get_ident())
            in_step[0] += 1
            try:
                return step()
            finally:
                in_step[0] -= 1

        backend.step = watched_step
        ticks_in_step = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks_in_step
            while not done.is_set():
                await asyncio.sleep(0.001)
                ticks_in_step += in_step[0] > 0

        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        tick = asyncio.create_task(ticker())
        try:
            prompts = random_prompts((400, 300, 350, 200), seed=3)
            await asyncio.gather(
                *(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts))
            )
        finally:
            done.set()
            await tick
            await engine.close()
        return ticks_in_step, set(stepped_on)

    ticks_in_step, threads = asyncio.run(main())
    assert threading.get_ident() not in threads and len(threads) == 1
    assert ticks_in_step > 0


def test_codes_kept_stages_and_block_steps_through_the_async_engine(llama_path):
    import torch
    from compute_flow import GreedyHead

    from omniflow.engine.heads import Guidance

    async def main():
        engine = AsyncEngine.from_path(llama_path, EngineConfig(device="cpu"))
        backend = engine.backend
        head = GreedyHead(backend.model.config.hidden_size)
        try:
            text, _ = await collect(engine, "t", [5, 6, 7, 8, 9])
            options = dict(head=head, guidance=Guidance([1], 2.0), keep=True)
            codes = [
                d.codes
                async for d in engine.generate(
                    "i", [4], SamplingParams(max_tokens=3, temperature=0.0), **options
                )
            ]
            assert sum(len(c) for c in codes if c is not None) == 3
            rows = torch.randn(4, backend.model.config.hidden_size)
            delta = await engine.block_step("b", "i", rows, torch.arange(10, 14))
            assert delta.hidden.shape == rows.shape and delta.finish_reason == "stop"
            with pytest.raises(ValueError, match="not kept"):
                await engine.block_step("b2", "nope", rows, torch.arange(10, 14))
            await engine.keep_context("ctx", [3, 4, 5])
            engine.release("i")
            engine.release("ctx")
            assert await engine.call(lambda: sorted(backend.kept)) == []
        finally:
            await engine.close()
        return text

    assert len(asyncio.run(main())) == 12
