"""DeepSeek-V2 and LongCat-Flash decoders: MLA attention with dense or MoE MLPs.

`MLADecoderLM` is a `DecoderLM` (same forward, heads, embedding overrides and packing), with
its own layers, rotary and weight names. Its attention hands the `AttentionFn` one latent
kv head (see mla.py), so the engine must pair it with latent pages (`MLAConfig`). On the CPU
kernels (bf16 on CPU, `use_cpu_kernels`) each layer's norms run with their residual adds and
every MLP's silu * up (dense, shared and routed experts) in one pass; the attention's own
projections and low-rank norms stay PyTorch ops, and the engine's latent attention reads
decode rows' pages on the kernels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from omniflow.models.deepseek.config import MLAConfig
from omniflow.models.deepseek.mla import InterleavedRotary, MLAttention, latent_causal_attention
from omniflow.models.deepseek.moe import MoE, MoEDecoderLM
from omniflow.models.llama.decoder import AttentionFn, DecoderBody, RMSNorm, SwiGLU
from omniflow.models.omni.ngram import NgramEmbedding

if TYPE_CHECKING:
    from omniflow.kernels import CpuKernels


class DeepseekLayer(nn.Module):
    def __init__(self, config: MLAConfig, layer_index: int):
        super().__init__()
        self.self_attn = MLAttention(config, layer_index)
        dense = layer_index < config.first_k_dense_replace or not config.n_routed_experts
        self.mlp: nn.Module = SwiGLU(config) if dense else MoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self, x, delta, cos, sin, attention: AttentionFn, kernels: CpuKernels
    ) -> torch.Tensor:
        """DecoderLayer.forward_fused's contract: x updated in place with the last layer's
        `delta` and this layer's attention; returns this layer's MLP output."""
        norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        attended = self.self_attn(h, cos, sin, attention)
        h = kernels.add_rms_norm(x, attended, post_norm.weight, post_norm.eps)
        return _mlp_fused(self.mlp, h, kernels)


class LongcatLayer(nn.Module):
    """Two attention + dense MLP sublayers, and an MoE on the first MLP's input whose output
    joins the residual at the end of the layer (the shortcut)."""

    def __init__(self, config: MLAConfig, layer_index: int):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = nn.ModuleList(MLAttention(config, 2 * layer_index + i) for i in (0, 1))
        self.mlps = nn.ModuleList(SwiGLU(config) for _ in (0, 1))
        self.mlp = MoE(config)
        self.input_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in (0, 1))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in (0, 1))

    def forward(self, x, cos, sin, attention: AttentionFn) -> torch.Tensor:
        x = x + self.self_attn[0](self.input_layernorm[0](x), cos, sin, attention)
        h = self.post_attention_layernorm[0](x)
        shortcut = self.mlp(h)
        x = x + self.mlps[0](h)
        x = x + self.self_attn[1](self.input_layernorm[1](x), cos, sin, attention)
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut

    def forward_fused(
        self, x, delta, cos, sin, attention: AttentionFn, kernels: CpuKernels
    ) -> torch.Tensor:
        """DeepseekLayer.forward_fused for LongCat's two sublayers and shortcut MoE."""
        norms = cast("list[RMSNorm]", self.input_layernorm)
        posts = cast("list[RMSNorm]", self.post_attention_layernorm)
        h = kernels.add_rms_norm(x, delta, norms[0].weight, norms[0].eps)
        attended = self.self_attn[0](h, cos, sin, attention)
        h = kernels.add_rms_norm(x, attended, posts[0].weight, posts[0].eps)
        shortcut = _mlp_fused(self.mlp, h, kernels)
        h = kernels.add_rms_norm(
            x, _mlp_fused(self.mlps[0], h, kernels), norms[1].weight, norms[1].eps
        )
        attended = self.self_attn[1](h, cos, sin, attention)
        h = kernels.add_rms_norm(x, attended, posts[1].weight, posts[1].eps)
        return _mlp_fused(self.mlps[1], h, kernels) + shortcut


def _mlp_fused(mlp: nn.Module, h: torch.Tensor, kernels: CpuKernels) -> torch.Tensor:
    if isinstance(mlp, MoE):
        return mlp(h, kernels)
    assert isinstance(mlp, SwiGLU)
    return mlp.forward_fused(h, kernels)


class MLABody(DecoderBody):
    def __init__(self, config: MLAConfig):
        super().__init__(config, LongcatLayer if config.is_longcat else DeepseekLayer)


