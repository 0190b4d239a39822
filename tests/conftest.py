"""Shared fixtures: short run directories (ipc:// paths are limited to 107 bytes)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.etcd_server import etcd_server  # noqa: F401  (a session fixture)
from tests.watchdog import Watchdog

# The shipped configs' gateways bind port 8000; `omniflow up` in tests takes any free one.
os.environ.setdefault("OMNIFLOW_GATEWAY_PORT", "0")

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False


def pytest_configure(config):
    config.pluginmanager.register(Watchdog(config), "omniflow-watchdog")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not keywords: a folder named gpu
            item.add_marker(skip)


@pytest.fixture
def run_root(monkeypatch) -> Path:
    """A fresh, short run root; deployments started by the test live under it."""
    root = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def leftover_sockets(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.sock")]


@pytest.fixture
def etcd_url(etcd_server) -> str:  # noqa: F811
    return etcd_server.url
