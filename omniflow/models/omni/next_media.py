"""The llm role's codes heads (engine/heads.py) in the published LongCat-Next layout.

An image or audio token is made by ``visual_head`` / ``audio_head`` (next_heads.py), level
by level: the LLM's last hidden state and the running sum of the chosen levels' word-
embedding rows -> level l's logits over codebook size + 1, each level's id picked by the
request's sampling (the engine's ``pick``: temperature, top-k, top-p and the repetition
penalty over its earlier codes, as published) or greedy over the codebook. The
extra last output is for audio level 0 the published end-of-audio flag: chosen, it ends the
audio (the engine's ``end_code``: modules/state_machine.py of LongCat-Next-inference leaves
its audio stage there), its row's other levels are 0 and it goes back in as no codes but
``<longcat_audiogen_end>``'s word embedding (that step's published ext id); an
image never chooses it (its last class is masked, as published). It goes back in as the sum of each level's
row of ``model.embed_tokens`` (level l's id + ``visual_offset``/``audio_offset`` + the sizes
of the levels before), then, for images, ``model.visual_tokenizer.visual_embedding_layer``:
the same input the encoders give a seen image or sound (next_vision.py, next_audio.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from omniflow.models.omni.checkpoint import load_part, read_config
from omniflow.models.omni.next_codes import (
    VISION_PREFIX,
    EmbeddingLayer,
    code_offsets,
    load_code_rows,
)
from omniflow.models.omni.next_heads import NextDepthHead, head_for

# (level, logits [B, n]) -> ids [B]: the engine's CodesPick (engine/heads.py)
CodesPick = Callable[[int, torch.Tensor], torch.Tensor]


class SpeechTokens(NamedTuple):
    """The published ids that route speech: ``<longcat_audiogen_start>`` (the turn turns to
    audio), ``<longcat_audiotext_start>`` and ``_pad`` (the text spoken beside it starts /
    is over: engine/spoken.py), ``<longcat_audiogen_end>`` (after the audio)."""

    gen_start: int
    text_start: int
    text_pad: int
    gen_end: int


class ImageTokens(NamedTuple):
    """The published ids that route an image: ``<longcat_img_start>`` (after the
    ``<longcat_img_token_size>h w</longcat_img_token_size>`` anyres prefix), the newline
    after each row of tokens, ``<longcat_img_end>``."""

    start: int
    newline: int
    end: int


class NextMediaHead:
    """One modality's codes head: ``codes`` (hidden -> ids [B, 8]) and ``embed`` (ids ->
    the next input row)."""

    def __init__(
        self,
        key: str,
        head: NextDepthHead,
        code_rows: nn.Embedding,
        sizes: list[int],
        placeholder_id: int,
        embedding_layer: EmbeddingLayer | None = None,
        speech: SpeechTokens | None = None,
        image: ImageTokens | None = None,
    ) -> None:
        self.key, self.placeholder_id = key, placeholder_id
        self.speech = speech  # the audio head's: the tokens that route speech
        self.image = image  # the image head's: the tokens that route an image
        self.head, self.code_rows, self.sizes = head, code_rows, sizes
        self.offsets = code_offsets(0, sizes).to(code_rows.weight.device)
        self.embedding_layer = embedding_layer
        # the level-0 id that ends the media (engine/heads.py end_code): audio's flag
        self.end_code = sizes[0] if key == "audio" else None
        # the flag row's input: <longcat_audiogen_end>'s word embedding (set by the loader)
        self.end_row: torch.Tensor | None = None

    @torch.no_grad()
    def codes(self, hidden: torch.Tensor, pick: CodesPick | None = None) -> torch.Tensor:
        """Level by level: level l's id (``pick``ed from its logits, or greedy), then its
        word-embedding row joins the running sum the next level's position reads."""
        return self._levels(hidden, pick)

    @torch.no_grad()
    def guided_codes(
        self,
        cond: torch.Tensor,
        uncond: torch.Tensor,
        scale: torch.Tensor,
        pick: CodesPick | None = None,
    ) -> torch.Tensor:
        """Classifier-free guidance as the published image head runs it
        (``depth_transformer_forward_new``): each level's logits of both halves, then
        uncond + scale * (cond - uncond) (scale [B]); the one id picked goes on in both."""
        return self._levels(cond, pick, uncond, scale)

    def _levels(
        self,
        hidden: torch.Tensor,
        pick: CodesPick | None,
        uncond: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        choose = pick or _greedy
        hidden = hidden.to(self.head.hidden_proj.weight.dtype)
        rows, width = hidden.shape
        both = hidden if uncond is None else torch.cat([hidden, uncond.to(hidden.dtype)])
        previous = hidden.new_zeros(both.shape[0], len(self.sizes) - 1, width)
        total = hidden.new_zeros(rows, width)
        ids = []
        ended, flag = None, self.end_code
        for level, size in enumerate(self.sizes):
            logits = self.head.level_logits(both, previous, level)
            if scale is not None:
                cond, base = logits[:rows], logits[rows:]
                logits = base + (scale.to(logits)[:, None] * (cond - base))
            if level == 0 and flag is not None:
                code = choose(level, logits[:, : size + 1])  # the flag may end the audio
                ended = code == flag
                code = code.masked_fill(ended, 0)  # the levels after read no flag row
            else:
                code = choose(level, logits[:, :size])
            ids.append(code)
            if level + 1 < len(self.sizes):
                total = total + self.code_rows(code + self.offsets[level]).to(hidden.dtype)
                previous[:rows, level] = total
                if uncond is not None:  # the unconditional half reads the same ids
                    previous[rows:, level] = total
        out = torch.stack(ids, -1).to(torch.int64)
        if ended is not None and flag is not None and bool(ended.any()):
            out[ended] = 0
            out[ended, 0] = flag
        return out

    @torch.no_grad()
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.to(self.offsets.device)
        empty = flagged = None
        if self.end_code is not None:
            # An audio row goes back in as no codes where its level 0 is the end-of-audio
            # flag or 0, as the published get_audio_embeddings masks them; the flag's step
            # feeds <longcat_audiogen_end> instead (its ext id there).
            flagged = codes[:, 0] == self.end_code
            empty = flagged | (codes[:, 0] == 0)
            codes = codes.masked_fill(empty[:, None], 0)
        rows = self.code_rows(codes + self.offsets).sum(1)
        if empty is not None and flagged is not None:
            rows = rows.masked_fill(empty[:, None], 0.0)
            if self.end_row is not None:
                rows = torch.where(flagged[:, None], self.end_row.to(rows), rows)
        if self.embedding_layer is not None:
            rows = self.embedding_layer.pre_buffer(rows)
        return rows


def _greedy(level: int, logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def load_next_media_heads(
    folder: str | Path, placeholder_id: int, device: str = "cpu", role: str = "llm"
) -> tuple[NextMediaHead, NextMediaHead]:
    """(image head, audio head) of a published-layout folder, strictly loaded."""
    config = read_config(folder, role)
    hidden = int(config["hidden_size"])
    heads = []
    for key, which, offset in (
        ("image", "visual", "visual_offset"),
        ("audio", "audio", "audio_offset"),
    ):
        sizes = [int(n) for n in config[f"{which}_config"]["vq_config"]["codebook_sizes"]]
        head = head_for(config, which)
        load_part(head, folder, f"{which}_head.", role)
        rows = nn.Embedding(sum(sizes), hidden)
        load_code_rows(rows, folder, int(config[offset]), role)
        layer = None
        if key == "image":
            layer = _embedding_layer(config, folder, role)
        heads.append((key, head, rows, sizes, layer))
    audio = config["audio_config"]
    names = ("audiogen_start", "audiotext_start", "audiotext_pad", "audiogen_end")
    speech = None
    if all(f"{n}_token_id" in audio for n in names):
        speech = SpeechTokens(*(int(audio[f"{n}_token_id"]) for n in names))
    visual = config["visual_config"]
    parts = ("image_start", "image_line", "image_end")
    image = None
    if all(f"{n}_token_id" in visual for n in parts):
        image = ImageTokens(*(int(visual[f"{n}_token_id"]) for n in parts))
    out = []
    for key, head, rows, sizes, layer in heads:
        modules: list[Any] = [head, rows] + ([layer] if layer is not None else [])
        for module in modules:
            module.to(device).eval()
        marks = (None, image) if key == "image" else (speech, None)
        made = NextMediaHead(key, head, rows, sizes, placeholder_id, layer, *marks)
        if key == "audio" and speech is not None:
            end = nn.Embedding(1, hidden)
            load_code_rows(end, folder, speech.gen_end, role)
            made.end_row = end.weight.detach()[0].to(device)
        out.append(made)
    return out[0], out[1]


def _embedding_layer(config: dict[str, Any], folder: str | Path, role: str) -> EmbeddingLayer:
    layer = EmbeddingLayer(
        int(config["hidden_size"]),
        int(config["visual_embedding_layer_intermediate_size"]),
        float(config.get("rms_norm_eps", 1e-5)),
    )
    load_part(layer, folder, VISION_PREFIX + "visual_embedding_layer.", role)
    return layer
