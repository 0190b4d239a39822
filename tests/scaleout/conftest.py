"""Three hosts as network namespaces, one etcd on the bridge, a LongCat deployment over them."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from omniflow.memory.segment import unlink_pool
from omniflow.runtime.config import generate_keys
from tests.etcd_server import EtcdServer, etcd_binary
from tests.helpers import prebuilt_longcat
from tests.scaleout.netns import Hosts, namespaces_or_skip

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("a", "b", "c")
# Every host runs an llm; each encoder and decoder lives on one host only, so a request
# with an image and audio in and audio out crosses all three whichever llm it gets.
ROLES = {
    "a": ["vision_encoder", "llm"],
    "b": ["audio_encoder", "llm"],
    "c": ["image_decoder", "audio_decoder", "llm"],
}


@dataclass
class Cluster:
    hosts: Hosts
    etcd: EtcdServer
    name: str
    config: Path
    work: Path
    env: dict[str, str]

    def up(self, host: str, *extra: str) -> None:
        self.hosts.omniflow(host, "up", str(self.config), "--detach", "--host-id", host, *extra,
                            cwd=self.work, env=self.env)  # fmt: skip

    def logs(self, host: str, lines: int = 20) -> str:
        """The end of each log of ``host``'s share: what a failed start leaves to read."""
        run_dir = Path(self.env["OMNIFLOW_RUN_ROOT"]) / f"{self.name}@{host}"
        found = sorted(run_dir.glob("logs/*.log")) + sorted(run_dir.glob("supervisor.log"))
        return "\n".join(
            f"==> {path.name} <==\n"
            + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in found
        )

    def forget(self, host: str) -> None:
        """What a killed host left on this machine, which a real host's memory and disk take
        with them (namespaces share /dev/shm and /tmp): its pool segment and run dir."""
        run_dir = Path(self.env["OMNIFLOW_RUN_ROOT"]) / f"{self.name}@{host}"
        state = run_dir / "state.json"
        if state.exists():
            unlink_pool(json.loads(state.read_text())["pool"])
        shutil.rmtree(run_dir, ignore_errors=True)

    def omniflow(self, host: str, *args: str, **kwargs: Any):
        return self.hosts.omniflow(host, *args, cwd=self.work, env=self.env, **kwargs)


def longcat_toml(name: str, registry: str, hosts: Hosts, keys: Path, on: Sequence[str]) -> str:
    """configs/longcat.toml on ``registry``, over tcp with CurveZMQ, hosts ``on`` in
    [hosts] (written as text: the shipped file, its gateway and [runtime] replaced)."""
    text = (ROOT / "configs" / "longcat.toml").read_text()
    text = text[: text.index("[runtime]")]  # [runtime] and [gateway] come last
    text = re.sub(r"(?m)^name = .*$", f'name = "{name}"', text)
    text = re.sub(r"(?m)^registry = .*$", f'registry = "{registry}"', text)
    text = re.sub(r"(?m)^max_tokens = .*$", "max_tokens = 512", text)  # requests that last
    text += """[runtime]
transport = "tcp"
heartbeat_s = 0.2
ttl_s = 2.0                 # etcd 3.4 grants no lease shorter than about 2 s
send_timeout_s = 2.0
drain_timeout_s = 3.0
start_timeout_s = 180
request_timeout_s = 60

"""
    text += f'[security]\nkeys = "{keys}"\n\n'
    for host in on:
        roles = ", ".join(f'"{r}"' for r in ROLES[host])
        text += f'[hosts.{host}]\nroles = [{roles}]\naddress = "{hosts.address[host]}"\n\n'
    return text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    namespaces_or_skip()
    binary = etcd_binary()
    if binary is None:
        pytest.fail("etcd server binary not found: the scale-out tests need one")
    hosts = Hosts(HOSTS).make()
    run_root = Path(tempfile.mkdtemp(prefix="of-so-", dir="/tmp"))
    etcd = None
    try:
        etcd = EtcdServer(binary, tmp_path_factory.mktemp("etcd"), host=hosts.bridge_address)
        etcd.start()
        work = tmp_path_factory.mktemp("scaleout")
        keys = work / "keys"
        generate_keys(str(keys))
        name = f"lc{hosts.tag}"
        config = work / "longcat.toml"
        # Host c is left out of [hosts]: it joins with flags only (--roles, --address).
        config.write_text(longcat_toml(name, etcd.url, hosts, keys, on=("a", "b")))
        prebuilt_longcat(work)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMNIFLOW_RUN_ROOT": str(run_root)}
        yield Cluster(hosts, etcd, name, config, work, env)
    finally:
        hosts.remove()
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(run_root, ignore_errors=True)
