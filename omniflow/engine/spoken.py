"""Text spoken beside audio tokens: LongCat-Next's parallel speech.

In the published model's streaming speech ("parallel internal text-guided generation",
delay 0), every decode step of the audio stage makes a text token (lm_head) and an audio
token (the codes head) from the same hidden state. The first step makes text only: its
token is `Spoken.start_id` (``<longcat_audiotext_start>``). Each later step's token is the
head's placeholder, with the audio token's codes. A position's input row is its own
embedding plus the text-stream embedding of the text token sampled with it. The text
stream's embedding is the model's input embedding over the text tokens alone (for an
n-gram embedding, its predecessors are the stream's). A row has no text part once the
text has ended: at one of `end_ids` (the audiotext pad, EOS) or after `max_text` tokens.

Serial speech (the published delay ∞, `Spoken.audio_tokens` set): the text comes first
inside the speech block, a token per step, each its own row (its text-stream embedding) and
no audio; the step whose text ends (an end id, or after `max_text` tokens) makes the start
token alone; then `audio_tokens` audio tokens, with no text. As LongCat-Next-inference's
`output_processor.py` and `input_processor.py` run it: until the text's pad the step's
input is the text token, then `<longcat_audiotext_start>`, then the audio codes alone.

`speak` runs a step's speaking sequences: their text tokens, the start tokens (a parallel
request's first step, a serial one's after its text), and the text rows the others' media
tokens take. `text_rows` and `token_row` rebuild the
same rows from a finished turn's text, for a session's next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from omniflow.engine.sampler import Sampler
    from omniflow.engine.sequence import Sequence
    from omniflow.models import DecoderLM

NO_TEXT = -1  # a step's text entry once the text has ended


class Spoken(NamedTuple):
    """A codes request that also makes text, a token per step (add_request's ``spoken``)."""

    start_id: int  # the first step's token; its row carries the first text token
    end_ids: frozenset[int]  # text tokens that end the text (then no text follows)
    max_text: int  # text tokens at most
    # Serial: the text first, then the start token, then this many audio tokens (None:
    # parallel, a text token beside each audio token).
    audio_tokens: int | None = None


@dataclass(eq=False, slots=True)
class SpokenText:
    spec: Spoken
    steps: list[int] = field(default_factory=list)  # per step: its text token, or NO_TEXT
    stream: list[int] = field(default_factory=list)  # the text tokens so far (no end id)
    ended: bool = False
    started: bool = False  # the start token is in: the steps after it make audio


def text_row(model: DecoderLM, stream: list[int], token: int) -> torch.Tensor:
    """The text-stream embedding [hidden] of ``token`` after the stream's ``stream``."""
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor([token], device=device)
    context = None
    if model.input_context:
        before = stream[::-1][: model.input_context]
        before += [-1] * (model.input_context - len(before))
        context = torch.tensor([before], device=device)
    return model.embed(ids, context)[0]


def speak(
    model: DecoderLM, sampler: Sampler, leaders: list[Sequence], states: torch.Tensor
) -> tuple[dict[int, tuple[int, torch.Tensor | None]], set[int]]:
    """The step of the speaking leaders (states: every leader's hidden state [hidden]):
    each samples its text token; a parallel first step appends the start token (its row:
    the start token's plus the text's), a serial one its text token until the text ends,
    then the start token. Returns, for the others, index -> (the text token, its text row
    or None once the text has ended), for their media token's row; and the indices of the
    steps before the start token's (done: no codes)."""
    speaking = [i for i, s in enumerate(leaders) if s.media is not None and s.media.spoken]
    if not speaking:
        return {}, set()
    opening = {i for i in speaking if not _state(leaders[i]).started}  # no audio this step
    rows: dict[int, torch.Tensor | None] = dict.fromkeys(speaking)
    live = [i for i in speaking if not _state(leaders[i]).ended]
    for i in speaking:
        if i not in live:
            _state(leaders[i]).steps.append(NO_TEXT)
    if live:
        logits = model.logits(states[live]).float()
        sampled = sampler(logits, [leaders[i] for i in live])
        for k, i in enumerate(live):
            state = _state(leaders[i])
            token = sampled.token_ids[k]
            state.steps.append(token)
            if token in state.spec.end_ids:
                state.ended = True
                continue
            rows[i] = text_row(model, state.stream, token).to(states.dtype)
            state.stream.append(token)
            state.ended = len(state.stream) >= state.spec.max_text
    said = {}
    for i in speaking:
        state, text = _state(leaders[i]), rows[i]
        if i not in opening:
            said[i] = (state.steps[-1], text)
        elif state.spec.audio_tokens is None or text is None:
            # parallel's first step, or serial's once its text has ended: the start token
            start = token_row(model, state.spec.start_id)
            start = start if text is None else start + text.to(start.dtype)
            leaders[i].append_row(state.spec.start_id, start, ("spoken", state.steps[-1]))
            state.started = True
        else:  # serial, its text going on: the text token, its own row
            leaders[i].append_row(state.steps[-1], text, ("spoken", state.steps[-1]))
    return said, opening


def token_row(model: DecoderLM, token: int) -> torch.Tensor:
    """The input row [hidden] of a special token (an n-gram model hashes none for it)."""
    device = model.model.embed_tokens.weight.device
    context = None
    if model.input_context:
        context = torch.full((1, model.input_context), -1, device=device)
    return model.embed(torch.tensor([token], device=device), context)[0]


def text_rows(model: DecoderLM, steps: list[int], end_ids: frozenset[int]) -> torch.Tensor:
    """The text rows [len(steps), hidden] of a turn's per-step text (zero where none)."""
    weight = model.model.embed_tokens.weight
    out = torch.zeros(len(steps), weight.shape[1], dtype=weight.dtype)
    stream: list[int] = []
    with torch.inference_mode():
        for i, token in enumerate(steps):
            if token == NO_TEXT or token in end_ids:
                continue
            out[i] = text_row(model, stream, token).to(out.device)
            stream.append(token)
    return out


def _state(sequence: Sequence) -> SpokenText:
    media = sequence.media
    assert media is not None and media.spoken is not None, "a speaking sequence"
    return media.spoken
