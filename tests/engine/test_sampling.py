"""Seeded sampling, filters, penalties, stop rules, max_tokens, logprobs, bad input."""

import math

import pytest
import torch
from conftest import random_prompts

from omniflow.engine import LLM, LLMEngine, SamplingParams
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.sampler import apply_penalties, filter_logits
from omniflow.engine.sequence import Sequence


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, device="cpu", page_size=8)


def test_same_seed_same_tokens_batched_or_not(llm):
    [prompt] = random_prompts((12,), seed=1)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    [alone] = llm.generate([prompt], seeded)
    others = random_prompts((5, 30, 8), seed=2)
    noisy = SamplingParams(temperature=1.3, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate([others[0], prompt, others[1], others[2]], [noisy, seeded, greedy, noisy])
    assert batch[1].token_ids == alone.token_ids
    [other_seed] = llm.generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True)
    )
    assert other_seed.token_ids != alone.token_ids


def test_a_seeded_request_resent_with_its_first_tokens_goes_on_the_same(llm):
    """A migration resends the prompt plus the tokens already streamed: the draws that
    follow depend on (seed, position) only, so the rest is the rest of the first run."""
    [prompt] = random_prompts((12,), seed=5)
    options = dict(temperature=1.0, top_p=0.95, seed=77, ignore_eos=True)
    [whole] = llm.generate([prompt], SamplingParams(max_tokens=24, **options))
    for cut in (1, 9):
        head = whole.token_ids[:cut]
        [rest] = llm.generate([prompt + head], SamplingParams(max_tokens=24 - cut, **options))
        assert head + rest.token_ids == whole.token_ids, cut


def test_filters_that_keep_one_token_equal_greedy(llm):
    prompts = random_prompts((6, 14), seed=3)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for options in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        params = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, **options)
        sampled = llm.generate(prompts, params)
        assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy], options


def test_filter_logits_rules():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda out: (out > float("-inf")).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0, min_p=0.0)) == [0, 1]
    assert kept(filter_logits(logits, top_k=0, top_p=0.8, min_p=0.0)) == [0, 1]
    assert kept(filter_logits(logits, top_k=0, top_p=0.81, min_p=0.0)) == [0, 1, 2]
    assert kept(filter_logits(logits, top_k=0, top_p=1.0, min_p=0.5)) == [0, 1]


def test_penalty_formulas():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    sequence = Sequence("p", [0, 1], params)
    sequence.append_token(2, 0.0, None)
    sequence.append_token(2, 0.0, None)
    logits = torch.tensor([1.0, -1.0, 4.0, 3.0])
    out = apply_penalties(logits.clone(), sequence)
    # prompt tokens 0,1: repetition only; token 2 (twice in output): all three; 3: untouched.
    assert out.tolist() == pytest.approx([0.5, -2.0, 2.0 - 0.5 - 0.5, 3.0])


def test_repetition_penalty_stops_repeats(llm):
    [prompt] = random_prompts((10,), seed=4)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert len(set(plain[0].token_ids)) < 24  # tiny random models loop
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=50.0
    )
    [penalised] = llm.generate([prompt], params)
    seen = set(prompt)
    for token in penalised.token_ids:
        assert token not in seen
        seen.add(token)


def test_frequency_penalty_reduces_repeats(llm):
    [prompt] = random_prompts((10,), seed=4)
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    [plain] = llm.generate([prompt], base)
    [penalised] = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
    )
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def test_max_tokens_and_stop_token_ids(llm):
    [prompt] = random_prompts((9,), seed=5)
    [full] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    stop_token = full.token_ids[4]
    cut = full.token_ids.index(stop_token) + 1
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token]
    )
    [stopped] = llm.generate([prompt], params)
    assert stopped.token_ids == full.token_ids[:cut]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_token)


def test_eos_stops_unless_ignored(llama_path):
    [prompt] = random_prompts((9,), seed=5)
    engine = LLMEngine(llama_path, EngineConfig(device="cpu"))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", prompt, greedy)
    full = [t for d in engine.run_to_completion() for t in d.token_ids]
    engine.eos_token_ids = {full[3]}
    engine.add_request("b", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    deltas = engine.run_to_completion()
    assert [t for d in deltas for t in d.token_ids] == full[: full.index(full[3]) + 1]
    assert deltas[-1].finish_reason == "stop"


def test_stop_string_cuts_text_and_stops(llm):
    [prompt] = random_prompts((9,), seed=8)
    [full] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    decode = llm.tokenizer.decode
    # A stop string: the text of some output token that is plain ASCII and new at that point.
    for index, token in enumerate(full.token_ids):
        piece = decode([token]).strip()
        earlier = decode(full.token_ids[:index])
        if len(piece) >= 2 and piece.isascii() and piece.isalpha() and piece not in earlier:
            break
    else:
        pytest.skip("no usable stop string in this random output")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[piece])
    [stopped] = llm.generate([prompt], params)
    assert stopped.token_ids == full.token_ids[: index + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", piece)
    assert stopped.text == decode(full.token_ids[: index + 1]).split(piece)[0]
    assert piece not in stopped.text


def test_logprobs(llm):
    [prompt] = random_prompts((7,), seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    [out] = llm.generate([prompt], params)
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0.0 and math.isfinite(logprob)
        assert max(top, key=top.get) == token  # greedy picks the most likely token
        assert top[token] == pytest.approx(logprob)
    [plain] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert plain.top_logprobs is None and len(plain.logprobs) == 6


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        ([3, 999_999], {}, ["bad-1", "prompt_token_ids[1]"]),
        ([3, -1], {}, ["bad-1", "prompt_token_ids[1]"]),
        ([], {}, ["bad-1", "prompt_token_ids"]),
        ([3, 4], {"max_tokens": -2}, ["bad-1", "max_tokens"]),
        ([3, 4], {"temperature": -1.0}, ["bad-1", "temperature"]),
        ([3, 4], {"top_p": 0.0}, ["bad-1", "top_p"]),
        ([3, 4], {"tempreature": 1.0}, ["bad-1", "tempreature"]),
        ([3, 4], {"stop_token_ids": [10**7]}, ["bad-1", "stop_token_ids"]),
        ([3, 4], {"max_tokens": 10**6}, ["bad-1", "max_model_len"]),
    ],
)
def test_bad_input_names_field_and_request(llama_path, prompt, params, words):
    engine = LLMEngine(llama_path, EngineConfig(device="cpu"))
    with pytest.raises(ValueError) as error:
        engine.add_request("bad-1", prompt, params)
    for word in words:
        assert word in str(error.value)
    engine.add_request("ok", [3, 4], SamplingParams(max_tokens=2, ignore_eos=True))  # keeps serving
    assert len([t for d in engine.run_to_completion() for t in d.token_ids]) == 2


def test_duplicate_request_id_and_abort(llama_path):
    engine = LLMEngine(llama_path, EngineConfig(device="cpu"))
    engine.add_request("x", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(ValueError, match="x.*already in use"):
        engine.add_request("x", [3, 4], SamplingParams())
    engine.step()
    engine.abort("x")
    deltas = engine.run_to_completion()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("x", "abort")]
    assert engine.allocator.usage().free_pages == engine.allocator.num_pages
