"""Role tests share one folder of tiny models (built on first use by the roles themselves)."""

from __future__ import annotations

import pytest

from tests.torch_threads import one_torch_thread  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("role-models")
