"""Embed a deployment in any asyncio program, or attach to a running one.

    async with Runtime.from_config("configs/echo.toml") as rt:
        async for event in rt.stream({"text": "hi"}):
            ...

    rt = await omniflow.connect("echo")   # a deployment started by `omniflow up`

Neither installs signal handlers nor touches the event-loop policy: the host
program's loop runs the supervisor and the client as ordinary tasks.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from omniflow.memory import pid_alive
from omniflow.messages import ActorRecord
from omniflow.runtime.client import Client, Output, Result
from omniflow.runtime.config import Config, from_json, load
from omniflow.runtime.request_check import check_request
from omniflow.runtime.rundir import (
    UntrustedPath,
    check_private,
    holds_run_dir,
    run_root,
    run_root_of,
)
from omniflow.runtime.supervisor import Supervisor
from omniflow.runtime.supervisor_dir import default_run_dir


class DeploymentNotFound(LookupError):
    """No running deployment matches what was asked for."""


class SeveralDeployments(DeploymentNotFound):
    """No name or run dir was given and more than one deployment is running."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(
            f"several deployments are running ({', '.join(names)}); pick one with --name"
        )
        self.names = names


class SeveralHosts(SeveralDeployments):
    """Several hosts' shares of one deployment run on this machine and none was named."""

    def __init__(self, name: str, hosts: list[str]) -> None:
        LookupError.__init__(
            self,
            f"{name} runs here as several hosts' shares ({', '.join(hosts)}); pick one with "
            "--host-id (or stop them all with down --all)",
        )
        self.names = [name]
        self.hosts = hosts


