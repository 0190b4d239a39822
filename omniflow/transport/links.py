"""What a sender knows of a receiver, which pools this process sends through, and the
error for a ref that cannot be honoured.

Torch-free, so that routing, the hot path and a worker attaching its pool name them
without importing torch (``transport.tensors`` does, where a tensor travels).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from omniflow.cache import PagePool

FRAME_THRESHOLD = 64 << 10


class Link(NamedTuple):
    """What the sender knows of the receiver, from the registry's records."""

    same_host: bool = False
    gpus: tuple[int, ...] = ()
    pid: int = 0  # the receiver's pid: its refs are reclaimed if it dies (0: anonymous)


class TensorError(ValueError):
    """A tensor ref that cannot be honoured (forged, stale, or inconsistent)."""


class _Attached:
    pool: PagePool | None = None
    frame_threshold: int = FRAME_THRESHOLD
    device_pools: dict[int, Any] = {}  # cuda ordinal -> cache.cuda_ipc.DevicePool
    opener: Any = None  # cache.cuda_ipc.IpcOpener, made on the first CudaIpc ref


_attached = _Attached()


def attach_pool(pool: PagePool, frame_threshold: int = FRAME_THRESHOLD) -> None:
    """Use ``pool`` for same-host tensors of at least ``frame_threshold`` bytes."""
    if frame_threshold < 0:
        raise ValueError(f"frame_threshold: must be >= 0, got {frame_threshold}")
    _attached.pool = pool
    _attached.frame_threshold = frame_threshold


def detach_pool() -> PagePool | None:
    """Stop using the attached pool (and device pools); returns it, for the caller to close."""
    pool, _attached.pool = _attached.pool, None
    _attached.device_pools = {}
    if _attached.opener is not None:
        _attached.opener.close()
        _attached.opener = None
    return pool


def attached_pool() -> PagePool | None:
    return _attached.pool


def attach_device_pool(device_pool: Any) -> None:
    """Send CUDA tensors on ``device_pool.device`` to GPU receivers on this host by CUDA IPC."""
    _attached.device_pools = {**_attached.device_pools, device_pool.device: device_pool}


# A client that maps the deployment's page pool says so in its reply address (ipc://, so
# on this host), with its pid: outputs sent to it go as pool handles held for that pid.
_POOL_CLIENT = re.compile(r"^ipc://.*/client-(\d+)-\d+-pool\.sock$")
_NO_LINK = Link()


def pool_client_address(run_dir: str, pid: int, n: int) -> str:
    """The reply address of a client (pid ``pid``, its ``n``-th) that maps the pool."""
    return f"ipc://{run_dir}/client-{pid}-{n}-pool.sock"


@functools.lru_cache(maxsize=256)
def client_link(reply_to: str) -> Link:
    """What a sender knows of the client behind ``reply_to``: a pool-mapping client on
    this host (``pool_client_address``) gets handles, any other one frames."""
    m = _POOL_CLIENT.match(reply_to)
    return Link(same_host=True, pid=int(m.group(1))) if m else _NO_LINK
