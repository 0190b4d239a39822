"""The ``llm`` role's media outputs (roles/llm.py): the LongCat codes heads, the image and
audio stages a request asks for (checked), and one stage run through the engine, streaming
an image at the end or audio in chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from omniflow.engine import AsyncEngine, Guidance, SamplingParams
from omniflow.models.omni import load_depth_head
from omniflow.models.omni.loader import ensure_model, has_model, load_model
from omniflow.runtime.actor import BadRequest, Context, Request

AUDIO_CODEBOOKS = [8192, 4096, 2048] + [1024] * 5
IMAGE_CODEBOOKS = [1024] * 8


class MediaHead:
    """The engine's codes head (engine/heads.py) for one LongCat modality: the depth head
    (hidden state -> 8 codebook ids, greedy) and the code embedder (ids -> next input)."""

    def __init__(self, key: str, depth_head: Any, embedder: Any, placeholder_id: int) -> None:
        self.key, self.placeholder_id = key, placeholder_id
        self.depth_head, self.embedder = depth_head, embedder

    def codes(self, hidden: torch.Tensor) -> torch.Tensor:
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
        stages.append(Stage(image, grid[0] * grid[1], 0, scale, list(grid)))
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
):
    """One media stage through the engine, going on from request ``previous`` (or from
    the prompt ``tokens``, then reporting its cache hit): yields each delta's new ids
    [n, K] (for the session), then the outputs: one image at the end, or audio chunks as
    they complete."""
    guidance = None if stage.cfg is None else Guidance(bos, stage.cfg)
    options: dict[str, Any] = dict(
        head=stage.head, guidance=guidance, keep=keep, continue_from=previous
    )
    prompt, given = (tokens, spans or None) if previous is None else ([], None)
    params = SamplingParams(max_tokens=stage.tokens)
    buffered: list[torch.Tensor] = []  # ids rows not yet sent
    index = 0
    first = previous is None
    async for delta in engine.generate(rid, prompt, params, given, **options):
        if first:
            ctx.add_usage(cached_tokens=delta.num_cached_tokens)
            first = False
        if delta.codes is None:
            continue
        yield delta.codes
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


def embed_codes(head: MediaHead, ids: torch.Tensor) -> torch.Tensor:
    """The input rows of media tokens [n, K], as the engine fed them: the session's spans."""
    with torch.inference_mode():
        return head.embed(ids)
