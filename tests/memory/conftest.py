from __future__ import annotations

import os
import uuid

import pytest

from omniflow.memory import PagePool, unlink_pool


@pytest.fixture
def pool_name() -> str:
    name = f"omniflow-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    unlink_pool(name)


@pytest.fixture
def pool(pool_name: str) -> PagePool:
    p = PagePool.create(pool_name, 16 << 20, page_size=64 << 10)
    yield p
    p.unlink()
    p.close()
