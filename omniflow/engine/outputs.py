"""What a step's output becomes: tokens appended through each request's head, guided pairs
combined before it, block steps' hidden states handed back."""

from __future__ import annotations

import torch

from omniflow.engine.heads import guided
from omniflow.engine.model_runner import StepOutput
from omniflow.engine.sampler import Sampler
from omniflow.engine.sequence import Sequence
from omniflow.models import DecoderLM


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
    the codes head for media tokens (one batched call per head)."""
    assert output.hidden is not None
    rows = {id(sequence): row for row, sequence in enumerate(output.sequences)}
    hidden = []
    for sequence in leaders:
        state = output.hidden[rows[id(sequence)]]
        if sequence.partner is not None:
            base = output.hidden[rows[id(sequence.partner)]]
            state = guided(state, base, sequence.guidance_scale)
        hidden.append(state)
    states = torch.stack(hidden)
    text = [i for i, s in enumerate(leaders) if s.head is None]
    if text:
        logits = model.logits(states[text]).float()
        append_text(sampler, [leaders[i] for i in text], logits)
    heads: dict[int, list[int]] = {}
    for i, sequence in enumerate(leaders):
        if sequence.head is not None:
            heads.setdefault(id(sequence.head), []).append(i)
    for indices in heads.values():
        head = leaders[indices[0]].head
        assert head is not None
        codes = head.codes(states[indices])
        inputs = head.embed(codes).to(states.dtype)
        for j, i in enumerate(indices):
            for member in (leaders[i], leaders[i].partner):
                if member is not None:
                    member.append_codes(head, codes[j], inputs[j])


def block_outputs(output: StepOutput) -> list[tuple[Sequence, torch.Tensor]]:
    """(leader, hidden states [N, hidden]) per block step this step finished; a pair's
    halves combined."""
    by_sequence = {id(sequence): hidden for sequence, hidden in output.blocks}
    done = []
    for sequence, hidden in output.blocks:
        if sequence.follows:
            continue
        if sequence.partner is not None:
            hidden = guided(hidden, by_sequence[id(sequence.partner)], sequence.guidance_scale)
        done.append((sequence, hidden))
    return done
