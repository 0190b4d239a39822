"""Wire names of tensor dtypes, shared by the pool (``Shm`` refs) and the transport.

torch is imported on the first lookup of a torch dtype, not with this module: the pool
checks handles (names, sizes) in processes that never make a tensor.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZE}


@cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_dtypes().items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _dtype_names()[dtype]
    except KeyError:
        raise TypeError(
            f"unsupported tensor dtype {dtype}; supported: {', '.join(ITEMSIZE)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name``; ``ValueError`` naming it when unknown."""
    try:
        return _torch_dtypes()[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(ITEMSIZE)}") from None


def nbytes_of(name: str, shape: tuple[int, ...]) -> int:
    """Bytes a contiguous tensor of dtype ``name`` and ``shape`` occupies."""
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(ITEMSIZE)}")
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"shape {list(shape)} has a dimension that is not a non-negative int")
    return math.prod(shape) * ITEMSIZE[name]
