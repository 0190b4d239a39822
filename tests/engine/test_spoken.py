"""Spoken requests (engine/spoken.py): a text token beside each audio token from one hidden
state, as LongCat-Next's parallel speech makes them, against a full-recompute oracle."""

import pytest
import torch
from compute_flow import GreedyHead, codes_of, embed, run
from conftest import random_prompts

from omniflow.engine import LLMEngine, SamplingParams, Spoken
from omniflow.engine.llm_engine import EngineConfig
from omniflow.engine.spoken import NO_TEXT
from omniflow.models.omni.next_builder import build_tiny_next
from omniflow.roles.llm_media import spoken_rows

START, END = 7, frozenset({9})
GREEDY = SamplingParams(temperature=0.0, max_tokens=7)


@pytest.fixture
def engine(llama_path):
    return LLMEngine(
        llama_path, EngineConfig(page_size=4, num_pages=256, max_num_batched_tokens=512)
    )


def oracle(model, head, prompt, steps, spoken, allowed=None):
    """Each step by re-running the whole context: the greedy text token (None once the
    text ended) and, after the first step, the head's codes; the next row is the step's
    token row (the start token's, or the codes') plus the text token's embedding."""
    context, text, codes, ended = embed(model, prompt), [], [], False
    with torch.inference_mode():
        for step in range(steps):
            hidden = model.hidden_states(context)[-1:]
            row = embed(model, [spoken.start_id])[0] if step == 0 else None
            if step:
                ids = head.codes(hidden)
                codes.append(ids[0])
                row = head.embed(ids)[0].to(context.dtype)
            token = NO_TEXT
            if not ended:
                logits = model.logits(hidden).float()[0]
                if allowed is not None:
                    logits[[i for i in range(len(logits)) if i not in allowed]] = -torch.inf
                token = int(logits.argmax())
                stream = [t for t in text if t != NO_TEXT]
                ended = token in spoken.end_ids or len(stream) + 1 >= spoken.max_text
                if token not in spoken.end_ids:
                    row = row + embed(model, [token])[0]
            text.append(token)
            context = torch.cat([context, row[None]])
    return text, torch.stack(codes)


def spoken_text(deltas):
    return [t for d in deltas for t in d.text_ids]


def test_text_and_codes_equal_the_oracle_alone_and_batched_with_others(engine):
    head = GreedyHead(engine.model.config.hidden_size, key="audio")
    prompts = random_prompts([11, 19], seed=8)
    spoken = Spoken(START, END, max_text=4)
    want = [oracle(engine.model, head, p, 7, spoken) for p in prompts]
    engine.add_request("alone", prompts[0], GREEDY, head=head, spoken=spoken)
    out = run(engine)["alone"]
    assert spoken_text(out) == want[0][0]
    assert torch.equal(codes_of(out), want[0][1])
    assert out[0].token_ids[0] == START and out[-1].finish_reason == "length"
    text = want[0][0]
    assert len([t for t in text if t != NO_TEXT]) == 4 and text[4:] == [NO_TEXT] * 3
    # Batched with a second spoken request, a plain codes one and a text one.
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("text", prompts[1], plain)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, GREEDY, head=head, spoken=spoken)
    engine.add_request(
        "codes", prompts[1], SamplingParams(max_tokens=5, temperature=0.0), head=head
    )
    out = run(engine)
    for i in range(2):
        assert spoken_text(out[f"s{i}"]) == want[i][0]
        assert torch.equal(codes_of(out[f"s{i}"]), want[i][1])
    assert codes_of(out["codes"]).shape == (5, head.levels)
    assert len([t for d in out["text"] for t in d.token_ids]) == 5


def test_an_end_token_ends_the_text_and_the_audio_goes_on(engine):
    """The first text token is the end token (the only one allowed): no text follows, and
    every row after has no text part."""
    head = GreedyHead(engine.model.config.hidden_size, key="audio")
    prompt = random_prompts([13], seed=9)[0]
    spoken = Spoken(START, END, max_text=50)
    params = SamplingParams(temperature=0.0, max_tokens=5, allowed_token_ids=[9])
    engine.add_request("r", prompt, params, head=head, spoken=spoken)
    out = run(engine)["r"]
    text, codes = oracle(engine.model, head, prompt, 5, spoken, allowed={9})
    assert spoken_text(out) == text == [9] + [NO_TEXT] * 4
    assert torch.equal(codes_of(out), codes)


@pytest.fixture(scope="module")
def next_path(tmp_path_factory):
    return build_tiny_next(tmp_path_factory.mktemp("spoken-next") / "ckpt", seed=5)


