"""LongCat-Next's audio tokenizer in the published layout.

``model.audio_tokenizer.``:
  ``audio_model.*``   a Whisper encoder: ``conv1``, ``conv2`` (stride 2), sinusoid
                      ``positional_embedding``, ``layers.N`` (transformers' ``WhisperEncoderLayer``
                      names: ``self_attn.{q,k,v,out}_proj`` with k unbiased, ``fc1``, ``fc2``,
                      the two layer norms), ``layer_norm``; run on any length (no 30 s padding);
  ``audio_bridge_model.*``  Conv1d ``gate_proj``/``up_proj`` (kernel = stride = ``avg_pooler``),
                      ``down_proj``, ``layer_norm`` over SiLU(g)*u + the pooled input, then RVQ
                      ``vq_list.i.codebook.{embed, embed_avg, cluster_size}`` (nearest by L2),
                      and ``proj_decoder`` (code sum → d_model, for the audio decoder).
Codes enter the LLM as summed rows of ``model.embed_tokens`` from ``audio_offset`` on, level by
level; the audio role reads only that region.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.audio_utils import mel_filter_bank
from transformers.models.whisper.configuration_whisper import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

from omniflow.models.omni.checkpoint import CheckpointError, load_part, read_config, read_index
from omniflow.models.omni.mel import LogMel
from omniflow.models.omni.next_codes import AUDIO_PREFIX, code_offsets, load_code_rows, sinusoids

PREFIX = AUDIO_PREFIX
_OWN_KEYS = ("vq_config", "vocoder_config", "flow_matching_config", "cosy24kvocoder_config")
HOP = 160
N_FFT = 400


@dataclass
class NextAudioInfo:
    sample_rate: int
    pool: int
    codebook_sizes: list[int]
    hidden_size: int

    @property
    def samples_per_token(self) -> int:
        return HOP * 2 * self.pool


class WhisperMel(LogMel):
    """Whisper's log-mel: our STFT front end with Whisper's Slaney filterbank."""

    def __init__(self, sample_rate: int, n_mels: int) -> None:
        super().__init__(sample_rate, N_FFT, HOP, n_mels)
        bank = mel_filter_bank(
            num_frequency_bins=N_FFT // 2 + 1,
            num_mel_filters=n_mels,
            min_frequency=0.0,
            max_frequency=sample_rate / 2,
            sampling_rate=sample_rate,
            norm="slaney",
            mel_scale="slaney",
        )
        self.filters = torch.from_numpy(bank.T.copy()).float()


def whisper_config(config: dict[str, Any]) -> WhisperConfig:
    raw = {k: v for k, v in config["audio_config"].items() if k not in _OWN_KEYS}
    wconf = WhisperConfig(**raw)
    wconf._attn_implementation = "sdpa"
    return wconf


class AudioModel(nn.Module):
    positional_embedding: torch.Tensor

    def __init__(self, wconf: WhisperConfig) -> None:
        super().__init__()
        d = wconf.d_model
        self.conv1 = nn.Conv1d(wconf.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(wconf.max_source_positions, d))
        self.layers = nn.ModuleList(WhisperEncoderLayer(wconf) for _ in range(wconf.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, frames // 2, d] of log-mel [B, n_mels, frames]."""
        x = nn.functional.gelu(self.conv1(mel))
        x = nn.functional.gelu(self.conv2(x)).transpose(1, 2)
        if x.shape[1] > self.positional_embedding.shape[0]:
            raise ValueError(
                f"audio of {x.shape[1]} encoder frames exceeds max_source_positions "
                f"{self.positional_embedding.shape[0]}"
            )
        x = (x.float() + self.positional_embedding[: x.shape[1]]).to(x.dtype)
        for layer in self.layers:
            x = layer(x, None)
        return self.layer_norm(x)


class Codebook(nn.Module):
    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(n, dim) * 0.5)
        self.embed_avg = nn.Parameter(torch.zeros(n, dim))
        self.cluster_size = nn.Parameter(torch.zeros(n))


class VectorQuantize(nn.Module):
    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.codebook = Codebook(n, dim)


