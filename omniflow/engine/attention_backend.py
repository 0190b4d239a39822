"""The seam between the runner and attention: `create_attention_backend` picks, once per
runner, how a step's attention runs; the runner builds each step's `AttentionBatch` as the
backend asks (`decode_masks`) and `bind`s it into the `AttentionFn` the model's one forward
calls per layer. Models and the scheduler never see which backend it is.

- `torch`: the PyTorch reference path (paged_attention.py, latent_attention.py): any
  device and dtype; decode rows read gathered pages or the DecodeMirror's copies.
- `cpu`: omniflow's CPU kernels (omniflow.kernels, a bf16 model on CPU; cpu_attention.py):
  they write the new K/V and run decode attention over the pages in place (no mirror, no
  masks) where they take the heads, and the rest on the reference path's code.

A GPU backend is one more class here with the same three members."""

from __future__ import annotations

from typing import Protocol

from omniflow.engine.cpu_attention import CpuLatentAttention, CpuPagedAttention
from omniflow.engine.latent_attention import LatentPagedAttention
from omniflow.engine.paged_attention import AttentionBatch, KVCache, PagedAttention
from omniflow.kernels import CpuKernels
from omniflow.models import DecoderConfig, MLAConfig
from omniflow.models.llama.decoder import AttentionFn


class AttentionBackend(Protocol):
    name: str
    scale: float  # the softmax scale of the model's attention
    # Whether a step's decode rows need their masks built (False: the backend reads block
    # tables and lengths instead).
    decode_masks: bool
    # Whether decode rows read the pages in place (then a DecodeMirror would only cost).
    decodes_in_place: bool

    def bind(self, batch: AttentionBatch) -> AttentionFn: ...


class TorchAttention:
    """The PyTorch reference path: `PagedAttention` (MHA/GQA) or `LatentPagedAttention` (MLA)."""

    name = "torch"
    decode_masks = True
    decodes_in_place = False

    def __init__(self, cache: KVCache, scale: float, latent: bool):
        self.cache, self.scale, self.latent = cache, scale, latent

    def bind(self, batch: AttentionBatch) -> AttentionFn:
        if self.latent:
            return LatentPagedAttention(self.cache, batch, self.scale)
        return PagedAttention(self.cache, batch, self.scale)


class CpuKernelAttention:
    """The same attention with omniflow's CPU kernels: K/V writes, decode attention over the
    pages in place (tables and lengths, no masks) where the kernels take these heads (MLA:
    always, on its latent kernel), prefill attention where they fit (PagedAttention)."""

    name = "cpu"

    def __init__(
        self,
        cache: KVCache,
        scale: float,
        latent: bool,
        kernels: CpuKernels,
        config: DecoderConfig | MLAConfig,
    ):
        self.cache, self.scale, self.latent, self.kernels = cache, scale, latent, kernels
        self.decodes_in_place = not latent and kernels.decode_attention_supported(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        self.decode_masks = not (latent or self.decodes_in_place)

    def bind(self, batch: AttentionBatch) -> AttentionFn:
        if self.latent:
            return CpuLatentAttention(self.cache, batch, self.scale, self.kernels)
        return CpuPagedAttention(self.cache, batch, self.scale, self.kernels)


def create_attention_backend(
    cache: KVCache, config: DecoderConfig | MLAConfig, kernels: CpuKernels | None
) -> AttentionBackend:
    """The backend of a runner over ``cache`` for a model of ``config``: on the CPU kernels
    where given (a bf16 model on CPU that loaded them), else the PyTorch reference."""
    latent = isinstance(config, MLAConfig)
    scale = config.softmax_scale if isinstance(config, MLAConfig) else config.head_dim**-0.5
    if kernels is not None:
        return CpuKernelAttention(cache, scale, latent, kernels, config)
    return TorchAttention(cache, scale, latent)