def serial_oracle(model, head, prompt, spoken):
    """Serial speech (the published delay ∞) by re-running the whole context: greedy text
    tokens, each step's row its own embedding, until an end id or max_text tokens; then the
    start token's row alone; then audio_tokens steps of the head's codes and their rows.
    Returns each step's token id, its text entry, and the codes."""
    context, tokens, text, codes = embed(model, prompt), [], [], []
    with torch.inference_mode():
        while len(codes) < spoken.audio_tokens:
            hidden = model.hidden_states(context)[-1:]
            if START in tokens:  # the audio
                ids = head.codes(hidden)
                codes.append(ids[0])
                row, token, said = head.embed(ids)[0].to(context.dtype), 0, NO_TEXT
            elif len(text) >= spoken.max_text:  # the text ran out: the start token
                row, token, said = embed(model, [START])[0], START, NO_TEXT
            else:
                said = int(model.logits(hidden).float()[0].argmax())
                token = START if said in spoken.end_ids else said
                row = embed(model, [token])[0]
            tokens.append(token)
            text.append(said)
            context = torch.cat([context, row[None]])
    return tokens, text, torch.stack(codes)


def test_serial_speech_says_its_text_first_then_the_audio_alone(engine):
    """As published delay ∞: the text's tokens, the start token, then the audio tokens with
    no text, against the recompute; max_tokens counts them all, the audio ends at its own
    count. Batched with a parallel one, each is what it is alone."""
    head = GreedyHead(engine.model.config.hidden_size, key="audio")
    prompts = random_prompts([13, 9], seed=21)
    first = serial_oracle(engine.model, head, prompts[0], Spoken(START, END, 3, 4))[1]
    for max_text, end in ((3, END), (40, frozenset({first[1]}))):  # cut; ended by its end id
        serial = Spoken(START, end, max_text=max_text, audio_tokens=4)
        tokens, text, codes = serial_oracle(engine.model, head, prompts[0], serial)
        assert (text[-5] in end) == (max_text == 40)
        params = SamplingParams(temperature=0.0, max_tokens=4 + max_text + 1)
        engine.add_request("s", prompts[0], params, head=head, spoken=serial)
        engine.add_request("p", prompts[1], GREEDY, head=head, spoken=Spoken(START, end, 4))
        out = run(engine)
        got = out["s"]
        assert [t for d in got for t in d.token_ids][: len(tokens) - 4] == tokens[:-4]
        assert spoken_text(got) == text and torch.equal(codes_of(got), codes)
        assert got[-1].finish_reason == "length" and codes.shape[0] == 4
        assert text[-4:] == [NO_TEXT] * 4  # no text beside the audio
        assert tokens.index(START) == len(tokens) - 5  # the start token right before it
        assert spoken_text(out["p"])[0] != NO_TEXT and out["p"][0].token_ids[0] == START


@pytest.mark.parametrize("audio_tokens", [None, 3])
@pytest.mark.parametrize("model", ["llama", "longcat-next"])
def test_the_role_rebuilds_the_rows_the_engine_fed(request, model, audio_tokens):
    """A session's next turn gets a spoken turn's rows from the role's spoken_rows: each
    step's hidden state, recomputed over them, is the one the engine handed the head. On
    LongCat-Next the text rows read the text stream's n-gram predecessors. Parallel
    (audio_tokens None) and serial."""
    path = request.getfixturevalue("llama_path" if model == "llama" else "next_path")
    engine = LLMEngine(path, EngineConfig(page_size=4, num_pages=256))
    head = GreedyHead(engine.model.config.hidden_size, key="audio")
    prompt = random_prompts([10], seed=10, vocab=400)[0]
    spoken = Spoken(START, END, max_text=5, audio_tokens=audio_tokens)
    more = 0 if audio_tokens is None else 5
    params = SamplingParams(temperature=0.0, max_tokens=8 + more)
    engine.add_request("r", prompt, params, head=head, spoken=spoken)
    out = run(engine)["r"]
    steps, codes = spoken_text(out), codes_of(out)
    assert len([t for t in steps if t != NO_TEXT and t not in END]) > 1  # a text stream
    model = engine.model
    rows, keys = spoken_rows(model, head, spoken, steps, codes)
    lead = len(steps) - len(codes)  # the steps without codes
    assert lead == 1 if audio_tokens is None else lead > 1
    assert keys[0] == ("spoken", steps[0]) and keys[lead][1] == steps[lead]
    seen = list(head.seen)  # the hidden states the engine handed the head
    context = torch.cat([prompt_rows(model, prompt), rows])
    with torch.inference_mode():  # each step's state comes from the rows before it
        for k in range(lead, len(steps)):
            hidden = model.hidden_states(context[: len(prompt) + k])[-1:]
            torch.testing.assert_close(hidden, seen[k - lead], atol=1e-4, rtol=1e-4)
            assert torch.equal(head.codes(hidden)[0], codes[k - lead])


def prompt_rows(model, prompt):
    """The prompt's input rows as the engine embeds them (an n-gram model: with contexts)."""
    context = None
    if model.input_context:
        ids = list(prompt)
        context = torch.tensor(
            [[ids[p - s] if p >= s else -1 for s in range(1, model.input_context + 1)]
             for p in range(len(ids))]
        )  # fmt: skip
    with torch.inference_mode():
        return model.embed(torch.tensor(prompt), context).clone()


def test_spoken_needs_a_codes_head_and_no_guidance(engine):
    with pytest.raises(ValueError, match="spoken needs a codes head"):
        engine.add_request("r", [1, 2, 3], GREEDY, spoken=Spoken(START, END, 4))
    assert not engine.sequences
