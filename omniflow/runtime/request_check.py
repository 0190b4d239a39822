"""A request's parameters and inputs checked against what the deployment's roles read,
before anything is sent: the Python API (``Runtime``, ``connect``) refuses what
``omniflow send`` and the gateway refuse.

Each role declares the parameters it reads (``Params``, a msgspec Struct; the shipped
roles' are ``PARAMS`` in omniflow/roles/options.py). A key that no role of the deployment
declares is refused, naming it, and so is a value of the wrong type or shape; ranges are
the roles' to check (a bad one comes back as ``bad_request``). A deployment with a role
that declares nothing takes any parameter and any input.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from omniflow.runtime.config import Config
from omniflow.runtime.loading import params_type

# What a client hands the input: the only keys the shipped roles read from it.
INPUT_KEYS = ("text", "image", "images", "audio")
# Parameters the runtime itself adds (a migrated request's ``resume``), read by the roles.
INTERNAL_PARAMS = ("resume",)


class InvalidRequest(ValueError):
    """A parameter or an input the deployment would refuse; the message names it."""


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
    check_params(kwargs.get("params") or {}, config)