class AudioBridge(nn.Module):
    def __init__(self, d: int, pool: int, sizes: list[int]) -> None:
        super().__init__()
        inner = d * pool
        self.pool = pool
        self.gate_proj = nn.Conv1d(d, inner, pool, stride=pool, bias=False)
        self.up_proj = nn.Conv1d(d, inner, pool, stride=pool, bias=False)
        self.down_proj = nn.Linear(inner, inner, bias=False)
        self.layer_norm = nn.LayerNorm(inner)
        self.proj_decoder = nn.Linear(inner, d)
        self.vq_list = nn.ModuleList(VectorQuantize(n, inner) for n in sizes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features [B, ceil(T / pool), d * pool] of encoder states [B, T, d]."""
        batch, length, _ = x.shape
        pad = (-length) % self.pool
        x = nn.functional.pad(x, (0, 0, 0, pad))
        xt = x.transpose(1, 2)
        g = self.gate_proj(xt).transpose(1, 2)
        u = self.up_proj(xt).transpose(1, 2)
        pooled = x.reshape(batch, -1, self.layer_norm.normalized_shape[0])
        return self.layer_norm(self.down_proj(nn.functional.silu(g) * u) + pooled)

    @torch.no_grad()
    def quantize(self, feats: torch.Tensor) -> torch.Tensor:
        """Residual VQ ids [N, L] of features [N, d * pool]."""
        residual = feats.float().clone()
        ids = []
        for vq in self.vq_list:
            assert isinstance(vq, VectorQuantize)
            book = vq.codebook.embed.float()
            dist = (
                residual.pow(2).sum(-1, keepdim=True)
                + book.pow(2).sum(-1)[None]
                - 2.0 * residual @ book.t()
            )
            level = dist.argmin(-1)
            residual = residual - book[level]
            ids.append(level)
        return torch.stack(ids, -1).to(torch.int64)


class NextAudioTokenizer(nn.Module):
    """``model.audio_tokenizer`` of a LongCat-Next checkpoint (random until loaded)."""

    offsets: torch.Tensor

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        wconf = whisper_config(config)
        audio = config["audio_config"]
        sizes = [int(n) for n in audio["vq_config"]["codebook_sizes"]]
        pool = int(audio.get("avg_pooler", 4))
        hidden = int(config["hidden_size"])
        self.config = NextAudioInfo(int(audio.get("sampling_rate", 16000)), pool, sizes, hidden)
        self.mel = WhisperMel(self.config.sample_rate, wconf.num_mel_bins)
        self.audio_model = AudioModel(wconf)
        self.audio_bridge_model = AudioBridge(wconf.d_model, pool, sizes)
        self.code_rows = nn.Embedding(sum(sizes), hidden)  # loaded from model.embed_tokens
        self.first_row = int(config["audio_offset"])
        self.register_buffer("offsets", code_offsets(0, sizes), persistent=False)

    def tokens_for(self, samples: int) -> int:
        return max(1, -(-samples // self.config.samples_per_token))

    @torch.no_grad()
    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """RVQ ids [tokens, L] of a 16 kHz mono waveform [T] in [-1, 1]."""
        if wave.dim() != 1 or wave.numel() == 0:
            raise ValueError(f"expected a non-empty mono waveform [T], got {list(wave.shape)}")
        tokens = self.tokens_for(wave.shape[0])
        need = tokens * self.config.samples_per_token
        wave = nn.functional.pad(wave.float(), (0, need - wave.shape[0]))
        mel = self.mel(wave)[None].to(self.audio_model.conv1.weight.dtype)
        feats = self.audio_bridge_model.features(self.audio_model(mel))[0]
        return self.audio_bridge_model.quantize(feats[:tokens])

    @torch.no_grad()
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """LLM input vectors [N, hidden]: the sum of each level's word-embedding row."""
        return self.code_rows(codes.to(self.offsets.device) + self.offsets).sum(1)


def load_next_audio(folder: str | Path, device: str = "cpu") -> NextAudioTokenizer:
    """The audio tokenizer of a published-layout folder, strictly loaded."""
    role = "audio_encoder"
    model = NextAudioTokenizer(read_config(folder, role))
    load_part(model.audio_model, folder, PREFIX + "audio_model.", role)
    load_part(model.audio_bridge_model, folder, PREFIX + "audio_bridge_model.", role)
    # the audio decoder role's parts (next_audio_decoder.py) may sit beside them
    parts = (
        "audio_model.",
        "audio_bridge_model.",
        "audio_decoder.",
        "audio_flow_matching_decoder.",
    )
    for name in read_index(folder, role):
        if name.startswith(PREFIX) and not name[len(PREFIX) :].startswith(parts):
            raise CheckpointError(f"role {role}: unexpected tensor {name} in {folder}")
    load_code_rows(model.code_rows, folder, model.first_row, role)
    return model.to(device).eval()
