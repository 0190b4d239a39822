"""CUDA page-locking of the host pool, when a GPU is present.

Each process registers its own mapping of the pool (pinning is per virtual address
range), so device<->host copies from and to pool pages run at DMA speed. cupy is the
first choice (``cupy.cuda.runtime.hostRegister``); torch's bundled cudart is the
fallback. Without CUDA every function here is a no-op that says so by returning False.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

try:  # cupy is optional (the "gpu" extra)
    import cupy as _cupy
except Exception:  # noqa: BLE001 - a broken CUDA install must not break CPU-only use
    _cupy = None


def cuda_available() -> bool:
    if not _nvidia_driver_present():
        return False  # and torch stays unimported in processes that never need it
    if _cupy is not None:
        try:
            return bool(_cupy.cuda.is_available())
        except Exception:  # noqa: BLE001
            return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")


def register_host(ptr: int, nbytes: int) -> bool:
    """Page-lock ``[ptr, ptr + nbytes)`` for CUDA; False (and nothing done) without CUDA."""
    if nbytes == 0 or not cuda_available():
        return False
    if _cupy is not None:
        _cupy.cuda.runtime.hostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
        return True
    import torch

    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
    return True


def unregister_host(ptr: int) -> None:
    try:
        if _cupy is not None:
            _cupy.cuda.runtime.hostUnregister(ptr)
        else:
            import torch

            torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception as e:  # noqa: BLE001 - teardown: report, keep closing
        log.warning("cudaHostUnregister failed: %s", e)
