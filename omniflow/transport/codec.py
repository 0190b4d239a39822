"""Header codec: one msgspec-msgpack header per message, tensors out of band.

A message on the wire is ``[header, *buffers]``. ``pack`` exports the tensors a
message carries into refs (and frames, for ``Frame`` refs); ``unpack`` decodes
the header against the union its socket expects. Unknown Python types raise
``TypeError`` at encode time: nothing is ever pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omniflow.messages import Message
from omniflow.transport.tensors import Link, export, materialize


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
    return {name: export(value, frames, link) for name, value in tensors.items()}


def materialize_tensors(refs: dict[str, Any], frames: list[Any]) -> dict[str, Any]:
    return {name: materialize(ref, frames) for name, ref in refs.items()}
