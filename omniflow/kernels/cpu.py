"""omniflow's CPU kernels for a bf16 decoder step, built from this folder's C files on first use.

`cpu_kernels()` compiles every .c file here (one per kernel family, sharing cpu_kernels.h) with
the machine's compiler (`$CC`, else cc/gcc/clang; -O3 -march=native -fopenmp) into one shared
library in a per-user cache, keyed by the content of every source file, the flags, the
compiler and the CPU's flags, and loads it through ctypes. It returns None, and the engine keeps its PyTorch
ops, where that cannot work: no compiler, a failed build, not x86-64 Linux, or
OMNIFLOW_CPU_KERNELS=0. The reason is logged once and kept in `unavailable_reason()`.

The library is loaded after torch and links libgomp by its soname, so it runs on torch's
OpenMP runtime and threads rather than a second pool competing for the same cores.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from omniflow.kernels.attention import AttentionKernels
from omniflow.kernels.build import Unavailable, build

log = logging.getLogger(__name__)

AMX_SWITCH = "OMNIFLOW_CPU_AMX"  # "0": the kernels' AMX paths off (the AVX-512 ones stay)
# "0": no projections on AVX-512 BF16 where AMX is off or absent (oneDNN's run instead)
AVX512_LINEAR_SWITCH = "OMNIFLOW_CPU_AVX512_LINEAR"
MAX_HEAD_DIM = 512  # the rotary kernel's per-head buffer
# What CpuKernels.decode_layers reads of each layer, in order (decode_layers.c: L_NORM ...).
DECODE_LAYER_FIELDS = (
    "norm",
    "qkv",
    "qkv_bias",
    "o",
    "o_bias",
    "post_norm",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
    "keys",
    "values",
)
# One block of a packed weight (see CpuKernels.pack_linear): k-blocks x 2 halves x 16 x 16 x 2.
PACKED_TILE = (2, 16, 16, 2)

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "omniflow_add_rms_norm_bf16": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]),
    "omniflow_rotary_bf16": (None, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT]),
    "omniflow_kv_write_bf16": (
        None,
        [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT],
    ),
    "omniflow_silu_mul_bf16": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    "omniflow_decode_attention_supported": (_INT, [_I64, _I64]),
    "omniflow_amx_supported": (_INT, []),
    "omniflow_avx512_linear_supported": (_INT, []),
    "omniflow_context_attention_supported": (_INT, [_I64, _I64, _I64]),
    "omniflow_chunk_attention_bf16": (
        _INT,
        [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64]
        + [_I64, _F32, _PTR, _INT, _INT],
    ),
    "omniflow_decode_layer_fields": (_INT, []),
    "omniflow_decode_layers_bf16": (
        _INT,
        [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _I64, _I64, _I64]
        + [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _INT, _INT],
    ),
    "omniflow_linear_bf16": (
        _INT,
        [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _INT, _PTR, _PTR, _I64, _INT],
    ),
    "omniflow_linear_avx512_bf16": (
        _INT,
        [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _INT, _PTR, _PTR, _I64, _INT],
    ),
    "omniflow_latent_decode_attention_bf16": (
        _INT,
        [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _F32]
        + [_PTR, _INT],
    ),
    "omniflow_decode_attention_bf16": (
        _INT,
        [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR]
        + [_I64, _I64, _I64, _I64, _F32, _PTR, _INT],
    ),
}


class CpuKernels(AttentionKernels):
    """Typed entry points of the built library. Every tensor is bf16 on CPU (int64 for
    indices) with the layout each method states; the callers check what they pass."""

    def __init__(self, library: ctypes.CDLL):
        self._lib = library
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes
        # Asks the OS for the AMX tile state once: true where the build and the kernel allow,
        # unless OMNIFLOW_CPU_AMX=0 turns the AMX paths off (as on a CPU without AMX).
        self.amx = os.environ.get(AMX_SWITCH, "1") != "0" and bool(library.omniflow_amx_supported())
        # Without AMX, the projections on AVX-512 BF16 where the build and the CPU have it
        # (cpuid), unless OMNIFLOW_CPU_AVX512_LINEAR=0.
        self.avx512_linear = (
            not self.amx
            and os.environ.get(AVX512_LINEAR_SWITCH, "1") != "0"
            and bool(library.omniflow_avx512_linear_supported())
        )
        # Whether `linear` and `decode_layers` run here, on one path or the other.
        self.packed_linear = self.amx or self.avx512_linear
        # Addresses per layer that decode_layers reads (see DECODE_LAYER_FIELDS).
        if library.omniflow_decode_layer_fields() != len(DECODE_LAYER_FIELDS):
            raise OSError("decode_layers.c and cpu.py disagree on the decode layer fields")

    @staticmethod
    def _threads(rows_elements: int) -> int:
        return torch.get_num_threads() if rows_elements > 1 << 16 else 1

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (when given); returns weight * rmsnorm(x), as transformers'
        RMSNorm rounds it. x, delta: [rows, hidden] contiguous."""
        _check_rows(x, "x")
        if delta is not None:
            _check_rows(delta, "delta")
            if delta.shape != x.shape:
                raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} != x {tuple(x.shape)}")
        out = torch.empty_like(x)
        rows, hidden = x.shape
        self._lib.omniflow_add_rms_norm_bf16(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            self._threads(x.numel()),
        )
        return out

    def rotary_(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place over the first `heads` heads of each row of x
        ([rows, >= heads * head_dim], unit stride in a row); cos/sin [rows, head_dim]."""
        rows, head_dim = cos.shape
        if x.stride(-1) != 1 or x.shape[0] != rows or x.shape[1] < heads * head_dim:
            raise ValueError(
                f"rotary_: x {tuple(x.shape)} does not hold {heads} heads of {head_dim}"
            )
        if head_dim > MAX_HEAD_DIM or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(
                f"rotary_: head_dim {head_dim} (max {MAX_HEAD_DIM}) or cos/sin strided"
            )
        self._lib.omniflow_rotary_bf16(
            x.data_ptr(),
            x.stride(0),
            rows,
            heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            self._threads(rows * heads * head_dim),
        )

    def kv_write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_keys: torch.Tensor,
        layer_values: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Store row r's k/v [rows, kv_heads, head_dim] (heads and dims dense, rows strided
        alike) at slot slots[r] of one layer's pages [kv_heads, pages, page_size, head_dim]."""
        rows, kv_heads, head_dim = k.shape
        if k.stride() != v.stride() or k.stride()[1:] != (head_dim, 1):
            raise ValueError(f"kv_write: k/v strides {k.stride()} / {v.stride()}")
        if not layer_keys.is_contiguous() or slots.dtype != torch.int64 or len(slots) != rows:
            raise ValueError("kv_write: pages must be contiguous and slots int64, one per row")
        self._lib.omniflow_kv_write_bf16(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            rows,
            kv_heads,
            head_dim,
            layer_keys.data_ptr(),
            layer_values.data_ptr(),
            layer_keys.stride(0),
            slots.data_ptr(),
            self._threads(k.numel()),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] ([rows, 2 * inter], contiguous)."""
        _check_rows(gate_up, "gate_up")
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self._lib.omniflow_silu_mul_bf16(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, self._threads(out.numel())
        )
        return out

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        gate_up: int = 0,
        silu: bool = False,
    ) -> torch.Tensor:
        """x @ W.T (+ bias) on AMX tiles, else on AVX-512 BF16, for W packed by `pack_linear`
        (out_features: W's rows). x: [rows, in] bf16, unit stride in a row. gate_up: W is a fused [gate; up]
        weight of gate_up rows each, packed so; then `silu` returns silu(gate) * up
        [rows, gate_up], rounded as the unfused ops round. Needs `packed_linear`."""
        rows, in_features = x.shape
        blocks, kblocks = packed.shape[:2]
        wanted = (gate_up + 15) // 16 if gate_up else (out_features + 31) // 32
        if (
            x.stride(-1) != 1
            or x.dtype != torch.bfloat16
            or packed.shape[2:] != PACKED_TILE
            or blocks != wanted
            or kblocks != (in_features + 31) // 32
            or (gate_up and out_features != 2 * gate_up)
        ):
            raise ValueError(
                f"linear: x {tuple(x.shape)} {x.dtype} does not fit a packed "
                f"{tuple(packed.shape)} weight of {out_features} rows (gate_up={gate_up})"
            )
        if silu and not gate_up:
            raise ValueError("linear: silu needs a fused gate/up weight (gate_up > 0)")
        if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()):
            raise ValueError(f"linear: bias {tuple(bias.shape)} for {out_features} outputs")
        out = x.new_empty((rows, gate_up if silu else out_features))
        run = self._lib.omniflow_linear_bf16 if self.amx else self._lib.omniflow_linear_avx512_bf16
        status = run(
            x.data_ptr(),
            x.stride(0),
            rows,
            in_features,
            packed.data_ptr(),
            out_features,
            gate_up,
            int(silu),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads() if rows * out_features > 1 << 14 else 1,
        )
        if status != 0:
            raise RuntimeError(
                "linear: this build has neither AMX nor AVX-512 BF16 (check packed_linear first)"
            )
        return out

    def decode_layers(
        self,
        x: torch.Tensor,
        layers: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pages: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        heads: int,
        intermediate: int,
        eps: float,
        scale: float,
    ) -> None:
        """A decode step's decoder layers in one call (one new token a row; see
        decode_layers.c): x [rows, hidden] in place, from the embeddings to the last layer's
        residual stream. layers: int64 [layers, len(DECODE_LAYER_FIELDS)] of addresses (0 for
        no bias): norms' weights, projections packed by pack_linear (gate/up fused), each
        layer's pages, laid out as `pages` (one layer's keys, [kv_heads, pages, page_size,
        head_dim] contiguous). cos/sin [rows, head_dim]; slots [rows], tables [rows, width],
        lengths [rows] int64. Needs `packed_linear` and decode_attention_supported."""
        rows, hidden = x.shape
        kv_heads, _, page_size, head_dim = pages.shape
        if (
            not x.is_contiguous()
            or not pages.is_contiguous()
            or layers.dtype != torch.int64
            or not layers.is_contiguous()
            or layers.shape[1:] != (len(DECODE_LAYER_FIELDS),)
            or cos.shape != (rows, head_dim)
            or not (cos.is_contiguous() and sin.is_contiguous())
            or slots.shape != (rows,)
            or lengths.shape != (rows,)
            or tables.shape[0] != rows
            or not (slots.is_contiguous() and tables.is_contiguous() and lengths.is_contiguous())
        ):
            raise ValueError(
                f"decode_layers: inputs do not fit x {tuple(x.shape)} over pages "
                f"{tuple(pages.shape)}"
            )
        q_size = heads * head_dim
        qkv_size = q_size + 2 * kv_heads * head_dim
        scratch = x.new_empty(rows * (2 * hidden + qkv_size + q_size + intermediate))
        status = self._lib.omniflow_decode_layers_bf16(
            x.data_ptr(),
            rows,
            layers.shape[0],
            layers.data_ptr(),
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            eps,
            scale,
            pages.stride(0),
            pages.stride(1),
            page_size,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            scratch.data_ptr(),
            int(self.amx),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(
                "decode_layers: needs AMX or AVX-512 BF16 projections and decode attention for "
                "these heads in this build"
            )

    @staticmethod
    def pack_linear(weight: torch.Tensor, gate_up: int = 0) -> torch.Tensor:
        """A [out, in] weight re-laid for `CpuKernels.linear`: blocks of 32 output columns, each
        k-block of 32 inputs as two 16 x 16 x 2 AMX tiles (VNNI pairs of inputs), zero-padded.
        gate_up: W is [gate; up] of gate_up rows each; a block then holds 16 gate and the same 16
        up columns (see linear_amx.c). Returns [blocks, k-blocks, 2, 16, 16, 2]."""
        out_features, in_features = weight.shape
        kblocks = (in_features + 31) // 32
        if gate_up:
            if out_features != 2 * gate_up:
                raise ValueError(f"pack_linear: {out_features} rows is not gate + up of {gate_up}")
            blocks = (gate_up + 15) // 16
            halves = [
                _padded(weight[:gate_up], blocks * 16, kblocks * 32),
                _padded(weight[gate_up:], blocks * 16, kblocks * 32),
            ]
            grid = torch.stack([h.view(blocks, 16, kblocks, 16, 2) for h in halves], dim=1)
        else:
            blocks = (out_features + 31) // 32
            grid = _padded(weight, blocks * 32, kblocks * 32).view(blocks, 2, 16, kblocks, 16, 2)
        # (block, half, n, kblock, kk, pair) -> (block, kblock, half, kk, n, pair)
        return grid.permute(0, 3, 1, 4, 2, 5).contiguous()

    @staticmethod
    def unpack_linear(
        packed: torch.Tensor, out_features: int, in_features: int, gate_up: int = 0
    ) -> torch.Tensor:
        """The [out, in] weight `pack_linear` was given."""
        blocks, kblocks = packed.shape[:2]
        grid = packed.permute(0, 2, 4, 1, 3, 5)  # (block, half, n, kblock, kk, pair)
        if gate_up:
            gate, up = (grid[:, h].reshape(blocks * 16, kblocks * 32) for h in (0, 1))
            return torch.cat([gate[:gate_up], up[:gate_up]])[:, :in_features]
        return grid.reshape(blocks * 32, kblocks * 32)[:out_features, :in_features]


def _padded(weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = weight.new_zeros((rows, cols))
    out[: weight.shape[0], : weight.shape[1]] = weight
    return out


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() != 2 or not tensor.is_contiguous() or tensor.dtype != torch.bfloat16:
        raise ValueError(f"{name}: expected a contiguous bf16 [rows, n] tensor")


_lock = threading.Lock()
_loaded: CpuKernels | None = None
_reason: str | None = None
_tried = False


def cpu_kernels() -> CpuKernels | None:
    """The built kernels, or None where they cannot run here (see unavailable_reason())."""
    global _loaded, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = CpuKernels(ctypes.CDLL(str(build())))
            except (Unavailable, OSError) as error:  # OSError: an unwritable cache, a bad .so
                _reason = str(error)
                log.info("CPU kernels off, PyTorch ops instead: %s", _reason)
        return _loaded


def unavailable_reason() -> str | None:
    cpu_kernels()
    return _reason
