"""The ``llm`` role's media outputs (roles/llm.py): the LongCat codes heads, the image and
audio stages a request asks for (checked), and one stage run through the engine, streaming
an image at the end or audio in chunks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from omniflow.engine import (
    AsyncEngine,
    EmbeddingSpan,
    Guidance,
    SamplingParams,
    Spoken,
    TokenDelta,
)
from omniflow.engine.heads import codes_key
from omniflow.engine.spoken import NO_TEXT, text_rows, token_row
from omniflow.models.omni import load_depth_head
from omniflow.models.omni.loader import ensure_model, has_model, load_model
from omniflow.models.omni.next_media import SpeechTokens
from omniflow.roles.llm_prompt import TextDeltas
from omniflow.runtime.actor import BadRequest, Context, Request

SIZE_OPEN, SIZE_CLOSE = "<longcat_img_token_size>", "</longcat_img_token_size>"
AUDIO_CODEBOOKS = [8192, 4096, 2048] + [1024] * 5
IMAGE_CODEBOOKS = [1024] * 8


class MediaHead:
    """The engine's codes head (engine/heads.py) for one LongCat modality: the depth head
    (hidden state -> 8 codebook ids, greedy) and the code embedder (ids -> next input)."""

    def __init__(self, key: str, depth_head: Any, embedder: Any, placeholder_id: int) -> None:
        self.key, self.placeholder_id = key, placeholder_id
        self.depth_head, self.embedder = depth_head, embedder

    def codes(self, hidden: torch.Tensor, pick: Any = None) -> torch.Tensor:
        """Greedy: the legacy omni-layout depth head chooses its levels itself."""
        return self.depth_head.generate(hidden, temperature=0.0)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embedder(codes)


class Stage(NamedTuple):
    """One media output of a turn."""

    head: MediaHead
    tokens: int  # media tokens to make
    chunk: int  # stream them in chunks of this many (0: all at once)
    cfg: float | None  # classifier-free guidance scale, or None
    grid: list[int] | None  # an image's [h, w]
    first: int = 0  # the first chunk's tokens (0: chunk)
    # An image as published: the anyres prefix and <longcat_img_start> before its tokens,
    # the newline after each row, <longcat_img_end> after (none: the tokens alone).
    prefix: tuple[int, ...] = ()
    row_end: tuple[int, int] | None = None
    closing: tuple[int, ...] = ()


def speech_tokens(head: Any) -> SpeechTokens | None:
    """The ids that route speech, where the audio head has them (the published layout)."""
    return getattr(head, "speech", None)


def load_media_head(kind: str, omni: Path, device: str, placeholder: int) -> MediaHead | None:
    """``omni/{kind}_head`` and ``omni/{kind}_embedder`` as a codes head; None without them."""
    head, embedder = omni / f"{kind}_head", omni / f"{kind}_embedder"
    if not (has_model(head) or has_model(embedder)):
        return None
    return MediaHead(
        kind,
        load_depth_head(head, device),
        load_model("code_embedder", embedder, device),
        placeholder,
    )


def build_tiny_heads(omni: Path, hidden: int, seed: int) -> None:
    """Random-weight depth heads and code embedders for image and audio under ``omni``."""
    for offset, (kind, name, books) in enumerate(
        [
            ("depth_head", "image_head", IMAGE_CODEBOOKS),
            ("depth_head", "audio_head", AUDIO_CODEBOOKS),
            ("code_embedder", "image_embedder", IMAGE_CODEBOOKS),
            ("code_embedder", "audio_embedder", AUDIO_CODEBOOKS),
        ]
    ):
        ensure_model(kind, omni / name, seed + 1 + offset, hidden_size=hidden, codebook_sizes=books)


def media_stages(
    request: Request,
    want: set[str],
    backend: str,
    heads: dict[str, Any],
    path: Path,
    tokenizer: Any,
) -> list[Stage]:
    """The image stage (guided) and the audio stage this request wants, checked."""
    stages = []
    if want & {"image", "audio"} and backend == "sglang":
        raise BadRequest(
            "params.want", "image and audio need codes heads: backend 'sglang' makes text only"
        )
    for kind in sorted(want & {"image", "audio"}):
        if heads[kind] is None:
            raise BadRequest(
                "params.want",
                f"{path} has no {kind} head (omni/{kind}_head): this model makes text only",
            )
    if "image" in want:
        grid = request.params.get("image_grid", [4, 4])
        if not (
            isinstance(grid, list)
            and len(grid) == 2
            and all(isinstance(g, int) and 1 <= g <= 32 for g in grid)
        ):
            raise BadRequest(
                "params.image_grid", f"expected [h, w] with 1..32 tokens each, got {grid!r}"
            )
        scale = float(request.params.get("cfg_scale", 2.0))
        image = cast(MediaHead, heads["image"])
        stage = Stage(image, grid[0] * grid[1], 0, scale, list(grid))
        marks = getattr(image, "image", None)
        if marks is not None:  # the published routing
            size = f"{SIZE_OPEN}{grid[0]} {grid[1]}{SIZE_CLOSE}"
            prefix = (*tokenizer.encode(size, False), marks.start)
            row_end = (marks.newline, grid[1])
            stage = stage._replace(prefix=prefix, row_end=row_end, closing=(marks.end,))
        stages.append(stage)
    if "audio" in want:
        chunks = int(request.params.get("audio_chunks", 3))
        per_chunk = int(request.params.get("audio_chunk_tokens", 4))
        if not (1 <= chunks <= 64 and 1 <= per_chunk <= 256):
            raise BadRequest("params.audio_chunks", "expected 1..64 chunks of 1..256 tokens")
        # The first chunk sooner: the time to first audio waits for its tokens only.
        first = int(request.params.get("audio_first_chunk_tokens", 1)) or per_chunk
        head = cast(MediaHead, heads["audio"])
        stages.append(Stage(head, chunks * per_chunk, per_chunk, None, None, first))
    return stages


async def run_stage(
    engine: AsyncEngine,
    bos: list[int],
    rid: str,
    stage: Stage,
    tokens: list[int],
    spans: list,
    previous: str | None,
    keep: bool,
    ctx: Context,
    spoken: Spoken | None = None,
    text: TextDeltas | None = None,
    params: SamplingParams | None = None,
    closing: tuple[int, ...] = (),
):
    """One media stage through the engine, going on from request ``previous`` (or from
    the prompt ``tokens``, then reporting its cache hit): yields each delta (for the
    session), then the outputs: one image at the end, or audio chunks as they complete.
    ``spoken``: the text is made beside the audio (engine/spoken.py), sampled by ``params``,
    and streamed through ``text`` before the chunk its step ends."""
    prefix = list(stage.prefix)
    guidance = None if stage.cfg is None else Guidance(bos + prefix, stage.cfg)
    options: dict[str, Any] = dict(
        head=stage.head, guidance=guidance, keep=keep, continue_from=previous
    )
    if stage.row_end is not None:
        options["row_end"] = stage.row_end
    # Going on from the last stage: its closing tokens (``tokens``'s tail) come first.
    prompt = (tokens if previous is None else list(closing)) + prefix
    given = (spans or None) if previous is None else None
    if spoken is not None:
        options["spoken"] = spoken  # one more step: the first makes text only
        made = stage.tokens + 1 + (spoken.max_text if spoken.audio_tokens is not None else 0)
        params = dataclasses.replace(cast(SamplingParams, params), max_tokens=made)
    else:
        rows = stage.tokens // stage.row_end[1] if stage.row_end else 0  # + a newline each
        params = media_params(params, stage.tokens + rows)
    buffered: list[torch.Tensor] = []  # ids rows not yet sent
    index = 0
    first = previous is None
    said = SaidText(spoken)
    async for delta in engine.generate(rid, prompt, params, given, **options):
        if first:
            ctx.add_usage(cached_tokens=delta.num_cached_tokens)
            first = False
        yield delta
        if text is not None and (out := said.push(text, delta)) is not None:
            yield out
        if delta.codes is None:
            continue
        buffered += list(delta.codes)
        size = (stage.first or stage.chunk) if index == 0 else stage.chunk
        while stage.chunk and len(buffered) >= size:
            chunk, buffered = buffered[:size], buffered[size:]
            yield {"audio_codes": torch.stack(chunk).cpu(), "index": index}
            index += 1  # streams on while the next chunk is made
            size = stage.chunk
    if stage.chunk and buffered:  # what a short first chunk left over
        yield {"audio_codes": torch.stack(buffered).cpu(), "index": index}
    if stage.grid is not None:
        yield {"image_codes": torch.stack(buffered).cpu(), "image_grid": stage.grid}


def media_params(params: SamplingParams | None, tokens: int) -> SamplingParams:
    """A media stage's params: the request's sampling, by which the engine picks its codes
    (as published), without its text's stops and logprobs; greedy without a request's."""
    if params is None:
        return SamplingParams(max_tokens=tokens, temperature=0.0)
    return dataclasses.replace(params, max_tokens=tokens, stop=[], stop_token_ids=[], logprobs=None)


class SaidText:
    """A spoken stage's text, step by step: its ids, and how it ended (an end id: "stop";
    ``max_text`` ids, or the audio ending first: "length")."""

    def __init__(self, spoken: Spoken | None) -> None:
        self.spoken, self.done = spoken, spoken is None
        self.ids: list[int] = []

    def push(self, text: TextDeltas, delta: TokenDelta) -> dict[str, Any] | None:
        if self.done or self.spoken is None:
            return None
        new, reason = [], None
        for token in delta.text_ids or []:
            if token == NO_TEXT or token in self.spoken.end_ids:
                reason = "stop"
                break
            new.append(token)
            if len(self.ids) + len(new) >= self.spoken.max_text:
                reason = "length"
                break
        if reason is None and delta.finish_reason is not None:
            reason = "length"  # the audio ended first
        self.ids += new
        self.done = reason is not None
        return text.push(new, reason)


def spoken_rows(
    model: Any, head: Any, spoken: Spoken, steps: list[int], codes: torch.Tensor
) -> tuple[torch.Tensor, list]:
    """A spoken turn's input rows and prefix keys, as the engine fed them (engine/spoken.py):
    a serial turn's text tokens' rows, the start token's row, then each media token's, each
    with its step's text row (a parallel turn's steps: the start token's, then codes)."""
    rows = text_rows(model, steps, spoken.end_ids)
    lead = len(steps) - len(codes)  # the steps without codes: the start token's is last
    with torch.inference_mode():
        rows[lead - 1] += token_row(model, spoken.start_id).to(rows.dtype).cpu()
        rows[lead:] += head.embed(codes).to(rows.dtype).cpu()
    keys: list[Any] = [("spoken", step) for step in steps[:lead]]
    keys += [(codes_key(head, ids), text) for ids, text in zip(codes, steps[lead:], strict=True)]
    return rows, keys


