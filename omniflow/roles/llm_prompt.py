"""The llm role's prompt: a dialogue's messages through the chat template, as token ids and
the media spans at their markers.

A request carries ``data["messages"]`` (the whole dialogue, as the gateway sends it: system,
earlier user and assistant turns, every turn's media as ``{"type": "image"}`` /
``{"type": "audio"}`` parts in the order of the request's embeddings), or only ``text`` (and
media), which is one user message. Text pieces are tokenized piece by piece, media markers
become placeholder positions keyed by the media's content hash, and an assistant message
whose text this replica generated gets back the ids it generated: so a resent dialogue's
tokens are the earlier prompt's tokens and reply, and the prefix cache serves all of them.
A reply this replica spoke (text made beside audio) gets back its whole speech: the
speech tokens, and the audio tokens' rows and keys as the engine fed them.

With a session, a dialogue that extends the session's messages is prompted as the session's
tokens (generated media included) plus the new messages' tokens; one that diverges (an
edited or regenerated turn) is prompted whole, and the prefix cache serves the part in
common: nothing is dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from omniflow.engine import EmbeddingSpan
from omniflow.roles.chat_template import ChatTemplate, Piece, TemplateError, with_sentinels
from omniflow.runtime.actor import BadRequest, Request

log = logging.getLogger(__name__)
Media = dict[str, list[tuple[str, torch.Tensor]]]  # kind -> [(content hash, rows)] in order
_KINDS = ("image", "audio")


def request_messages(data: dict[str, Any], text: str, media: Media) -> tuple[list[dict], bool]:
    """(the dialogue's messages with media parts annotated by hash, whether the request sent
    the whole dialogue)."""
    given = data.get("messages")
    if given is None:
        parts: list[dict[str, Any]] = [{"type": k} for k in _KINDS for _ in media[k]]
        content: Any = [*parts, {"type": "text", "text": text}] if parts else text
        return _annotate([{"role": "user", "content": content}], media, True), False
    if not isinstance(given, list) or not given:
        raise BadRequest("messages", "expected a non-empty list of messages")
    for i, message in enumerate(given):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}]", "expected {role, content}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content", "expected a string or a list of parts")
    return _annotate(given, media, False), True


def _annotate(messages: list[dict], media: Media, last_only: bool) -> list[dict]:
    """Copies, each media part with the hash of the medium it stands for."""
    counts = {k: 0 for k in _KINDS}
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _KINDS:
                    held = media[kind]
                    if counts[kind] >= len(held):
                        raise BadRequest("messages", f"more {kind} parts than {kind}s sent")
                    part = {"type": kind, "hash": held[counts[kind]][0]}
                    counts[kind] += 1
                parts.append(part)
            content = parts
        out.append({"role": message["role"], "content": "" if content is None else content})
    for kind in _KINDS:
        if counts[kind] != len(media[kind]):
            raise BadRequest("messages", f"{len(media[kind])} {kind}s for {counts[kind]} parts")
    return out


class PromptBuilder:
    """Token ids and spans of rendered dialogues, and the replies this replica generated."""

    def __init__(self, tokenizer: Any, template: ChatTemplate, placeholder: int) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.placeholder = placeholder
        self.replies: OrderedDict[str, list[int]] = OrderedDict()  # text -> generated ids
        self.max_replies = 4096
        # text -> (the speech's tokens, where its span starts in them, the span's rows, keys)
        self.spoken: OrderedDict[str, tuple[list[int], int, torch.Tensor, list]] = OrderedDict()
        self.spoken_bytes, self.max_spoken_bytes = 0, 64 << 20  # their rows: hidden a token

    def without_eos(self, ids: list[int]) -> list[int]:
        """``ids`` less the end token(s) that closed them: the template's own closing text
        renders the turn's end (a resent dialogue's prompt has it once, not twice)."""
        eos = set(self.tokenizer.eos_token_ids)
        end = len(ids)
        while end and ids[end - 1] in eos:
            end -= 1
        return ids[:end]

    def remember(self, text: str, ids: list[int]) -> None:
        """A reply's text and the ids that made it (without a closing eos), when they agree."""
        ids = self.without_eos(ids)
        if not text or self.tokenizer.decode(ids) != text:
            return
        self.replies[text] = list(ids)
        self.replies.move_to_end(text)
        while len(self.replies) > self.max_replies:
            self.replies.popitem(last=False)

    def remember_spoken(
        self, text: str, tokens: list[int], start: int, rows: torch.Tensor, keys: list
    ) -> None:
        """A spoken reply's text and its speech as the turn's sequence holds it: ``tokens``
        (from <audiogen_start> to <audiogen_end>), the span of its audio tokens at
        ``start`` in them with ``rows`` and ``keys``."""
        if not text or _nbytes(rows) > self.max_spoken_bytes:
            return
        old = self.spoken.pop(text, None)
        self.spoken_bytes -= 0 if old is None else _nbytes(old[2])
        self.spoken[text] = (list(tokens), start, rows, list(keys))
        self.spoken_bytes += _nbytes(rows)
        while self.spoken_bytes > self.max_spoken_bytes:  # the oldest go first
            self.spoken_bytes -= _nbytes(self.spoken.popitem(last=False)[1][2])

    def full(
        self, messages: list[dict], media: Media, offset: int = 0
    ) -> tuple[list[int], list[EmbeddingSpan]]:
        """The whole dialogue's prompt, positions from ``offset``."""
        try:
            pieces = self.template.pieces(messages)
        except TemplateError as e:
            raise BadRequest("messages", str(e)) from None
        return self._tokens(pieces, media, {k: 0 for k in _KINDS}, offset)

    def continuation(
        self, history: list[dict], messages: list[dict], media: Media, offset: int
    ) -> tuple[list[int], list[EmbeddingSpan]] | None:
        """The tokens that follow ``history`` (ending with the assistant's reply, whose
        tokens the session holds) up to ``messages``' generation prompt; None when the
        template does not render ``history`` as a prefix of ``messages``."""
        t = self.template
        try:
            before = t.render(with_sentinels(history), add_generation_prompt=False)
            after = t.render(with_sentinels(messages), add_generation_prompt=True)
        except TemplateError as e:
            raise BadRequest("messages", str(e)) from None
        if not after.startswith(before):
            return None
        closing = before[before.rfind("\ue001") + 1 :] if "\ue001" in before else ""
        try:
            pieces = t.cut(closing + after[len(before) :], messages)
        except TemplateError as e:
            raise BadRequest("messages", str(e)) from None
        # The new markers stand for the last media of each kind.
        first = {k: len(media[k]) - sum(p.kind == k for p in pieces) for k in _KINDS}
        if min(first.values()) < 0:
            return None
        return self._tokens(pieces, media, first, offset)

    def _tokens(
        self, pieces: list[Piece], media: Media, first: dict[str, int], offset: int
    ) -> tuple[list[int], list[EmbeddingSpan]]:
        tokens: list[int] = []
        spans: list[EmbeddingSpan] = []
        for piece in pieces:
            if piece.kind == "text":
                tokens += self.tokenizer.encode(piece.text, add_special_tokens=False)
            elif piece.kind == "reply" and piece.text in self.spoken:  # said, not written
                speech, start, rows, keys = self.spoken[piece.text]
                spans.append(EmbeddingSpan(offset + len(tokens) + start, rows, keys))
                tokens += speech
            elif piece.kind == "reply":
                ids = self.replies.get(piece.text)
                if ids is None:
                    ids = self.tokenizer.encode(piece.text, add_special_tokens=False)
                tokens += ids
            else:
                content_hash, rows = media[piece.kind][first[piece.kind] + piece.nth]
                spans.append(EmbeddingSpan(offset + len(tokens), rows, (piece.kind, content_hash)))
                tokens += [self.placeholder] * rows.shape[0]
        return tokens, spans


