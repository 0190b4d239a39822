"""Wire names of tensor dtypes, shared by the pool (``Shm`` refs) and the transport."""

from __future__ import annotations

import math

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
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
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
ITEMSIZE: dict[str, int] = {
    k: torch.empty((), dtype=v).element_size() for k, v in TORCH_DTYPES.items()
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"unsupported tensor dtype {dtype}; supported: {', '.join(TORCH_DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name``; ``ValueError`` naming it when unknown."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(TORCH_DTYPES)}") from None


def nbytes_of(name: str, shape: tuple[int, ...]) -> int:
    """Bytes a contiguous tensor of dtype ``name`` and ``shape`` occupies."""
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(TORCH_DTYPES)}")
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"shape {list(shape)} has a dimension that is not a non-negative int")
    return math.prod(shape) * ITEMSIZE[name]
