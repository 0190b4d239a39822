"""``audio_decoder`` role: a stream of audio-code chunks → a stream of 24 kHz PCM chunks.

Each input chunk (one Call of a streamed request) carries
    tensors["audio_codes"]: int64 (or int32) [n, 8]     RVQ ids of n audio tokens
and yields, as soon as it is decoded, one output
    audio_chunk: bytes   raw PCM16 little-endian mono frames, n * 1920 samples at 24 kHz
    sample_rate: int     24000
    index:       int     0, 1, 2, ... per request, in arrival order

A client assembles the WAV by concatenating the ``audio_chunk`` bytes in ``index`` order and
writing them with ``wave``: ``setnchannels(1)``, ``setsampwidth(2)``, ``setframerate(24000)``,
``writeframes(b"".join(chunks))``. A chunk with no codes (a closing chunk) yields nothing.

Options: ``AudioDecoderOptions`` in roles/options.py.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from omniflow.models.omni import AudioDecoder, ensure_model, load_audio_decoder, to_pcm16
from omniflow.roles.base import ModelActor
from omniflow.roles.options import AudioDecoderOptions, NoParams
from omniflow.runtime.actor import BadRequest, Context, Request


class _StreamState:
    """Where one request's stream is: chunks emitted and tokens decoded so far."""

    __slots__ = ("index", "tokens")

    def __init__(self) -> None:
        self.index = 0
        self.tokens = 0


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
        self.model: AudioDecoder = await self._run(self._load)
        self.sample_rate = self.model.config.sample_rate
        # Warm-up: the first forward pays for allocator and kernel setup; do it before serving.
        warm = torch.zeros(1, len(self.model.config.codebook_sizes), dtype=torch.int64)
        await self._run(self._decode, warm, 0)

    def _load(self) -> AudioDecoder:
        opts = self.options
        if opts.build_tiny:
            ensure_model("audio_decoder", opts.model_path, opts.seed)
        return load_audio_decoder(opts.model_path, opts.device)

    async def handle(self, request: Request, ctx: Context):
        codes = request.tensors.get("audio_codes")
        if codes is None and request.last and request.seq > 0:
            return  # a closing chunk without codes
        codes = self._codes(codes)
        if codes.shape[0] == 0:
            return
        state = self._streams.setdefault(ctx, _StreamState())
        offset = state.tokens
        state.tokens += codes.shape[0]
        pcm = await self._run(self._decode, codes, offset)
        index = state.index
        state.index += 1
        yield {"audio_chunk": pcm, "sample_rate": self.sample_rate, "index": index}

    def _codes(self, codes: Any) -> torch.Tensor:
        sizes = self.model.config.codebook_sizes
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

    def _decode(self, codes: torch.Tensor, offset: int) -> bytes:
        return to_pcm16(self.model.decode_chunk(codes, offset))
