"""Multi-head latent attention (DeepSeek-V2, LongCat-Flash) in its absorbed form.

Per token the layer makes a latent of kv_lora_rank values and one rotary key of
qk_rope_head_dim shared by all heads; only those reach the `AttentionFn`, as a single
"kv head" [latent ‖ rotary key]. kv_b_proj is never applied to the context: its key half
(w_kc) is folded into the query and its value half (w_vc) into the output, so attention is
MQA over the latent, prefill and decode alike, and the cache holds the latent alone.
"""

from __future__ import annotations

import torch
from torch import nn

from omniflow.models.deepseek.config import MLAConfig
from omniflow.models.layers.rope import RotaryEmbedding
from omniflow.models.llama.decoder import AttentionFn, RMSNorm

# transformers builds q_a_layernorm and kv_a_layernorm with its default eps, not the config's.
LORA_NORM_EPS = 1e-6


class Weight(nn.Module):
    """A bare weight under a Hugging Face module name: read in slices, never as an nn.Linear
    (so CPU weight packing leaves it dense)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class InterleavedRotary(RotaryEmbedding):
    """DeepSeek's rotary: pairs (x0, x1), (x2, x3), ... each rotated by one frequency."""

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [tokens, rope_dim / 2] whatever the model's dtype: transformers
        rotates DeepSeek's rotary dims in float32."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, rope_dim] -> rotated, evens then odds: the same dot products as the
    interleaved layout (queries and keys are permuted alike), without interleaving back."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MLAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = heads = config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        q_size = heads * config.qk_head_dim
        self.q_proj: nn.Module | None = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS)
        self.kv_b_proj = Weight(heads * (self.nope + self.v_head_dim), self.rank)
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=config.o_bias)
        # LongCat-Flash scales the low-rank query and latent up to the hidden width.
        self.q_scale = self.kv_scale = 1.0
        if config.is_longcat and config.q_lora_rank is not None:
            self.q_scale = (hidden / config.q_lora_rank) ** 0.5
            self.kv_scale = (hidden / self.rank) ** 0.5

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w_kc [heads, nope, rank] and w_vc [heads, v_head_dim, rank], views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        if self.q_scale != 1.0:
            q_nope, q_pe, latent = (
                q_nope * self.q_scale,
                q_pe * self.q_scale,
                latent * self.kv_scale,
            )
        q_pe = rotate_pairs(q_pe, cos, sin)
        k_pe = rotate_pairs(k_pe[:, None], cos, sin)
        w_kc, w_vc = self._split_kv_b()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc)  # [heads, tokens, rank]
        query = torch.cat((q_latent.transpose(0, 1), q_pe), dim=-1)
        key = torch.cat((latent[:, None], k_pe), dim=-1)  # [tokens, 1, rank + rope]
        out = attention(self.layer_index, query, key, key[..., : self.rank])
        out = torch.bmm(out.transpose(0, 1), w_vc.transpose(1, 2))  # [heads, tokens, v]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, -1))


def latent_causal_attention(scale: float) -> AttentionFn:
    """Causal attention over one sequence for MLA's query [T, H, D] and latent keys
    [T, 1, D] / values [T, 1, rank]: the plain reference (no pages)."""

    def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        scores = torch.einsum("thd,sd->hts", q, k[:, 0]) * scale
        mask = torch.ones(scores.shape[1:], dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).float().softmax(-1).to(v.dtype)
        return torch.einsum("hts,sr->thr", probs, v[:, 0])

    return attend