class Runtime:
    def __init__(
        self,
        config: Config,
        run_dir: str | Path | None = None,
        on_progress: Callable[[str, str], None] | None = None,
    ) -> None:
        self.config = config
        self.supervisor = Supervisor(config, Path(run_dir) if run_dir else None, on_progress)
        self.client: Client | None = None

    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> Runtime:
        return cls(load(path), **kwargs)

    @property
    def run_dir(self) -> Path:
        return self.supervisor.run_dir

    async def start(self) -> Runtime:
        await self.supervisor.start()
        try:
            self.client = Client(
                self.config, self.supervisor.registry_address, self.run_dir, self.supervisor.pool
            )
            await self.client.start()
            # One host's share of a deployment is started when its own roles are: the
            # other hosts come up on their own.
            local = self.config.local_processes()
            await self.client.wait_ready(roles=[r for r in self.config.roles if r in local])
        except BaseException:
            await self.supervisor.stop()
            raise
        return self

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        await self.supervisor.stop()

    async def __aenter__(self) -> Runtime:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stream(
        self, inputs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> AsyncIterator[Output | Result]:
        assert self.client is not None, "the runtime is not started"
        check_request(self.config, inputs, kwargs)  # as omniflow send and the gateway do
        return self.client.stream(inputs, **kwargs)

    async def call(
        self, inputs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> tuple[list[Output], Result]:
        assert self.client is not None, "the runtime is not started"
        check_request(self.config, inputs, kwargs)
        return await self.client.call(inputs, **kwargs)


class Connection:
    """A client attached to a deployment someone else supervises."""

    def __init__(self, state: dict[str, Any], client: Client) -> None:
        self.state = state
        self.client = client

    def stream(
        self, inputs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> AsyncIterator[Output | Result]:
        check_request(self.client.config, inputs, kwargs)
        return self.client.stream(inputs, **kwargs)

    async def call(
        self, inputs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> tuple[list[Output], Result]:
        check_request(self.client.config, inputs, kwargs)
        return await self.client.call(inputs, **kwargs)

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _states(
    name: str | None, run_dir: str | Path | None, host_id: str | None = None
) -> list[dict[str, Any]]:
    root = run_root()
    if run_dir is not None:
        candidates = [Path(run_dir)]
    elif name is not None:  # NAME, and NAME@HOST: one host's share of it
        shares = sorted(root.glob(f"{glob.escape(name)}@*")) if root.exists() else []
        candidates = [default_run_dir(name), *shares]
    else:
        candidates = sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []
    states = []
    for path in candidates:
        state_file = path / "state.json"
        try:  # a state another user could have planted names nothing of ours
            check_private(path, run_root_of(path))
        except (UntrustedPath, FileNotFoundError):
            continue
        if state_file.exists():
            state = json.loads(state_file.read_text())
            if host_id is None or state.get("host_id") == host_id:
                states.append(state)
    return states


def _live(state: Mapping[str, Any]) -> bool:
    """Its supervisor is alive and is the process holding the run dir's lock (a pid
    reused by another process, or a forged state, is not signalled)."""
    pid = state.get("pid", 0)
    return pid_alive(pid) and holds_run_dir(pid, state.get("run_dir", ""))


def running_deployments() -> list[dict[str, Any]]:
    """The state of every deployment (or host share) running on this machine."""
    return [s for s in _states(None, None) if _live(s)]


def find_deployment(
    name: str | None = None,
    run_dir: str | Path | None = None,
    host_id: str | None = None,
    any_host: bool = False,
) -> dict[str, Any]:
    """The state of a running deployment: by run dir, by name, or the only one running.

    Where several hosts' shares of one deployment run on this machine (network
    namespaces, containers sharing /tmp), ``host_id`` picks one; with ``any_host`` the
    first does (they share one registry: for a client or a status, any will do)."""
    states = [s for s in _states(name, run_dir, host_id) if _live(s)]
    if not states:
        what = f"run dir {run_dir}" if run_dir else f"name {name!r}" if name else "any name"
        if host_id is not None:
            what += f", host {host_id!r}"
        raise DeploymentNotFound(
            f"no running omniflow deployment ({what}); start one with `omniflow up`"
        )
    if len(states) > 1:
        names = sorted({s["name"] for s in states})
        if len(names) == 1 and any_host:
            return states[0]
        if len(names) == 1:
            raise SeveralHosts(names[0], sorted(s.get("host_id", "?") for s in states))
        raise SeveralDeployments([s["name"] for s in states])
    return states[0]


async def connect(
    name: str | None = None,
    run_dir: str | Path | None = None,
    *,
    registry: str | None = None,
    address: str | None = None,
    keys: str | None = None,
) -> Connection:
    """Attach to a running deployment: one started on this machine by ``omniflow up``, or,
    with ``registry`` (``etcd://H:P``) and ``name``, one on other hosts. ``address`` is
    where its actors reach this client (tcp: another host's actors need a routable one);
    ``keys`` the CurveZMQ keys folder where it differs from the config's."""
    if registry is not None:
        if name is None:
            raise DeploymentNotFound("connecting through a registry needs the deployment's name")
        config = await config_in_registry(registry, name)
        state: dict[str, Any] = {"name": name, "registry": registry, "run_dir": "", "pid": 0}
        run_dir = Path(tempfile.gettempdir())  # ipc only: a multi-host deployment is tcp
    else:
        state = find_deployment(name, run_dir, any_host=True)
        config = from_json((Path(state["run_dir"]) / "deployment.json").read_bytes())
        run_dir = Path(state["run_dir"])
    config = client_config(config, address, keys)
    client = Client(config, state["registry"], run_dir)
    await client.start()
    return Connection(state, client)


def client_config(config: Config, address: str | None, keys: str | None) -> Config:
    """``config`` for a client that replies on ``address`` with ``keys`` (each: if given)."""
    if address is not None:
        runtime = msgspec.structs.replace(config.runtime, bind_host=address)
        config = msgspec.structs.replace(config, runtime=runtime)
    if keys is not None:
        security = msgspec.structs.replace(config.security, keys=keys)
        config = msgspec.structs.replace(config, security=security)
    return config


async def config_in_registry(address: str, name: str) -> Config:
    """The config deployment ``name`` published at the registry ``address`` (etcd)."""
    from omniflow.control.discovery import open_registry
    from omniflow.runtime.hosts import read_config

    registry = open_registry(address)
    try:
        return await read_config(registry, name)
    except LookupError as e:
        raise DeploymentNotFound(str(e)) from None
    finally:
        await registry.close()


def clean_dead(name: str | None = None, run_dir: str | Path | None = None) -> list[str]:
    """Remove what deployments whose supervisor died left behind (sockets, state, pool).

    Workers exit with their supervisor (PDEATHSIG), but a supervisor killed with -9
    cannot remove its files. Returns the names of the deployments cleaned.
    """
    from omniflow.memory import unlink_pool

    cleaned = []
    for state in _states(name, run_dir):
        if pid_alive(state.get("pid", 0)):
            continue
        folder = Path(state["run_dir"])
        for path in [*folder.glob("*.sock"), folder / "state.json"]:
            path.unlink(missing_ok=True)
        if state.get("pool"):
            unlink_pool(state["pool"])
        cleaned.append(state["name"])
    return cleaned


def request_stop(state: Mapping[str, Any], timeout: float) -> None:
    """Ask the supervisor of ``state`` to stop, draining in-flight requests for at most
    ``timeout`` seconds (a Shutdown on its control socket; SIGTERM where that fails)."""
    import zmq

    from omniflow.messages import Shutdown
    from omniflow.transport.codec import encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing until the supervisor is there
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(state["control"])
        if sock.poll(2000, zmq.POLLOUT):
            sock.send(encode(Shutdown("down", timeout)), zmq.NOBLOCK)
            return
    except (KeyError, zmq.ZMQError):
        pass
    finally:
        sock.close()
        ctx.term()
    with contextlib.suppress(ProcessLookupError):  # it is gone already: nothing to stop
        os.kill(state["pid"], signal.SIGTERM)


async def list_deployment_actors(state: Mapping[str, Any]) -> list[ActorRecord]:
    """The registry records of every actor of the deployment ``state`` describes."""
    from omniflow.control.discovery import list_actors, open_registry

    registry = open_registry(state["registry"])
    try:
        return await list_actors(registry, state["name"])
    finally:
        await registry.close()
