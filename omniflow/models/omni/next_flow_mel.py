"""LongCat-Next's flow-matching mel decoder, ``audio_flow_matching_decoder``, published layout.

From the checkpoint's ``modular_longcat_next_audio.py`` (``LongcatNextAudioFlowMatchingDecoder``,
CosyVoice's ``ConditionalDecoder`` / ``ConditionalCFM``), keys of ``flow_matching_config``:

* ``prenet`` (``FlowmatchingPrenet``): nearest resize by ``prenet_target_mel_length_scale_ratio``,
  ``in_mlp`` (Linear, SiLU, Linear), ``prenet_nlayers`` causal Whisper-style layers with
  RMSNorm, ``final_norm`` (RMSNorm), ``out_proj`` (no bias) to ``in_channels`` = mu. Its
  ``positional_embedding`` is stored but unused by the published forward, as here.
* ``conditional_decoder``: a 1-D U-Net over [x; mu] (``spk_emb_dim`` extra channels, 0 here)
  with a sinusoid time embedding (scale 1000) → ``time_mlp`` (``linear_1``, SiLU, ``linear_2``);
  ``down_blocks`` / ``mid_blocks`` / ``up_blocks`` of [causal ResNet block, transformer blocks,
  resample], causal convolutions (left padding), LayerNorm in the blocks, attention masked to
  blocks of 100 frames (``static_chunk_size``), ``final_block``, ``final_proj``.
* ``cfm``: Euler steps over ``diffusion_steps`` (a cosine ``t_scheduler`` bends the times) from
  Gaussian noise, with classifier-free guidance ``inference_cfg_rate`` against mu = 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from omniflow.models.omni.next_codes import sinusoids

F = nn.functional
CHUNK = 2 * 25 * 2  # ConditionalDecoder.static_chunk_size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)  # as published: normalise in float32, then cast
        return self.weight * h


class WhisperAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in projections)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": functools.partial(nn.GELU, approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
}


def activation(name: str) -> nn.Module:
    """The activation a config names, as transformers' ``ACT2FN`` reads it; the common
    ones without importing transformers (seconds at every audio decoder start)."""
    make = _ACTIVATIONS.get(name)
    if make is not None:
        return make()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class WhisperLayer(nn.Module):
    """``OmniWhisperTransformerLayer`` with causal attention (LayerNorm or RMSNorm)."""

    def __init__(self, dim: int, heads: int, ffn: int, act: str, rms: bool = False) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(dim, heads)
        self.self_attn_layer_norm: nn.Module = RMSNorm(dim) if rms else nn.LayerNorm(dim)
        self.act = activation(act)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm: nn.Module = RMSNorm(dim) if rms else nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Prenet(nn.Module):
    positional_embedding: torch.Tensor

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        d = int(c["prenet_d_model"])
        self.ratio = float(c["prenet_target_mel_length_scale_ratio"])
        self.register_buffer(
            "positional_embedding", sinusoids(int(c["prenet_max_source_positions"]), d)
        )
        self.in_mlp = nn.Sequential(
            nn.Linear(int(c["prenet_in_dim"]), 4 * d), nn.SiLU(), nn.Linear(4 * d, d)
        )
        heads, ffn, act = (
            int(c["prenet_attention_heads"]),
            int(c["prenet_ffn_dim"]),
            c["prenet_activation_function"],
        )
        self.transformer_layers = nn.ModuleList(
            WhisperLayer(d, heads, ffn, act, rms=True) for _ in range(int(c["prenet_nlayers"]))
        )
        self.final_norm = RMSNorm(d)
        self.out_proj = nn.Linear(d, int(c["prenet_out_dim"]), bias=False)

    def frames(self, length: int) -> int:
        return int(torch.tensor([float(length)]).mul(self.ratio).to(torch.int64))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """mu [B, prenet_out_dim, frames] of features [B, T, prenet_in_dim]."""
        size = self.frames(feats.shape[1])
        x = F.interpolate(feats.float().transpose(1, 2), size=size, mode="nearest")
        x = self.in_mlp(x.transpose(1, 2).to(feats.dtype))
        for layer in self.transformer_layers:
            x = layer(x)
        return self.out_proj(self.final_norm(x)).transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, out, 3), Transpose(), nn.LayerNorm(out), Transpose(), nn.Mish()
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnet(nn.Module):
    def __init__(self, dim: int, out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, out))
        self.block1 = CausalBlock(dim, out)
        self.block2 = CausalBlock(out, out)
        self.res_conv = nn.Conv1d(dim, out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(t)[..., None]
        return self.block2(h, mask) + self.res_conv(x * mask)


class Attention(nn.Module):
    """diffusers' ``Attention`` as the blocks use it: unbiased q/k/v, ``to_out.0``."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2)
            for p in (self.to_q, self.to_k, self.to_v)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        return self.to_out[0](y.transpose(1, 2).reshape(b, t, -1))


