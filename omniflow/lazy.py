"""Package faces that import on first use: ``__getattr__ = exports(__name__, where)``.

A package whose members pull in heavy dependencies (torch) names them here, so that
importing one light member (a config type, an ``Actor`` base) loads only its module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that finds ``name`` in the module ``where[name]``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # the next lookup skips this function
        return value

    return __getattr__
