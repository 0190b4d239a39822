"""LongCat-Next's audio decoder, codes → coarse hidden states → mel, in the published layout.

Names and equations follow the checkpoint's ``modular_longcat_next_audio.py``
(``LongcatNextAudioTokenizer.decode``):

1. ``model.audio_tokenizer.audio_bridge_model`` (shared with the audio tokenizer): the rows
   ``vq_list.i.codebook.embed[id_i]`` are summed (in float32, last level first) and projected
   by ``proj_decoder`` to ``d_model``: one vector per token.
2. ``model.audio_tokenizer.audio_decoder`` (``LongcatNextAudioDecoder``): ``dconv1`` (a
   ``ConvTranspose1d`` of kernel ``decoder_kernel_size``, stride ``avg_pooler``, then
   ``GroupNorm(1)`` over the whole chunk, then the right ``kernel - stride`` frames cut), the
   sinusoid ``positional_embedding`` added, ``decoder_layers`` causal Whisper-style layers
   (``OmniWhisperTransformerLayer``: pre-LayerNorm, ``k_proj`` unbiased, causal attention),
   ``layer_norm``; then ``dconv2`` (stride ``decoder_stride_size``, to ``num_mel_bins``) and
   ``post_net`` (``MelSpecRefineNet``: nearest resize to the vocoder's frame rate, Conv1d(5) +
   GroupNorm(1) + Mish per ``vocoder_config.channels[:-1]``, a 1x1 projector, plus the input).
3. ``model.audio_tokenizer.audio_flow_matching_decoder`` (``next_flow_mel.py``): the prenet
   takes the hidden states before ``dconv2`` when ``use_hidden_states_before_dconv2``, else
   the refined mel, and the conditional flow matching makes the 80-bin mel.

Nothing here is causal across a chunk (``GroupNorm`` normalises over time, ``post_net`` looks
two frames ahead): a chunk is decoded as the published code decodes one audio segment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from omniflow.models.omni.checkpoint import (
    CheckpointError,
    fill_strictly,
    read_config,
    read_index,
    read_tensors,
)
from omniflow.models.omni.next_codes import AUDIO_PREFIX as PREFIX
from omniflow.models.omni.next_codes import sinusoids
from omniflow.models.omni.next_flow_mel import FlowMelDecoder, WhisperLayer

F = nn.functional
BRIDGE = PREFIX + "audio_bridge_model."
DECODER = PREFIX + "audio_decoder."
FLOW = PREFIX + "audio_flow_matching_decoder."


class CausalDeconv(nn.Module):
    """``CasualConvTranspose1d``: ConvTranspose1d + GroupNorm(1), the right overhang cut."""

    def __init__(self, channels: int, out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels, out, kernel, stride)
        self.norm = nn.GroupNorm(1, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, L] → [B, out, (L - 1) * stride + min(kernel, stride)]."""
        kernel, stride = self.conv.kernel_size[0], self.conv.stride[0]
        y = self.norm(self.conv(x))
        cut = max(0, kernel - stride)
        return y[:, :, : y.shape[-1] - cut]


class MelRefine(nn.Module):
    """``post_net`` (``MelSpecRefineNet``)."""

    def __init__(self, audio: dict[str, Any]) -> None:
        super().__init__()
        vocoder = audio["vocoder_config"]
        mels = int(vocoder["num_mel_bins"])
        layers: list[nn.Module] = []
        width = mels
        for out in vocoder["channels"][:-1]:
            layers += [nn.Conv1d(width, int(out), 5, 1, 2), nn.GroupNorm(1, int(out)), nn.Mish()]
            width = int(out)
        layers.append(nn.Conv1d(width, mels, 1, 1))
        self.layers = nn.Sequential(*layers)
        # compute_output_length's factors, applied in float32 as published
        self.factors = (
            float(audio["hop_length"]),
            float(audio["sampling_rate"]),
            float(vocoder["sampling_rate"]),
            float(vocoder["hop_length"]),
        )

    def frames(self, length: int) -> int:
        hop, rate, voc_rate, voc_hop = self.factors
        n = torch.tensor([length], dtype=torch.float32) * hop / rate
        return int((n * voc_rate / voc_hop).to(torch.int64))

    def forward(self, coarse: torch.Tensor) -> torch.Tensor:
        """[B, mels, L] → refined [B, mels, frames(L)]."""
        size = self.frames(coarse.shape[-1])
        coarse = F.interpolate(coarse.float(), size=size, mode="nearest").to(coarse.dtype)
        return self.layers(coarse) + coarse


