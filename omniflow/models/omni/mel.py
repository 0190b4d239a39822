"""Log-mel spectrogram front end, Whisper's recipe, with the mel filterbank computed in code."""

from __future__ import annotations

import math

import torch
from torch import nn


def hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Triangular HTK-scale filters [n_mels, n_fft // 2 + 1], each normalized to unit area."""
    bins = n_fft // 2 + 1
    fft_hz = torch.linspace(0.0, sample_rate / 2.0, bins, dtype=torch.float64)
    mel_points = torch.linspace(0.0, hz_to_mel(sample_rate / 2.0), n_mels + 2, dtype=torch.float64)
    hz_points = 700.0 * (10.0 ** (mel_points / 2595.0) - 1.0)
    lower, center, upper = hz_points[:-2, None], hz_points[1:-1, None], hz_points[2:, None]
    rising = (fft_hz[None] - lower) / (center - lower)
    falling = (upper - fft_hz[None]) / (upper - center)
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    filters = filters * (2.0 / (upper - lower))  # Slaney-style area normalization
    return filters.float()


class LogMel(nn.Module):
    """Waveform [T] float in [-1, 1] → log-mel [n_mels, frames], frames = T // hop."""

    window: torch.Tensor  # registered buffer
    filters: torch.Tensor  # registered buffer

    def __init__(self, sample_rate: int, n_fft: int, hop: int, n_mels: int) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.hop = hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer(
            "filters", mel_filterbank(sample_rate, n_fft, n_mels), persistent=False
        )

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(
            wave.float(), self.n_fft, self.hop, window=self.window, return_complex=True
        )
        power = spec[..., :-1].abs() ** 2  # Whisper drops the last frame: frames = T // hop
        mel = self.filters @ power
        log = torch.clamp(mel, min=1e-10).log10()
        log = torch.maximum(log, log.max() - 8.0)
        return (log + 4.0) / 4.0
