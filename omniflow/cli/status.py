"""omniflow status and omniflow logs: what a deployment's actors are doing, and said."""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import typer

from omniflow.cli.common import (
    EXIT_NOT_RUNNING,
    EXIT_USAGE,
    HostIdOpt,
    NameOpt,
    RegistryOpt,
    RunDirOpt,
    fail,
    find_running,
    out,
)
from omniflow.runtime.deployment import DeploymentNotFound, SeveralDeployments, find_deployment
from omniflow.runtime.supervisor_dir import default_run_dir


def status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
    registry: str | None = RegistryOpt,
    host_id: str | None = HostIdOpt,
) -> None:
    """List every actor of a running deployment, a replica being restarted included; on
    several hosts, every host's (from etcd).

    Columns: role, replica, host, pid, endpoint, state, requests in flight and served,
    restarts (this host's)."""
    if registry is not None:
        if name is None:
            fail("--registry needs the deployment's --name", EXIT_USAGE)
        state: dict = {"name": name, "pid": 0, "run_dir": "", "registry": registry}
    else:
        state = find_running(name, run_dir, host_id, any_host=True)
    import uvloop

    from omniflow.runtime.deployment import list_deployment_actors

    try:
        records = uvloop.run(list_deployment_actors(state))
    except Exception as e:  # the registry unreachable, most likely
        fail(f"cannot list {state['name']}'s actors at {state['registry']}: {e}", EXIT_NOT_RUNNING)
    actors = _actors(records, state.get("actors", []))
    if as_json:
        print(
            json.dumps(
                {
                    "name": state["name"],
                    "supervisor_pid": state["pid"],
                    "run_dir": state["run_dir"],
                    "registry": state["registry"],
                    "host_id": state.get("host_id", ""),
                    "actors": actors,
                }
            )
        )
        return
    _print_table(state, actors)


def _actors(records: list[Any], supervised_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The registry's records joined with the supervisor's view (state.json), which names
    what the registry cannot: a replica being restarted has no record there, and only the
    supervisor counts restarts."""
    supervised = {(a["role"], a["replica"]): a for a in supervised_list}
    actors = [
        {
            "role": r.role,
            "replica": r.replica,
            "pid": r.pid,
            "endpoint": r.endpoint,
            "state": r.state,
            "inflight": r.inflight,
            "served": r.served,
            "restarts": supervised.pop((r.role, r.replica), {}).get("restarts", 0),
            "host": r.host,
        }
        for r in records
    ]
    for a in supervised.values():
        actors.append(
            {
                "role": a["role"],
                "replica": a["replica"],
                "pid": a["pid"],
                "endpoint": "",
                "state": a["state"] if a["state"] != "ready" else "unregistered",
                "inflight": 0,
                "served": 0,
                "restarts": a["restarts"],
                "host": "",
            }
        )
    actors.sort(key=lambda a: (a["role"], a["replica"]))
    return actors


def _print_table(state: dict[str, Any], actors: list[dict[str, Any]]) -> None:
    from rich.table import Table

    title = (
        state["name"] if not state["pid"] else f"{state['name']} (supervisor pid {state['pid']})"
    )
    table = Table(title=title)
    columns: tuple[str, ...] = (
        "role",
        "replica",
        "pid",
        "endpoint",
        "state",
        "inflight",
        "served",
        "restarts",
    )
    if len({a["host"] for a in actors if a["host"]}) > 1:  # several hosts: say which runs what
        columns = ("role", "replica", "host", *columns[2:])
    for col in columns:
        table.add_column(col)
    for a in actors:
        table.add_row(*(str(a[c]) for c in columns))
    out.print(table, crop=False)


def logs(
    role: str | None = typer.Argument(
        None, help="A role (all its replicas), ROLE-N (one replica), or supervisor."
    ),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing what is added."),
    lines: int = typer.Option(50, "--lines", "-l", min=0, help="Lines from the end of each."),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
) -> None:
    """Print the end of a role's log; without ROLE, list the deployment's logs.

    Each replica logs to RUN_DIR/logs/ROLE-N.log; a detached supervisor to
    RUN_DIR/supervisor.log. A stopped deployment's logs stay: name it with --name or
    --run-dir."""
    folder = _log_folder(name, run_dir)
    found = sorted((folder / "logs").glob("*.log"))
    if (folder / "supervisor.log").exists():
        found.append(folder / "supervisor.log")
    if role is None:
        for path in found:
            out.print(f"{path.stem:<24} {path.stat().st_size:>10} bytes  {path}")
        return
    chosen = [p for p in found if p.stem == role or p.stem.rpartition("-")[0] == role]
    if not chosen:
        names = sorted(
            {p.stem.rpartition("-")[0] or p.stem for p in found} | {p.stem for p in found}
        )
        fail(f"no log of {role!r} in {folder}; there are: {', '.join(names)}", EXIT_USAGE)
    if follow:  # tail follows renames and truncation, and stops on Ctrl-C
        os.execvp("tail", ["tail", "-n", str(lines), "-F", *map(str, chosen)])
    for path in chosen:
        if len(chosen) > 1:
            print(f"==> {path} <==")
        with open(path, "rb") as f:
            tail = collections.deque(f, maxlen=lines) if lines else ()
        sys.stdout.write(b"".join(tail).decode(errors="replace"))
    sys.stdout.flush()


def _log_folder(name: str | None, run_dir: Path | None) -> Path:
    """The run dir whose logs to read: a running deployment's, or one named (stopped too)."""
    if run_dir is not None and run_dir.is_dir():
        return run_dir
    try:
        return Path(find_deployment(name, run_dir)["run_dir"])
    except SeveralDeployments as e:
        fail(str(e), EXIT_USAGE)
    except DeploymentNotFound as e:
        if name is not None and default_run_dir(name).is_dir():
            return default_run_dir(name)
        fail(str(e), EXIT_NOT_RUNNING)