class StopText:
    """Text deltas with stop strings cut out: holds back the characters that could begin
    one until the next delta shows they do not."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.done = False

    def push(self, piece: str, finished: bool) -> str:
        if self.done:
            return ""
        if not self.stops:
            return piece
        self.pending += piece
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.done = self.pending[:cut], "", True
            return out
        if finished:
            out, self.pending = self.pending, ""
            return out
        keep = min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out


class TextDeltas:
    """A stage's text as the client gets it: decoded as it comes (no partial character
    out), stop strings cut; each output names the ids it covers ("tokens": what a migration
    resumes from), the last one "finished" and its finish_reason."""

    def __init__(self, tokenizer: Any, stops: list[str], resumed: list[int]) -> None:
        self.stream = tokenizer.stream()
        self.stream.push(resumed)  # the client has their text: only what follows is sent
        self.stops = StopText(stops)
        self.unsent: list[int] = []  # ids whose text is not out yet
        self.ids: list[int] = []  # every id pushed
        self.reply = ""  # the text sent

    def push(self, ids: list[int], finish_reason: str | None, always: bool = False):
        """The output for new ids (None: nothing to send yet, unless ``always``)."""
        self.unsent += ids
        self.ids += ids
        piece = self.stream.push(ids)
        finished = finish_reason is not None
        if finished:
            piece += self.stream.finish()
        piece = self.stops.push(piece, finished)
        self.reply += piece
        if not (piece or finished or always):
            return None
        out: dict[str, Any] = {"text": piece, "tokens": self.unsent}
        if finished:
            out["finished"] = True
            out["finish_reason"] = finish_reason
        self.unsent = []
        return out


def media_inputs(request: Request, hidden_size: int) -> Media:
    """The request's media rows, kind by kind, each piece with its content hash."""
    media: Media = {"image": [], "audio": []}
    for kind in ("image", "audio"):
        embeds = request.tensors.get(f"{kind}_embeds")
        if embeds is None:
            continue
        if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
            raise BadRequest(
                f"{kind}_embeds", f"expected [n, {hidden_size}], got {list(embeds.shape)}"
            )
        pieces = request.data.get(f"{kind}_spans") or [
            [request.data.get(f"{kind}_hash") or _tensor_hash(embeds), embeds.shape[0]]
        ]
        if sum(int(n) for _, n in pieces) != embeds.shape[0]:
            raise BadRequest(f"{kind}_spans", "token counts do not add up to the embeddings")
        row = 0
        for content_hash, n in pieces:
            # The content hash, not the placeholder id, keys these positions in the
            # prefix cache: two images of equal size never share KV.
            media[kind].append((content_hash, embeds[row : row + int(n)].float().clone()))
            row += int(n)
    return media


