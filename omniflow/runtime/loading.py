"""Actor classes and their option Structs, found through a config's actor strings.

The runtime never imports a role statically (the layers point down); it imports what a
config names. To check options at load without importing a role's module (and with it
torch), a package may list its actors' option Structs in a light sibling module
``<package>.options`` as ``OPTIONS = {"package.module:Class": Struct}``; omniflow.roles
does. Other actors are imported and their ``Options`` attribute read (None: any table).
Likewise ``PARAMS`` and ``Params``: the request parameters an actor reads.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from omniflow.runtime.actor import Actor


def load_actor_class(path: str) -> type[Actor]:
    module, _, name = path.partition(":")
    cls = getattr(_import(module), name, None)
    if cls is None:
        raise AttributeError(f"module {module} has no {name}")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{path} is not an omniflow.Actor subclass")
    return cls


def options_type(path: str) -> Any:
    """The msgspec Struct that ``path``'s actor takes as options, or None for any table."""
    module = path.partition(":")[0]
    package = module.rpartition(".")[0]
    if package:
        try:
            listed = importlib.util.find_spec(f"{package}.options") is not None
        except ImportError:
            listed = False
        if listed:
            found = getattr(_import(f"{package}.options"), "OPTIONS", {}).get(path)
            if found is not None:
                return found
    return load_actor_class(path).Options


def params_type(path: str) -> Any:
    """The msgspec Struct of the request parameters ``path``'s actor reads (``PARAMS`` in
    ``<package>.options``, else the class's ``Params``), or None: it declares none."""
    module = path.partition(":")[0]
    package = module.rpartition(".")[0]
    if package:
        try:
            listed = importlib.util.find_spec(f"{package}.options") is not None
        except ImportError:
            listed = False
        if listed:
            found = getattr(_import(f"{package}.options"), "PARAMS", {}).get(path)
            if found is not None:
                return found
    return load_actor_class(path).Params


def _import(module: str) -> ModuleType:
    # A worker runs `python -m ...` from the deployment's working directory, so modules there
    # import; the `omniflow` script does not have it on sys.path.
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    finally:
        if added:
            sys.path.remove(cwd)
