"""``audio_decoder`` role: a stream of audio-code chunks → a stream of 24 kHz PCM chunks.

``model_path`` is a published-layout LongCat-Next folder. The role reads the audio bridge's
codebooks and ``proj_decoder`` (``model.audio_tokenizer.audio_bridge_model.``), every tensor
under ``model.audio_tokenizer.audio_decoder.`` and ``...audio_flow_matching_decoder.``
(``models/omni/next_audio_decoder.py``, ``next_flow_mel.py``), and the HiFT vocoder's
``cosy24k_vocoder/hift.pt`` (``models/omni/next_hift.py``).

Each input chunk (one Call of a streamed request) carries
    tensors["audio_codes"]: int64 (or int32) [n, 8]     RVQ ids of n audio tokens; a row whose
                         level 0 is codebook_sizes[0] (the published end-of-audio flag)
                         ends a segment: the runs between flags decode on their own
and yields, as soon as it is decoded, one output
    audio_chunk: bytes   raw PCM16 little-endian mono frames at 24 kHz; with the tiny
                         checkpoint's config n * 1920 samples (4 mel frames a token, hop 480)
    sample_rate: int     24000
    index:       int     0, 1, 2, ... per request, in arrival order

The published decoder is not causal across a chunk (GroupNorm over time, a post-net that
looks ahead, a flow decoder that attends in blocks of 100 frames), so each chunk is decoded on
its own, as the published ``lazy_decode_and_save`` decodes each audio segment; the flow's
start noise and the vocoder's source phases and noise are seeded by the chunk's index (option
``noise_seed``), so a chunk decodes the same wherever it runs. Chunks of one segment are
cross-faded (``crossfade_ms``, default 50): a chunk is decoded after the last chunk's last
token(s), and that overlap fades in over the last ``crossfade_ms`` of the last chunk, which
it held back; the stream's closing chunk (or a chunk flagged last) gives the held-back tail.
The samples add up as without it: n * 1920 a token.

A client assembles the WAV by concatenating the ``audio_chunk`` bytes in ``index`` order and
writing them with ``wave``: ``setnchannels(1)``, ``setsampwidth(2)``, ``setframerate(24000)``,
``writeframes(b"".join(chunks))``. A closing chunk (no codes, last) yields the held-back
tail, if any; an empty chunk nothing.

Options: ``AudioDecoderOptions`` in roles/options.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Any

import torch

from omniflow.models.conv_backend import ConvChoice, conv_path, pick_conv_backend
from omniflow.models.omni.checkpoint import ensure_next, read_config
from omniflow.models.omni.next_audio_decoder import NextAudioDecoder, load_next_audio_decoder
from omniflow.models.omni.next_hift import HiFTGenerator, load_hift, to_pcm16
from omniflow.roles.base import ModelActor
from omniflow.roles.options import AudioDecoderOptions, NoParams
from omniflow.runtime.actor import BadRequest, Context, Request

log = logging.getLogger(__name__)


class _StreamState:
    """Where one request's stream is: chunks emitted so far; the last chunk's last audio
    tokens (decoded again before the next chunk's, for the cross-fade) and its held-back
    tail samples (float), None at a segment's start."""

    __slots__ = ("context", "index", "tail")

    def __init__(self) -> None:
        self.index = 0
        self.context: torch.Tensor | None = None
        self.tail: torch.Tensor | None = None


class AudioDecoderRole(ModelActor):
    Options = AudioDecoderOptions
    Params = NoParams
    Makes = ("audio",)
    handles_stream_end = True  # the closing marker gives the held-back tail
    options: AudioDecoderOptions

    async def setup(self) -> None:
        self.max_chunk_tokens = self.options.max_chunk_tokens
        self.conv: ConvChoice | None = None  # the faster convolution path, measured below
        # Keyed by the request's Context, which lives exactly as long as the request's stream:
        # state goes away with the request even if it ends by cancel or without a last chunk.
        self._streams: weakref.WeakKeyDictionary[Context, _StreamState] = (
            weakref.WeakKeyDictionary()
        )
        self.start_model_thread()
        self.model, self.vocoder, self.sample_rate = await self._run(self._load)
        # Warm-up: the first forward pays for allocator and kernel setup; do it before serving.
        warm = torch.zeros(1, len(self.model.codebook_sizes), dtype=torch.int64)
        await self._run(self._wave, warm, torch.Generator().manual_seed(0))
        # A one-token chunk (the first of a stream, the one a listener waits for) timed
        # through oneDNN and PyTorch's own convolutions: the faster is kept (option conv).
        if self.options.conv != "auto":
            self.conv = ConvChoice(self.options.conv == "mkldnn", math.nan, math.nan)
            return
        self.conv = choice = await self._run(
            pick_conv_backend, lambda: self._wave(warm, torch.Generator().manual_seed(0))
        )
        log.info(
            "%s-%d: convolutions %s (a one-token chunk %.1f ms with mkldnn, %.1f ms native)",
            self.role,
            self.replica,
            choice.name,
            choice.mkldnn_ms,
            choice.native_ms,
        )

    def _load(self) -> tuple[NextAudioDecoder, HiFTGenerator, int]:
        opts = self.options
        if opts.build_tiny:
            ensure_next(opts.model_path, opts.seed)
        role = self.role
        config = read_config(opts.model_path, role)
        model = load_next_audio_decoder(opts.model_path, role, opts.device)
        vocoder = load_hift(opts.model_path, role, opts.device)
        rate = int(config["audio_config"]["vocoder_config"]["sampling_rate"])
        return model, vocoder, rate

    async def handle(self, request: Request, ctx: Context):
        codes = request.tensors.get("audio_codes")
        state = self._streams.setdefault(ctx, _StreamState())
        if codes is None and request.last and request.seq > 0:  # a closing chunk
            if state.tail is not None:  # what the last chunk held back for its cross-fade
                tail, state.tail = to_pcm16(state.tail), None
                yield self._out(tail, state)
            return
        codes = self._codes(codes)
        segments = self._segments(codes)
        flag = self.model.codebook_sizes[0]
        if not segments:
            if codes.shape[0]:  # flag rows only: the segment ended
                state.context = None
            return
        # The chunk's first run goes on from the last chunk's unless a flag row parts them.
        continues = state.context is not None and int(codes[0, 0]) != flag
        pcm = await self._run(self._decode, segments, state, continues, request.last)
        if int(codes[-1, 0]) == flag:  # the segment ended with this chunk
            state.context = None
        yield self._out(pcm, state)

    def _out(self, pcm: bytes, state: _StreamState) -> dict[str, Any]:
        state.index += 1
        return {"audio_chunk": pcm, "sample_rate": self.sample_rate, "index": state.index - 1}

    def _segments(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """The runs of codes between end-of-audio rows (level 0 = ``codebook_sizes[0]``, the
        published end flag): each is decoded on its own, the flag rows are dropped."""
        ends = (codes[:, 0] == self.model.codebook_sizes[0]).nonzero().view(-1).tolist()
        bounds = [-1, *ends, codes.shape[0]]
        runs = [codes[a + 1 : b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return [run for run in runs if run.shape[0]]

    def _codes(self, codes: Any) -> torch.Tensor:
        sizes = self.model.codebook_sizes
        if not torch.is_tensor(codes) or codes.dtype not in (torch.int64, torch.int32):
            got = "nothing" if codes is None else getattr(codes, "dtype", type(codes).__name__)
            raise BadRequest(
                "audio_codes", f"expected an int64 tensor [n, {len(sizes)}], got {got}"
            )
        if codes.dim() != 2 or codes.shape[1] != len(sizes):
            raise BadRequest(
                "audio_codes", f"expected shape [n, {len(sizes)}], got {list(codes.shape)}"
            )
        limit = min(self.max_chunk_tokens, self.model.max_tokens)
        if codes.shape[0] > limit:
            why = (
                "option max_chunk_tokens"
                if limit == self.max_chunk_tokens
                else "the decoder's positional_embedding rows / avg_pooler"
            )
            raise BadRequest(
                "audio_codes",
                f"{codes.shape[0]} tokens in one chunk exceeds the limit of {limit} ({why})",
            )
        flags = codes[:, 0] == sizes[0]  # end-of-audio rows: level 0 = codebook_sizes[0]
        rows = codes[~flags]
        for level, size in enumerate(sizes):
            if rows.shape[0] and (
                int(rows[:, level].min()) < 0 or int(rows[:, level].max()) >= size
            ):
                raise BadRequest(
                    "audio_codes",
                    f"level {level} ids must lie in [0, {size}) (or level 0 = {sizes[0]}, "
                    "the end-of-audio flag)",
                )
        flagged = codes[flags]  # the head has size + 1 classes a level: the flag row's may be size
        if flagged.shape[0] and bool(((flagged < 0) | (flagged > torch.tensor(sizes))).any()):
            raise BadRequest(
                "audio_codes", f"an end-of-audio row's ids must lie in [0, size] for sizes {sizes}"
            )
        return codes.to(torch.int64)

    def _wave(self, codes: torch.Tensor, noise: torch.Generator) -> torch.Tensor:
        conv = self.conv  # None while setup measures both paths
        with contextlib.nullcontext() if conv is None else conv_path(conv.mkldnn):
            mel = self.model.mel(codes, noise)
            with torch.no_grad():
                return self.vocoder(mel.t()[None], noise)[0].float().cpu()

    def _decode(
        self, segments: list[torch.Tensor], state: _StreamState, continues: bool, last: bool
    ) -> bytes:
        """PCM16 of a chunk's runs. With a cross-fade, a run that goes on from the last
        chunk is decoded after that chunk's last tokens (``context``); the overlap before
        its own first sample is faded in over the tail the last chunk held back, and this
        chunk holds back its own tail unless it is the stream's last."""
        noise = torch.Generator().manual_seed(self.options.noise_seed * 1_000_003 + state.index)
        overlap = round(self.options.crossfade_ms * self.sample_rate / 1000)
        waves = []
        for k, codes in enumerate(segments):
            context = state.context if k == 0 and continues and overlap else None
            full = codes if context is None else torch.cat([context, codes])
            wave = self._wave(full, noise)
            skip = 0 if context is None else len(wave) * len(context) // len(full)
            own = wave[skip:]
            tail = state.tail if k == 0 else None
            if tail is not None and context is not None and skip >= len(tail):
                fade = torch.linspace(0.0, 1.0, len(tail) + 2)[1:-1]
                seam = tail * (1 - fade) + wave[skip - len(tail) : skip] * fade
                own = torch.cat([seam, own])
            elif tail is not None:  # a new segment (or no room): the tail as it was
                own = torch.cat([tail, own])
            waves.append(own)
            state.context = full[-max(1, -(-overlap * len(full) // len(wave))) :]
        state.tail = None
        out = torch.cat(waves)
        if overlap and not last and len(out) > overlap:
            out, state.tail = out[:-overlap], out[-overlap:]
        return to_pcm16(out)
