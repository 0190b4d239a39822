"""Another local user cannot take a deployment over: a run root they made (or may write)
is refused at `up` naming it, a key folder they may write is refused, and a planted
state.json makes `down` signal nothing (issue #40 items 2 and 11).

Needs root (it makes a second user with `useradd`); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.runtime.config import ConfigError, generate_keys, parse
from tests.helpers import cli
from tests.security.gateway_live import KEY, LiveGateway
from tests.security.other_user import other_uid as make_other_user
from tests.security.other_user import second_user_phase, targets

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="makes a second user: needs root")
CONFIG = """
name = "victim"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
[graph]
edges = [{ from = "input", to = "upper" }]
"""


@pytest.fixture(scope="module")
def other_uid() -> int:
    return make_other_user()


@pytest.fixture
def shared(monkeypatch) -> Iterator[Path]:
    """A sticky, world-writable folder standing in for /tmp."""
    top = Path(tempfile.mkdtemp(prefix="ofu-", dir="/tmp"))
    top.chmod(0o1777)
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_up_refuses_a_run_root_another_user_made(shared, other_uid, monkeypatch, mode):
    root = shared / "omniflow-0"
    root.mkdir()
    os.chown(root, other_uid, other_uid)
    root.chmod(mode)
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", str(root))
    (shared / "v.toml").write_text(CONFIG)
    proc = cli("up", str(shared / "v.toml"), "--detach", check=False, timeout=60)
    if proc.returncode == 0:
        cli("down", "--name", "victim", check=False)
    assert proc.returncode != 0
    assert str(root) in proc.stdout + proc.stderr and f"uid {other_uid}" in proc.stderr


def test_up_refuses_a_run_root_of_ours_others_may_write(shared, monkeypatch):
    root = shared / "omniflow-0"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("OMNIFLOW_RUN_ROOT", str(root))
    (shared / "v.toml").write_text(CONFIG)
    proc = cli("up", str(shared / "v.toml"), "--detach", check=False, timeout=60)
    if proc.returncode == 0:
        cli("down", "--name", "victim", check=False)
    assert proc.returncode != 0
    assert f"{root}: writable by group or others" in proc.stderr


def test_a_planted_state_makes_down_signal_nothing(run_root):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        fake = run_root / "fake"
        fake.mkdir(mode=0o700)
        state = {"name": "fake", "pid": bystander.pid, "run_dir": str(fake), "registry": ""}
        (fake / "state.json").write_text(__import__("json").dumps(state))
        proc = cli("down", "--name", "fake", check=False, timeout=30)
        time.sleep(0.3)
        assert bystander.poll() is None, f"down signalled pid {bystander.pid}: {proc.stdout}"
        assert proc.returncode != 0
    finally:
        bystander.kill()
        bystander.wait()


def test_a_key_folder_others_may_write_is_refused(tmp_path, other_uid):
    keys = tmp_path / "keys"
    generate_keys(str(keys))
    raw = {
        "name": "k",
        "roles": {"upper": {"actor": "omniflow.roles.echo:Upper"}},
        "graph": {"edges": [{"from": "input", "to": "upper"}]},
        "runtime": {"transport": "tcp"},
        "security": {"keys": str(keys)},
    }
    parse(raw, "<test>")  # private: fine
    (keys / "authorized").chmod(0o777)  # the other user may add a key it admits
    with pytest.raises(ConfigError, match=f"{keys / 'authorized'}: writable by group"):
        parse(raw, "<test>")
    (keys / "authorized").chmod(0o700)
    os.chown(keys, other_uid, -1)
    with pytest.raises(ConfigError, match=f"{keys}: owned by uid {other_uid}"):
        parse(raw, "<test>")


def test_another_user_reaches_nothing_of_a_live_deployment(other_uid, monkeypatch):
    """The second-user phase of benchmarks/fuzz.py against the gateway deployment: every
    folder, file, socket, pool segment and process of root's deployment, and its gateway
    without the key. Nothing works; the deployment serves on. The default run root starts
    0755, as an older version made it: others could list the deployments in it."""
    monkeypatch.delenv("OMNIFLOW_RUN_ROOT", raising=False)
    default_root = Path(f"/tmp/omniflow-{os.getuid()}")
    default_root.mkdir(mode=0o755, exist_ok=True)
    default_root.chmod(0o755)
    dep = LiveGateway("otheruser")
    try:
        found = targets(dep.rt, dep.url, KEY, "otheruser")
        assert found["sockets"] and found["segments"] and found["files"], found
        result = second_user_phase(found)
        assert result["tried"] >= 10 + len(found["sockets"]) + len(found["files"])
        assert result["breaches"] == []
        status, body, _ = dep.request(
            "POST",
            "/v1/chat/completions",
            {"model": "otheruser", "messages": [{"role": "user", "content": "ok"}]},
        )
        assert status == 200, body
    finally:
        dep.close()
