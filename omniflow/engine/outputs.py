"""What a step's output becomes: tokens appended through each request's head, guided pairs
combined before it, stop rules, the deltas reported, block steps' hidden states."""

from __future__ import annotations

import torch

from omniflow.engine.flows import MediaOutput
from omniflow.engine.heads import CodesHead, CodesPick, end_code, guided
from omniflow.engine.model_runner import StepOutput
from omniflow.engine.protocol import TokenDelta
from omniflow.engine.sampler import Sampler
from omniflow.engine.sequence import Sequence
from omniflow.engine.spoken import speak
from omniflow.models import DecoderLM, TextTokenizer


def append_text(sampler: Sampler, sequences: list[Sequence], logits: torch.Tensor) -> None:
    """Sample one token per sequence (a pair's leader: for both halves) and append it."""
    sampled = sampler(logits, sequences)
    for row, sequence in enumerate(sequences):
        token = sampled.token_ids[row]
        for member in (sequence, sequence.partner):
            if member is not None:
                member.append_token(token, sampled.logprobs[row], sampled.top_logprobs[row])


def append_from_hidden(
    model: DecoderLM, sampler: Sampler, output: StepOutput, leaders: list[Sequence]
) -> None:
    """Guidance on the hidden states, then each leader's head: lm_head + sampler for text,
    the codes head for media tokens (one batched call per head, its levels picked by the
    sampler from each request's params)."""
    assert output.hidden is not None
    rows = {id(sequence): row for row, sequence in enumerate(output.sequences)}
    hidden = []
    halves: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # for guided_codes
    for i, sequence in enumerate(leaders):
        state = output.hidden[rows[id(sequence)]]
        if sequence.pair is not None:
            base = output.hidden[rows[id(sequence.pair.follower)]]
            halves[i] = (state, base, sequence.pair.scale)
            state = guided(state, base, sequence.pair.scale)
        hidden.append(state)
    states = torch.stack(hidden)
    text = [i for i, s in enumerate(leaders) if s.head is None]
    if text:
        logits = model.logits(states[text]).float()
        append_text(sampler, [leaders[i] for i in text], logits)
    said, opened = speak(model, sampler, leaders, states)  # spoken text (engine/spoken.py)
    done = opened | _row_ends(leaders)  # steps that made their token without codes
    heads: dict[int, list[int]] = {}
    for i, sequence in enumerate(leaders):
        if sequence.head is not None and i not in done:
            heads.setdefault(id(sequence.head), []).append(i)
    for indices in heads.values():
        head = leaders[indices[0]].head
        assert head is not None
        codes = _codes(
            head, states, indices, halves, sampler.codes_pick([leaders[i] for i in indices])
        )
        inputs = head.embed(codes).to(states.dtype)
        end = end_code(head)
        ends = codes[:, 0].eq(end).tolist() if end is not None else [False] * len(indices)
        for j, i in enumerate(indices):
            if ends[j]:
                for member in (leaders[i], leaders[i].partner):
                    if member is not None and member.media is not None:
                        member.media.ended = True  # this token is the media's last
            if i in said:  # the text spoken with it: its embedding joins the row
                token, spoken_row = said[i]
                row = inputs[j] if spoken_row is None else inputs[j] + spoken_row
                leaders[i].append_codes(head, codes[j], row, token)
                continue
            for member in (leaders[i], leaders[i].partner):
                if member is not None:
                    member.append_codes(head, codes[j], inputs[j])


def _codes(
    head: CodesHead,
    states: torch.Tensor,
    indices: list[int],
    halves: dict[int, tuple[torch.Tensor, torch.Tensor, float]],
    pick: CodesPick | None,
) -> torch.Tensor:
    """The head's codes for the leaders at ``indices``: from their guided hidden states, or,
    for a head with ``guided_codes`` (engine/heads.py), from both halves of each pair (an
    unpaired row is its own unconditional half at scale 1)."""
    guide = getattr(head, "guided_codes", None)
    if guide is None or not any(i in halves for i in indices):
        return head.codes(states[indices], pick)
    cond = torch.stack([halves[i][0] if i in halves else states[i] for i in indices])
    uncond = torch.stack([halves[i][1] if i in halves else states[i] for i in indices])
    scale = torch.tensor([halves[i][2] if i in halves else 1.0 for i in indices])
    return guide(cond, uncond, scale, pick)


