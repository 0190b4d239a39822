"""TensorRef <-> tensor: how a tensor leaves one process and arrives in another.

``export`` turns a tensor into a ``TensorRef`` for one link, appending any bytes
that must travel to ``frames``; ``materialize`` turns a received ref (and the
message's frames) back into a tensor without copying.

This version knows ``Frame`` refs only; the data plane adds ``Shm`` and
``CudaIpc`` refs from the host page pool.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

from omniflow.messages import Frame, TensorRef


class Link(NamedTuple):
    """What the sender knows of the receiver, from the registry's records."""

    same_host: bool = False
    gpus: tuple[int, ...] = ()


class TensorError(ValueError):
    """A tensor ref that cannot be honoured (forged, stale, or inconsistent)."""


# Received frames are read-only; the views handed to roles are documented as such.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"unsupported tensor dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise TensorError(f"unknown dtype {name!r}") from None


def as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def export(value: Any, frames: list[Any], link: Link = Link()) -> TensorRef:
    """A ref for ``value``; bytes that must travel are appended to ``frames``.

    ``frames`` is the whole multipart message so far (the header's slot is 0).

    The frame is a memoryview over the tensor's own storage (contiguous tensors
    are not copied); the caller keeps the tensor alive until ZeroMQ released it.
    """
    t = as_tensor(value).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    name = dtype_name(t.dtype)
    shape = tuple(t.shape)
    # bf16 has no numpy dtype: view the bytes as uint8 (zero-copy).
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    frames.append(memoryview(raw))
    return Frame(index=len(frames) - 1, dtype=name, shape=shape)


def materialize(ref: TensorRef, frames: list[Any]) -> torch.Tensor:
    """A tensor viewing the bytes ``ref`` names; no copy."""
    if isinstance(ref, Frame):
        if not 1 <= ref.index < len(frames):
            raise TensorError(f"frame ref {ref.index} outside the message's {len(frames)} frames")
        dtype = torch_dtype(ref.dtype)
        buf = frames[ref.index]
        buf = buf.buffer if hasattr(buf, "buffer") else buf  # zmq.Frame -> memoryview
        nbytes = _nbytes(dtype, ref.shape)
        if len(buf) != nbytes:
            raise TensorError(
                f"frame {ref.index} holds {len(buf)} bytes, dtype {ref.dtype} shape "
                f"{list(ref.shape)} needs {nbytes}"
            )
        if nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(dtype).reshape(ref.shape)
    raise TensorError(f"{type(ref).__name__} refs are not supported by this process")


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise TensorError(f"negative dimension in shape {list(shape)}")
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()
