"""Header codec: one msgspec-msgpack header per message, tensors out of band.

A message on the wire is ``[header, *buffers]``. ``encode``/``decode`` handle the
header (decoded against the union its socket expects); ``export_tensors`` turns the
tensors a message carries into refs (and frames, for ``Frame`` refs) and
``materialize_tensors`` turns them back. Unknown Python types raise ``TypeError`` at
encode time: nothing is ever pickled. torch is imported only when a tensor travels.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from omniflow.messages import Message
from omniflow.transport.links import Link


def _refuse(obj: Any) -> Any:
    raise TypeError(
        f"cannot put a {type(obj).__name__} on the wire: use plain data "
        "(str, int, float, bool, None, bytes, list, dict) or pass tensors separately"
    )


_encoder = msgspec.msgpack.Encoder(enc_hook=_refuse)
_message_decoder = msgspec.msgpack.Decoder(Message)


class BadMessage(ValueError):
    """Bytes that are not a valid omniflow message."""


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decoder_for(union: Any) -> msgspec.msgpack.Decoder:
    """A decoder typed to what one socket receives."""
    return msgspec.msgpack.Decoder(union)


def decode(header: bytes | memoryview, decoder: msgspec.msgpack.Decoder = _message_decoder) -> Any:
    try:
        return decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessage(f"malformed message header: {e}") from None


def export_tensors(
    tensors: dict[str, Any], frames: list[Any], link: Link = Link()
) -> dict[str, Any]:
    """Refs for ``tensors``; bytes that must travel are appended to ``frames``."""
    from omniflow.transport.tensors import export

    return {name: export(value, frames, link) for name, value in tensors.items()}


def materialize_tensors(refs: dict[str, Any], frames: list[Any]) -> dict[str, Any]:
    if not refs:
        return {}
    from omniflow.transport.tensors import materialize

    return {name: materialize(ref, frames) for name, ref in refs.items()}


def release_tensors(refs: Collection[Any]) -> None:
    """Release every ref of a message (``msg.tensors.values()``); see ``tensors.release``."""
    if refs:
        from omniflow.transport.tensors import release_all

        release_all(refs)


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
