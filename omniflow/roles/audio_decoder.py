"""``audio_decoder`` role: a stream of audio-code chunks → a stream of 24 kHz PCM chunks.

``model_path`` is a published-layout LongCat-Next folder. The role reads the audio bridge's
codebooks and ``proj_decoder`` (``model.audio_tokenizer.audio_bridge_model.``), every tensor
under ``model.audio_tokenizer.audio_decoder.`` and ``...audio_flow_matching_decoder.``
(``models/omni/next_audio_decoder.py``, ``next_flow_mel.py``), and the HiFT vocoder's
``cosy24k_vocoder/hift.pt`` (``models/omni/next_hift.py``).

Each input chunk (one Call of a streamed request) carries
    tensors["audio_codes"]: int64 (or int32) [n, 8]     RVQ ids of n audio tokens
and yields, as soon as it is decoded, one output
    audio_chunk: bytes   raw PCM16 little-endian mono frames at 24 kHz; with the tiny
                         checkpoint's config n * 1920 samples (4 mel frames a token, hop 480)
    sample_rate: int     24000
    index:       int     0, 1, 2, ... per request, in arrival order

The published decoder is not causal across a chunk (GroupNorm over time, a post-net that
looks ahead, a flow decoder that attends in blocks of 100 frames), so each chunk is decoded on
its own, as the published ``lazy_decode_and_save`` decodes each audio segment; the flow's
start noise and the vocoder's source phases and noise are seeded by the chunk's index (option
``noise_seed``), so a chunk decodes the same wherever it runs. The published cross-fade between
segments is not applied.

A client assembles the WAV by concatenating the ``audio_chunk`` bytes in ``index`` order and
writing them with ``wave``: ``setnchannels(1)``, ``setsampwidth(2)``, ``setframerate(24000)``,
``writeframes(b"".join(chunks))``. A chunk with no codes (a closing chunk) yields nothing.

Options: ``AudioDecoderOptions`` in roles/options.py.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from omniflow.models.omni.checkpoint import read_config
from omniflow.models.omni.next_audio_decoder import NextAudioDecoder, load_next_audio_decoder
from omniflow.models.omni.next_builder import ensure_next
from omniflow.models.omni.next_hift import HiFTGenerator, load_hift, to_pcm16
from omniflow.roles.base import ModelActor
from omniflow.roles.options import AudioDecoderOptions, NoParams
from omniflow.runtime.actor import BadRequest, Context, Request


class _StreamState:
    """Where one request's stream is: chunks emitted so far."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index = 0


class AudioDecoderRole(ModelActor):
    Options = AudioDecoderOptions
    Params = NoParams
    Makes = ("audio",)
    options: AudioDecoderOptions

    async def setup(self) -> None:
        self.max_chunk_tokens = self.options.max_chunk_tokens
        # Keyed by the request's Context, which lives exactly as long as the request's stream:
        # state goes away with the request even if it ends by cancel or without a last chunk.
        self._streams: weakref.WeakKeyDictionary[Context, _StreamState] = (
            weakref.WeakKeyDictionary()
        )
        self.start_model_thread()
        self.model, self.vocoder, self.sample_rate = await self._run(self._load)
        # Warm-up: the first forward pays for allocator and kernel setup; do it before serving.
        warm = torch.zeros(1, len(self.model.codebook_sizes), dtype=torch.int64)
        await self._run(self._decode, warm, 0)

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
        if codes is None and request.last and request.seq > 0:
            return  # a closing chunk without codes
        codes = self._codes(codes)
        if codes.shape[0] == 0:
            return
        state = self._streams.setdefault(ctx, _StreamState())
        index = state.index
        state.index += 1
        pcm = await self._run(self._decode, codes, index)
        yield {"audio_chunk": pcm, "sample_rate": self.sample_rate, "index": index}

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
        if codes.shape[0] > self.max_chunk_tokens:
            raise BadRequest(
                "audio_codes",
                f"{codes.shape[0]} tokens in one chunk exceeds the limit of "
                f"{self.max_chunk_tokens} (option max_chunk_tokens)",
            )
        for level, size in enumerate(sizes):
            if codes.shape[0] and (
                int(codes[:, level].min()) < 0 or int(codes[:, level].max()) >= size
            ):
                raise BadRequest("audio_codes", f"level {level} ids must lie in [0, {size})")
        return codes.to(torch.int64)

    def _decode(self, codes: torch.Tensor, index: int) -> bytes:
        noise = torch.Generator().manual_seed(self.options.noise_seed * 1_000_003 + index)
        mel = self.model.mel(codes, noise)
        with torch.no_grad():
            wave = self.vocoder(mel.t()[None], noise)[0]
        return to_pcm16(wave.float().cpu())
