"""TOML tables → msgspec Structs, one field at a time, so an error names its table and field.

``msgspec.convert`` on a whole config reports a failure as text (``... - at `$.roles[...]```),
which names neither a dict key nor an unknown field. Here each Struct is walked field by
field: unknown and missing keys are found by comparing names, and msgspec converts only
scalars (its ``Meta`` ranges and patterns apply), so its message needs no location parsed
out of it. Nested Structs, dicts and lists recurse with the table path extended.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Literal, TypeVar, Union

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


class FieldError(ValueError):
    """A bad value at ``[table] field``. ``__post_init__`` of an options Struct may raise it
    with only ``field``; the walker fills in the table."""

    def __init__(self, field: str, message: str, table: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.table = table

    def where(self) -> str:
        table = f"[{'.'.join(self.table)}] " if self.table else ""
        return f"{table}{self.field}" if self.field else table.strip()

    def __str__(self) -> str:
        return f"{self.where()}: {self.message}"


def decode(raw: Any, cls: type[S], table: tuple[str, ...] = (), noun: str = "field") -> S:
    """``raw`` (a decoded TOML table) as ``cls``; ``noun`` names a key in errors."""
    if not isinstance(raw, dict):
        raise FieldError(
            table[-1] if table else "", f"expected a table, got {_kind(raw)}", table[:-1]
        )
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise FieldError(str(key), f"unknown {noun}{hint}", table)
    for name, f in fields.items():
        if f.required and name not in raw:
            raise FieldError(name, f"missing (a required {noun})", table)
    values = {fields[key].name: _value(v, fields[key].type, table, key) for key, v in raw.items()}
    try:
        return cls(**values)
    except FieldError as e:  # from __post_init__: a check across fields
        raise FieldError(e.field, e.message, table) from None


def _value(value: Any, tp: Any, table: tuple[str, ...], field: str) -> Any:
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp
    origin = typing.get_origin(base)
    if origin in (Union, types.UnionType) and isinstance(value, dict):
        structs = [a for a in typing.get_args(base) if _is_struct(a)]
        base = structs[0] if len(structs) == 1 else base  # an optional table: `T | None`
    if _is_struct(base):
        return decode(value, base, (*table, field))
    if origin is dict and _has_struct(base):
        if not isinstance(value, dict):
            raise FieldError(field, f"expected a table, got {_kind(value)}", table)
        value_type = typing.get_args(base)[1]
        value = {k: _value(v, value_type, (*table, field), k) for k, v in value.items()}
    elif origin is dict and isinstance(value, dict):
        value_type = typing.get_args(base)[1]
        value = {k: _value(v, value_type, table, f"{field}.{k}") for k, v in value.items()}
    elif origin is list and isinstance(value, list):
        item = typing.get_args(base)[0]
        struct = isinstance(item, type) and issubclass(item, msgspec.Struct)
        value = [
            decode(v, item, (*table, f"{field}[{i}]"))
            if struct
            else _value(v, item, table, f"{field}[{i}]")
            for i, v in enumerate(value)
        ]
    elif origin is Literal and value not in typing.get_args(base):
        choices = ", ".join(_show(c) for c in typing.get_args(base))
        raise FieldError(field, f"{_show(value)} is not one of {choices}", table)
    try:
        return msgspec.convert(value, tp)
    except msgspec.ValidationError as e:
        # At the top level msgspec's message carries no location: "Expected `int` >= 1".
        text = str(e).replace("`", "")
        raise FieldError(f"{field} = {_show(value)}", text[:1].lower() + text[1:], table) from None


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _has_struct(tp: Any) -> bool:
    args = typing.get_args(tp)
    return bool(args) and isinstance(args[-1], type) and issubclass(args[-1], msgspec.Struct)


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _show(value: Any) -> str:
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe(tp: Any) -> tuple[str, str, str]:
    """(type, range or choices, description) of a field's annotation, for the README."""
    limits: list[str] = []
    description = ""
    for m in _metas(tp):
        description = m.description or description
        for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, name) is not None:
                limits.append(f"{op} {getattr(m, name)}")
        if m.min_length is not None:
            limits.append(f"length >= {m.min_length}")
        if m.pattern is not None:
            limits.append(f"matches `{m.pattern}`")
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp
    if typing.get_origin(base) is Literal:
        return "str", " or ".join(_show(c) for c in typing.get_args(base)), description
    return _type_name(base), ", ".join(limits), description


def _metas(tp: Any) -> list[msgspec.Meta]:
    """The Meta of ``tp`` and of a union's members."""
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        return [m for m in extras if isinstance(m, msgspec.Meta)] + _metas(base)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [m for arg in typing.get_args(tp) for m in _metas(arg)]
    return []


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Annotated:
        return _type_name(typing.get_args(tp)[0])
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))
