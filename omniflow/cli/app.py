"""omniflow up | status | send | down: start, inspect, use and stop a deployment.

Exit codes: 0 ok; 1 the deployment failed to start or stop; 2 a bad config or
argument; 3 no such deployment running; 4 the request failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from omniflow.cli.progress import StartProgress
from omniflow.runtime.config import ConfigError, load
from omniflow.runtime.deployment import DeploymentNotFound, find_deployment
from omniflow.runtime.supervisor import StartError, Supervisor, default_run_dir

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
err = Console(stderr=True)
out = Console()

EXIT_START, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_REQUEST = 1, 2, 3, 4

NameOpt = typer.Option(
    None, "--name", "-n", help="Deployment name (default: the only one running)."
)
RunDirOpt = typer.Option(None, "--run-dir", help="The deployment's run directory.")


def _print_version(value: bool) -> None:
    if value:
        from omniflow import __version__

        print(f"omniflow {__version__}")
        raise typer.Exit(0)


@app.callback()
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


def _load(config: Path) -> Any:
    try:
        return load(config)
    except ConfigError as e:
        # The message names tables as "[roles.x]": print it as text, not as rich markup.
        err.print(f"[red]config error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from None


def _state(name: str | None, run_dir: Path | None) -> dict[str, Any]:
    try:
        return find_deployment(name, run_dir)
    except DeploymentNotFound as e:
        err.print(f"[red]{e}[/]")
        raise typer.Exit(EXIT_NOT_RUNNING) from None


@app.command()
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
    ready_fd: int = typer.Option(-1, hidden=True),
) -> None:
    """Start a deployment and wait until every actor is ready."""
    cfg = _load(config)
    run_dir = run_dir or Path(cfg.runtime.run_dir or default_run_dir(cfg.name))
    if port is not None and cfg.gateway is not None:
        cfg.gateway.port = port
    if detach:
        raise typer.Exit(_detach(config, run_dir, port))
    import uvloop

    raise typer.Exit(uvloop.run(_serve(cfg, run_dir, ready_fd)))


async def _serve(cfg: Any, run_dir: Path, ready_fd: int) -> int:
    notify = os.fdopen(ready_fd, "w", buffering=1) if ready_fd >= 0 else None

    total = sum(rc.replicas for rc in cfg.processes().values())
    bar = StartProgress(total) if notify is None else None

    running = False  # ready: what follows are restarts, after the bar or the ready pipe

    def progress(actor_id: str, state: str) -> None:
        if running or (notify is not None and notify.closed):
            # One line per change, to the terminal (or supervisor.log when detached).
            print(f"{time.strftime('%H:%M:%S')} {actor_id} {state}", file=sys.stderr, flush=True)
        elif notify is not None:
            notify.write(f"progress {actor_id} {state}\n")
        elif bar is not None:
            bar.update(actor_id, state)

    sup = Supervisor(cfg, run_dir, progress)
    if notify is None:
        err.print(f"starting [bold]{cfg.name}[/] ({total} actors) in {run_dir}")
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
            err.print(f"[red]failed to start:[/] {e}")
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
        notify.write(message + "\n")
        notify.close()
    else:
        err.print(f"[green]{message}[/]\nstop with Ctrl-C or `omniflow down`")
    await sup.wait()
    return 0


def _detach(config: Path, run_dir: Path, port: int | None = None) -> int:
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    read_end, write_end = os.pipe()
    log_path = run_dir / "supervisor.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omniflow.cli",
                "up",
                str(config),
                "--run-dir",
                str(run_dir),
                "--ready-fd",
                str(write_end),
                *(["--port", str(port)] if port is not None else []),
            ],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    os.close(write_end)
    cfg = load(config)
    bar = StartProgress(sum(rc.replicas for rc in cfg.processes().values()))
    with os.fdopen(read_end) as lines, bar:
        for line in lines:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "progress":
                actor_id, _, state = rest.partition(" ")
                bar.update(actor_id, state)
                continue
            bar.stop()
            if kind == "ready":
                out.print(f"[green]ready[/] {rest} (supervisor pid {proc.pid})", soft_wrap=True)
                return 0
            elif kind == "error":
                err.print(f"[red]failed to start:[/] {rest}")
                return EXIT_START
    err.print(f"[red]the supervisor exited before it was ready; see {log_path}[/]")
    return EXIT_START


@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
) -> None:
    """List every actor of a running deployment: role, replica, pid, endpoint, state, in-flight."""
    state = _state(name, run_dir)
    import uvloop

    from omniflow.runtime.deployment import list_deployment_actors

    records = uvloop.run(list_deployment_actors(state))
    actors = [
        {
            "role": r.role,
            "replica": r.replica,
            "pid": r.pid,
            "endpoint": r.endpoint,
            "state": r.state,
            "inflight": r.inflight,
            "served": r.served,
            "host": r.host,
        }
        for r in records
    ]
    if as_json:
        print(
            json.dumps(
                {
                    "name": state["name"],
                    "supervisor_pid": state["pid"],
                    "run_dir": state["run_dir"],
                    "registry": state["registry"],
                    "actors": actors,
                }
            )
        )
        return
    from rich.table import Table

    table = Table(title=f"{state['name']} (supervisor pid {state['pid']})")
    for col in ("role", "replica", "pid", "endpoint", "state", "inflight", "served"):
        table.add_column(col)
    for a in actors:
        table.add_row(
            *(
                str(a[c])
                for c in ("role", "replica", "pid", "endpoint", "state", "inflight", "served")
            )
        )
    out.print(table)


@app.command()
def send(
    text: str | None = typer.Option(None, "--text", "-t", help="Text input."),
    image: list[Path] = typer.Option([], "--image", "-i", help="An image file (repeatable)."),
    audio: Path | None = typer.Option(None, "--audio", "-a", help="A WAV file."),
    want: str | None = typer.Option(
        None, "--want", "-w", help="Output modalities, e.g. text,image,audio."
    ),
    param: list[str] = typer.Option(
        [], "--param", "-p", help="Request parameter KEY=VALUE (repeatable)."
    ),
    session: str = typer.Option(
        "", "--session", help="Session id: continue a multi-turn dialogue."
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", "-o", help="Where images and audio are written (default: ./out)."
    ),
    timeout: float = typer.Option(60.0, "--timeout", help="Deadline in seconds."),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object with outputs, files, timings, usage."
    ),
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
) -> None:
    """Send one request: stream text to the terminal, write images (PNG) and audio (WAV) to --out."""
    # Before anything is sent: a result must never be lost for want of a place to write it.
    out_dir = _out_dir(out_dir)
    state = _state(name, run_dir)
    inputs: dict[str, Any] = {}
    if text is not None:
        inputs["text"] = text
    images = [_read_input(path, "--image") for path in image]
    if len(images) == 1:
        inputs["image"] = images[0]
    elif images:
        inputs["images"] = images
    if audio is not None:
        inputs["audio"] = _read_input(audio, "--audio")
    params: dict[str, Any] = {}
    for item in param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            err.print(f"[red]--param {item!r}: expected KEY=VALUE[/]")
            raise typer.Exit(EXIT_USAGE)
        params[key] = _parse_value(value)
    if want is not None:
        params["want"] = want
    import uvloop

    from omniflow.cli.outputs import OutputWriter
    from omniflow.runtime.client import Output, RequestFailed
    from omniflow.runtime.deployment import connect

    async def run() -> int:
        conn = await connect(run_dir=state["run_dir"])
        request_id = uuid.uuid4().hex
        writer = OutputWriter(out_dir, request_id, echo=not as_json)
        try:
            async for event in conn.stream(
                inputs, params=params, session=session, timeout=timeout, request_id=request_id
            ):
                if isinstance(event, Output):
                    writer.add(event)
                else:
                    writer.finish()
                    _report(event, writer, as_json)
        except RequestFailed as e:
            if as_json:
                print(
                    json.dumps(
                        {
                            "error": {
                                "code": e.code,
                                "role": e.role,
                                "message": e.detail,
                                "request_id": e.request_id,
                            }
                        }
                    )
                )
            else:
                err.print(f"\n[red]request failed:[/] {e}")
            return EXIT_REQUEST
        finally:
            await conn.close()
        return 0

    raise typer.Exit(uvloop.run(run()))


def _out_dir(given: Path | None) -> Path:
    """The folder for output files, checked: an explicit --out is created now if missing;
    anything there that is not a folder is a usage error."""
    path = given if given is not None else Path("out")
    if path.exists() and not path.is_dir():
        err.print(f"[red]--out {path}: exists and is not a directory[/]")
        raise typer.Exit(EXIT_USAGE)
    if given is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err.print(f"[red]--out {path}: cannot create the directory: {e.strerror}[/]")
            raise typer.Exit(EXIT_USAGE) from None
    return path


def _read_input(path: Path, option: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        err.print(f"[red]{option} {path}: cannot read: {e.strerror}[/]")
        raise typer.Exit(EXIT_USAGE) from None


def _report(result: Any, writer: Any, as_json: bool) -> None:
    timings: dict[str, float] = {}
    for t in result.timings:
        timings[t.role] = timings.get(t.role, 0.0) + t.compute_ms
    if as_json:
        print(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "text": writer.text,
                    "outputs": writer.outputs,
                    "files": writer.files,
                    "timings_ms": timings,
                    "latency_ms": result.latency_ms,
                    "usage": result.usage,
                }
            )
        )
        return
    if writer.text:
        sys.stdout.write("\n")
    for path in writer.files:
        err.print(f"wrote {path}")
    parts = ", ".join(f"{role} {ms:.1f} ms" for role, ms in timings.items())
    usage = ", ".join(f"{k} {v}" for k, v in sorted(result.usage.items()))
    err.print(f"[dim]{result.latency_ms:.1f} ms end to end; compute: {parts}[/]")
    if usage:
        err.print(f"[dim]usage: {usage}[/]")


def _parse_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


@app.command()
def down(
    name: str | None = NameOpt,
    run_dir: Path | None = RunDirOpt,
    timeout: float = typer.Option(
        30.0, "--timeout", help="Seconds in-flight requests may take to finish."
    ),
) -> None:
    """Stop a running deployment: refuse new requests, let those in flight finish through
    the whole graph (up to --timeout), stop every actor, remove its sockets."""
    from omniflow.runtime.deployment import clean_dead, request_stop

    try:
        state = find_deployment(name, run_dir)
    except DeploymentNotFound as e:
        cleaned = clean_dead(name, run_dir)
        if cleaned:  # its supervisor died: take away what it could not
            out.print(f"cleaned up after the dead supervisor of {', '.join(cleaned)}")
            return
        err.print(f"[red]{e}[/]")
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    pid = state["pid"]
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        err.print("[yellow]the supervisor is already gone[/]")
        return
    request_stop(state, timeout)
    # The supervisor drains for up to `timeout`, then kills what is left: a little longer.
    ready, _, _ = select.select([pidfd], [], [], timeout + 5.0)
    os.close(pidfd)
    if not ready:
        err.print(f"[red]supervisor {pid} did not stop within {timeout:g}s[/]")
        raise typer.Exit(EXIT_START)
    leftovers = list(Path(state["run_dir"]).glob("*.sock"))
    if leftovers:
        err.print(f"[red]left behind: {', '.join(map(str, leftovers))}[/]")
        raise typer.Exit(EXIT_START)
    out.print(f"stopped {state['name']}")
