"""A request's parameters and inputs checked against what the deployment's roles read,
before anything is sent: the Python API (``Runtime``, ``connect``) refuses what
``omniflow send`` and the gateway refuse.

Each role declares the parameters it reads (``Params``, a msgspec Struct; the shipped
roles' are ``PARAMS`` in omniflow/roles/options.py). A key that no role of the deployment
declares is refused, naming it, and so is a value of the wrong type or shape; ranges are
the roles' to check (a bad one comes back as ``bad_request``). A deployment with a role
that declares nothing takes any parameter and any input.

Whatever the roles declare, a request is refused early (before any tokenizer or wire
sees it) for an integer past 64 bits anywhere (the wire's msgpack cannot carry it) and
for a string longer than ``[runtime] max_prompt_chars``, naming the field.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from omniflow.messages import MAX_CALLER_ID_BYTES
from omniflow.runtime.config import Config
from omniflow.runtime.loading import params_type

# What a client hands the input: the only keys the shipped roles read from it.
INPUT_KEYS = ("text", "image", "images", "audio")
# Parameters the runtime itself adds (a migrated request's ``resume``), read by the roles.
INTERNAL_PARAMS = ("resume",)


# msgpack carries int64 and uint64; a seed needs room for the ``+ i`` of n choices.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
_MAX_DEPTH = 32  # deeper params or inputs are not plain data a role reads


class InvalidRequest(ValueError):
    """A parameter or an input the deployment would refuse; the message names it
    (``field``: the name alone, as ``params.seed``)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def check_values(value: Any, where: str, max_chars: int, depth: int = 0) -> None:
    """Refuse an int outside 64 bits and a str past ``max_chars`` anywhere in ``value``
    (dicts and lists walked), naming its path from ``where``."""
    kind = type(value)
    if kind is int:
        if not INT_MIN <= value <= INT_MAX:
            digits = len(str(abs(value))) if value.bit_length() < 10_000 else "thousands of"
            raise InvalidRequest(
                f"{where}: an integer of {digits} digits is out of range "
                f"(a 64-bit integer, {INT_MIN}..{INT_MAX})",
                where,
            )
    elif kind is str:
        if len(value) > max_chars:
            raise InvalidRequest(
                f"{where}: {len(value)} characters, more than [runtime] max_prompt_chars "
                f"({max_chars})",
                where,
            )
    elif kind is dict or kind is list or kind is tuple:
        if depth >= _MAX_DEPTH:
            raise InvalidRequest(f"{where}: nested deeper than {_MAX_DEPTH}", where)
        items = value.items() if kind is dict else enumerate(value)
        for key, item in items:
            path = f"{where}.{key}" if kind is dict else f"{where}[{key}]"
            check_values(item, path, max_chars, depth + 1)


def declared(config: Config) -> dict[str, list[Any]] | None:
    """Each parameter some graph role reads, with the types it takes (without ranges);
    None when a role declares nothing (it may read any key)."""
    types: dict[str, list[Any]] = {}
    for role in config.roles.values():
        schema = params_type(role.actor)
        if schema is None:
            return None
        # get_type_hints without extras drops Annotated: the type, not the Meta range.
        for key, hint in typing.get_type_hints(schema).items():
            types.setdefault(key, []).append(hint)
    return types


def check_params(params: Mapping[str, Any], config: Config, prefix: str = "params.") -> None:
    """Refuse a key no role reads and a value no role could take, naming the key."""
    types = declared(config)
    if types is None:
        return
    for key, value in params.items():
        if key in INTERNAL_PARAMS:
            continue
        if key not in types:
            near = difflib.get_close_matches(key, types, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            known = ", ".join(sorted(types)) or "none"
            raise InvalidRequest(
                f"{prefix}{key}: no role of {config.name} reads it{hint}; known: {known}"
            )
        errors = []
        for hint in types[key]:
            try:
                msgspec.convert(value, hint)
            except msgspec.ValidationError as e:
                errors.append(str(e))
        if len(errors) == len(types[key]):
            raise InvalidRequest(f"{prefix}{key}={json.dumps(value, default=repr)}: {errors[0]}")


def check_inputs(inputs: Mapping[str, Any], config: Config) -> None:
    """Refuse an input key that no shipped role reads (``txt`` for ``text``)."""
    if declared(config) is None:
        return
    for key in inputs:
        if key not in INPUT_KEYS:
            near = difflib.get_close_matches(key, INPUT_KEYS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise InvalidRequest(
                f"inputs.{key}: no role of {config.name} reads it{hint}; "
                f"known: {', '.join(INPUT_KEYS)}"
            )


def check_request(
    config: Config, inputs: Mapping[str, Any] | None, kwargs: Mapping[str, Any]
) -> None:
    """The inputs and ``params`` of a ``stream``/``call`` (keyword arguments ``kwargs``)."""
    check_inputs(inputs or {}, config)
    params = kwargs.get("params") or {}
    check_params(params, config)
    max_chars = config.runtime.max_prompt_chars
    check_values(dict(inputs or {}), "inputs", max_chars)
    check_values(dict(params), "params", max_chars)
    request_id = kwargs.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise InvalidRequest(
                f"request_id: a string, not {type(request_id).__name__}", "request_id"
            )
        if len(request_id.encode()) > MAX_CALLER_ID_BYTES:
            raise InvalidRequest(
                f"request_id: {len(request_id.encode())} bytes, more than {MAX_CALLER_ID_BYTES}",
                "request_id",
            )
