"""Role tests share one folder of tiny models (built on first use by the roles themselves)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("role-models")