class GELUProj(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, act: str) -> None:
        super().__init__()
        if act != "gelu":
            raise ValueError(f"flow_matching_config.act_fn {act!r}: only 'gelu' is implemented")
        self.net = nn.ModuleList([GELUProj(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    """diffusers-style ``BasicTransformerBlock`` (layer_norm, self-attention only)."""

    def __init__(self, dim: int, heads: int, head_dim: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, act)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


class Downsample(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def chunk_bias(mask: torch.Tensor) -> torch.Tensor:
    """Additive attention bias [B, T, T]: key j is seen by query i when it is valid and in
    i's block of ``CHUNK`` frames or before (``add_optional_chunk_mask`` + ``mask_to_bias``)."""
    t = mask.shape[-1]
    pos = torch.arange(t, device=mask.device)
    seen = pos[None, :] < ((pos // CHUNK + 1) * CHUNK)[:, None]
    allowed = mask.bool() & seen[None]
    return (1.0 - allowed.to(mask.dtype)) * torch.finfo(mask.dtype).min


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``SinusoidalPosEmb`` (scale 1000) of times [B] → [B, dim]."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = 1000 * t.reshape(-1, 1) * freqs[None]
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


class TimeMLP(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, out)
        self.linear_2 = nn.Linear(out, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def _parts(stage: nn.Module) -> list[nn.Module]:
    assert isinstance(stage, nn.ModuleList)
    return list(stage)


def _blocks(dim: int, c: dict[str, Any]) -> nn.ModuleList:
    heads, head_dim = int(c["num_heads"]), int(c["attention_head_dim"])
    return nn.ModuleList(
        TransformerBlock(dim, heads, head_dim, c["act_fn"]) for _ in range(int(c["n_blocks"]))
    )


class ConditionalDecoder(nn.Module):
    """The U-Net estimator of the flow's velocity (causal, as the published one is built)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        mels = int(c["in_channels"])
        channels = [int(n) for n in c["channels"]]
        width = 2 * mels + int(c.get("spk_emb_dim", 0))
        self.width = width
        time_dim = 4 * channels[0]
        self.time_mlp = TimeMLP(width, time_dim)
        self.down_blocks = nn.ModuleList()
        out = width
        for i, ch in enumerate(channels):
            last = i == len(channels) - 1
            down = CausalConv1d(ch, ch, 3) if last else Downsample(ch)
            self.down_blocks.append(
                nn.ModuleList([CausalResnet(out, ch, time_dim), _blocks(ch, c), down])
            )
            out = ch
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnet(out, out, time_dim), _blocks(out, c)])
            for _ in range(int(c["num_mid_blocks"]))
        )
        ups = channels[::-1] + [channels[0]]
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            last = i == len(ups) - 2
            up = CausalConv1d(ups[i + 1], ups[i + 1], 3) if last else Upsample(ups[i + 1])
            self.up_blocks.append(
                nn.ModuleList(
                    [CausalResnet(2 * ups[i], ups[i + 1], time_dim), _blocks(ups[i + 1], c), up]
                )
            )
        self.final_block = CausalBlock(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], mels, 1)

    @staticmethod
    def _attend(
        x: torch.Tensor, mask: torch.Tensor, blocks: nn.Module, biases: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        bias = biases.get(mask.shape[-1])
        if bias is None:
            bias = biases[mask.shape[-1]] = chunk_bias(mask)
        h = x.transpose(1, 2)
        for block in _parts(blocks):
            h = block(h, bias)
        return h.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        biases: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Velocity [B, mels, T] at x [B, mels, T], mask [B, 1, T], mu [B, mels, T], t [].
        ``biases``: the attention biases of ``mask`` by length, kept across the steps of
        one generation (the mask is the same at every step)."""
        biases = {} if biases is None else biases
        temb = self.time_mlp(time_embedding(t, self.width).to(x.dtype))
        x = torch.cat([x, mu], dim=1)
        hiddens, masks = [], [mask]
        for resnet, blocks, down in map(_parts, self.down_blocks):
            m = masks[-1]
            x = self._attend(resnet(x, m, temb), m, blocks, biases)
            hiddens.append(x)
            x = down(x * m)
            masks.append(m[:, :, ::2])
        masks.pop()
        m = masks[-1]
        for resnet, blocks in map(_parts, self.mid_blocks):
            x = self._attend(resnet(x, m, temb), m, blocks, biases)
        for resnet, blocks, up in map(_parts, self.up_blocks):
            m = masks.pop()
            skip = hiddens.pop()
            x = torch.cat([x[:, :, : skip.shape[-1]], skip], dim=1)
            x = up(self._attend(resnet(x, m, temb), m, blocks, biases) * m)
        x = self.final_block(x, m)
        return self.final_proj(x * m) * mask


class FlowMelDecoder(nn.Module):
    """``audio_flow_matching_decoder``: prenet → mu, then Euler steps of the CFM."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.prenet = Prenet(c)
        self.conditional_decoder = ConditionalDecoder(c)
        self.steps = int(c["diffusion_steps"])
        cfm = c["cfm_params"]
        self.cosine = cfm.get("t_scheduler") == "cosine"
        self.cfg_rate = float(cfm.get("inference_cfg_rate", 0.0))
        self.temperature = 1.0

    def times(self) -> torch.Tensor:
        t = torch.linspace(0, 1, self.steps + 1)
        return 1 - torch.cos(t * 0.5 * torch.pi) if self.cosine else t

    def generate(self, feats: torch.Tensor, noise: torch.Generator | torch.Tensor) -> torch.Tensor:
        """Mel [1, mels, frames] of prenet features [1, T, prenet_in_dim]."""
        mu = self.prenet(feats)
        if isinstance(noise, torch.Generator):
            x = torch.randn(mu.shape, generator=noise).to(mu) * self.temperature
        else:
            if tuple(noise.shape) != tuple(mu.shape):
                raise ValueError(f"noise {list(noise.shape)} != mu {list(mu.shape)}")
            x = noise.to(mu)
        mask = torch.ones_like(mu[:, :1])
        span = self.times().to(mu.dtype)
        estimator = self.conditional_decoder
        t, dt = span[0], span[1] - span[0]
        guided = self.cfg_rate > 0
        biases: dict[int, torch.Tensor] = {}  # one mask for every step: its biases once
        if guided:  # the conditional and unconditional halves in one batch, as CosyVoice
            mask, mu = torch.cat([mask, mask]), torch.cat([mu, torch.zeros_like(mu)])
        for step in range(1, len(span)):
            if guided:
                v, uncond = estimator(torch.cat([x, x]), mask, mu, t, biases).chunk(2)
                v = (1.0 + self.cfg_rate) * v - self.cfg_rate * uncond
            else:
                v = estimator(x, mask, mu, t, biases)
            x = x + dt * v
            t = t + dt
            if step < len(span) - 1:
                dt = span[step + 1] - t
        return x
