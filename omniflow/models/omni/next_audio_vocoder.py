"""The vocoder behind LongCat-Next's mel: still our stand-in, not the published HiFT.

The published ``Cosy24kVocoder`` (CosyVoice's HiFT generator + ``ConvRNNF0Predictor``, weights
``cosy24k_vocoder/hift.pt``, a torch pickle) is not implemented. Until it is, the role runs our
HiFi-GAN-style ``Vocoder`` (``vocoder.py``) over the published 80-bin mel, with its own weights
in ``cosy24k_vocoder/standin_vocoder.safetensors`` (written by the tiny builder; a real
checkpoint has no such file, and loading one fails naming it). Its upsampling rates multiply
to the mel hop (``vocoder_config.hop_length``, 480 at 24 kHz), so ``frames`` mel frames give
``frames * 480`` samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omniflow.models.omni.checkpoint import CheckpointError, fill_strictly
from omniflow.models.omni.vocoder import Vocoder

STANDIN_PATH = "cosy24k_vocoder/standin_vocoder.safetensors"
RATES = [8, 5, 3, 4]  # product 480
CHANNELS = 64
MELS = 80


def standin_vocoder(seed: int | None = None) -> Vocoder:
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return Vocoder(MELS, CHANNELS, RATES)


def standin_vocoder_tensors(seed: int) -> dict[str, torch.Tensor]:
    return dict(standin_vocoder(seed).state_dict())


def load_standin_vocoder(
    folder: str | Path, config: dict[str, Any], role: str, device: str = "cpu"
) -> Vocoder:
    """The stand-in vocoder of ``folder``, strictly loaded, checked against the mel it gets."""
    vocoder_config = config["audio_config"]["vocoder_config"]
    if int(vocoder_config["num_mel_bins"]) != MELS or int(vocoder_config["hop_length"]) != 480:
        raise CheckpointError(
            f"role {role}: the stand-in vocoder takes {MELS} mel bins at hop 480; "
            f"{folder}'s vocoder_config has {vocoder_config}"
        )
    path = Path(folder) / STANDIN_PATH
    if not path.is_file():
        raise CheckpointError(
            f"role {role}: {STANDIN_PATH} missing from {folder} (the published HiFT vocoder, "
            "cosy24k_vocoder/hift.pt, is not implemented yet; only our stand-in is)"
        )
    model = Vocoder(MELS, CHANNELS, RATES)
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())

        def read(wanted: list[str]) -> dict[str, torch.Tensor]:
            return {n: f.get_tensor(n) for n in wanted}

        fill_strictly(model, names, read, "", role, path)
    return model.to(device).eval()


def to_pcm16(wave: torch.Tensor) -> bytes:
    """Raw little-endian PCM16 mono frames of a float waveform in [-1, 1]."""
    ints = (wave.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return ints.numpy().astype("<i2").tobytes()
