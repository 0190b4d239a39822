"""Header codec: one msgspec-msgpack header per message, tensors out of band.

A message on the wire is ``[header, *buffers]``. ``encode``/``decode`` handle the
header (decoded against the union its socket expects); ``export_tensors`` turns the
tensors a message carries into refs (and frames, for ``Frame`` refs) and
``materialize_tensors`` turns them back. Unknown Python types raise ``TypeError`` at
encode time: nothing is ever pickled. torch is imported only when a tensor travels.

Hostile input: ``decode`` refuses a header over ``MAX_HEADER_BYTES``, unknown tags,
undeclared fields, msgpack extension types and nesting too deep to decode;
``check_parts`` refuses a message whose frames do not match its tensor refs (too
many, missing, unreferenced, reused) or whose tensors sum past ``MAX_TENSOR_BYTES``.
Both raise ``BadMessage`` naming the request and the field, before any buffer is read.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from omniflow.cache.dtypes import nbytes_of
from omniflow.messages import Frame, Message
from omniflow.transport.links import Link

MAX_HEADER_BYTES = 64 << 20  # media may ride inline (base64 from the gateway)
MAX_FRAMES = 1 + 1024  # the header and one frame per tensor
MAX_TENSOR_BYTES = 16 << 30  # all tensors of one message, frames and pool refs alike


def _refuse(obj: Any) -> Any:
    raise TypeError(
        f"cannot put a {type(obj).__name__} on the wire: use plain data "
        "(str, int, float, bool, None, bytes, list, dict) or pass tensors separately"
    )


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise msgspec.ValidationError(f"msgpack extension type {code} is not part of the protocol")


_encoder = msgspec.msgpack.Encoder(enc_hook=_refuse)
_message_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_refuse_ext)


class BadMessage(ValueError):
    """Bytes that are not a valid omniflow message."""


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decoder_for(union: Any) -> msgspec.msgpack.Decoder:
    """A decoder typed to what one socket receives."""
    return msgspec.msgpack.Decoder(union, ext_hook=_refuse_ext)


def decode(header: bytes | memoryview, decoder: msgspec.msgpack.Decoder = _message_decoder) -> Any:
    if len(header) > MAX_HEADER_BYTES:
        raise BadMessage(f"message header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessage(f"malformed message header: {e}") from None
    except RecursionError:
        raise BadMessage("malformed message header: nested too deep") from None


def check_parts(msg: Any, parts: list[Any]) -> None:
    """``msg``'s tensor refs against the frames it came with: each frame after the header
    named by exactly one ``Frame`` ref, sizes and the message's total within limits."""
    where = f"request {getattr(msg, 'request_id', '?')!r}"
    if len(parts) > MAX_FRAMES:
        raise BadMessage(f"{where}: {len(parts)} frames, more than {MAX_FRAMES}")
    refs = getattr(msg, "tensors", None) or {}
    used: set[int] = set()
    total = 0
    for name, ref in refs.items():
        try:
            nbytes = nbytes_of(ref.dtype, tuple(ref.shape))
        except ValueError as e:
            raise BadMessage(f"{where}: tensors[{name!r}]: {e}") from None
        total += nbytes
        if total > MAX_TENSOR_BYTES:
            raise BadMessage(
                f"{where}: tensors[{name!r}]: {total} tensor bytes in one message, "
                f"more than {MAX_TENSOR_BYTES}"
            )
        if isinstance(ref, Frame):
            if ref.index >= len(parts) or ref.index in used:
                raise BadMessage(
                    f"{where}: tensors[{name!r}] names frame {ref.index}, which is "
                    f"{'taken' if ref.index in used else 'missing'} ({len(parts)} frames)"
                )
            used.add(ref.index)
            size = len(parts[ref.index])
            if size != nbytes:
                raise BadMessage(
                    f"{where}: tensors[{name!r}]: frame {ref.index} holds {size} bytes, dtype "
                    f"{ref.dtype} shape {list(ref.shape)} needs {nbytes}"
                )
    if len(used) != len(parts) - 1:
        raise BadMessage(
            f"{where}: {len(parts) - 1} frames after the header, {len(used)} named by tensors"
        )


def export_tensors(
    tensors: dict[str, Any], frames: list[Any], link: Link = Link()
) -> dict[str, Any]:
    """Refs for ``tensors``; bytes that must travel are appended to ``frames``."""
    from omniflow.transport.tensors import export

    return {name: export(value, frames, link) for name, value in tensors.items()}


def materialize_tensors(
    refs: dict[str, Any], frames: list[Any], owned: bool = False
) -> dict[str, Any]:
    """Every tensor of a message, or none opened; see ``tensors.materialize_all``
    (``owned``: ``tensors.materialize_owned``, pool blocks copied out and released)."""
    if not refs:
        return {}
    from omniflow.transport.tensors import materialize_all, materialize_owned

    return materialize_owned(refs, frames) if owned else materialize_all(refs, frames)


def release_tensors(refs: Collection[Any], opened: bool = True) -> None:
    """Release every ref of a message (``msg.tensors.values()``); ``opened=False`` for a
    message dropped before its tensors were materialized. See ``tensors.release``."""
    if refs:
        from omniflow.transport.tensors import release_all

        release_all(refs, opened)


def revoke_tensors(refs: Collection[Any], pid: int) -> None:
    """Take back refs exported for reader ``pid`` that never reached it; see ``tensors.revoke``."""
    if refs:
        from omniflow.transport.tensors import revoke

        for ref in refs:
            revoke(ref, pid)


def split_output(output: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plain data and tensors (torch or numpy) of one output."""
    data: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    tensor_types = _tensor_types()
    for key, value in output.items():
        # Plain values by exact type first: isinstance against torch.Tensor goes through
        # its metaclass's __instancecheck__, slower than the rest of a hop's routing.
        if type(value) not in _PLAIN and tensor_types and isinstance(value, tensor_types):
            tensors[key] = value
        else:
            data[key] = value
    return data, tensors


_PLAIN = frozenset({str, int, float, bool, bytes, list, dict, tuple, type(None)})


def _tensor_types() -> tuple[type, ...]:
    # A value can only be a tensor of a library that is already imported: asking
    # sys.modules keeps processes that never see a tensor free of torch and numpy.
    types: tuple[type, ...] = ()
    if (torch := sys.modules.get("torch")) is not None:
        types += (torch.Tensor,)
    if (np := sys.modules.get("numpy")) is not None:
        types += (np.ndarray,)
    return types
