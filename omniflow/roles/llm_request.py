"""The ``llm`` role's request reading (roles/llm.py): which outputs it wants, its sampling
params (with the checkpoint's ``generation_config.json`` defaults), the context check, a
migrated request's resume point, and the per-session state a dialogue goes on from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omniflow.engine import EmbeddingSpan, SamplingParams
from omniflow.runtime.actor import BadRequest, Request

SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "logprobs",
)

# generation_config.json keys -> sampling params (the checkpoint's defaults; a request's own
# values win).
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class Session:
    __slots__ = ("tokens", "ended", "spans", "key", "messages")

    def __init__(self, key: int = 0) -> None:
        self.tokens: list[int] = []
        self.ended: list[int] = []  # the eos that closed the last reply, not in tokens
        self.spans: list[EmbeddingSpan] = []
        self.messages: list[dict[str, Any]] = []  # what the tokens render, reply included
        self.key = key  # summary_key("session", id): what the routing summary publishes


def sampling(request: Request, defaults: dict[str, Any], cap: int) -> SamplingParams:
    """The request's sampling params over the checkpoint's ``defaults``, max_tokens capped."""
    values = {k: request.params[k] for k in SAMPLING_KEYS if k in request.params}
    for key, value in defaults.items():  # the checkpoint's, capped
        values.setdefault(key, min(value, cap) if key == "max_tokens" else value)
    values.setdefault("max_tokens", 16)
    if isinstance(values["max_tokens"], int) and values["max_tokens"] > cap:
        raise BadRequest(
            "params.max_tokens", f"{values['max_tokens']} exceeds this role's cap of {cap}"
        )
    try:
        return SamplingParams.from_dict(values, request.request_id)
    except (TypeError, ValueError) as e:
        raise BadRequest("params", str(e)) from None


def generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults ``generation_config.json`` sets (``do_sample: false``: greedy)."""
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not JSON ({e})") from None
    out = {ours: raw[theirs] for theirs, ours in _GENERATION_KEYS.items() if theirs in raw}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def check_length(prompt_len: int, max_tokens: int, limits: Any) -> None:
    """A prompt past the context, or max_tokens past what is left of it: bad requests,
    refused before the engine sees them."""
    limit = min(limits.max_model_len, limits.capacity_tokens)
    name = "max_model_len" if limit == limits.max_model_len else "the KV cache's capacity"
    if prompt_len >= limit:
        raise BadRequest("text", f"the prompt is {prompt_len} tokens, past {name} {limit}")
    if prompt_len + max_tokens > limit:
        raise BadRequest(
            "params.max_tokens",
            f"{max_tokens} past the context: the prompt's {prompt_len} tokens + {max_tokens} "
            f"exceed {name} {limit}; at most {limit - prompt_len}",
        )


def resume_point(params: dict[str, Any], vocab_size: int) -> tuple[list[int], bool]:
    """``params["resume"]`` of a migrated request: (text token ids already streamed,
    whether the text had ended)."""
    resume = params.get("resume")
    if resume is None:
        return [], False
    tokens = resume.get("tokens", []) if isinstance(resume, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens
    ):
        raise BadRequest("params.resume.tokens", f"expected a list of ids below {vocab_size}")
    return tokens, bool(resume.get("finished", False))


def wanted(params: dict[str, Any]) -> set[str]:
    """``params.want``: some of text, image, audio."""
    want = params.get("want", "text")
    kinds = {w.strip() for w in (want.split(",") if isinstance(want, str) else want)}
    unknown = kinds - {"text", "image", "audio"}
    if unknown or not kinds:
        raise BadRequest("params.want", f"expected some of text,image,audio; got {want!r}")
    return kinds
