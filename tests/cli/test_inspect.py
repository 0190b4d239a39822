"""status, logs and the choice of deployment, with two deployments running."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import cli

# Slow restarts: a killed replica stays "restarting" long enough to be seen.
CONFIG = """
name = "{name}"
[roles.upper]
actor = "omniflow.roles.echo:Upper"
[roles.reverse]
actor = "omniflow.roles.echo:Reverse"
replicas = 2
[graph]
edges = [{{ from = "input", to = "upper" }}, {{ from = "upper", to = "reverse" }}]
[runtime]
restart_backoff_s = 4.0
"""


@pytest.fixture(scope="module")
def two():
    """Deployments alpha and beta under one run root (OMNIFLOW_RUN_ROOT)."""
    root = Path(tempfile.mkdtemp(prefix="of-two-", dir="/tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNIFLOW_RUN_ROOT", str(root / "run"))
        for name in ("alpha", "beta"):
            (root / f"{name}.toml").write_text(CONFIG.format(name=name))
            cli("up", str(root / f"{name}.toml"), "-d")
        try:
            yield root / "run"
        finally:
            for name in ("alpha", "beta"):
                cli("down", "--name", name, check=False)
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    "args", [["status"], ["send", "-t", "hi"], ["down"], ["logs"]], ids=lambda a: a[0]
)
def test_several_deployments_running_is_a_usage_error_naming_them(two, args):
    proc = cli(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "several deployments are running (alpha, beta); pick one with --name" in proc.stderr


def _actors(name):
    return json.loads(cli("status", "--name", name, "--json").stdout)["actors"]


def test_status_shows_a_restarting_replica_with_its_restart_count(two):
    victim = next(a for a in _actors("alpha") if (a["role"], a["replica"]) == ("reverse", 1))
    os.kill(victim["pid"], signal.SIGKILL)
    until = time.monotonic() + 10
    while True:
        row = next(a for a in _actors("alpha") if (a["role"], a["replica"]) == ("reverse", 1))
        if row["state"] == "restarting":
            break
        assert time.monotonic() < until, row
        time.sleep(0.1)
    assert row["restarts"] == 1 and row["endpoint"] == ""
    table = cli("status", "--name", "alpha").stdout
    line = next(x for x in table.splitlines() if "reverse" in x and " 1 " in x and "restart" in x)
    assert line.split("│")[5].strip() == "restarting" and line.split("│")[8].strip() == "1"
    # Piped, the table is not cropped to 80 columns: endpoints print whole.
    assert str(two / "alpha" / "upper-0.sock") in table
    until = time.monotonic() + 30
    while row["state"] != "ready":
        assert time.monotonic() < until, row
        time.sleep(0.2)
        row = next(a for a in _actors("alpha") if (a["role"], a["replica"]) == ("reverse", 1))
    assert row["restarts"] == 1 and row["pid"] != victim["pid"] and row["endpoint"]


def test_logs_lists_and_prints_a_role_s_logs(two):
    logs = two / "beta" / "logs"
    (logs / "reverse-0.log").open("a").write("zero says hi\n")
    (logs / "reverse-1.log").open("a").write("one says hi\n")
    listed = cli("logs", "--name", "beta").stdout
    for stem in ("upper-0", "reverse-0", "reverse-1", "supervisor"):
        assert stem in listed
    both = cli("logs", "reverse", "--name", "beta").stdout
    assert "zero says hi" in both and "one says hi" in both
    assert f"==> {logs / 'reverse-0.log'} <==" in both
    one = cli("logs", "reverse-1", "--name", "beta", "-l", "1").stdout
    assert one == "one says hi\n"
    missing = cli("logs", "nope", "--name", "beta", check=False)
    assert missing.returncode == 2 and "no log of 'nope'" in missing.stderr


def test_logs_follow_prints_what_is_added(two):
    path = two / "beta" / "logs" / "upper-0.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omniflow.cli", "logs", "upper", "-f", "-l", "0", "--name", "beta"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Lines written before the follower starts are not "added": write until one shows.
        for n in range(50):
            with path.open("a") as log:
                log.write(f"late line {n}\n")
            ready, _, _ = select.select([proc.stdout], [], [], 0.3)
            if ready:
                break
        assert ready, "nothing followed"
        assert proc.stdout.readline().startswith("late line ")
    finally:
        proc.terminate()
        proc.wait(5)


def test_logs_of_a_stopped_deployment_stay_readable(tmp_path):
    (tmp_path / "gone" / "logs").mkdir(parents=True)
    (tmp_path / "gone" / "logs" / "llm-0.log").write_text("last words\n")
    proc = cli("logs", "llm", "--run-dir", str(tmp_path / "gone"))
    assert proc.stdout == "last words\n"