def _row_ends(leaders: list[Sequence]) -> set[int]:
    """The leaders whose step is a row end: its token appended (both halves of a pair)."""
    ends = set()
    for i, sequence in enumerate(leaders):
        media = sequence.media
        if media is not None and media.ends_row(len(sequence.output_token_ids)):
            assert media.row_end is not None
            ends.add(i)
            for member in (sequence, sequence.partner):
                if member is not None:
                    member.append_token(media.row_end[0], 0.0, None)
    return ends


def block_outputs(output: StepOutput) -> list[tuple[Sequence, torch.Tensor]]:
    """(leader, hidden states [N, hidden]) per block step this step finished; a pair's
    halves combined, or stacked [cond; uncond] where the guidance says not to combine."""
    by_sequence = {id(sequence): hidden for sequence, hidden in output.blocks}
    done = []
    for sequence, hidden in output.blocks:
        if sequence.follows:
            continue
        if sequence.pair is not None:
            uncond = by_sequence[id(sequence.pair.follower)]
            if sequence.pair.combine:
                hidden = guided(hidden, uncond, sequence.pair.scale)
            else:
                hidden = torch.cat((hidden, uncond))
        done.append((sequence, hidden))
    return done


def check_stop(
    sequence: Sequence,
    eos_token_ids: set[int],
    tokenizer: TextTokenizer | None,
    max_model_len: int,
) -> None:
    """Set finish_reason (and stop_reason) if the token just appended ends the request."""
    params, token = sequence.params, sequence.output_token_ids[-1]
    if sequence.head is not None:  # media tokens: the head's end code or their count
        media = sequence.media
        if media is not None and media.ended:
            sequence.finish_reason = "stop"
        elif len(sequence.output_token_ids) >= params.max_tokens or _made_all(media):
            sequence.finish_reason = "length"
        return
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        sequence.finish_reason, sequence.stop_reason = "stop", token
        return
    if params.stop:
        if tokenizer is None:
            raise RuntimeError("sampling field stop needs a tokenizer")
        # Incremental: only the new text and the few characters before it can hold a stop
        # string that was not there a token ago.
        if sequence.text_stream is None:
            sequence.text_stream = tokenizer.stream()
        stream = sequence.text_stream
        new = len(stream.push([token]))
        longest = max(len(stop) for stop in params.stop)
        tail = stream.text[-(new + longest - 1) :] if new else ""
        for stop in params.stop:
            if stop in tail:
                sequence.finish_reason, sequence.stop_reason = "stop", stop
                return
    if len(sequence.output_token_ids) >= params.max_tokens or len(sequence) >= max_model_len:
        sequence.finish_reason = "length"


def _made_all(media: MediaOutput | None) -> bool:
    """A serial spoken request has made the audio tokens it asked for (max_tokens counts its
    text too)."""
    if media is None or media.spoken is None or media.spoken.spec.audio_tokens is None:
        return False
    return len(media.codes) >= media.spoken.spec.audio_tokens


def delta_of(sequence: Sequence, num_new: int) -> TokenDelta:
    """The delta reporting a sequence's last num_new tokens (0: only its state)."""
    start = len(sequence.output_token_ids) - num_new
    tops = None
    if sequence.params.logprobs is not None:
        tops = sequence.output_top_logprobs[start:]
    codes = text = None
    media = sequence.media
    if media is not None and num_new:
        new = media.codes_since(start)
        codes = torch.stack(new) if new else None
        if media.spoken is not None:
            text = media.spoken.steps[start:]
    return TokenDelta(
        sequence.request_id,
        sequence.output_token_ids[start:],
        sequence.output_logprobs[start:],
        tops,
        sequence.finish_reason,
        sequence.stop_reason,
        sequence.num_cached_tokens or 0,
        codes=codes,
        text_ids=text,
    )
