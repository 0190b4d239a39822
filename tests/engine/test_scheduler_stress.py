"""Random arrivals and aborts under a tight page budget: no crash, no deadlock, no leak,
and every surviving request gets the tokens it would get alone."""

import random

from conftest import random_prompts

from omniflow.engine import LLM, LLMEngine, SamplingParams
from omniflow.engine.llm_engine import EngineConfig


def test_random_arrivals_and_aborts_under_pressure(tiny_models):
    path = tiny_models["llama-gqa"]
    rng = random.Random(0)
    prompts = random_prompts([rng.randint(1, 40) for _ in range(14)], seed=51)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 20), ignore_eos=True)
        for _ in prompts
    ]
    expected = LLM(path, device="cpu").generate(prompts, params)

    config = EngineConfig(
        device="cpu",
        page_size=4,
        num_pages=16,
        max_num_seqs=5,
        max_num_batched_tokens=24,
    )
    engine = LLMEngine(path, config)
    pending = list(range(len(prompts)))
    aborted = {3, 9}
    produced = {i: [] for i in range(len(prompts))}
    finals: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    steps = 0
    while pending or engine.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "no progress: scheduler deadlocked"
        for _ in range(rng.randint(0, 2)):
            if pending:
                index = pending.pop(0)
                engine.add_request(f"r{index}", prompts[index], params[index])
        for index in aborted:
            if steps == 6 + index and f"r{index}" in engine.sequences:
                engine.abort(f"r{index}")
        for delta in engine.step():
            index = int(delta.request_id[1:])
            produced[index] += delta.token_ids
            if delta.finish_reason:
                finals[index].append(delta.finish_reason)

    assert all(len(reasons) == 1 for reasons in finals.values()), finals
    for index, output in enumerate(expected):
        if finals[index] == ["abort"]:
            assert produced[index] == output.token_ids[: len(produced[index])]
        else:
            assert produced[index] == output.token_ids, index
    assert engine.allocator.usage().free_pages == 16
    assert not engine.sequences
