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
    sampled = [row for row, s in enumerate(sequences) if not s.params.is_greedy]
    plain = [row for row in sampled if not _filters(sequences[row].params)]  # batched
    filtered = [row for row in sampled if _filters(sequences[row].params)]  # a row at a time
    temperature = torch.tensor([sequences[row].params.temperature for row in plain])
    penalty = [s.params.repetition_penalty for s in sequences]
    past = {}  # the penalized rows' earlier codes [N, K]
    for row, sequence in enumerate(sequences):
        if penalty[row] != 1.0 and sequence.media is not None:
            if (made := sequence.media.made()) is not None:
                past[row] = made

    def pick(level: int, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().clone()
        if past:
            _penalize(logits, level, past, penalty)
        chosen = logits.argmax(-1).cpu()  # the greedy rows'
        noise = {row: _noise(sequences[row], level, generator) for row in sampled}
        if plain:  # one softmax and inverse CDF for all of them
            u = torch.stack([torch.rand((), generator=noise[row]) for row in plain])
            chosen[plain] = _inverse_cdf(logits[plain] / temperature[:, None].to(logits), u)
        for row in filtered:
            chosen[row] = draw(logits[row], sequences[row].params, noise[row])
        return chosen.to(logits.device)

    return pick


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _noise(sequence: Sequence, level: int, generator: torch.Generator) -> torch.Generator:
    """A row's generator for this level: its own (seed, position, level)'s, or the shared."""
    seed = sequence.params.seed
    return generator if seed is None else position_generator(seed, len(sequence), level + 1)


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of logits [B, n], the id whose CDF first passes u [B] (in [0, 1)) of the
    row's mass: a draw from the row's softmax."""
    cdf = logits.softmax(-1).cumsum(-1)
    at = u.to(cdf)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, at, right=True)[:, 0].clamp(max=cdf.shape[-1] - 1).cpu()


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


def _penalize(
    logits: torch.Tensor, level: int, past: dict[int, torch.Tensor], penalty: list[float]
) -> None:
    """transformers' repetition rule, in place, on each row's ids seen at this level (past:
    row -> its earlier codes [N, K]): divided by the row's penalty where positive, else
    multiplied by it."""
    rows = list(past)
    ids = torch.cat([past[row][:, level] for row in rows]).to(logits.device)
    counts = torch.tensor([past[row].shape[0] for row in rows])
    at = torch.tensor(rows).repeat_interleave(counts).to(logits.device)
    keep = ids < logits.shape[-1]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[at[keep], ids[keep]] = True
    scale = torch.tensor(penalty, dtype=logits.dtype, device=logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / scale, logits * scale)
    logits.copy_(torch.where(seen, penalized, logits))
