"""omniflow up | serve | status | send | logs | down: start, inspect, use and stop a deployment.

Exit codes: 0 ok; 1 the deployment failed to start or stop; 2 a bad config or
argument (a request the deployment refused as bad_request included); 3 no such
deployment running; 4 the request failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import typer

from omniflow.cli.common import (
    EXIT_NOT_RUNNING,
    EXIT_START,
    EXIT_USAGE,
    HostIdOpt,
    LogFormatOpt,
    NameOpt,
    RegistryOpt,
    RunDirOpt,
    app,
    err,
    fail,
    find_running,
    load_config,
    out,
    use_log_format,
)
from omniflow.cli.keys import keys
from omniflow.cli.progress import StartProgress
from omniflow.cli.send import send
from omniflow.cli.serve import serve
from omniflow.cli.status import logs, status
from omniflow.runtime import logs as runlog
from omniflow.runtime.config import GATEWAY_ROLE, ConfigError
from omniflow.runtime.deployment import DeploymentNotFound, SeveralDeployments, find_deployment
from omniflow.runtime.hosts import for_host, with_registry
from omniflow.runtime.replica import StartError
from omniflow.runtime.supervisor import Supervisor
from omniflow.runtime.supervisor_dir import make_run_dir, run_dir_for

progress_log = logging.getLogger("omniflow.supervisor")

__all__ = ["app"]


def _print_version(value: bool) -> None:
    if value:
        from omniflow import __version__

        print(f"omniflow {__version__}")
        raise typer.Exit(0)


def _main(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    pass


def up(
    config: Path = typer.Argument(..., help="Deployment config (TOML)."),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Return once ready; run in the background."
    ),
    run_dir: Path | None = RunDirOpt,
    port: int | None = typer.Option(
        None,
        "--port",
        envvar="OMNIFLOW_GATEWAY_PORT",
        min=0,
        max=65535,
        help="The HTTP gateway's port (0: any free one), over [gateway] port.",
    ),
    registry: str | None = typer.Option(
        None, "--registry", help="etcd://HOST:PORT, over the config's registry."
    ),
    host_id: str | None = HostIdOpt,
    roles: str | None = typer.Option(
        None, "--roles", help="Roles this host runs, comma-separated (over its [hosts] entry)."
    ),
    address: str | None = typer.Option(
        None, "--address", help="Where the other hosts reach this host's actors (tcp)."
    ),
    log_format: str = LogFormatOpt,
    ready_fd: int = typer.Option(-1, hidden=True),
) -> None:
    """Start a deployment (or, with --host-id or [hosts], this host's share of one) and
    wait until every actor here is ready."""
    use_log_format(log_format)
    cfg = _share(load_config(config), registry, host_id, roles, address)
    if port is not None and cfg.gateway is not None:
        cfg.gateway.port = port
    argv = ["up", str(config), *(["--port", str(port)] if port is not None else [])]
    argv += ["--registry", registry] if registry else []
    argv += ["--host-id", host_id] if host_id else []
    argv += ["--roles", roles] if roles is not None else []
    argv += ["--address", address] if address else []
    argv += ["--log-format", log_format]
    raise typer.Exit(start(cfg, run_dir, detach, argv, ready_fd))


def start(cfg: Any, run_dir: Path | None, detach: bool, argv: list[str], ready_fd: int) -> int:
    """Run the deployment ``cfg`` here (foreground), or re-run ``omniflow ARGV`` in the
    background and return once it is ready (--detach)."""
    run_dir = run_dir or run_dir_for(cfg)
    if detach:
        return _detach(argv, cfg, run_dir)
    import uvloop

    return uvloop.run(_serve(cfg, run_dir, ready_fd))


def _share(
    cfg: Any, registry: str | None, host_id: str | None, roles: str | None, address: str | None
) -> Any:
    """The config as this host runs it: its share when hosts are named, on ``registry``."""
    try:
        if host_id or roles is not None or address or cfg.hosts:
            host = host_id or cfg.runtime.host_id or socket.gethostname()
            names = None if roles is None else [r.strip() for r in roles.split(",") if r.strip()]
            return for_host(cfg, host, names, address, registry)
        if registry:
            return with_registry(cfg, registry)
    except ConfigError as e:
        fail(f"config error: {e}", EXIT_USAGE)
    return cfg


async def _serve(cfg: Any, run_dir: Path, ready_fd: int) -> int:
    notify = os.fdopen(ready_fd, "w", buffering=1) if ready_fd >= 0 else None
    runlog.configure("supervisor")  # its format (--log-format) goes on to every worker

    total = sum(rc.replicas for rc in cfg.local_processes().values())
    bar = StartProgress(total) if notify is None else None

    running = False  # ready: what follows are restarts, after the bar or the ready pipe

    def progress(actor_id: str, state: str) -> None:
        if running or (notify is not None and notify.closed):
            # One line per change, to the terminal (or supervisor.log when detached).
            progress_log.info(
                "%s %s", actor_id, state, extra=runlog.fields(replica=actor_id, state=state)
            )
        elif notify is not None:
            notify.write(f"progress {actor_id} {state}\n")
        elif bar is not None:
            bar.update(actor_id, state)

    taken = _gateway_port_taken(cfg)  # before any model loads
    if taken:
        if notify is not None:
            notify.write(f"error {taken}\n")
            notify.close()
        else:
            err.print(f"failed to start: {taken}", style="red")
        return EXIT_START
    sup = Supervisor(cfg, run_dir, progress)
    if notify is None:
        err.print(f"starting {cfg.name} ({total} actors) in {run_dir}")
    started = time.monotonic()
    try:
        if bar is not None:
            with bar:
                await sup.start()
        else:
            await sup.start()
    except (StartError, OSError) as e:
        if notify is not None:
            notify.write(f"error {e}\n")
            notify.close()
        else:
            err.print(f"failed to start: {e}", style="red")
        return EXIT_START
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop)
    where = sup.registry_address
    message = (
        f"ready {cfg.name}: {len(sup.replicas)} actors in {time.monotonic() - started:.1f}s; "
        f"registry {where}; run dir {run_dir}"
    )
    url = run_dir / "gateway.url"  # written by the gateway once it listens
    if cfg.gateway is not None and url.exists():
        message += f"; http {url.read_text().strip()}"
    running = True
    if notify is not None:
        progress_log.info(message)  # supervisor.log: when it was ready, and where
        notify.write(message + "\n")
        notify.close()
    else:
        err.print(message, style="green")
        err.print("stop with Ctrl-C or: omniflow down")
    await sup.wait()
    return 0


def _gateway_port_taken(cfg: Any) -> str:
    """Why the gateway this host runs could not listen on its port ("" when it can)."""
    gateway = cfg.gateway
    if gateway is None or not gateway.port or GATEWAY_ROLE not in cfg.local_processes():
        return ""
    family = socket.AF_INET6 if ":" in gateway.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((gateway.host, gateway.port))
        except OSError as e:
            return (
                f"the gateway cannot listen on {gateway.host}:{gateway.port}: {e.strerror} "
                "(--port to pick another, 0: any free one)"
            )
    return ""


def _detach(argv: list[str], cfg: Any, run_dir: Path) -> int:
    try:  # 0700 from a run root it makes down, as the supervisor's own check wants
        make_run_dir(run_dir)
    except OSError as e:
        err.print(f"failed to start: {e}", style="red")
        return EXIT_START
    read_end, write_end = os.pipe()
    log_path = run_dir / "supervisor.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omniflow.cli",
                *argv,
                "--run-dir",
                str(run_dir),
                "--ready-fd",
                str(write_end),
            ],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    os.close(write_end)
    bar = StartProgress(sum(rc.replicas for rc in cfg.local_processes().values()))
    with os.fdopen(read_end) as lines, bar:
        for line in lines:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "progress":
                actor_id, _, state = rest.partition(" ")
                bar.update(actor_id, state)
                continue
            bar.stop()
            if kind == "ready":
                out.print(f"ready {rest} (supervisor pid {proc.pid})", style="green")
                return 0
            elif kind == "error":
                err.print(f"failed to start: {rest}", style="red")
                return EXIT_START
    err.print(f"the supervisor exited before it was ready; see {log_path}", style="red")
    return EXIT_START


def down(
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
    timeout: float = typer.Option(
        30.0, "--timeout", help="Seconds in-flight requests may take to finish."
    ),
    host_id: str | None = HostIdOpt,
    every_host: bool = typer.Option(
        False,
        "--all",
        help="Stop every host's share of a multi-host deployment; with no --name and "
        "several deployments here, every one of them.",
    ),
    registry: str | None = RegistryOpt,
) -> None:
    """Stop a running deployment, letting the requests in flight finish.

    New requests are refused; those in flight finish through the whole graph (up to
    --timeout); then every actor stops and its sockets are removed. On several hosts
    this stops this host's share; --all stops every host's (through etcd)."""
    from omniflow.runtime.deployment import clean_dead

    if every_host and name is None and run_dir is None and registry is None:
        from omniflow.runtime.deployment import running_deployments

        states = running_deployments()
        if len({s["name"] for s in states}) > 1:  # several: each here (one: all its hosts)
            raise typer.Exit(_down_every_local(states, timeout))
    if every_host:
        raise typer.Exit(_down_all(name, run_dir, registry, timeout))
    try:
        state = find_deployment(name, run_dir, host_id)
    except SeveralDeployments as e:
        fail(str(e), EXIT_USAGE)
    except DeploymentNotFound as e:
        cleaned = clean_dead(name, run_dir)
        if cleaned:  # its supervisor died: take away what it could not
            out.print(f"cleaned up after the dead supervisor of {', '.join(cleaned)}")
            return
        fail(str(e), EXIT_NOT_RUNNING)
    problem = _stop_one(state, timeout)
    if problem:
        fail(problem, EXIT_START)
    out.print(f"stopped {state['name']}")


def _stop_one(state: dict[str, Any], timeout: float) -> str:
    """Stop the deployment of ``state`` and wait for it; what went wrong, or ""."""
    from omniflow.runtime.deployment import request_stop

    pid = state["pid"]
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        err.print("the supervisor is already gone", style="yellow")
        return ""
    request_stop(state, timeout)
    # The supervisor drains for up to `timeout`, then kills what is left: a little longer.
    ready, _, _ = select.select([pidfd], [], [], timeout + 5.0)
    os.close(pidfd)
    if not ready:
        return f"supervisor {pid} did not stop within {timeout:g}s"
    leftovers = list(Path(state["run_dir"]).glob("*.sock"))
    if leftovers:
        return f"left behind: {', '.join(map(str, leftovers))}"
    return ""


def _down_every_local(states: list[dict[str, Any]], timeout: float) -> int:
    """down --all without a name: every deployment running on this machine, at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(states)) as pool:
        problems = list(pool.map(lambda s: _stop_one(s, timeout), states))
    for state, problem in zip(states, problems, strict=True):
        if problem:
            err.print(f"{state['name']}: {problem}", style="red")
        else:
            out.print(f"stopped {state['name']}")
    return EXIT_START if any(problems) else 0


def _down_all(name: str | None, run_dir: Path | None, registry: str | None, timeout: float) -> int:
    import uvloop

    from omniflow.runtime.hosts import stop_everywhere

    if registry is None:
        state = find_running(name, run_dir, any_host=True)
        name, registry = state["name"], state["registry"]
    if name is None:
        fail("--all with --registry needs the deployment's --name", EXIT_USAGE)
    if not registry.startswith("etcd://"):
        fail(f"{name} runs on one host (registry {registry}): use omniflow down", EXIT_USAGE)
    try:
        hosts = uvloop.run(stop_everywhere(registry, name, timeout))
    except TimeoutError:
        fail(f"not every host of {name} stopped within {timeout + 10:g}s", EXIT_START)
    except Exception as e:  # the registry unreachable, most likely
        fail(f"down --all {name}: {e}", EXIT_START)
    if not hosts:
        fail(f"no host of {name!r} is registered at {registry}", EXIT_NOT_RUNNING)
    out.print(f"stopped {name} on hosts {', '.join(hosts)}")
    return 0


app.callback(help=__doc__)(_main)
for command in (up, serve, status, send, logs, down, keys):  # in the order help lists them
    app.command()(command)
