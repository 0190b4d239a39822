"""The HunyuanImage-3.0 backbone: one MoE decoder for text and for denoising image tokens.

GQA attention with QK-norm (RMSNorm over each q and k head, after rotary, as the reference
orders them), MoE MLPs (models/deepseek/moe.py: softmax top-k routing, one shared MLP) and 2D rotary
positions: rotary frequency i turns with the row (y) for even i and the column (x) for odd
i. A text token at position p sits at (p, p), where the 2D rotary equals the 1D one, so an
engine running text with 1D positions computes exactly the K/V of the 2D model.

`HunyuanImage3LM` is a `DecoderLM` (same forward, heads, embedding overrides, packing) with
its own layers, rotary and checkpoint names; `load_decoder` loads the backbone's tensors
from a HunyuanImage-3 folder and leaves the image parts (parts.py) alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from omniflow.models.deepseek.config import MLAConfig
from omniflow.models.deepseek.moe import MoE, MoEDecoderLM
from omniflow.models.hunyuan_image3.config import HunyuanImage3Config
from omniflow.models.layers.rope import RotaryEmbedding, apply_rotary
from omniflow.models.llama.config import DecoderConfig
from omniflow.models.llama.decoder import (
    Attention,
    AttentionFn,
    DecoderBody,
    RMSNorm,
    SwiGLU,
)

if TYPE_CHECKING:
    from omniflow.kernels import CpuKernels

# Checkpoint tensors of the image parts, which the backbone does not load.
IMAGE_PART_PREFIXES = (
    "vae.",
    "vision_model.",
    "vision_aligner.",
    "timestep_emb.",
    "patch_embed.",
    "time_embed.",
    "final_layer.",
    "time_embed_2.",
)


class Rotary2D(RotaryEmbedding):
    """cos/sin [tokens, head_dim] for positions [tokens] (text: (p, p)) or [tokens, 2] (y, x):
    the default frequencies (RotaryEmbedding's inv_freq), over 2D positions."""

    def __init__(self, config: HunyuanImage3Config):
        if config.head_dim % 4:
            raise ValueError(f"2D rotary needs head_dim divisible by 4, not {config.head_dim}")
        super().__init__(config)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions[:, None].expand(-1, 2)
        half = self.inv_freq.shape[0]
        axis = torch.arange(half, device=positions.device) % 2  # 0: y, 1: x
        freqs = positions.float()[:, axis] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class QKNormAttention(Attention):
    """Llama's attention with RMSNorm on each query and key head, after rotary."""

    def __init__(self, config: HunyuanImage3Config, layer_index: int):
        super().__init__(cast(DecoderConfig, config), layer_index)
        self.query_layernorm: RMSNorm | None = None
        self.key_layernorm: RMSNorm | None = None
        if config.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.reshape(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        if self.query_layernorm is not None and self.key_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous()  # like k (kv_write)
        out = attention(self.layer_index, q.contiguous(), k.contiguous(), v)
        return self.o_proj(out.reshape(tokens, self.q_size))


class HunyuanLayer(nn.Module):
    def __init__(self, config: HunyuanImage3Config, layer_index: int):
        super().__init__()
        self.self_attn = QKNormAttention(config, layer_index)
        moe = config.n_routed_experts > 1 and layer_index >= config.moe_layer_num_skipped
        # MoE reads the MoE fields by the names MLAConfig gives them.
        self.mlp: nn.Module = MoE(cast(MLAConfig, config)) if moe else SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class HunyuanBody(DecoderBody):
    def __init__(self, config: HunyuanImage3Config):
        super().__init__(config, HunyuanLayer)


# Checkpoint names -> ours (before the per-tensor rewrites below).
_RENAMES = (
    ("model.wte.", "model.embed_tokens."),
    ("model.ln_f.", "model.norm."),
    (".mlp.gate.wg.", ".mlp.gate."),
    (".mlp.shared_mlp.", ".mlp.shared_experts."),
    (".gate_and_up_proj.", ".gate_up_proj."),
)
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """The reference's fused [up; gate] (it computes up * silu(gate)) -> our [gate; up]."""
    up, gate = weight.chunk(2, dim=0)
    return torch.cat((gate, up))


class HunyuanImage3LM(MoEDecoderLM):
    config: HunyuanImage3Config
    # Block steps may give image rows (y, x) positions (engine/llm_engine.py).
    positions_2d = True
    # Block steps' hidden states come back before the final norm (forward's unnormed_from).
    block_rows_unnormed = True

    # DecoderLM.__init__ builds these: the body of HunyuanLayers, the 2D rotary.
    body_class = HunyuanBody
    rotary_class = Rotary2D

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """The CPU kernels' fused layers know Llama's layers only: PyTorch ops here (the
        engine's attention may still run on the kernels)."""
        self._kernels = None

    def materialized(self) -> None:
        """After `to_empty`: routers in float32 (the reference keeps them so), the MoE's
        unused score biases zeroed."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.gate.weight.data = module.gate.weight.data.float()
                module.e_score_correction_bias.zero_()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the backbone's tensors of a HunyuanImage-3 checkpoint into this module (the
        image parts' are skipped); returns the checkpoint names loaded."""
        if self.packed:
            raise RuntimeError("load_weights after use_packed_weights: load into a new model")
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.startswith(IMAGE_PART_PREFIXES) or "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue
            name = hf_name
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if name.endswith("gate_up_proj.weight"):
                tensor = _swap_halves(tensor)
            if name.endswith("self_attn.qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                tensor = self._qkv_from_groups(hf_name, tensor)
            expert = _EXPERT.match(name)
            if expert:
                base, index, which = expert.groups()
                target = f"{base}.{which}"
                if target not in params or int(index) >= params[target].shape[0]:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
                view = params[target][int(index)]
            elif name in params:
                view = params[name]
            else:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if tuple(view.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {list(tensor.shape)}, the model "
                    f"expects {list(view.shape)}"
                )
            with torch.no_grad():
                view.copy_(tensor.to(view.dtype))
            loaded.add(hf_name)
        return loaded

    def _qkv_from_groups(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The reference's fused qkv rows, per kv head [its q heads, k, v], -> [q; k; v]."""
        config = self.config
        kv, dim = config.num_key_value_heads, config.head_dim
        groups = config.num_attention_heads // kv
        if tensor.shape[0] != kv * (groups + 2) * dim:
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the model expects "
                f"{kv * (groups + 2) * dim} ({kv} kv heads x ({groups} q + k + v) x {dim})"
            )
        grouped = tensor.reshape(kv, groups + 2, dim, *tensor.shape[1:])
        q = grouped[:, :groups].reshape(kv * groups * dim, *tensor.shape[1:])
        k = grouped[:, groups].reshape(kv * dim, *tensor.shape[1:])
        v = grouped[:, groups + 1].reshape(kv * dim, *tensor.shape[1:])
        return torch.cat((q, k, v))

    def expected_checkpoint_names(self) -> set[str]:
        return backbone_checkpoint_names(self.config)


def qkv_to_groups(config: HunyuanImage3Config, q, k, v) -> torch.Tensor:
    """Our [q; k; v] rows -> the reference's per-kv-head grouping (for writing checkpoints)."""
    kv, dim = config.num_key_value_heads, config.head_dim
    groups = config.num_attention_heads // kv
    rest = q.shape[1:]
    grouped = torch.cat(
        (
            q.reshape(kv, groups, dim, *rest),
            k.reshape(kv, 1, dim, *rest),
            v.reshape(kv, 1, dim, *rest),
        ),
        dim=1,
    )
    return grouped.reshape(-1, *rest)


def backbone_checkpoint_names(config: HunyuanImage3Config) -> set[str]:
    """The checkpoint names of the backbone's tensors."""
    names = {"model.wte.weight", "model.ln_f.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        names |= {
            f"{prefix}.self_attn.qkv_proj.weight",
            f"{prefix}.self_attn.o_proj.weight",
            f"{prefix}.input_layernorm.weight",
            f"{prefix}.post_attention_layernorm.weight",
        }
        if config.qkv_bias:
            names |= {f"{prefix}.self_attn.qkv_proj.bias", f"{prefix}.self_attn.o_proj.bias"}
        if config.use_qk_norm:
            names |= {
                f"{prefix}.self_attn.query_layernorm.weight",
                f"{prefix}.self_attn.key_layernorm.weight",
            }
        if config.n_routed_experts > 1 and i >= config.moe_layer_num_skipped:
            names.add(f"{prefix}.mlp.gate.wg.weight")
            for e in range(config.n_routed_experts):
                for which in ("gate_and_up_proj", "down_proj"):
                    names.add(f"{prefix}.mlp.experts.{e}.{which}.weight")
            if config.n_shared_experts:
                for which in ("gate_and_up_proj", "down_proj"):
                    names.add(f"{prefix}.mlp.shared_mlp.{which}.weight")
        else:
            names |= {f"{prefix}.mlp.gate_and_up_proj.weight", f"{prefix}.mlp.down_proj.weight"}
    return names
