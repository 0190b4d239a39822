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
    return _declared(path, "OPTIONS", "Options")


def params_type(path: str) -> Any:
    """The msgspec Struct of the request parameters ``path``'s actor reads (``PARAMS`` in
    ``<package>.options``, else the class's ``Params``), or None: it declares none."""
    return _declared(path, "PARAMS", "Params")


def makes_of(path: str) -> tuple[str, ...]:
    """The outputs ``path``'s actor makes ("text", "image", "audio"): ``MAKES`` in
    ``<package>.options``, else the class's ``Makes``."""
    return tuple(_declared(path, "MAKES", "Makes") or ())


def _declared(path: str, table: str, attribute: str) -> Any:
    """``table[path]`` in the actor's ``<package>.options`` module where it lists the actor
    (no import of the actor's own module: the shipped roles' torch stays out of the CLI and
    the gateway), else the actor class's ``attribute``."""
    module = path.partition(":")[0]
    package = module.rpartition(".")[0]
    if package:
        try:
            listed = importlib.util.find_spec(f"{package}.options") is not None
        except ImportError:
            listed = False
        if listed:
            found = getattr(_import(f"{package}.options"), table, {}).get(path)
            if found is not None:
                return found
    return getattr(load_actor_class(path), attribute)


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
