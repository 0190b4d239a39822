"""Audio tokenizer: log-mel → Whisper-style conv stem + transformer → pooling conv → RVQ codes.

At 16 kHz with hop 160, the conv stem's stride 2 and a ×4 pooling conv, one token covers
``hop * 2 * pool`` = 1280 samples (12.5 tokens per second). A waveform is zero-padded up to a
whole number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from omniflow.models.omni.embedder import CodeEmbedder
from omniflow.models.omni.layers import Transformer, sincos_1d
from omniflow.models.omni.mel import LogMel
from omniflow.models.omni.rvq import ResidualVQ


@dataclass
class AudioConfig:
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 80
    dim: int = 64
    depth: int = 2
    heads: int = 4
    pool: int = 4
    code_dim: int = 32
    # LongCat-Next's level sizes; the tiny model keeps them (the tables are narrow).
    codebook_sizes: list[int] = field(default_factory=lambda: [8192, 4096, 2048] + [1024] * 5)
    hidden_size: int = 64

    @property
    def samples_per_token(self) -> int:
        return self.hop * 2 * self.pool


class AudioTokenizer(nn.Module):
    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.mel = LogMel(c.sample_rate, c.n_fft, c.hop, c.n_mels)
        self.conv1 = nn.Conv1d(c.n_mels, c.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.dim, c.dim, kernel_size=3, stride=2, padding=1)
        self.encoder = Transformer(c.dim, c.depth, c.heads)
        self.pool = nn.Conv1d(c.dim, c.dim, kernel_size=c.pool, stride=c.pool)
        self.to_code = nn.Sequential(nn.LayerNorm(c.dim), nn.Linear(c.dim, c.code_dim))
        self.quantizer = ResidualVQ(c.code_dim, c.codebook_sizes)
        self.embedder = CodeEmbedder(c.codebook_sizes, c.code_dim, c.hidden_size)

    def tokens_for(self, samples: int) -> int:
        """How many tokens a waveform of this many samples becomes."""
        return max(1, -(-samples // self.config.samples_per_token))

    @torch.no_grad()
    def features(self, wave: torch.Tensor) -> torch.Tensor:
        """Pre-quantization features [N, code_dim] of a mono float waveform [T] at 16 kHz."""
        if wave.dim() != 1 or wave.numel() == 0:
            raise ValueError(f"expected a non-empty mono waveform [T], got {list(wave.shape)}")
        c = self.config
        device = self.conv1.weight.device
        tokens = self.tokens_for(wave.numel())
        padded = F.pad(wave.float().to(device), (0, tokens * c.samples_per_token - wave.numel()))
        mel = self.mel(padded)  # [n_mels, tokens * 2 * pool]
        x = F.gelu(self.conv1(mel[None]))
        x = F.gelu(self.conv2(x))  # [1, dim, tokens * pool]
        x = x.transpose(1, 2) + sincos_1d(torch.arange(x.shape[2]), c.dim).to(device)
        x = self.encoder(x)
        x = self.pool(x.transpose(1, 2)).transpose(1, 2)[0]  # [tokens, dim]
        return self.to_code(x)

    @torch.no_grad()
    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """Code ids [N, L] of a mono float waveform [T] at 16 kHz."""
        return self.quantizer.encode(self.features(wave))

    @torch.no_grad()
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """LLM input vectors [N, hidden_size] of code ids [N, L]."""
        return self.embedder(codes.to(self.embedder.table(0).weight.device))
