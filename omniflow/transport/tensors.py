"""TensorRef <-> tensor: how a tensor leaves one process and arrives in another.

``export`` turns a tensor into a ``TensorRef`` for one link, appending any bytes that
must travel to ``frames``; ``materialize`` turns a received ref (and the message's
frames) back into a tensor without copying; ``release`` is the receiver's ack.

Which ref, per link:

- other host, no pool attached, a receiver of unknown pid, or fewer than
  ``frame_threshold`` bytes: ``Frame``
  (the bytes ride as a zero-copy ZeroMQ frame);
- same host, receiver on a GPU, CUDA tensor, a ``DevicePool`` attached: ``CudaIpc``;
- same host otherwise: ``Shm``. A contiguous tensor already in the pool (from
  ``pool.empty``) goes with no copy; any other is copied into the pool once.

A process opts in once, at startup, after mapping the deployment's pool::

    pool = PagePool.attach(name)
    attach_pool(pool)

Each ``Shm``/``CudaIpc`` ref holds one ref on its block for the receiver, attributed to
``received(Link.pid)`` (the receiver's pid from the registry, marked as shared to it) so
that a receiver that dies is reclaimed, and so that releasing a received ref can only
drop a ref shared to this process, never one it holds itself nor an anonymous one; the receiver calls ``release(ref)`` when done with the tensor, and also for
refs of a message it drops unread (bad header, overload, cancelled), or the block stays
allocated until the receiver exits and is reclaimed (``opened=False`` for those: they
never counted as opened). A full pool makes ``export`` raise
``PoolExhausted`` (a ``MemoryError``) at once; the caller may resend with ``Link()``.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from omniflow.memory import PagePool, PoolError
from omniflow.memory.dtypes import dtype_name as _dtype_name
from omniflow.memory.dtypes import nbytes_of
from omniflow.memory.dtypes import torch_dtype as _torch_dtype
from omniflow.memory.pool import received
from omniflow.messages import CudaIpc, Frame, Shm, TensorRef
from omniflow.transport.links import (  # re-exported: callers import them from here
    FRAME_THRESHOLD as FRAME_THRESHOLD,
)
from omniflow.transport.links import Link, TensorError, _attached
from omniflow.transport.links import attach_device_pool as attach_device_pool
from omniflow.transport.links import attach_pool as attach_pool
from omniflow.transport.links import attached_pool as attached_pool
from omniflow.transport.links import detach_pool as detach_pool
from omniflow.transport.throttle import Throttled

log = logging.getLogger(__name__)
_skipped = Throttled(log, "skipped a tensor ref: %s")

# Shm refs this process opened and has not released yet, per lease: a second message
# naming the same lease is accepted only while the lease holds more refs for this pid.
# Exact: only ``materialize`` counts up and only the release of an opened ref counts down
# (a ref dropped unread never counted); a lower count would let a forged copy of a ref
# this process holds but has not opened yet be opened, and released, in its place.
_opened: dict[int, int] = {}


def opened_refs(lease: int) -> int:
    """How many refs on ``lease`` this process opened and has not released."""
    return _opened.get(lease, 0)


# Received frames are read-only; the views handed to roles are documented as such.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def dtype_name(dtype: torch.dtype) -> str:
    return _dtype_name(dtype)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _torch_dtype(name)
    except ValueError as e:
        raise TensorError(str(e)) from None


def as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def export(value: Any, frames: list[Any], link: Link = Link()) -> TensorRef:
    """A ref for ``value``; bytes that must travel are appended to ``frames``.

    ``frames`` is the whole multipart message so far (the header's slot is 0). For a
    ``Frame`` ref the frame is a memoryview over the tensor's own storage (contiguous
    tensors are not copied); the caller keeps the tensor alive until ZeroMQ released it.
    """
    t = as_tensor(value).detach()
    pool = _attached.pool
    if link.same_host and link.pid and pool is not None:  # a receiver that can release it
        device_pool = _attached.device_pools.get(t.device.index) if t.is_cuda else None
        if device_pool is not None and device_pool.bus_id in link.gpus:  # the receiver's GPU
            return device_pool.share(t, received(link.pid))
        if t.numel() * t.element_size() >= _attached.frame_threshold:
            return _export_shm(pool, t, link.pid)
    return _export_frame(t, frames)


def _export_shm(pool: PagePool, t: torch.Tensor, pid: int) -> Shm:
    shared = pool.try_share(t, received(pid))  # already in the pool: no copy
    if shared is not None:
        return shared
    staged = pool.copy_in(t)  # the one copy (device -> pinned host by DMA when registered)
    try:
        return pool.share(staged.tensor, received(pid))
    finally:
        staged.lease.release()  # the receiver's ref keeps the block


def _export_frame(t: torch.Tensor, frames: list[Any]) -> Frame:
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    name = dtype_name(t.dtype)
    # bf16 has no numpy dtype: view the bytes as uint8 (zero-copy).
    raw: Any = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    frames.append(memoryview(raw))  # numpy arrays are buffers (Any: their stubs say otherwise)
    return Frame(index=len(frames) - 1, dtype=name, shape=tuple(t.shape))


def materialize(ref: TensorRef, frames: list[Any]) -> torch.Tensor:
    """A tensor viewing the bytes ``ref`` names; no copy. Refs are checked before any read."""
    if isinstance(ref, Frame):
        return _materialize_frame(ref, frames)
    if isinstance(ref, Shm):
        pool = _require_pool(ref)
        try:
            view = pool.open(ref, received(os.getpid()), _opened.get(ref.lease, 0))
        except (PoolError, ValueError) as e:
            raise TensorError(f"rejected Shm ref: {e}") from None
        _opened[ref.lease] = _opened.get(ref.lease, 0) + 1
        return view
    if isinstance(ref, CudaIpc):
        try:
            return _opener(ref).open(ref)
        except (PoolError, ValueError) as e:
            raise TensorError(f"rejected CudaIpc ref: {e}") from None
    raise TensorError(f"{type(ref).__name__} refs are not supported by this process")


def materialize_all(refs: Mapping[str, TensorRef], frames: list[Any]) -> dict[str, torch.Tensor]:
    """Every tensor of one message, or none: when a ref is refused, those opened before it
    no longer count as opened, so the caller releases the whole message as unopened."""
    tensors: dict[str, torch.Tensor] = {}
    opened: list[Shm | CudaIpc] = []
    try:
        for name, ref in refs.items():
            tensors[name] = materialize(ref, frames)
            if isinstance(ref, Shm | CudaIpc):
                opened.append(ref)
    except BaseException:
        for done in opened:
            if isinstance(done, Shm):
                _count_closed(done.lease)
            else:
                _attached.opener.forget(done)  # its mapping closes with the last ref
        raise
    return tensors


def materialize_owned(refs: Mapping[str, TensorRef], frames: list[Any]) -> dict[str, torch.Tensor]:
    """``materialize_all`` for a receiver whose caller keeps outputs as long as it likes
    (the client): a ``Shm`` tensor stays a view of the pool, with no copy, on storage of
    its own whose last user going releases the ref (until then the block stays
    allocated: ``.clone()`` what is kept for long); other pool-backed ones are copied
    out and released at once."""
    tensors = materialize_all(refs, frames)
    for name, ref in refs.items():
        if isinstance(ref, Shm) and ref.nbytes and _attached.pool is not None:
            tensors[name] = _kept_view(_attached.pool, ref, tensors[name])
        elif not isinstance(ref, Frame):
            tensors[name] = tensors[name].clone()
            release(ref)
    return tensors


def _kept_view(pool: PagePool, ref: Shm, view: torch.Tensor) -> torch.Tensor:
    # A numpy array of its own over the block's bytes: torch keeps it alive as long as any
    # tensor or view shares the storage, and frees it (running the finalizer) after.
    arr = np.frombuffer(pool.mapping, np.uint8, ref.nbytes, ref.offset)
    kept = torch.from_numpy(arr).view(view.dtype).reshape(view.shape)
    weakref.finalize(arr, _release_quietly, ref)
    return kept


def _release_quietly(ref: Shm) -> None:
    pool = _attached.pool
    if pool is None or pool.name != ref.pool:  # the deployment is down: nothing to give back
        _count_closed(ref.lease)
        return
    try:
        release(ref)
    except TensorError:
        pass


def _count_closed(lease: int) -> None:
    left = _opened.pop(lease, 0) - 1
    if left > 0:
        _opened[lease] = left


def _materialize_frame(ref: Frame, frames: list[Any]) -> torch.Tensor:
    if not 1 <= ref.index < len(frames):
        raise TensorError(f"frame ref {ref.index} outside the message's {len(frames)} frames")
    dtype = torch_dtype(ref.dtype)
    buf = frames[ref.index]
    buf = buf.buffer if hasattr(buf, "buffer") else buf  # zmq.Frame -> memoryview
    try:
        nbytes = nbytes_of(ref.dtype, tuple(ref.shape))
    except ValueError as e:
        raise TensorError(f"frame ref {ref.index}: {e}") from None
    if len(buf) != nbytes:
        raise TensorError(
            f"frame {ref.index} holds {len(buf)} bytes, dtype {ref.dtype} shape "
            f"{list(ref.shape)} needs {nbytes}"
        )
    if nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(ref.shape)


def _opener(ref: CudaIpc) -> Any:
    if _attached.opener is None:
        from omniflow.memory.cuda_ipc import IpcOpener  # imports cupy: only when needed

        local = {p.handle: p for p in _attached.device_pools.values()}
        _attached.opener = IpcOpener(_require_pool(ref), local)
    return _attached.opener


def _require_pool(ref: Shm | CudaIpc) -> PagePool:
    if _attached.pool is None:
        raise TensorError(
            f"a {type(ref).__name__} ref arrived but this process has no page pool attached "
            "(omniflow.transport.tensors.attach_pool)"
        )
    return _attached.pool


def release(ref: TensorRef, opened: bool = True) -> None:
    """The receiver's ack: drop its ref on the block behind ``ref`` (no-op for frames).

    Call once per received ``Shm``/``CudaIpc`` ref, when the tensor is no longer used;
    ``opened=False`` for a ref of a message dropped before ``materialize`` (or whose
    ``materialize_all`` failed).
    """
    if isinstance(ref, Frame):
        return
    pool = _require_pool(ref)
    if opened and isinstance(ref, Shm):
        _count_closed(ref.lease)
    if opened and isinstance(ref, CudaIpc) and _attached.opener is not None:
        _attached.opener.release(ref)  # after this process's kernels on it are done
    try:  # only a ref shared to this process: never its own, never an anonymous one
        pool.release(ref.lease, received(os.getpid()), anonymous=False)
    except PoolError as e:
        raise TensorError(f"cannot release {type(ref).__name__} ref: {e}") from None


def revoke(ref: TensorRef, pid: int) -> None:
    """Take back the ref ``export`` gave reader ``pid`` for a message it never got (a send
    that failed); without this the block stays allocated for good once ``pid`` is dead and
    reclaimed. A ref already reclaimed is fine."""
    if isinstance(ref, Frame) or _attached.pool is None:
        return
    try:
        _attached.pool.release(ref.lease, received(pid), anonymous=False)
    except PoolError:
        pass


def release_all(refs: Iterable[TensorRef], opened: bool = True) -> None:
    """``release`` every ref of a message (``msg.tensors.values()``); a ref this process
    holds nothing on (forged, or already reclaimed) is logged and skipped, so that the
    message's other refs still go back."""
    for ref in refs:
        try:
            release(ref, opened)
        except TensorError as e:
            _skipped.note(e)
