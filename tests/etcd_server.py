"""A real etcd server on free loopback ports, for the tests that need one."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ETCD_START_TIMEOUT = 20.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def etcd_binary() -> str | None:
    """``$OMNIFLOW_ETCD_BIN`` if set (a wrong path counts as missing), else etcd on PATH."""
    candidate = os.environ.get("OMNIFLOW_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"
    return candidate if os.access(candidate, os.X_OK) else None


class EtcdServer:
    """One etcd member on free ports (of ``host``: loopback unless told) with its own data dir."""

    def __init__(self, binary: str, data_dir: Path, host: str = "127.0.0.1"):
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"etcd://{host}:{self.client_port}"
        self.log_path = data_dir / "etcd.log"
        client, peer = f"http://{host}:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.argv = [
            binary,
            "--name", "omniflow-test",
            "--data-dir", str(data_dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"omniflow-test={peer}",
        ]  # fmt: skip
        self.health_url = f"{client}/health"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ETCD_START_TIMEOUT
        # etcd has no readiness handshake; /health answers true once it has a leader.
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=1) as reply:
                    if b'"true"' in reply.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd not healthy after {ETCD_START_TIMEOUT}s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    binary = etcd_binary()
    if binary is None:
        message = "etcd server binary not found (apt-get install etcd-server, or OMNIFLOW_ETCD_BIN)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{message}: the etcd tests must run in CI")
        pytest.skip(message)
    server = EtcdServer(binary, tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()
