"""Hosts as Linux network namespaces: one bridge, a veth pair per namespace, addresses from
198.18.0.0/15 (reserved for network benchmarks: RFC 2544), all made and removed here.

Processes in the namespaces share this machine's hostname, /tmp and /dev/shm: only the
network is theirs, which is why omniflow names its hosts (``--host-id``) instead of
asking ``gethostname()``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from omniflow.runtime import preload

SUBNET = "198.18"  # 198.18.N.0/24 per harness; the bridge is .1, hosts .2, .3, ...


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def namespaces_or_skip() -> None:
    """Skip (fail under CI=true) where network namespaces cannot be made here."""
    why = None
    if os.geteuid() != 0:
        why = "network namespaces need root"
    elif not Path("/usr/sbin/ip").exists() and not Path("/sbin/ip").exists():
        why = "iproute2 (ip) is not installed"
    else:
        probe = f"ofprobe{secrets.token_hex(3)}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            why = f"ip netns add failed: {made.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    if why is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}: the scale-out tests must run in CI")
    pytest.skip(why)


def _free_octet() -> int:
    """A third octet no interface of this machine uses in 198.18.N.0/24."""
    used = _ip("-4", "-o", "addr", "show").stdout
    for _ in range(64):
        octet = 1 + secrets.randbelow(254)
        if f" {SUBNET}.{octet}." not in used:
            return octet
    raise RuntimeError("no free 198.18.N.0/24 found")


class Hosts:
    """Namespaces ``of<tag>-<name>`` on bridge ``ofb<tag>``; ``remove()`` undoes it all."""

    def __init__(self, names: Sequence[str]) -> None:
        self.tag = secrets.token_hex(3)  # interface names stay under 16 bytes
        octet = _free_octet()
        self.bridge = f"ofb{self.tag}"
        self.bridge_address = f"{SUBNET}.{octet}.1"
        self.names = list(names)
        self.address = {n: f"{SUBNET}.{octet}.{i + 2}" for i, n in enumerate(self.names)}
        self.namespace = {n: f"of{self.tag}-{n}" for n in self.names}
        self._veth = {n: f"ofv{self.tag}{i}" for i, n in enumerate(self.names)}
        self._made: list[tuple[str, str]] = []  # ("link" | "netns", name), in order made

    def make(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                ns, veth, peer = self.namespace[name], self._veth[name], f"ofp{self.tag}x"
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
                _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
                self._made.append(("link", veth))
                _ip("link", "set", peer, "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                inside = ("netns", "exec", ns, "ip")
                _ip(*inside, "link", "set", peer, "name", "eth0")
                _ip(*inside, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
                _ip(*inside, "link", "set", "eth0", "up")
                _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespace[name], *argv], **kwargs)

    def run(self, name: str, argv: Sequence[str], timeout: float = 180, **kwargs):
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace[name], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def omniflow(self, name: str, *args: str, timeout: float = 240, **kwargs):
        """``omniflow ARGS`` run inside host ``name``; raises with its output on failure."""
        proc = self.run(name, [sys.executable, "-m", "omniflow.cli", *args], timeout, **kwargs)
        if proc.returncode != 0:
            raise AssertionError(
                f"[{name}] omniflow {' '.join(args)} -> {proc.returncode}\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def pids(self, name: str) -> list[int]:
        if ("netns", self.namespace[name]) not in self._made:
            return []
        found = _ip("netns", "pids", self.namespace[name], check=False).stdout.split()
        return [int(p) for p in found]

    def freeze(self, name: str) -> None:
        """SIGSTOP every process of host ``name``: from here it does nothing at all."""
        for pid in self.pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def kill(self, name: str) -> None:
        """The host dies: SIGKILL to every process in its namespace, then the namespace and
        its link are deleted (what it had in flight never gets an answer from it)."""
        killed = self.pids(name)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in killed:  # its supervisor died too: nobody reaps them to do this
            preload.forget(pid)  # a worker's Intel OpenMP registration in the shared /dev/shm
        for kind, what in (("link", self._veth[name]), ("netns", self.namespace[name])):
            if (kind, what) in self._made:
                self._undo(kind, what)

    def _undo(self, kind: str, what: str) -> None:
        if kind == "netns":
            _ip("netns", "del", what, check=False)
        else:
            _ip("link", "del", what, check=False)
        self._made.remove((kind, what))

    def remove(self) -> None:
        """Kill what still runs in the namespaces, then delete them, the veths, the bridge."""
        for name in self.names:
            for pid in self.pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for kind, what in reversed(list(self._made)):
            self._undo(kind, what)
