"""omniflow's CPU kernels for a bf16 decoder step, built from cpu_kernels.c on first use.

`cpu_kernels()` compiles the C source with the machine's compiler (`$CC`, else cc/gcc/clang;
-O3 -march=native -fopenmp) into a per-user cache, keyed by the source, the flags and the
compiler, and loads it through ctypes. It returns None, and the engine keeps its PyTorch
ops, where that cannot work: no compiler, a failed build, not x86-64 Linux, or
OMNIFLOW_CPU_KERNELS=0. The reason is logged once and kept in `unavailable_reason()`.

The library is loaded after torch and links libgomp by its soname, so it runs on torch's
OpenMP runtime and threads rather than a second pool competing for the same cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-shared", "-fPIC"]
ENV_SWITCH = "OMNIFLOW_CPU_KERNELS"
MAX_HEAD_DIM = 512  # the rotary kernel's per-head buffer

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
    "omniflow_decode_attention_bf16": (
        _INT,
        [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR]
        + [_I64, _I64, _I64, _I64, _F32, _PTR, _INT],
    ),
}


class CpuKernels:
    """Typed entry points of the built library. Every tensor is bf16 on CPU (int64 for
    indices) with the layout each method states; the callers check what they pass."""

    def __init__(self, library: ctypes.CDLL):
        self._lib = library
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes

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

    def decode_attention_supported(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        return heads % kv_heads == 0 and bool(
            self._lib.omniflow_decode_attention_supported(heads // kv_heads, head_dim)
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        layer_keys: torch.Tensor,
        layer_values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token per row over its pages: q [rows, heads, head_dim] (rows strided),
        pages [kv_heads, pages, page_size, head_dim] contiguous, tables [rows, width] and
        lengths [rows] int64 contiguous. Returns [rows, heads, head_dim]."""
        rows, heads, head_dim = q.shape
        kv_heads, _, page_size, _ = layer_keys.shape
        if q.stride()[1:] != (head_dim, 1) or not layer_keys.is_contiguous():
            raise ValueError(f"decode_attention: q strides {q.stride()} or pages strided")
        if not (tables.is_contiguous() and lengths.is_contiguous()):
            raise ValueError("decode_attention: tables and lengths must be contiguous")
        out = q.new_empty((rows, heads, head_dim))
        status = self._lib.omniflow_decode_attention_bf16(
            q.data_ptr(),
            q.stride(0),
            layer_keys.data_ptr(),
            layer_values.data_ptr(),
            layer_keys.stride(0),
            layer_keys.stride(1),
            page_size,
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            rows,
            heads,
            kv_heads,
            head_dim,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"decode_attention: {heads} heads over {kv_heads} kv heads of {head_dim} "
                "not supported by this build (check decode_attention_supported first)"
            )
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
                _loaded = CpuKernels(ctypes.CDLL(str(_build())))
            except (_Unavailable, OSError) as error:  # OSError: an unwritable cache, a bad .so
                _reason = str(error)
                log.info("CPU kernels off, PyTorch ops instead: %s", _reason)
        return _loaded


def unavailable_reason() -> str | None:
    cpu_kernels()
    return _reason


class _Unavailable(Exception):
    pass


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    raise _Unavailable("no C compiler (set CC, or install gcc)")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "omniflow" / "kernels"


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build() -> Path:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise _Unavailable(f"{ENV_SWITCH}=0")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise _Unavailable(
            f"built for x86-64 Linux only, not {platform.system()} {platform.machine()}"
        )
    compiler = _compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise _Unavailable(f"{compiler} --version failed: {error}") from error
    source = SOURCE.read_bytes()
    # -march=native: the build is only good for CPUs with these features.
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_flags()])
    )
    target = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never load a half file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            raise _Unavailable(f"{' '.join(command)}: {error}") from error
        if done.returncode != 0:
            raise _Unavailable(f"{' '.join(command)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target
