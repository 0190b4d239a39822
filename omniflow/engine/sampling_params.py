"""Per-request sampling settings, validated with errors that name the field and request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k <= 0, top_p 1 and min_p 0 disable those filters.
    repetition_penalty (transformers' rule) covers prompt and output tokens; presence and
    frequency penalties (OpenAI's rule) cover output tokens only. A request stops at
    max_tokens ("length"), at an eos or stop_token_ids token, or when its text contains a
    stop string ("stop"); a stop string is cut from the returned text, its tokens are kept.
    seed makes one request's samples reproducible whatever it is batched with.
    logprobs: the chosen token's log-probability is always reported; logprobs=n also
    reports the n most likely tokens. Log-probabilities are of the raw model distribution.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    # Sample only among these ids (None: the whole vocabulary), e.g. HunyuanImage-3's
    # aspect-ratio tokens when the AR step picks an image's size.
    allowed_token_ids: list[int] | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any], request_id: str = "?") -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"request {request_id}: unknown sampling field(s) {unknown}; known: {sorted(known)}"
            )
        params = cls(**values)
        params.validate(request_id)
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, request_id: str = "?", vocab_size: int | None = None) -> None:
        def fail(name: str, rule: str) -> None:
            value = getattr(self, name)
            raise ValueError(f"request {request_id}: sampling field {name}={value!r} {rule}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not isinstance(self.top_k, int):
            fail("top_k", "must be an integer (<= 0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "must be in [-2, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", "must be None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be None or an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be a list of non-empty strings")
        for token in self.stop_token_ids:
            if not isinstance(token, int) or token < 0 or (vocab_size and token >= vocab_size):
                fail("stop_token_ids", f"must hold token ids in [0, {vocab_size})")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                fail("allowed_token_ids", "must be None or a non-empty list of token ids")
            for token in ids:
                if not isinstance(token, int) or token < 0 or (vocab_size and token >= vocab_size):
                    fail("allowed_token_ids", f"must hold token ids in [0, {vocab_size})")
