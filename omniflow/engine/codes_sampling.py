"""How a codes head picks each level's ids (engine/heads.py ``CodesPick``), request by
request, as LongCat-Next's published sampler draws media codes (``modules/output_processor.py``
of LongCat-Next-inference): the repetition penalty over the ids that level took earlier in
the media, then temperature, top-k, top-p, min-p, and one draw from what is left.

One difference, decided here: temperature 0 is greedy (the published code reads it as 1),
so a greedy request's media is reproducible without a seed. A seeded request's draw for
level l of the token at position p comes from (seed, p, l + 1) alone (seeds.py).

The draw is by the inverse CDF of one uniform number, over the top-k candidates only where
top-k is set: a level has up to 8,193 classes and up to eight levels run per token, where
the text sampler's exponential race over the whole row would cost ~0.2 ms a level.
"""

from __future__ import annotations

import torch

from omniflow.engine.heads import CodesPick
from omniflow.engine.sampling_params import SamplingParams
from omniflow.engine.seeds import position_generator
from omniflow.engine.sequence import Sequence

_FEW = 256


def codes_pick(sequences: list[Sequence], generator: torch.Generator) -> CodesPick | None:
    """The pick for one step's media rows (a sequence each); None where every one is greedy
    without a penalty (the head's own argmax). ``generator``: the unseeded rows' noise."""
    if all(s.params.is_greedy and s.params.repetition_penalty == 1.0 for s in sequences):
        return None
    past: dict[int, torch.Tensor | None] = {}  # each row's earlier codes [N, K], made once

    def pick(level: int, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().clone()
        chosen = torch.empty(len(sequences), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            params = sequence.params
            if params.repetition_penalty != 1.0:
                if row not in past:
                    past[row] = _past_codes(sequence)
                seen = past[row]
                if seen is not None:
                    _penalize(logits[row], seen[:, level], params.repetition_penalty)
            if params.is_greedy:
                chosen[row] = int(logits[row].argmax())
                continue
            seed = params.seed
            noise = (
                generator if seed is None else position_generator(seed, len(sequence), level + 1)
            )
            chosen[row] = draw(logits[row], params, noise)
        return chosen.to(logits.device)

    return pick


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One id from a row of logits [n] under params' temperature, top-k, top-p and min-p."""
    logits = logits / params.temperature
    ids = None
    if 0 < params.top_k < logits.shape[-1]:
        logits, ids = logits.topk(params.top_k)  # sorted, likeliest first
        probs = logits.softmax(-1)
    else:
        probs = logits.softmax(-1)
        if params.top_p < 1.0:
            probs, ids = _likeliest(probs, params.top_p)
    if params.top_p < 1.0:  # the smallest prefix whose mass reaches top_p
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= params.top_p, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    cdf = probs.cumsum(-1)
    u = torch.rand((), generator=generator).to(cdf.device) * cdf[-1]
    index = min(int(torch.searchsorted(cdf, u[None], right=True)), cdf.shape[-1] - 1)
    return index if ids is None else int(ids[index])


def _likeliest(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The likeliest probabilities, sorted, with their ids: enough of them to hold ``mass``
    (the top 256 where they do: a sort of the whole row costs several times their top-k)."""
    if probs.shape[-1] > _FEW:
        top, ids = probs.topk(_FEW)
        if float(top.sum()) >= mass:
            return top, ids
    return probs.sort(descending=True)


def _penalize(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """transformers' repetition rule on the ids seen: divided where positive, else times."""
    ids = seen.to(row.device)  # repeats write the same value: no need to dedupe
    ids = ids[ids < row.shape[-1]]
    scores = row[ids]
    row[ids] = torch.where(scores > 0, scores / penalty, scores * penalty)


def _past_codes(sequence: Sequence) -> torch.Tensor | None:
    """The codes [N, K] a media sequence has made, or None."""
    return None if sequence.media is None else sequence.media.made()
