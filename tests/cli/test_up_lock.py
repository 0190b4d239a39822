"""Two `omniflow up` of one deployment at once: one runs, the other is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.cli.conftest import ECHO_TOML
from tests.helpers import cli, expected_echo


def test_two_ups_of_one_deployment_at_once():
    run_dir = Path(tempfile.mkdtemp(prefix="of-2up-", dir="/tmp")) / "echo"
    command = [sys.executable, "-m", "omniflow.cli", "up", ECHO_TOML, "-d"]
    procs = [
        subprocess.Popen(
            [*command, "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        ends = [p.communicate(timeout=180) for p in procs]
        codes = sorted(p.returncode for p in procs)
        assert codes == [0, 1], ends
        loser = ends[[p.returncode for p in procs].index(1)]
        assert "already running" in loser[1], loser
        # The winner is whole: it answers, and stops cleanly.
        sent = cli("send", "--run-dir", str(run_dir), "-t", "ok", "--json")
        assert json.loads(sent.stdout)["text"] == "".join(expected_echo("ok"))
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    assert not list(run_dir.glob("*.sock"))
