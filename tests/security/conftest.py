"""One live deployment per module, and a probe speaking raw ZeroMQ to its actor."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.security.live import LiveDeployment, Probe, tensor_config

# CI-sized by default; OMNIFLOW_FUZZ=long (or --hypothesis-profile=long) for a deep run.
_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=60, **_COMMON)
settings.register_profile("long", max_examples=5000, **_COMMON)
settings.load_profile(os.environ.get("OMNIFLOW_FUZZ", "ci"))


def pytest_collection_modifyitems(config, items):
    if settings.default.max_examples > 100:  # a long run: past the suite's 120 s timeout
        here = Path(__file__).parent
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(pytest.mark.timeout(3600))


@pytest.fixture(scope="module")
def run_root_module() -> Iterator[Path]:
    """A short run root for the module's deployments (ipc:// paths fit in 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="ofs-", dir="/tmp"))
    old = os.environ.get("OMNIFLOW_RUN_ROOT")
    os.environ["OMNIFLOW_RUN_ROOT"] = str(root)
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("OMNIFLOW_RUN_ROOT", None)
        else:
            os.environ["OMNIFLOW_RUN_ROOT"] = old
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def live(run_root_module: Path) -> Iterator[LiveDeployment]:
    dep = LiveDeployment(tensor_config(f"sec{os.getpid() % 10000}"))
    try:
        yield dep
    finally:
        dep.close()


@pytest.fixture
def probe(live: LiveDeployment) -> Iterator[Probe]:
    p = Probe(live.replica.endpoint, str(live.rt.supervisor.run_dir))
    try:
        yield p
    finally:
        p.close()
