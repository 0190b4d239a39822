"""Turns a step's logits into one token per sequence: penalties, allowed ids, temperature,
top-k, top-p, min-p, then greedy argmax or a seeded draw; reports log-probabilities. A codes
head's levels are picked the same way (``Sampler.codes_pick``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from omniflow.engine.codes_sampling import codes_pick
from omniflow.engine.heads import CodesPick
from omniflow.engine.seeds import position_generator
from omniflow.engine.sequence import Sequence


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # of the chosen token under the raw model distribution
    top_logprobs: list[dict[int, float] | None]


def apply_penalties(logits: torch.Tensor, sequence: Sequence) -> torch.Tensor:
    params = sequence.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(sequence.token_ids)), device=logits.device)
        scores = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    if sequence.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        outputs = torch.tensor(sequence.output_token_ids, device=logits.device)
        counts = torch.bincount(outputs, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k / top-p / min-p of one row [vocab]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop = mass_before >= top_p  # keeps the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, the first maximum of each row as torch.argmax picks it.

    On CPU in float32 it goes through numpy, whose argmax is vectorized and several times
    faster than torch's there; it runs every decode step.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, sequences: list[Sequence]) -> SampleResult:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        if all(
            s.params.is_greedy and not s.params.has_penalties and s.params.allowed_token_ids is None
            for s in sequences
        ):
            # The common batch: no copy of the logits, no per-row masks.
            chosen = greedy_tokens(logits)
            chosen_logprobs = raw_logprobs.gather(1, chosen[:, None])[:, 0]
            tops = self._top_logprobs(raw_logprobs, sequences)
            return SampleResult(chosen.tolist(), chosen_logprobs.tolist(), tops)
        logits = logits.clone()
        greedy = torch.tensor([s.params.is_greedy for s in sequences])
        chosen = torch.empty(len(sequences), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            if sequence.params.has_penalties:
                apply_penalties(logits[row], sequence)
            allowed = sequence.params.allowed_token_ids
            if allowed is not None:
                keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                keep[torch.tensor(allowed, device=logits.device)] = True
                logits[row].masked_fill_(~keep, float("-inf"))
        if greedy.any():
            chosen[greedy] = greedy_tokens(logits[greedy.to(logits.device)]).cpu()
        for row, sequence in enumerate(sequences):
            if not greedy[row]:
                chosen[row] = self._draw(logits[row], sequence)
        chosen_logprobs = raw_logprobs.gather(1, chosen.to(logits.device)[:, None])[:, 0]
        tops = self._top_logprobs(raw_logprobs, sequences)
        return SampleResult(chosen.tolist(), chosen_logprobs.tolist(), tops)

    def codes_pick(self, sequences: list[Sequence]) -> CodesPick | None:
        """How a codes head picks each level's ids for these sequences (codes_sampling.py),
        unseeded ones from this sampler's generator."""
        return codes_pick(sequences, self.generator)

    @staticmethod
    def _top_logprobs(
        raw_logprobs: torch.Tensor, sequences: list[Sequence]
    ) -> list[dict[int, float] | None]:
        tops: list[dict[int, float] | None] = []
        for row, sequence in enumerate(sequences):
            count = sequence.params.logprobs
            if count:
                values, ids = raw_logprobs[row].topk(count)
                tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
            else:
                tops.append({} if count == 0 else None)
        return tops

    def _draw(self, row_logits: torch.Tensor, sequence: Sequence) -> int:
        params = sequence.params
        row_logits = filter_logits(
            row_logits / params.temperature, params.top_k, params.top_p, params.min_p
        )
        probs = row_logits.softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. A seeded request's
        # noise for each token comes from (seed, position) alone: batch-independent, and a
        # request resent with its first tokens folded into the prompt (a migration) goes on
        # exactly as it would have.
        seed = params.seed
        generator = self.generator if seed is None else position_generator(seed, len(sequence))
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator)
        return int((probs / noise.to(probs.device)).argmax())
