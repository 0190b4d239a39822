"""CPU-specific weight layouts of a `DecoderLM`: input-major float32 projections, bf16
projections packed for oneDNN (`PackedLinear`) or omniflow's projection kernel (`KernelLinear`), and
the per-layer pointer table the one-call decode step reads.

The model (`models/llama/decoder.py`) calls these; they change how weights sit in memory, never
their values or names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from omniflow.kernels import CpuKernels
    from omniflow.models.llama.decoder import DecoderLayer, DecoderLM


# oneDNN's private ops that the packed layouts call: only here, and only where this torch has
# all of them (a torch that renames or drops one runs the plain layouts: PyTorch's public ops).
PRIVATE_ONEDNN_OPS = ("_is_mkldnn_bf16_supported", "_reorder_linear_weight", "_linear_pointwise")


def packed_weights_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `DecoderLM.use_packed_weights` applies: bf16 on a CPU whose oneDNN runs bf16,
    with the private ops it calls present in this torch."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and all(hasattr(torch.ops.mkldnn, op) for op in PRIVATE_ONEDNN_OPS)
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """A Linear whose weight lives in oneDNN's blocked layout (AMX/VNNI tiles for bf16),
    re-laid once here instead of by oneDNN on every call, as it does for a plain weight.
    Same parameter names; the weight is an opaque mkldnn tensor (``.to_dense()`` reads it)."""

    def __init__(self, linear: nn.Linear, rows_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class KernelLinear(nn.Module):
    """A Linear on omniflow's projection kernel (`CpuKernels.linear`: AMX, else AVX-512 BF16),
    its weight re-laid once in the kernel's tiles (`pack_linear`); it skips oneDNN's per-call
    cost, which dominates a decode step's small projections.
    gate_up > 0: a fused [gate; up] weight of gate_up rows each, packed so that `silu_mul`
    runs silu(gate) * up in the projection's own pass. Same parameter names; the weight is
    [blocks, k-blocks, 2, 16, 16, 2] (``dense_weight()`` reads it back)."""

    def __init__(self, linear: nn.Linear, kernels: CpuKernels, gate_up: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gate_up = gate_up
        packed = kernels.pack_linear(linear.weight.detach(), gate_up)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._kernels.linear(rows, self.weight, self.out_features, self.bias, self.gate_up)
        return out.view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows x [rows, in] (a gate_up weight only)."""
        return self._kernels.linear(
            x, self.weight, self.out_features, self.bias, self.gate_up, silu=True
        )

    def dense_weight(self) -> torch.Tensor:
        return self._kernels.unpack_linear(
            self.weight, self.out_features, self.in_features, self.gate_up
        )


def use_input_major_weights(model: DecoderLM) -> None:
    """Re-lay every projection weight [out, in] as the transpose of a contiguous [in, out]
    tensor. Values, shapes and names stay; x @ W.T then runs as a plain GEMM, which on
    CPU (MKL) is markedly faster than the transposed one at decode batch sizes. A tied
    embedding table is the output projection too: re-laid as well, since every step
    multiplies by all of it while a lookup reads only a few (now strided) rows."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if model.lm_head is None:
        weights.append(model.model.embed_tokens.weight)
    with torch.no_grad():
        for weight in weights:
            if weight.is_contiguous():
                weight.data = weight.data.t().contiguous().t()


def use_packed_weights(
    model: DecoderLM, rows_hint: int, kernels: CpuKernels | None
) -> tuple[torch.Tensor | None, CpuKernels | None]:
    """Replace every nn.Linear of `model` by its packed form: KernelLinear when `kernels` run
    projections here (AMX or AVX-512 BF16), else PackedLinear. Returns the tied output
    projection's packed table and the kernels that multiply by it (None, None for an untied
    head, which is packed as a Linear)."""
    ours = kernels if kernels is not None and kernels.packed_linear else None
    for module in list(model.modules()):
        for name, child in module.named_children():
            if not isinstance(child, nn.Linear):
                continue
            if ours is None:
                setattr(module, name, PackedLinear(child, rows_hint))
            else:
                # The fused [gate; up] projection of a SwiGLU MLP: packed so the kernel
                # runs silu(gate) * up in its own pass.
                fused = name == "gate_up_proj" and hasattr(module, "intermediate_size")
                gate_up = cast(int, module.intermediate_size) if fused else 0
                setattr(module, name, KernelLinear(child, ours, gate_up))
    if model.lm_head is not None:
        return None, None
    table = model.model.embed_tokens.weight.detach()
    if ours is None:
        return torch.ops.mkldnn._reorder_linear_weight(table, rows_hint), None
    return ours.pack_linear(table), ours


def decode_layer_table(model: DecoderLM, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per layer, the addresses the one-call decode step reads (cpu.DECODE_LAYER_FIELDS):
    norms, KernelLinear weights and biases, and the layer's K/V cache [int64, layers x 12].
    Valid while none of them moves."""

    def address(tensor: torch.Tensor | None) -> int:
        return 0 if tensor is None else tensor.data_ptr()

    rows = []
    for index, layer in enumerate(cast("list[DecoderLayer]", model.model.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        qkv, o, gate_up, down = (cast(KernelLinear, p) for p in projections)
        rows.append(
            [
                address(layer.input_layernorm.weight),
                address(qkv.weight),
                address(qkv.bias),
                address(o.weight),
                address(o.bias),
                address(layer.post_attention_layernorm.weight),
                address(gate_up.weight),
                address(gate_up.bias),
                address(down.weight),
                address(down.bias),
                address(keys[index]),
                address(values[index]),
            ]
        )
    return torch.tensor(rows, dtype=torch.int64)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) with a weight oneDNN packed (PackedLinear.pack): the one place a
    model calls oneDNN's private linear op; a model whose weights are not packed never does."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