def token_logprobs(tokenizer: Any, delta: Any) -> list[dict[str, Any]]:
    """Each new token's text, log-probability and top alternatives (OpenAI's shape).

    The chosen token's text is decoded as the reply's text is (special tokens skipped), so
    the entries always join to the content; the alternatives keep their special names."""
    decode, raw = tokenizer.decode, tokenizer.token_bytes
    tops = delta.top_logprobs or [{}] * len(delta.token_ids)
    return [
        {
            "token": decode([token], skip_special_tokens=True),
            "logprob": float(logprob),
            "bytes": list(raw(token, True)),  # a token's own bytes, a partial character's too
            "top_logprobs": [
                {
                    "token": decode([t], skip_special_tokens=False),
                    "logprob": float(p),
                    "bytes": list(raw(t, False)),
                }
                for t, p in top.items()
            ],
        }
        for token, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=False)
    ]


def _tensor_hash(t: torch.Tensor) -> str:
    """A digest of the tensor's dtype, shape and values, the same on every device and
    layout (CUDA, bf16 with no numpy dtype, strided views, tensor subclasses)."""
    import hashlib

    raw = t.detach().as_subclass(torch.Tensor).contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    h.update(raw.cpu().numpy().tobytes())
    return h.hexdigest()


def _nbytes(rows: torch.Tensor) -> int:
    return rows.numel() * rows.element_size()
