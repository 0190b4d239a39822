"""HiFi-GAN-style vocoder: mel frames → waveform by transposed-conv upsampling + residual blocks.

The upsampling rates multiply to the hop, so ``frames`` mel frames become exactly
``frames * hop`` samples: a chunk of frames maps to a chunk of samples with no overlap
bookkeeping (the convolutions see zero padding at chunk edges).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_SLOPE = 0.1


class ResBlock(nn.Module):
    def __init__(self, channels: int, dilations: tuple[int, ...] = (1, 3)) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size=3, dilation=d, padding=d) for d in dilations
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = x + conv(F.leaky_relu(x, _SLOPE))
        return x


class Vocoder(nn.Module):
    def __init__(self, n_mels: int, channels: int, upsample_rates: list[int]) -> None:
        super().__init__()
        self.hop = math.prod(upsample_rates)
        self.conv_pre = nn.Conv1d(n_mels, channels, kernel_size=7, padding=3)
        self.ups = nn.ModuleList()
        self.blocks = nn.ModuleList()
        width = channels
        for rate in upsample_rates:
            # kernel 2r, padding (r + r%2)/2, output_padding r%2: exactly r× the length.
            self.ups.append(
                nn.ConvTranspose1d(
                    width,
                    width // 2,
                    kernel_size=2 * rate,
                    stride=rate,
                    padding=(rate + rate % 2) // 2,
                    output_padding=rate % 2,
                )
            )
            width //= 2
            self.blocks.append(ResBlock(width))
        self.conv_post = nn.Conv1d(width, 1, kernel_size=7, padding=3)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Waveform [B, frames * hop] in (-1, 1) of mel [B, n_mels, frames]."""
        x = self.conv_pre(mel)
        for up, block in zip(self.ups, self.blocks, strict=True):
            x = block(up(F.leaky_relu(x, _SLOPE)))
        return torch.tanh(self.conv_post(F.leaky_relu(x, _SLOPE)))[:, 0]