def media_layout(
    stage: Stage, tokens: list[int], spans: list, rows: torch.Tensor, keys: list, pad: int
) -> tuple[list[int], list[EmbeddingSpan]]:
    """The turn's tokens and spans after a media stage, as the engine's sequence holds them:
    its prefix, its tokens (``pad``, their rows and keys), row by row with the newline
    after each where it has rows, then its closing tokens (fed by what goes on from it)."""
    width = (stage.row_end[1] if stage.row_end else len(keys)) or 1
    out, spans = list(tokens) + list(stage.prefix), list(spans)
    for r in range(0, len(keys), width):
        spans.append(EmbeddingSpan(len(out), rows[r : r + width], keys[r : r + width]))
        out += [pad] * len(keys[r : r + width])
        if stage.row_end:
            out.append(stage.row_end[0])
    return out + list(stage.closing), spans


def spoken_layout(
    stage: Stage,
    spoken: Spoken,
    tokens: list[int],
    spans: list,
    rows: torch.Tensor,
    keys: list,
    pad: int,
) -> tuple[list[int], list[EmbeddingSpan]]:
    """After a spoken stage: <audiogen_start>, then (serial) the text's tokens, the start
    token and the audio tokens (rows and keys from spoken_rows), then <audiogen_end>."""
    marks = cast(SpeechTokens, speech_tokens(stage.head))
    out = list(tokens) + [marks.gen_start]
    span = EmbeddingSpan(len(out), rows, keys)
    said = [key[1] for key in keys if key[0] == "spoken"][:-1]  # a serial turn's text
    out += said + [spoken.start_id] + [pad] * (len(keys) - len(said) - 1)
    # <audiogen_end> follows, unless the audio ended at its flag: that step's row is it
    return out + ([] if _flagged(stage, keys[-1]) else [marks.gen_end]), list(spans) + [span]


def _flagged(stage: Stage, key: Any) -> bool:
    """Whether a spoken turn's last key is the head's end-of-audio flag row."""
    end, codes = getattr(stage.head, "end_code", None), key[0]
    return end is not None and isinstance(codes, tuple) and codes[1][0] == end


def embed_codes(head: MediaHead, ids: torch.Tensor) -> torch.Tensor:
    """The input rows of media tokens [n, K], as the engine fed them: the session's spans."""
    with torch.inference_mode():
        return head.embed(ids)
