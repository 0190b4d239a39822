"""Tiny omni models, built once per test session into a temporary folder and loaded back."""

from __future__ import annotations

import pytest
import torch

from omniflow.models.omni import KINDS, build_tiny, load_model


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # The machine's cores are shared; the tiny models gain nothing from more threads.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni-models")
    return {kind: build_tiny(kind, root / kind, seed=0) for kind in KINDS}


@pytest.fixture(scope="session")
def models(model_dirs):
    return {kind: load_model(kind, path) for kind, path in model_dirs.items()}
