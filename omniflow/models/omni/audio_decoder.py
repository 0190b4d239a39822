"""Audio decoder: codes → mel frames (direct transformer decoder) → vocoder → 24 kHz waveform.

Each token becomes ``frames_per_token`` mel frames and each frame ``hop`` samples, so a chunk of
n tokens decodes to exactly ``n * samples_per_token`` samples on its own: the decoder streams
chunk by chunk. ``offset`` (the chunk's first token index) keeps positions absolute across
chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from omniflow.models.omni.layers import Transformer, sincos_1d
from omniflow.models.omni.rvq import check_ids
from omniflow.models.omni.vocoder import Vocoder


@dataclass
class AudioDecoderConfig:
    code_dim: int = 32
    codebook_sizes: list[int] = field(default_factory=lambda: [8192, 4096, 2048] + [1024] * 5)
    dim: int = 64
    depth: int = 2
    heads: int = 4
    n_mels: int = 80
    frames_per_token: int = 8
    sample_rate: int = 24000
    upsample_rates: list[int] = field(default_factory=lambda: [8, 6, 5])  # product = hop = 240
    vocoder_channels: int = 64

    @property
    def hop(self) -> int:
        hop = 1
        for rate in self.upsample_rates:
            hop *= rate
        return hop

    @property
    def samples_per_token(self) -> int:
        return self.frames_per_token * self.hop


class AudioDecoder(nn.Module):
    def __init__(self, config: AudioDecoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tables = nn.ModuleList(nn.Embedding(n, c.code_dim) for n in c.codebook_sizes)
        self.in_proj = nn.Linear(c.code_dim, c.dim)
        self.transformer = Transformer(c.dim, c.depth, c.heads)
        self.to_mel = nn.Linear(c.dim, c.frames_per_token * c.n_mels)
        self.vocoder = Vocoder(c.n_mels, c.vocoder_channels, c.upsample_rates)

    @torch.no_grad()
    def mel(self, codes: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Mel frames [1, n_mels, n * frames_per_token] of codes [n, L]."""
        c = self.config
        check_ids(codes, c.codebook_sizes)
        if codes.shape[0] == 0:
            raise ValueError("an audio chunk needs at least one token")
        device = self.in_proj.weight.device
        codes = codes.to(device)
        summed = sum(self.tables[level](codes[:, level]) for level in range(len(self.tables)))
        positions = torch.arange(offset, offset + codes.shape[0])
        x = self.in_proj(summed) + sincos_1d(positions, c.dim).to(device)
        x = self.to_mel(self.transformer(x[None])[0])  # [n, frames_per_token * n_mels]
        return x.view(-1, c.n_mels).t()[None]

    @torch.no_grad()
    def decode_chunk(self, codes: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Float waveform [n * samples_per_token] at ``sample_rate`` of codes [n, L]."""
        return self.vocoder(self.mel(codes, offset))[0].float().cpu()


def to_pcm16(wave: torch.Tensor) -> bytes:
    """Raw little-endian PCM16 mono frames of a float waveform in [-1, 1]."""
    ints = (wave.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return ints.numpy().astype("<i2").tobytes()