# Checkpoint names -> ours: LongCat's router, per-expert tensors into the fused ones.
_RENAMES = ((".mlp.router.classifier.", ".mlp.gate."),)
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP = re.compile(r"(.*)\.(gate_proj|up_proj)\.weight$")


class MLADecoderLM(MoEDecoderLM):
    config: MLAConfig

    body_class = MLABody
    rotary_class = InterleavedRotary

    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.ngram: NgramEmbedding | None = None
        if config.output_vocab_size:
            self.lm_head = nn.Linear(config.hidden_size, config.output_vocab_size, bias=False)
        if config.ngram is not None:
            self.ngram = NgramEmbedding(config.ngram)
            self.model.ngram_embeddings = self.ngram  # its published names
            self.input_context = self.ngram.context

    def embed(self, input_ids: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        word = self.model.embed_tokens(input_ids)
        if self.ngram is None:
            return word
        if context is None:
            raise ValueError("an n-gram input embedding needs each row's predecessors (context)")
        return self.ngram.rows(input_ids, context, word)

    def materialized(self) -> None:
        """After `to_empty`: routers back to float32 in a half-precision model (transformers
        keeps them so) and the score biases, which DeepSeek checkpoints lack, zeroed."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.gate.weight.data = module.gate.weight.data.float()
                module.e_score_correction_bias.zero_()

    def reference_attention(self) -> AttentionFn:
        return latent_causal_attention(self.config.softmax_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors (per-expert or fused experts) into this module;
        returns the names of our parameters written."""
        if self.packed:
            raise RuntimeError("load_weights after use_packed_weights: load into a new model")
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded: set[str] = set()
        seen: dict[str, set[tuple[int, str]]] = {}  # fused experts -> (expert, kind) loaded
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.startswith("model.mtp."):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            for old, new in _RENAMES:
                name = name.replace(old, new)
            name = name.replace(
                ".mlp.router.e_score_correction_bias", ".mlp.e_score_correction_bias"
            )
            target, view = self._target(name, params)
            expert = _EXPERT.match(name)
            if expert:
                seen.setdefault(expert[1], set()).add((int(expert[2]), expert[3]))
            if tensor.shape != view.shape:
                tensor = self._fit(name, tensor, view)
            with torch.no_grad():
                view.copy_(tensor.to(view.dtype))
            loaded.add(target)
        self._all_experts(seen)
        return loaded

    def _all_experts(self, seen: dict[str, set[tuple[int, str]]]) -> None:
        """Per-expert tensors fill the fused ones: every routed expert's three must come."""
        kinds = ("gate_proj", "up_proj", "down_proj")
        for prefix, got in seen.items():
            for index in range(self.config.n_routed_experts):
                for kind in kinds:
                    if (index, kind) not in got:
                        raise ValueError(
                            f"checkpoint tensor {prefix}.{index}.{kind}.weight missing"
                        )

    def _fit(self, name: str, tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """A fused experts tensor with rows for the weightless zero experts (transformers'
        save_pretrained writes them) keeps its routed experts' rows; any other shape that
        differs is an error (always, in the published LongCat-Next layout)."""
        fused_extra = (
            ".experts." in name
            and self.ngram is None
            and tensor.shape[1:] == view.shape[1:]
            and tensor.shape[0] > view.shape[0]
        )
        if not fused_extra:
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(tensor.shape)}, "
                f"expected {list(view.shape)}"
            )
        return tensor[: view.shape[0]]

    def _target(self, name: str, params: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        expert = _EXPERT.match(name)
        if expert:
            prefix, index, kind = expert.groups()
            target = f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
            stacked = self._param(params, target, name)
            if int(index) >= stacked.shape[0]:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.config.architecture}: "
                    f"expert {index}, but the config has {stacked.shape[0]} routed experts"
                )
            if kind == "down_proj":
                return target, stacked[int(index)]
            return target, stacked[int(index)].chunk(2)[kind == "up_proj"]
        gate_up = _GATE_UP.match(name)
        if gate_up:
            target = f"{gate_up.group(1)}.gate_up_proj.weight"
            return target, self._param(params, target, name).chunk(2)[gate_up.group(2) == "up_proj"]
        return name, self._param(params, name, name)

    def _param(self, params: dict[str, torch.Tensor], target: str, name: str) -> torch.Tensor:
        if target not in params:
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in {self.config.architecture}"
            )
        return params[target]

    def expected_checkpoint_names(self) -> set[str]:
        """Our parameter names (load_weights reports those)."""
        return {name for name, _ in self.named_parameters()}