class AudioDecoderNet(nn.Module):
    """``model.audio_tokenizer.audio_decoder``."""

    positional_embedding: torch.Tensor

    def __init__(self, audio: dict[str, Any]) -> None:
        super().__init__()
        d = int(audio["d_model"])
        kernel = int(audio["decoder_kernel_size"])
        mels = int(audio["vocoder_config"]["num_mel_bins"])
        rows = int(audio["max_audio_seconds"]) * int(audio["sampling_rate"])
        rows //= int(audio["hop_length"])
        self.dconv1 = CausalDeconv(d, d, kernel, int(audio["avg_pooler"]))
        self.register_buffer("positional_embedding", sinusoids(rows, d))
        self.layers = nn.ModuleList(
            WhisperLayer(
                d,
                int(audio["decoder_attention_heads"]),
                int(audio["decoder_ffn_dim"]),
                audio["activation_function"],
            )
            for _ in range(int(audio["decoder_layers"]))
        )
        self.layer_norm = nn.LayerNorm(d)
        self.dconv2 = CausalDeconv(d, mels, kernel, int(audio["decoder_stride_size"]))
        self.post_net = MelRefine(audio)

    def hidden(self, embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states before ``dconv2`` [B, T, d] of token vectors [B, n, d]."""
        x = self.dconv1(embeds.transpose(1, 2)).transpose(1, 2)
        rows = self.positional_embedding.shape[0]
        if x.shape[1] > rows:
            raise ValueError(f"{x.shape[1]} decoder frames exceed positional_embedding's {rows}")
        x = (x.float() + self.positional_embedding[: x.shape[1]]).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)

    def refined_mel(self, hidden: torch.Tensor) -> torch.Tensor:
        """``post_net(dconv2(hidden))`` [B, mels, frames] of hidden states [B, T, d]."""
        return self.post_net(self.dconv2(hidden.transpose(1, 2)))


class NextAudioDecoder(nn.Module):
    """Codes [n, L] → 80-bin mel [frames, 80], the published decode path before the vocoder."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        audio = config["audio_config"]
        self.codebook_sizes = [int(n) for n in audio["vq_config"]["codebook_sizes"]]
        inner = int(audio["d_model"]) * int(audio["avg_pooler"])
        self.codebooks = nn.ParameterList(
            nn.Parameter(torch.zeros(n, inner), requires_grad=False) for n in self.codebook_sizes
        )
        self.proj_decoder = nn.Linear(inner, int(audio["d_model"]))
        self.audio_decoder = AudioDecoderNet(audio)
        self.audio_flow_matching_decoder = FlowMelDecoder(audio["flow_matching_config"])
        self.use_hidden = bool(audio["flow_matching_config"]["use_hidden_states_before_dconv2"])
        # the most tokens one decode takes: dconv1 makes avg_pooler frames a token, and each
        # frame needs a positional_embedding row
        rows = self.audio_decoder.positional_embedding.shape[0]
        self.max_tokens = rows // int(audio["avg_pooler"])

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``audio_bridge_model.decode``: token vectors [n, d_model] of codes [n, L]."""
        total = sum(self.codebooks[i][codes[:, i]].float() for i in reversed(range(codes.shape[1])))
        assert isinstance(total, torch.Tensor)
        return self.proj_decoder(total.to(self.proj_decoder.weight.dtype))

    def condition(self, codes: torch.Tensor) -> torch.Tensor:
        """What the flow decoder's prenet reads, [1, T, D], for codes [n, L]."""
        hidden = self.audio_decoder.hidden(self.embed(codes)[None])
        if self.use_hidden:
            return hidden
        return self.audio_decoder.refined_mel(hidden).transpose(1, 2)

    @torch.no_grad()
    def mel(self, codes: torch.Tensor, noise: torch.Generator | torch.Tensor) -> torch.Tensor:
        """Mel [frames, 80] of one chunk of codes [n, L]; ``noise`` is the flow's start
        (a generator to draw it, or the tensor [1, 80, frames] itself)."""
        if codes.dim() != 2 or codes.shape[0] == 0 or codes.shape[1] != len(self.codebook_sizes):
            raise ValueError(f"expected codes [n >= 1, {len(self.codebook_sizes)}]")
        device = self.proj_decoder.weight.device
        flow = self.audio_flow_matching_decoder
        return flow.generate(self.condition(codes.to(device)), noise)[0].t()


def load_next_audio_decoder(
    folder: str | Path, role: str = "audio_decoder", device: str = "cpu"
) -> NextAudioDecoder:
    """The audio decoder of a published-layout folder: every tensor under ``audio_decoder.``
    and ``audio_flow_matching_decoder.``, strictly, plus the bridge's codebooks and
    ``proj_decoder``."""
    folder = Path(folder)
    try:
        model = NextAudioDecoder(read_config(folder, role))
    except KeyError as missing:
        raise CheckpointError(
            f"role {role}: {folder}/config.json: audio_config lacks {missing} (a tiny folder "
            "built by an omniflow before the published audio decoder lacks it: remove the "
            "folder and build_tiny writes a new one)"
        ) from None
    weight_map = read_index(folder, role)
    stored = set(weight_map)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        return read_tensors(folder, names, role, weight_map)

    fill_strictly(model.audio_decoder, stored, read, DECODER, role, folder)
    fill_strictly(model.audio_flow_matching_decoder, stored, read, FLOW, role, folder)
    names = [f"{BRIDGE}vq_list.{i}.codebook.embed" for i in range(len(model.codebook_sizes))]
    names += [BRIDGE + "proj_decoder.weight", BRIDGE + "proj_decoder.bias"]
    tensors = read(names)
    targets = [*model.codebooks, model.proj_decoder.weight, model.proj_decoder.bias]
    with torch.no_grad():
        for name, target in zip(names, targets, strict=True):
            got = tensors[name]
            if tuple(got.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"role {role}: tensor {name} in {folder} has shape {list(got.shape)}, "
                    f"expected {list(target.shape)}"
                )
            target.copy_(got.to(target.dtype))
    return model.to(device).eval()
