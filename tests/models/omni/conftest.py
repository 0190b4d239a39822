"""Tiny omni models, built once per test session into a temporary folder and loaded back."""

from __future__ import annotations

import pytest

from omniflow.models.omni import KINDS, build_tiny, load_model
from tests.torch_threads import one_torch_thread  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni-models")
    return {kind: build_tiny(kind, root / kind, seed=0) for kind in KINDS}


@pytest.fixture(scope="session")
def models(model_dirs):
    return {kind: load_model(kind, path) for kind, path in model_dirs.items()}
