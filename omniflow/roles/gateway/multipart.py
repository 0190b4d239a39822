"""multipart/form-data bodies (/v1/images/edits), read with the standard library's MIME
parser: {field name: [bytes, ...]} in the order sent."""

from __future__ import annotations

from email.parser import BytesParser
from email.policy import HTTP

from omniflow.roles.gateway.schema import ApiError


def form_fields(content_type: bytes | None, body: bytes) -> dict[str, list[bytes]]:
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        raise ApiError(400, "expected a multipart/form-data body", "body")
    head = b"Content-Type: " + content_type + b"\r\nMIME-Version: 1.0\r\n\r\n"
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise ApiError(400, "the multipart body has no parts", "body")
    fields: dict[str, list[bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise ApiError(400, "a form part without a name", "body")
        payload = part.get_payload(decode=True)
        fields.setdefault(name, []).append(payload if isinstance(payload, bytes) else b"")
    return fields


def text_field(fields: dict[str, list[bytes]], name: str) -> str | None:
    values = fields.get(name)
    if not values:
        return None
    try:
        return values[0].decode()
    except UnicodeDecodeError:
        raise ApiError(400, "not UTF-8 text", name) from None
