"""A request's parameters as `omniflow send` builds them, checked before anything is sent.

Each role declares the parameters it reads (``Params``, a msgspec Struct; the shipped
roles' are ``PARAMS`` in omniflow/roles/options.py). A key that no role of the deployment
declares is refused, naming it, and so is a value of the wrong type or shape; ranges are
the roles' to check (a bad one comes back as ``bad_request``). A deployment with a role
that declares nothing takes any key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from omniflow.runtime.config import Config
from omniflow.runtime.image_grid import SizeError, longcat_grid
from omniflow.runtime.request_check import InvalidRequest, check_params, check_values, declared

WANT = ("text", "image", "audio")
SIZE = re.compile(r"auto|[1-9][0-9]{0,5}x[1-9][0-9]{0,5}")


class ParamError(ValueError):
    """A parameter the deployment would refuse; the message names it."""


def parse_pairs(items: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as a dict; a VALUE that parses as JSON is that JSON value."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ParamError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
        except ValueError as e:  # an integer of thousands of digits
            raise ParamError(f"--param {key}: {e}") from None
    return params


def check_want(want: str) -> str:
    kinds = [w.strip() for w in want.split(",")]
    wrong = [k for k in kinds if k not in WANT]
    if wrong or not kinds:
        raise ParamError(f"--want {want!r}: expected some of {','.join(WANT)}, got {wrong}")
    return ",".join(kinds)


def check_size(size: str) -> str:
    if not SIZE.fullmatch(size):
        raise ParamError(f"--size {size!r}: expected WIDTHxHEIGHT (e.g. 512x512) or auto")
    return size


def map_size(params: dict[str, Any], config: Config, where: str = "--size") -> None:
    """On a deployment whose roles read ``image_grid`` and not ``size`` (LongCat), ``size``
    becomes that token grid, as the gateway maps it; a side that is no LongCat side is
    refused, naming ``where`` and the two nearest sides."""
    types = declared(config)
    if "size" not in params or types is None or "size" in types or "image_grid" not in types:
        return
    if "image_grid" in params:
        raise ParamError(f"{where} and --param image_grid: give one of them")
    size = params.pop("size")
    try:
        if not isinstance(size, str):
            raise SizeError(f"expected WIDTHxHEIGHT, got {size!r}")
        params["image_grid"] = longcat_grid(size)
    except SizeError as e:
        raise ParamError(f"{where} {size}: {e}") from None


def check(params: dict[str, Any], config: Config, inputs: dict[str, Any] | None = None) -> None:
    """Refuse a key no role reads and a value no role could take, naming the key; and an
    integer past 64 bits or a text past ``[runtime] max_prompt_chars``."""
    try:
        check_params(params, config, prefix="--param ")
        max_chars = config.runtime.max_prompt_chars
        for key, value in params.items():
            check_values(value, f"--param {key}", max_chars)
        if inputs and isinstance(inputs.get("text"), str):
            check_values(inputs["text"], "--text", max_chars)
    except InvalidRequest as e:
        raise ParamError(str(e)) from None
