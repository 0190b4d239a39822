"""Each shipped role's options Struct: listed for the config loader, and what the role uses."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import omniflow.roles
from omniflow.roles.base import ModelActor
from omniflow.roles.llm import LLMRole
from omniflow.roles.options import OPTIONS, LLMOptions
from omniflow.runtime.actor import Actor
from omniflow.runtime.loading import load_actor_class, options_type
from omniflow.runtime.tables import FieldError


def _shipped_actors() -> dict[str, type[Actor]]:
    found = {}
    for info in pkgutil.iter_modules(omniflow.roles.__path__):
        module = importlib.import_module(f"omniflow.roles.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Actor) and cls.__module__ == module.__name__ and name[0] != "_":
                found[f"{module.__name__}:{name}"] = cls
    return found


def test_the_loader_finds_the_struct_each_role_declares():
    for path, cls in _shipped_actors().items():
        assert options_type(path) is cls.Options, path
    for path, struct in OPTIONS.items():
        assert load_actor_class(path).Options is struct, path


def test_every_serving_role_with_options_is_listed():
    # A role outside OPTIONS would still be checked, by importing its module (and torch).
    for path, cls in _shipped_actors().items():
        if cls.Options not in (None, ModelActor.Options):  # bases: ModelActor, CachingEncoder
            assert path in OPTIONS, path


def test_a_role_takes_its_options_as_the_struct(tmp_path):
    actor = LLMRole("llm", 0, {"model_path": str(tmp_path), "max_tokens": 9})
    assert isinstance(actor.options, LLMOptions)
    assert (actor.options.max_tokens, actor.options.threads, actor.options.build_tiny) == (
        9,
        1,
        False,
    )


def test_a_role_built_in_code_checks_its_options_too(tmp_path):
    with pytest.raises(FieldError, match=r"^\[roles.x.options\] model_path: .* does not exist"):
        LLMRole("x", 0, {"model_path": str(tmp_path / "nothing")})
    assert not (tmp_path / "nothing").exists()
    with pytest.raises(FieldError, match=r"^\[roles.x.options\] steps: unknown option"):
        LLMRole("x", 0, {"model_path": str(tmp_path), "steps": 2})


def test_an_ssd_kv_tier_without_a_host_tier_is_refused_by_name(tmp_path):
    """KV pages reach the SSD tier from the host tier: ``ssd_kv_mb`` alone would give no
    SSD tier at all, silently."""
    with pytest.raises(FieldError, match=r"^\[roles.llm.options\] ssd_kv_mb: needs host_kv_mb"):
        LLMRole("llm", 0, {"model_path": str(tmp_path), "ssd_kv_mb": 4})
    LLMRole("llm", 0, {"model_path": str(tmp_path), "ssd_kv_mb": 4, "host_kv_mb": 8})
